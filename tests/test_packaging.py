"""The package page on PyPI: the README as pyproject's readme hook rewrites it has no link that cannot resolve there."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import chunked_offload

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
    assert "- Getting started (`docs/getting-started.md`): install" in page
    assert "hide the step under the next forward or the backward (Which mode for my loop (`docs/modes.md`))" in page
    assert page.splitlines()[0] == (ROOT / "README.md").read_text().splitlines()[0]


def test_every_file_the_readme_links_exists() -> None:
    readme = (ROOT / "README.md").read_text()
    for target in LINK.findall(readme):
        if target.startswith(("http://", "https://", "#")):
            continue
        assert (ROOT / target.split("#")[0]).is_file(), f"README links {target}, which the repository lacks"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel and the source distribution, built from this checkout as a release would build them."""
    import subprocess
    import sys

    pytest.importorskip("build")
    out = tmp_path_factory.mktemp("dist")
    done = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return out


def test_the_wheel_carries_the_metadata_a_package_page_needs(built: Path) -> None:
    import email
    import zipfile

    (wheel,) = built.glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        (meta_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = email.message_from_string(z.read(meta_name).decode())
    assert "bitwise identical" in meta["Summary"]
    assert meta["Requires-Python"] == ">=3.10" and meta["License-Expression"] == "Apache-2.0"
    assert "Programming Language :: Python :: 3" in meta.get_all("Classifier")
    assert meta.get_all("Requires-Dist")[0] == "torch>=2.9"
    # What a user installs (te), the plots and the docs site, and one for developers.
    assert sorted(meta.get_all("Provides-Extra")) == ["bench", "dev", "docs", "te"]
    assert meta["Version"] == chunked_offload.__version__  # one source: __init__.py
    assert "chunked_offload/py.typed" in names and not any(n.startswith("tests/") for n in names)
    assert meta.get_payload().startswith("# chunked_offload")


def test_the_source_distribution_ships_documents_and_no_benchmark_logs(built: Path) -> None:
    import tarfile

    (sdist,) = built.glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = [n.split("/", 1)[1] for n in tar.getnames() if "/" in n]
    assert {"README.md", "LICENSE", "CHANGELOG.md", "docs/design.md", "benchmarks/bench_step.py"} <= set(names)
    assert not [n for n in names if n.startswith(("benchmarks/results", "results/")) or n.endswith((".log", ".csv"))]


def test_the_citation_and_the_changelog_name_the_current_version() -> None:
    version = chunked_offload.__version__
    assert f"\nversion: {version}\n" in (ROOT / "CITATION.cff").read_text()
    headings = [line for line in (ROOT / "CHANGELOG.md").read_text().splitlines() if line.startswith("## ")]
    assert headings[0] == "## [Unreleased]" and headings[1].startswith(f"## [{version}] - ")  # Keep a Changelog


def test_the_wheel_installs_into_a_clean_venv_and_runs_the_readme_quick_start(built: Path, tmp_path: Path) -> None:
    """What a user does today: install the wheel that ``python -m build`` makes (with torch) into a fresh virtualenv
    and run the README's quick start, away from this checkout."""
    import subprocess
    import sys

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    (wheel,) = built.glob("*.whl")
    torch_spec = f"torch=={__import__('torch').__version__.split('+')[0]}"  # the build this suite runs on
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", torch_spec, str(wheel)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Quick start") :]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None
    script = tmp_path / "quick_start.py"
    script.write_text(code.group(1).replace("/tmp/optim.pt", str(tmp_path / "optim.pt")))
    run = subprocess.run([str(python), str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "ChunkPlan:" in run.stdout
    where = subprocess.run(
        [str(python), "-c", "import chunked_offload; print(chunked_offload.__file__)"], capture_output=True, text=True
    ).stdout
    assert where.startswith(str(venv)), where  # the installed wheel, not this checkout
