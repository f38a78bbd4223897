"""Input checks of the wrapper: each raises with what was given and how to fix it, before anything is modified."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from .adapters import Adapter, check_groups
from .dtensor import is_dtensor
from .layout import ParamInfo
from .masters import MasterMode, needs_master
from .notices import warn
from .state_table import StateTable

__all__ = [
    "check_grads",
    "check_inner",
    "check_master_mode",
    "check_not_wrapped",
    "check_options",
    "check_params",
    "check_sharding",
    "check_wrappable",
    "common_device",
]


def check_options(
    *,
    chunk_size_mb: Any,
    offload_fraction: Any,
    num_slots: Any,
    pin_memory: Any,
    master_weights: Any,
    gpu_budget_mb: Any,
    overlap: Any,
    step_in_backward: Any = False,
    gpu_headroom_mb: Any = None,
    spill_dir: Any = None,
    host_budget_mb: Any = None,
) -> None:
    """The constructor's keyword options."""
    _check_disk_options(spill_dir, host_budget_mb)
    _check_mib("chunk_size_mb", chunk_size_mb, positive=True)
    if offload_fraction is not None and gpu_budget_mb is not None:
        raise ValueError(
            f"pass offload_fraction ({offload_fraction}) or gpu_budget_mb ({gpu_budget_mb}), not both: the budget "
            "decides what stays resident on its own"
        )
    fraction = 1.0 if offload_fraction is None else offload_fraction
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
        raise TypeError(f"offload_fraction must be a number in [0, 1], got {type(fraction).__name__}")
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"offload_fraction must be in [0, 1], got {fraction}")
    _check_mib_or_auto("gpu_budget_mb", gpu_budget_mb)
    if gpu_headroom_mb is not None:
        if gpu_budget_mb != "auto":
            raise ValueError(
                f"gpu_headroom_mb={gpu_headroom_mb} applies to gpu_budget_mb='auto' only (given "
                f"gpu_budget_mb={gpu_budget_mb!r}): pass gpu_budget_mb='auto', or leave gpu_headroom_mb out"
            )
        _check_mib("gpu_headroom_mb", gpu_headroom_mb)
    if not isinstance(overlap, bool):
        raise TypeError(f"overlap must be True or False, got {overlap!r}")
    if not isinstance(step_in_backward, bool):
        raise TypeError(f"step_in_backward must be True or False, got {step_in_backward!r}")
    if overlap and step_in_backward:
        raise ValueError(
            "pass overlap=True or step_in_backward=True, not both: they are two ways to hide the step (the next "
            "forward overlaps it, or the backward runs it); docs/modes.md says which fits which loop"
        )
    if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
        raise ValueError(f"num_slots must be an int >= 1, got {num_slots!r}")
    if pin_memory is not None and not isinstance(pin_memory, bool):
        raise TypeError(f"pin_memory must be True, False or None, got {pin_memory!r}")
    modes = [m.value for m in MasterMode]
    if master_weights not in modes:
        raise ValueError(f"master_weights must be one of {modes}, got {master_weights!r}")


def _check_disk_options(spill_dir: Any, host_budget_mb: Any) -> None:
    """``spill_dir`` and ``host_budget_mb`` ([Note: Disk tier]); ``spill.check_spill_dir`` checks the directory."""
    if host_budget_mb is not None and spill_dir is None:
        raise ValueError(
            f"host_budget_mb={host_budget_mb!r} needs spill_dir: the state beyond the host budget lives in files "
            "there. Pass spill_dir=PATH (a directory on a local disk), or leave host_budget_mb out"
        )
    if spill_dir is not None and not isinstance(spill_dir, (str, os.PathLike)):
        raise TypeError(f"spill_dir must be a path (str or os.PathLike), got {type(spill_dir).__name__}")
    if spill_dir is not None and os.fspath(spill_dir) == "":
        raise ValueError(
            "spill_dir='' names no directory (it would spill into the current one): pass a directory on a local disk"
        )
    _check_mib_or_auto("host_budget_mb", host_budget_mb)


