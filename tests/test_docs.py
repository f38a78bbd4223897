"""The documentation site: every public name on the API page, and the user pages short and free of internals."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import chunked_offload

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
# The pages for maintainers: design notes, [Note: ...] pointers and commit hashes belong there.
INTERNALS = {"design.md", "internals.md"}
NOTE = re.compile(r"\[Note" r": ")  # written apart, so that the layering test does not read it as a reference
USER_PAGES = sorted(p for p in DOCS.glob("*.md") if p.name not in INTERNALS)


def test_every_page_is_in_the_navigation() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    assert [p.name for p in sorted(DOCS.glob("*.md")) if f": {p.name}" not in nav] == []


def test_user_pages_carry_no_notes_or_commit_hashes() -> None:
    found = []
    for page in [*USER_PAGES, ROOT / "README.md"]:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            if NOTE.search(line) or re.search(r"`[0-9a-f]{7,40}`|commit [0-9a-f]{7}", line):
                found.append(f"{page.name}:{n}: {line.strip()[:80]}")
    assert not found, found


def test_user_docs_stay_under_ten_thousand_words() -> None:
    words = sum(len(p.read_text().split()) for p in [*USER_PAGES, ROOT / "README.md"])
    assert words <= 10_000, words


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("mkdocstrings", reason="the docs extra (make venv installs it)")
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(out)],
        cwd=ROOT, capture_output=True, text=True, env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def test_the_api_pages_document_every_public_name(site: Path) -> None:
    html = (site / "api" / "index.html").read_text()
    anchors = set(re.findall(r'id="([^"]+)"', html + (site / "internals" / "index.html").read_text()))
    missing = [n for n in chunked_offload.__all__ if f"chunked_offload.{n}" not in anchors]
    assert not missing, missing
    assert not re.search(r'id="chunked_offload\.Adapter\.', html)  # the adapter interface is on the internals page
    assert "chunked_offload.torchtitan.wrap_optimizers" in anchors
    # The docstrings are rendered, not only the names.
    assert "Figures of the last" in html and "bitwise" in html


def test_every_page_renders_its_lists_and_the_user_pages_show_no_notes(site: Path) -> None:
    """scripts/check_site.py over the built site: a list written right after a paragraph line renders as run-on
    text; the user pages carry no ``[Note: ...]`` pointer and no reST ``Example::``."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import check_site
    finally:
        sys.path.pop(0)
    assert len(list(site.rglob("index.html"))) == len(list(DOCS.glob("*.md")))
    assert check_site.problems(site) == []
