"""Transformer Engine FusedAdam, wrapped: bitwise equal to unwrapped in every supported configuration."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch

from chunked_offload import ChunkedOffloadOptimizer, ChunkedOffloadWarning, GenericAdapter, TEFusedAdamAdapter
from reference import assert_equal, assert_states_equal, internals, make_grads, make_params, set_grads

pytestmark = pytest.mark.cuda
te_optimizers = pytest.importorskip("transformer_engine.pytorch.optimizers")
FusedAdam = te_optimizers.FusedAdam

SHAPES = [(256, 384), (1000,), (33, 17), (512, 512), (7,), (129, 64)]
CONFIGS: dict[str, dict[str, Any]] = {
    "fp32-moments": {},
    "bf16-moments": {"exp_avg_dtype": torch.bfloat16, "exp_avg_sq_dtype": torch.bfloat16},
    "master-weights": {"master_weights": True},
    "param-remainders": {
        "master_weights": True,
        "store_param_remainders": True,
        "exp_avg_dtype": torch.bfloat16,
        "exp_avg_sq_dtype": torch.bfloat16,
    },
}


def _dtype(config: str) -> torch.dtype:
    return torch.bfloat16 if "master" in config or "remainder" in config else torch.float32


def _make(params: list[torch.nn.Parameter], **kw: Any) -> Any:
    # Three groups: one whose params sit in several chunks, one empty, one with other hyperparameters.
    groups = [{"params": params[:4]}, {"params": []}, {"params": params[4:], "lr": 3e-3, "weight_decay": 0.0}]
    return FusedAdam(groups, lr=1e-2, weight_decay=0.1, **kw)


def _run(opt: Any, params: list[torch.nn.Parameter], steps: int, first: int = 0) -> None:
    for step in range(first, first + steps):
        grads = make_grads(params, step, none_every=4)
        if step % 10 == 7:
            grads = [None] * len(grads)  # TE still advances every group's step
        set_grads(params, grads)
        opt.step()
        opt.zero_grad(set_to_none=True)


def _assert_same(ref: Any, ref_params: list[torch.nn.Parameter], opt: Any, params: list[torch.nn.Parameter]) -> None:
    opt.synchronize()
    for i, (a, b) in enumerate(zip(ref_params, params, strict=True)):
        assert_equal(a, b, f"param {i}")
    assert_states_equal(ref, ref_params, opt, params)
    assert [g["step"] for g in ref.param_groups] == [g["step"] for g in opt.param_groups]


@pytest.mark.parametrize("chunk_mb", [0.3, 1024.0])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_te_fused_adam_matches_unwrapped(config: str, chunk_mb: float) -> None:
    dtype = _dtype(config)
    ref_params, params = make_params(SHAPES, dtype, "cuda"), make_params(SHAPES, dtype, "cuda")
    ref = _make(ref_params, **CONFIGS[config])
    opt = ChunkedOffloadOptimizer(_make(params, **CONFIGS[config]), chunk_size_mb=chunk_mb)
    assert isinstance(opt.adapter, TEFusedAdamAdapter)
    assert (len(opt.plan.chunks) > 2) == (chunk_mb < 1)
    _run(ref, ref_params, 50)
    _run(opt, params, 50)
    _assert_same(ref, ref_params, opt, params)
    for p in params:
        for value in opt.state[p].values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                assert value.device.type == "cpu"  # every state tensor, TE's masters included, is offloaded


@pytest.mark.parametrize("config", list(CONFIGS))
def test_te_resident_chunks_take_no_copy_where_one_kernel_updates_them(config: str) -> None:
    """With fp32 moments TE's one kernel call updates a chunk of one group: no rollback copy, and no chunk refutes
    it (a refutation warns); bf16 moments are written back after the kernel, so those chunks take the copy."""
    dtype = _dtype(config)
    ref_params, params = make_params(SHAPES, dtype, "cuda"), make_params(SHAPES, dtype, "cuda")
    ref = _make(ref_params, **CONFIGS[config])
    opt = ChunkedOffloadOptimizer(_make(params, **CONFIGS[config]), chunk_size_mb=0.3, offload_fraction=0.0)
    stepper = internals(opt).placement.pipeline.require_stepper()
    one_op = [stepper.in_one_op(c) for c in opt.plan.all_chunks]
    assert any(one_op) == (CONFIGS[config].get("exp_avg_dtype", torch.float32) == torch.float32), one_op
    with warnings.catch_warnings():
        warnings.simplefilter("error", ChunkedOffloadWarning)
        _run(ref, ref_params, 20)
        _run(opt, params, 20)
    _assert_same(ref, ref_params, opt, params)


@pytest.mark.parametrize("config", ["bf16-moments", "param-remainders"])
def test_te_checkpoints_are_te_native_and_cost_no_gpu_memory(config: str) -> None:
    dtype = _dtype(config)
    ref_params, params = make_params(SHAPES, dtype, "cuda"), make_params(SHAPES, dtype, "cuda")
    ref = _make(ref_params, **CONFIGS[config])
    opt = ChunkedOffloadOptimizer(_make(params, **CONFIGS[config]), chunk_size_mb=0.3)
    _run(ref, ref_params, 10)
    _run(opt, params, 10)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    sd = opt.state_dict()
    assert torch.cuda.max_memory_allocated() == base  # TE's own state_dict() would unscale on the GPU
    native = ref.state_dict()
    assert native["param_groups"] == sd["param_groups"]
    for pid, entry in native["state"].items():
        assert entry.keys() == sd["state"][pid].keys()
        for k, v in entry.items():
            assert_equal(v, sd["state"][pid][k], f"{pid}/{k}")  # bf16 moments saved as fp32, as TE saves them

    # A plain FusedAdam loads the wrapper's checkpoint, and the wrapper loads the plain one; both resume exactly.
    plain_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    plain = _make(plain_params, **CONFIGS[config])
    plain.load_state_dict(copy.deepcopy(sd))
    wrapped_again = ChunkedOffloadOptimizer(_make(params, **CONFIGS[config]), chunk_size_mb=0.3)
    native_copy = copy.deepcopy(native)  # TE's own checkpoint holds fp32 GPU tensors
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    wrapped_again.load_state_dict(native_copy)  # converted to bf16 on the host, never on the GPU
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() == base
    _run(ref, ref_params, 5, first=10)
    _run(plain, plain_params, 5, first=10)
    _run(wrapped_again, params, 5, first=10)
    _assert_same(ref, ref_params, wrapped_again, params)
    for a, b in zip(ref_params, plain_params, strict=True):
        assert_equal(a, b)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"exp_avg_dtype": torch.float16}, r"exp_avg_dtype=torch.float16.*supported: torch.float32, torch.bfloat16"),
        ({"exp_avg_sq_dtype": torch.uint8}, r"exp_avg_sq_dtype=torch.uint8.*_scales"),
        ({"capturable": True}, "capturable=True"),
    ],
)
def test_te_configurations_that_cannot_be_chunked_are_refused(kw: dict[str, Any], match: str) -> None:
    params = make_params(SHAPES, torch.float32, "cuda")
    with pytest.raises(ValueError, match=match):
        ChunkedOffloadOptimizer(FusedAdam(params, lr=1e-2, **kw))


def test_te_state_off_the_gpu_at_a_chunk_step_is_refused() -> None:
    params = make_params(SHAPES, torch.float32, "cuda")
    inner = _make(params)
    adapter = TEFusedAdamAdapter(inner)
    state = {params[0]: {"exp_avg": torch.zeros(params[0].shape)}}  # a host tensor: TE would write through it
    with pytest.raises(RuntimeError, match="need contiguous memory on the param's GPU"):
        adapter.verify_bound([params[0]], state)
    state = {params[0]: {"exp_avg": torch.zeros(384, 256, device="cuda").t()}}
    with pytest.raises(RuntimeError, match="strides"):
        adapter.verify_bound([params[0]], state)


def test_te_through_the_generic_probe_never_breaks_the_cuda_context() -> None:
    params = make_params(SHAPES, torch.bfloat16, "cuda")
    inner = _make(params, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    try:
        opt = ChunkedOffloadOptimizer(inner, adapter=GenericAdapter(inner), chunk_size_mb=0.3)
        _run(opt, params, 2)
    except (TypeError, RuntimeError) as exc:  # a clear error is fine: the probe cannot see TE's dtypes
        assert "FusedAdam" in str(exc) or "adapter" in str(exc)
    torch.cuda.synchronize()
    assert (torch.ones(4, device="cuda") * 2).sum().item() == 8.0  # the context is healthy
