"""The package page on PyPI: the README as pyproject's readme hook rewrites it has no link that cannot resolve there."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11 and later
ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)[^)]*\)")


def pypi_readme() -> str:
    """README.md after the substitutions of `[tool.hatch.metadata.hooks.fancy-pypi-readme]`, applied in order."""
    hook = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["hatch"]["metadata"]["hooks"]
    config = hook["fancy-pypi-readme"]
    assert [f["path"] for f in config["fragments"]] == ["README.md"]
    text = (ROOT / "README.md").read_text()
    for rule in config["substitutions"]:
        text = re.sub(rule["pattern"], rule["replacement"], text)
    return text


def test_pypi_readme_links_only_to_absolute_urls() -> None:
    readme = (ROOT / "README.md").read_text()
    assert any(not target.startswith(("http://", "https://")) for target in LINK.findall(readme))
    page = pypi_readme()
    relative = [t for t in LINK.findall(page) if not t.startswith(("http://", "https://"))]
    assert not relative, f"links that do not resolve on PyPI: {relative}"


def test_pypi_readme_keeps_what_the_links_named() -> None:
    page = pypi_readme()
    assert "- `docs/design.md`: architecture" in page
    assert "An explicit adapter (`docs/adapters.md`) for optimizers" in page
    assert "(Inside the iteration)" in page
    assert page.splitlines()[0] == (ROOT / "README.md").read_text().splitlines()[0]


def test_every_file_the_readme_links_exists() -> None:
    readme = (ROOT / "README.md").read_text()
    for target in LINK.findall(readme):
        if target.startswith(("http://", "https://", "#")):
            continue
        assert (ROOT / target.split("#")[0]).is_file(), f"README links {target}, which the repository lacks"
