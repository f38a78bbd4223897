"""The Transformer Engine adapter's logic, on the CPU with a stand-in (tests/cuda/test_te.py runs the real one)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from chunked_offload import TEFusedAdamAdapter
from chunked_offload.planner import Role, TensorSpec


def _fake(**kw: Any) -> Any:
    """The attributes of transformer_engine.pytorch.optimizers.FusedAdam the adapter reads."""
    attrs = {
        "exp_avg_dtype": torch.float32,
        "exp_avg_sq_dtype": torch.float32,
        "master_weights": False,
        "master_weight_dtype": torch.float32,
        "store_param_remainders": False,
        "capturable": False,
        "use_decoupled_grad": False,
        "state": {},
        "_scales": {},
        "multi_tensor_adam": print,  # TE's kernels are instance attributes
        "multi_tensor_adam_param_remainder": print,
        **kw,
    }
    attrs["name_to_dtype_map"] = {
        "exp_avg": attrs["exp_avg_dtype"],
        "exp_avg_sq": attrs["exp_avg_sq_dtype"],
        "master_param": attrs["master_weight_dtype"],
    }
    return SimpleNamespace(**attrs)


@pytest.mark.parametrize(
    "kw, error",
    [
        ({"exp_avg_dtype": torch.float16}, "exp_avg_dtype=torch.float16"),
        ({"exp_avg_sq_dtype": torch.uint8}, "exp_avg_sq_dtype=torch.uint8"),
        ({"master_weights": True, "master_weight_dtype": torch.float16}, "master_weight_dtype=torch.float16"),
        ({"capturable": True}, "capturable=True"),
    ],
)
def test_configurations_with_state_outside_state_or_fixed_pointers_are_refused(kw: dict[str, Any], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        TEFusedAdamAdapter(_fake(**kw)).check_config()


def test_predicted_state_follows_te_dtypes_and_masters() -> None:
    adapter = TEFusedAdamAdapter(_fake(exp_avg_dtype=torch.bfloat16, master_weights=True, store_param_remainders=True))
    bf16 = torch.empty(4, 6, dtype=torch.bfloat16, device="meta")
    specs = {s.key: s.dtype for s in adapter.predict_state(bf16, {})}
    assert specs == {"exp_avg": torch.bfloat16, "exp_avg_sq": torch.float32, "master_param": torch.int16}
    fp32 = torch.empty(4, 6, dtype=torch.float32, device="meta")
    assert {s.key: s.dtype for s in adapter.predict_state(fp32, {})}["master_param"] == torch.float32
    assert adapter.owns_masters()


@pytest.mark.parametrize(
    "kw, dtype, one_op",
    [
        ({}, torch.bfloat16, True),
        ({"master_weights": True, "store_param_remainders": True}, torch.bfloat16, True),
        ({"exp_avg_dtype": torch.bfloat16}, torch.bfloat16, False),  # written back after the kernel
        ({"master_weights": True}, torch.float32, False),  # the fp32 param's master is kept but not stepped
        ({}, torch.float32, True),
        ({"multi_tensor_adam": None}, torch.bfloat16, False),  # not where ``watching`` can report its calls
    ],
)
def test_one_kernel_updates_a_group_only_with_fp32_moments_and_every_master_stepped(
    kw: dict[str, Any], dtype: torch.dtype, one_op: bool
) -> None:
    inner = _fake(**kw)
    if inner.multi_tensor_adam is None:
        del inner.multi_tensor_adam
    group = {"params": [torch.nn.Parameter(torch.zeros(3, dtype=dtype))]}
    assert TEFusedAdamAdapter(inner).updates_in_one_op(group) == one_op


def test_checkpoints_use_te_dtypes_both_ways() -> None:
    adapter = TEFusedAdamAdapter(_fake(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16))
    moment = torch.randn(5, 3).bfloat16()
    saved = adapter.to_checkpoint("exp_avg", moment)
    assert saved.dtype == torch.float32 and torch.equal(saved.bfloat16(), moment)  # exact, as TE saves it
    spec = TensorSpec("exp_avg", Role.STATE, (5, 3), (3, 1), torch.bfloat16)
    loaded = adapter.from_checkpoint("exp_avg", saved + 1e-4, spec)
    assert loaded.dtype == torch.bfloat16 and torch.equal(loaded, (saved + 1e-4).to(torch.bfloat16))
    remainder = torch.zeros(5, 3, dtype=torch.int16)
    assert adapter.to_checkpoint("master_param", remainder) is remainder


def test_state_loaded_from_a_checkpoint_gets_te_scales() -> None:
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))]
    inner = _fake(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    inner.state = {params[0]: {"exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3)}}
    adapter = TEFusedAdamAdapter(inner)
    adapter.after_load(params)
    assert inner._scales == {}  # not at the load, which must cost no device memory: at the next step
    adapter.begin_step(lambda p: p.dtype)
    assert set(inner._scales) == {params[0]}  # a param without state gets none: TE creates them at its first step
    assert all(torch.equal(s, torch.ones(1)) for s in inner._scales[params[0]].values())
    fp32 = _fake()
    fp32.state = dict(inner.state)
    fp32_adapter = TEFusedAdamAdapter(fp32)
    fp32_adapter.after_load(params)
    fp32_adapter.begin_step(lambda p: p.dtype)
    assert fp32._scales == {}  # fp32 moments have no scales


def test_state_on_another_device_than_its_param_at_a_chunk_step_is_refused() -> None:
    param = torch.nn.Parameter(torch.zeros(4, 6))
    adapter = TEFusedAdamAdapter(_fake())
    adapter.verify_bound([param], {param: {"exp_avg": torch.zeros(4, 6)}})  # beside its param: TE's kernel may run
    with pytest.raises(RuntimeError, match="is on meta"):
        adapter.verify_bound([param], {param: {"exp_avg": torch.zeros(4, 6, device="meta")}})
    with pytest.raises(RuntimeError, match="strides"):
        adapter.verify_bound([param], {param: {"exp_avg": torch.zeros(6, 4).t()}})
