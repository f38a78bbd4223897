"""benchmarks/trace_summary.py on a made-up trace: the GPU idle it reports and where it puts a chunk's host time."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("trace_summary", ROOT / "benchmarks" / "trace_summary.py")
assert _spec is not None and _spec.loader is not None
trace_summary = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(trace_summary)


def _event(name: str, cat: str, ts: float, dur: float, tid: int = 1) -> dict[str, Any]:
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid, "pid": 1}


def _write(tmp_path: Path, events: list[dict[str, Any]]) -> Path:
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return path


def test_gpu_idle_is_the_span_less_the_union_of_gpu_work(tmp_path: Path) -> None:
    # Kernels at [0, 10) and [5, 20) on two streams, a copy at [30, 40): busy 30 of a 40 us span.
    events = [
        _event("k1", "kernel", 0, 10, tid=7),
        _event("k2", "kernel", 5, 15, tid=8),
        _event("memcpy", "gpu_memcpy", 30, 10, tid=7),
        _event("aten::add", "cpu_op", 0, 50),  # host work is not GPU activity
    ]
    s = trace_summary.summarise(_write(tmp_path, events), iters=2)
    assert s["span_ms"] == 40 / 1e3 / 2 and s["idle_ms"] == 10 / 1e3 / 2 and s["chunks"] == 0
    # Stream 8 has the most kernel time (15 us): busy [5, 20), idle the other 25 us of the span.
    assert s["main_busy_ms"] == 15 / 1e3 / 2 and s["main_idle_ms"] == 25 / 1e3 / 2


def test_a_chunks_host_time_goes_to_the_ops_inside_it_by_self_time(tmp_path: Path) -> None:
    chunk = trace_summary.CHUNK
    events = [
        _event(chunk, "user_annotation", 100, 100),
        _event("aten::copy_", "cpu_op", 110, 30),
        _event("aten::copy_", "cpu_op", 150, 20),
        _event("aten::to", "cpu_op", 180, 15),
        _event("aten::_to_copy", "cpu_op", 182, 10),  # inside aten::to: its 10 us are not aten::to's
        _event("aten::mul", "cpu_op", 300, 40),  # outside the chunk: not counted
        _event("aten::copy_", "cpu_op", 120, 5, tid=2),  # another thread, overlapping in time: not in the chunk
    ]
    rows = {name: (ms, calls) for name, ms, calls in trace_summary.chunk_ops(_write(tmp_path, events))}
    assert rows["aten::copy_"] == (50 / 1e3, 2)
    assert rows["aten::to"] == (5 / 1e3, 1) and rows["aten::_to_copy"] == (10 / 1e3, 1)
    assert rows[chunk] == ((100 - 30 - 20 - 15) / 1e3, 1)
    assert "aten::mul" not in rows


def test_kernel_rows_give_each_kernels_time_and_the_idle_just_before_it(tmp_path: Path) -> None:
    # adam<float> [0, 10), a copy [12, 20) beside norm [15, 20), adam<half> [30, 40): idle 2 before the copy, 10 before
    # the second adam; template arguments are cut from the names, and copies are named by their category.
    events = [
        _event("adam<float>", "kernel", 0, 10),
        _event("Memcpy HtoD", "gpu_memcpy", 12, 8, tid=9),
        _event("norm", "kernel", 15, 5),
        _event("adam<half>", "kernel", 30, 10),
    ]
    time, idle = trace_summary.kernel_rows(_write(tmp_path, events), iters=1)
    assert dict(time) == {"adam": 20 / 1e3, "gpu_memcpy": 8 / 1e3, "norm": 5 / 1e3}
    assert dict(idle) == {"gpu_memcpy": 2 / 1e3, "adam": 10 / 1e3}
    assert [name for name, _ in idle] == ["adam", "gpu_memcpy"]  # most idle first


def test_main_gaps_name_what_the_callers_stream_waited_for(tmp_path: Path) -> None:
    # The main stream (7, most kernel time) runs fwd [0, 100), waits, read [112, 113), waits, bwd [113.1, 200): a
    # 12 us gap in which stream 9 wrote back [90, 111) and stepped [100, 105); a 0.1 us gap under the floor.
    events = [
        _event("fwd", "kernel", 0, 100, tid=7),
        _event("Memcpy DtoH", "gpu_memcpy", 112, 1, tid=7),
        _event("bwd<float>", "kernel", 113.1, 86.9, tid=7),
        _event("Memcpy DtoH", "gpu_memcpy", 90, 21, tid=9),
        _event("adam", "kernel", 100, 5, tid=9),
        _event("Memcpy HtoD", "gpu_memcpy", 150, 10, tid=9),  # outside every gap
    ]
    gaps = trace_summary.main_gaps(_write(tmp_path, events), n=5, least_us=1)
    assert len(gaps) == 1
    ms, before, after, inside = gaps[0]
    assert (ms, before, after) == (12 / 1e3, "fwd", "Memcpy DtoH")
    assert inside == [("9: Memcpy DtoH", 11 / 1e3), ("9: adam", 5 / 1e3)]