def _check_mib_or_auto(name: str, value: Any) -> None:
    """A budget option: None, "auto", or a size in MiB (``_check_mib``)."""
    if isinstance(value, str):
        if value != "auto":
            raise TypeError(f"{name} must be a number of MiB or 'auto', got {value!r}")
    elif value is not None:
        _check_mib(name, value, kind="a number of MiB or 'auto'")


def _check_mib(name: str, value: Any, *, positive: bool = False, kind: str = "a number of MiB") -> None:
    """A size option in MiB: a real number (not a bool), finite, and > 0 (``positive``) or >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be {kind}, got {type(value).__name__}")
    if not (math.isfinite(value) and (value > 0 if positive else value >= 0)):
        raise ValueError(f"{name} must be a finite number {'>' if positive else '>='} 0, got {value}")


def check_inner(inner: object, wrapper: type) -> None:
    """``inner`` is an optimizer instance and not already a wrapper (of class ``wrapper``)."""
    if isinstance(inner, wrapper):
        raise TypeError(
            "inner is already a ChunkedOffloadOptimizer; wrap the underlying optimizer once (opt.inner is it)"
        )
    if not isinstance(inner, torch.optim.Optimizer):
        if isinstance(inner, (list, tuple)) or isinstance(inner, Iterator) or isinstance(inner, torch.Tensor):
            raise TypeError(
                f"ChunkedOffloadOptimizer wraps an optimizer instance, got {type(inner).__name__} (parameters?). "
                "Build the optimizer first: ChunkedOffloadOptimizer(torch.optim.AdamW(model.parameters()))"
            )
        raise TypeError(f"inner must be a torch.optim.Optimizer instance, got {type(inner).__name__}")


def check_wrappable(inner: torch.optim.Optimizer) -> None:
    """The inner is not wrapped yet, and its groups and params are ones the wrapper can plan."""
    check_not_wrapped(inner)
    check_groups(inner)
    check_params(inner.param_groups)


def check_not_wrapped(inner: torch.optim.Optimizer) -> None:
    state = inner.state
    if isinstance(state, StateTable) and state.binding is not None:
        raise ValueError(
            f"this {type(inner).__name__} is already wrapped by a live ChunkedOffloadOptimizer; two wrappers would "
            "each step and rebind the same state. Use the existing wrapper (or drop it before wrapping again)"
        )


def check_params(groups: Sequence[Mapping[str, Any]]) -> None:
    seen: dict[int, tuple[int, int]] = {}
    for gi, group in enumerate(groups):
        for pi, p in enumerate(group["params"]):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"param group {gi} holds a {type(p).__name__} at position {pi}, not a tensor")
            if p.is_sparse or p.layout != torch.strided:
                raise ValueError(
                    f"param group {gi} holds a param with layout {p.layout}; only dense params are supported"
                )
            if id(p) in seen:
                g0, p0 = seen[id(p)]
                raise ValueError(
                    f"param {pi} of param group {gi} (shape {tuple(p.shape)}) is also param {p0} of group {g0}; a "
                    "param listed twice would be stepped twice. List each param once (torch only warns about this)"
                )
            seen[id(p)] = (gi, pi)


def check_sharding(groups: Sequence[Mapping[str, Any]], adapter: Adapter) -> None:
    """DTensor params: refuse sharded params where the update needs whole ones."""
    for gi, group in enumerate(groups):
        for p in group["params"]:
            if not is_dtensor(p):
                continue
            placements = getattr(p, "placements", ())
            if adapter.whole_params and any(type(pl).__name__ in ("Shard", "_StridedShard") for pl in placements):
                raise TypeError(
                    f"{type(adapter.inner).__name__} updates whole matrices, but a param of param group {gi} is "
                    f"sharded across ranks ({tuple(placements)}); each rank would orthogonalize only its shard. Keep "
                    "the Muon params unsharded (do not fully_shard the modules that hold them), or use a Muon that "
                    "gathers shards itself, with adapter=KeyedAdapter(..., whole_params=False)"
                )


def common_device(inner: torch.optim.Optimizer) -> torch.device:
    devices = {p.device for g in inner.param_groups for p in g["params"]}
    if len(devices) > 1:
        raise ValueError(
            f"all params must be on one device, got {sorted(str(d) for d in devices)}; wrap one optimizer per device"
        )
    device = devices.pop() if devices else torch.device("cpu")
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"params must be on a CUDA device or the CPU, got {device}")
    return device


def check_setup(
    inner: torch.optim.Optimizer, adapter: Adapter, mode: MasterMode, pin_memory: bool | None
) -> torch.device:
    """The inner's config, sharding, device and master mode suit the wrapper's options; the params' device."""
    adapter.check_config()
    check_sharding(inner.param_groups, adapter)
    device = common_device(inner)
    check_master_mode(inner, adapter, mode)
    if pin_memory and device.type != "cuda":
        raise ValueError(f"pin_memory=True needs params on a CUDA device, but they are on {device}")
    return device


