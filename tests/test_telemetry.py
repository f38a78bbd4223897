"""What a wrapper reports: opt.stats per step, and its log lines."""

from __future__ import annotations

import logging

import pytest

from reference import (
    adamw_pair,
    run_steps,
    set_grads,
)

_KIB = 1 / 1024  # MiB


def test_stats_count_the_bytes_of_each_step() -> None:
    ref, ref_params, opt, params = adamw_pair(master_weights="none")
    assert opt.stats is None
    run_steps(opt, params, 1)
    first = opt.stats
    assert first is not None
    state = sum(c.transfer_nbytes for c in opt.plan.chunks)
    assert (first.chunks, first.h2d_bytes, first.d2h_bytes) == (len(opt.plan.chunks), 0, state)
    run_steps(opt, params, 1, first_step=1)
    later = opt.stats
    assert later is not None
    assert (later.h2d_bytes, later.d2h_bytes, later.d2d_bytes) == (state, state, 0)
    assert 0 < later.window_bytes <= opt.plan.window_bound_nbytes
    assert later.seconds > 0 and later.link_gbps > 0
    assert later.resident_bytes == 0 and later.pinned_host_bytes == 0  # the CPU arena is not page-locked
    set_grads(params, [None] * len(params))
    opt.step()
    assert opt.stats is not None and opt.stats.chunks == 0


def test_construction_logs_one_info_line_the_plan_at_debug_and_each_step_a_debug_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.DEBUG, logger="chunked_offload"):
        _, _, opt, params = adamw_pair()
        run_steps(opt, params, 2)
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(infos) == 1 and "window bound" in infos[0] and "\n" not in infos[0]
    assert any("ChunkPlan:" in r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG)
    steps = [
        r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG and r.getMessage().startswith("step:")
    ]
    assert len(steps) == 2 and "MiB H2D" in steps[1]
