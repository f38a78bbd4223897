"""The storage seam ([Note: Storage seam]): a tier behind the host is a store and a planner rule. The test-only tier
of ``slow_tier.py`` (its own file, nothing else edited) steps bitwise in every mode, and the parts that drive a step
name no tier."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from reference import internals
from slow_tier import SLOW, SlowTier
from test_loops import assert_same, build, train

SRC = Path(__file__).resolve().parents[1] / "src" / "chunked_offload"
TIER_WORDS = re.compile(r"\b(disk|spill\w*|bounces?|files?|mmap)\b", re.IGNORECASE)


def with_slow_tier(opt: object, keep_on_host: int, delay: float = 0.002) -> SlowTier:
    """Give the wrapper the slow tier from the next re-plan on, and re-plan now."""
    tier = SlowTier(keep_on_host, delay)
    placement = internals(opt).placement
    placement.options = dataclasses.replace(placement.options, tiers=(tier,))
    opt.replan()  # type: ignore[attr-defined]
    return tier


@pytest.mark.parametrize("master", ["none", "fp32", "remainder"])
@pytest.mark.parametrize("mode", ["sync", "overlap", "backward"])
def test_a_test_only_tier_steps_bitwise_in_every_mode(mode: str, master: str) -> None:
    plain = build("plain", master)
    train(*plain, range(4))
    model, opt = build(mode, master)
    tier = with_slow_tier(opt, keep_on_host=1)
    assert sum(c.home == SLOW for c in opt.plan.chunks) >= 2, opt.plan.summary()
    assert "chunks on slow-memory" in opt.plan.summary()
    train(model, opt, range(4))
    assert_same(plain[0], model)
    store = tier.stores[-1]
    assert store.reads and store.writes  # the steps went through the tier, not around it
    assert opt.stats.disk_read_bytes > 0 and opt.stats.disk_written_bytes > 0


def test_the_tiers_state_is_the_plain_optimizers_and_a_checkpoint_moves_to_the_host() -> None:
    plain = build("plain", "none")
    train(*plain, range(3))
    model, opt = build("sync", "none")
    with_slow_tier(opt, keep_on_host=0)
    train(model, opt, range(3))
    sd = opt.state_dict()
    for pid, entry in plain[1].state_dict()["state"].items():
        for key, value in entry.items():
            assert (sd["state"][pid][key] == value).all(), (pid, key)
    host_model, host_opt = build("sync", "none")
    host_model.load_state_dict(model.state_dict())
    host_opt.load_state_dict(sd)
    train(host_model, host_opt, range(3, 5))
    train(*plain, range(3, 5))
    assert_same(plain[0], host_model)


@pytest.mark.parametrize("module", ["pipeline", "placement", "context", "telemetry"])
def test_the_parts_that_drive_a_step_name_no_tier(module: str) -> None:
    text = (SRC / f"{module}.py").read_text()
    assert not TIER_WORDS.findall(text), f"{module}.py names a tier: {sorted(set(TIER_WORDS.findall(text)))}"
