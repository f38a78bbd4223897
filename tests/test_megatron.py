"""Megatron-Core ([Note: Megatron main params]): ``wrap_megatron_optimizer`` on Megatron's own DDP and
DistributedOptimizer (megatron-core 0.19.2, on gloo in spawned ranks, with ``megatron_cases.cuda_on_cpu`` standing in
for CUDA) is bitwise with Megatron's resident optimizer in losses, grad norms, params, fp32 mains and moments; a
dist-checkpointing round trip resumes bitwise; the RL path's offload and restore keep it so."""

from __future__ import annotations

import pytest

import megatron_cases
from test_distributed import _spawn

pytest.importorskip("megatron.core", reason="megatron-core is installed by `make venv` (Makefile)")


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize(
    "case",
    [
        {},  # clipping at 0.1 clips every step
        {"clip_grad": 0.0, "weight_decay": 0.0},
        # fp16 with dynamic loss scaling from 2**24: the first steps overflow and are skipped (found inf)
        {"bf16": False, "fp16": True, "initial_loss_scale": 2.0**24, "min_loss_scale": 1.0, "hysteresis": 1},
        {"overlap_param_gather": True},  # Megatron all-gathers each bucket's params in the next forward
        # the step beside the next forward, which (and each bucket's all-gather) waits for the chunks it reads
        {"overlap_param_gather": True, "wrap": {"overlap": True}},
        {
            "bf16": False,
            "fp16": True,
            "initial_loss_scale": 2.0**24,
            "min_loss_scale": 1.0,
            "hysteresis": 1,
            "wrap": {"overlap": True},
        },
        # Megatron's precision-aware path: TE's FusedAdam(master_weights=True) keeps the masters
        {"te": True},
        {"te": True, "use_precision_aware_optimizer": False},  # the default path, with TE's FusedAdam as the inner
        {"te": True, "grad_reduce_in_fp32": False},  # bf16 grads: TE's FusedAdam reads them as they are
        {"te": True, "overlap_param_gather": True, "wrap": {"overlap": True}},
        {"wrap": {"master_weights": "remainder"}},  # a 16-bit remainder of each main: 10 B/param, as exact
        {"overlap_param_gather": True, "wrap": {"overlap": True, "master_weights": "remainder"}},
    ],
    ids=[
        "adam-clip",
        "adam-plain",
        "fp16-found-inf",
        "overlap-param-gather",
        "overlap",
        "overlap-fp16",
        "te",
        "te-default-path",
        "te-bf16-grads",
        "te-overlap",
        "remainder",
        "remainder-overlap",
    ],
)
def test_a_wrapped_distributed_optimizer_is_bitwise_with_megatrons_resident_one(world: int, case: dict) -> None:
    if world > 1 and case.get("wrap", {}).get("overlap") and not case.get("overlap_param_gather"):
        pytest.skip("refused: overlap at more than one rank needs overlap_param_gather (the refusal's own test)")
    result = _spawn(megatron_cases.parity, 6, case, world=world)
    assert set(result) == set(range(world))
    for rank, (same, trace) in result.items():
        assert same, f"rank {rank}: {trace}"
        skipped = [not ok for _, (ok, _) in trace]
        assert any(skipped) == bool(case.get("fp16")) and not all(skipped), trace


@pytest.mark.parametrize(
    ("options", "sharding", "te"),
    [
        ({}, "dp_reshardable", False),
        ({"overlap": True}, "dp_reshardable", False),
        ({}, "fully_reshardable", False),  # Megatron's default, and --dist-ckpt-optim-fully-reshardable
        ({"master_weights": "remainder"}, "fully_reshardable", False),  # saves the mains the remainders make
        ({}, "dp_reshardable", True),  # the precision-aware path, loaded into a run that has not stepped
        ({"overlap": True}, "fully_reshardable", True),
    ],
    ids=["sync", "overlap", "fully-reshardable", "remainder", "te", "te-overlap-fully-reshardable"],
)
@pytest.mark.parametrize("world", [1, 2])
def test_a_dist_checkpoint_round_trip_resumes_bitwise(world: int, options: dict, sharding: str, te: bool) -> None:
    assert _spawn(megatron_cases.resume, options, sharding, te, world=world) == dict.fromkeys(range(world), True)


@pytest.mark.parametrize("te", [False, True], ids=["default", "te"])
def test_offload_to_cpu_and_restore_from_cpu_keep_the_run_bitwise(te: bool) -> None:
    assert _spawn(megatron_cases.rl_offload, te, world=1) == {0: True}


def test_what_cannot_be_wrapped_is_refused_with_what_to_do() -> None:
    messages = _spawn(megatron_cases.refusals, world=1)[0]
    expected = {
        "in backward": "step_in_backward=True is not supported under Megatron-Core",
        "masters": "master_weights='fp32' (the default) or 'remainder'",
        "remainder of fp16": "master_weights='remainder' needs bf16 params (--bf16), got torch.float16",
        "masters on te's path": "TE's FusedAdam keeps the masters",
        "bf16 grads": "grad_reduce_in_fp32=True",
        "wrapped": "wrapped already",
        "cpu offload": "optimizer_cpu_offload steps Megatron's HybridDeviceOptimizer on the CPU",
        "te without masters": "needs Transformer Engine's FusedAdam(master_weights=True)",
        "not distributed": "got Float16OptimizerWithFloat16Params: build it with OptimizerConfig(use_distributed",
    }
    for name, needle in expected.items():
        message, unchanged = messages[name]
        assert needle in message, (name, message)
        assert unchanged, f"{name}: the optimizer was modified before the refusal"
    assert messages["overlap without param gather"] == ("", False)  # one rank: nothing to gather, overlap runs


def test_overlap_at_two_ranks_without_overlap_param_gather_is_refused() -> None:
    for rank, messages in _spawn(megatron_cases.refusals, world=2).items():
        message, unchanged = messages["overlap without param gather"]
        assert "overlap_param_gather=True" in message and unchanged, (rank, message)


@pytest.mark.parametrize("te", [False, True], ids=["default", "te"])
@pytest.mark.parametrize("world", [1, 2])
def test_wrapping_after_resident_steps_carries_the_mains_and_moments_over(world: int, te: bool) -> None:
    assert _spawn(megatron_cases.wrap_midway, te, world=world) == dict.fromkeys(range(world), True)


@pytest.mark.parametrize(
    ("overlap", "fp32_source"), [(False, False), (True, False), (False, True)], ids=["sync", "overlap", "state-dict"]
)
@pytest.mark.parametrize("world", [1, 2])
def test_reload_model_params_makes_the_mains_the_loaded_params(world: int, overlap: bool, fp32_source: bool) -> None:
    result = _spawn(megatron_cases.reload_params, overlap, fp32_source, world=world)
    assert result == dict.fromkeys(range(world), True)


@pytest.mark.parametrize("world", [1, 2])
def test_overlap_reads_the_grad_buffer_in_place_and_refuses_a_write_before_the_step_read_it(world: int) -> None:
    for rank, (same, refused) in _spawn(megatron_cases.held_zeroing, world=world).items():
        assert same, f"rank {rank}: a zeroing with no forward after it is not bitwise with the resident run"
        assert "was written after step() returned and before the step had read it" in refused, (rank, refused)
