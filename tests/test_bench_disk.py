"""benchmarks/bench_disk.py's driver: a child run takes the options its caller adds (the checksum A/B's "off")."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench_disk() -> Any:
    sys.path.insert(0, str(ROOT / "benchmarks"))  # its `common`
    try:
        spec = importlib.util.spec_from_file_location("bench_disk", ROOT / "benchmarks" / "bench_disk.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


@pytest.mark.parametrize("checksums", ["on", "off"])
def test_a_child_run_takes_the_checksums_its_caller_asks_for(bench_disk: Any, tmp_path: Path, checksums: str) -> None:
    args = argparse.Namespace(
        params=2e4, dim=64, chunk_mb=0.02, iters=1, spill_dir=tmp_path, shares="0", writes="tier", checksums="on"
    )
    row = bench_disk.child(args, ["--one", "--host-budget", str(150_000), "--checksums", checksums])
    assert row["checksums"] == checksums and row["exact"] and row["disk_read"] > 0


def test_the_checksum_ab_runs_on_off_off_on_so_that_a_drift_of_the_disk_cancels(
    bench_disk: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk that slows by the same step each run (1.0, 1.1, 1.2, 1.3 s) costs the checksums nothing."""
    runs: list[str] = []

    def child(args: Any, extra: list[str]) -> dict[str, Any]:
        checksums = extra[extra.index("--checksums") + 1] if "--checksums" in extra else "on"
        runs.append(checksums)
        return {"checksums": checksums, "step_s": 1.0 + 0.1 * len(runs)}

    monkeypatch.setattr(bench_disk, "child", child)
    on = {"step_s": 1.0}
    assert bench_disk.checksum_cost(argparse.Namespace(ab_rounds=1), 1, on) == [pytest.approx(0.0)]
    assert runs == ["off", "off", "on"]


def test_each_round_of_the_checksum_ab_runs_on_off_off_on_and_gives_its_own_cost(
    bench_disk: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Round two's runs: checksums on 1.0 s, off 0.5 s twice, on 1.0 s: it costs +100%, round one nothing."""
    runs: list[str] = []
    off_seconds = [1.0, 1.0, 0.5, 0.5]

    def child(args: Any, extra: list[str]) -> dict[str, Any]:
        checksums = extra[extra.index("--checksums") + 1] if "--checksums" in extra else "on"
        runs.append(checksums)
        return {"checksums": checksums, "step_s": off_seconds.pop(0) if checksums == "off" else 1.0}

    monkeypatch.setattr(bench_disk, "child", child)
    costs = bench_disk.checksum_cost(argparse.Namespace(ab_rounds=2), 1, {"step_s": 1.0})
    assert runs == ["off", "off", "on", "on", "off", "off", "on"]
    assert costs == [pytest.approx(0.0), pytest.approx(1.0)]
