"""The README quick start runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_quick_start_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    text = README.read_text()
    section = text[text.index("## Quick start") :]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None, "the quick start has no python block"
    source = code.group(1).replace("/tmp/optim.pt", str(tmp_path / "optim.pt"))
    exec(compile(source, str(README), "exec"), {"__name__": "readme"})
    assert "ChunkPlan:" in capsys.readouterr().out


def test_readme_opens_for_users_and_gives_the_contributor_commands() -> None:
    text = README.read_text()
    first_screen = text[: text.index("## Quick start")]
    assert "bitwise" in first_screen and "## Install" in first_screen and "pip install ." in first_screen
    contributors = text[text.index("## For contributors") :].split("```")[1]
    assert all(f"make {c}" in contributors for c in ("test-fast", "test", "bench"))