def check_master_mode(inner: torch.optim.Optimizer, adapter: Adapter, mode: MasterMode) -> None:
    if mode is MasterMode.NONE:
        return
    if adapter.owns_masters() or getattr(inner, "master_weights", False):
        raise ValueError(
            f"master_weights={mode.value!r} but {type(inner).__name__} already keeps fp32 masters in its own state; "
            "they are offloaded with the rest of its state. Use master_weights='none' so masters are not stored twice"
        )
    params = [p for g in inner.param_groups for p in g["params"]]
    bad = sorted({str(p.dtype) for p in params if not p.is_floating_point()})
    if bad:
        raise ValueError(f"master_weights={mode.value!r} needs floating-point params, got params of dtype {bad}")
    if mode is MasterMode.FP32 and params and not any(needs_master(p, mode) for p in params):
        warn(
            f"master_weights='fp32' does nothing here: every param is {sorted({str(p.dtype) for p in params})}, "
            "and only bf16/fp16 params get a master. Use master_weights='none'"
        )
    if mode is MasterMode.REMAINDER:
        dtypes = {p.dtype for p in params}
        if torch.float16 in dtypes:
            raise ValueError(
                "master_weights='remainder' encodes bf16 params only, got float16 params; use master_weights='fp32'"
            )
        if torch.bfloat16 not in dtypes:
            raise ValueError(
                f"master_weights='remainder' needs bf16 params, got only {sorted(str(d) for d in dtypes)}; "
                "fp32 params need no master: use master_weights='none'"
            )


def _where(info: ParamInfo) -> str:
    p = info.param
    return f"param {info.index} (shape {tuple(p.shape)}, dtype {p.dtype}, device {p.device})"


def check_grads(infos: Sequence[ParamInfo], adapter: Adapter) -> None:
    """Every grad fits its param; checked for all chunks before any is modified."""
    inner_masters = adapter.owns_masters()
    for info in infos:
        p, grad = info.param, adapter.grad_of(info.param)
        if grad is None:
            continue
        if grad.is_sparse or grad.layout != torch.strided:
            raise RuntimeError(
                f"{_where(info)} has a {grad.layout} gradient; chunked offload stages dense state only. Use dense "
                "gradients (e.g. nn.Embedding(sparse=False))"
            )
        fp32_fits = info.has_master or inner_masters  # an fp32 grad of a param with an fp32 master: exact
        dtype_fits = grad.dtype == p.dtype or (fp32_fits and grad.dtype == torch.float32)
        if grad.shape != p.shape or not dtype_fits or grad.device != p.device:
            raise RuntimeError(
                f"{_where(info)} has a grad of shape {tuple(grad.shape)}, dtype {grad.dtype} on {grad.device}; a grad "
                "must match its param (was the param resized or converted after backward?). Zero the grads "
                "(opt.zero_grad()) and run backward again"
            )
