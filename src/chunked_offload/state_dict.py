"""The state-dict gate: save from the host copies, validate a whole checkpoint, load straight into host memory."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from .adapters import is_dense
from .planner import Role, TensorSpec

if TYPE_CHECKING:
    from .optimizer import ChunkedOffloadOptimizer

__all__ = ["MASTER_KEY", "load", "save"]

# Where a wrapper-owned fp32 master goes in a checkpoint: one extra key in the param's own state entry. Plain
# optimizers carry unknown keys along and never read them; DCP's optimizer state dict keeps them too.
MASTER_KEY = "chunked_offload.master_fp32"


def save(opt: ChunkedOffloadOptimizer, *, snapshot: bool) -> dict[str, Any]:
    """The inner optimizer's native state dict, read from the host copies.

    ``state`` maps param ids (positions in ``param_groups`` order) to the state entries; ``param_groups`` holds the
    hyperparameters. Offloaded tensors are views of the host arena (or copies, with ``snapshot``); no device memory
    is allocated.
    """
    opt.synchronize()  # every in-flight D2H lands before its host view is handed out
    sd = torch.optim.Optimizer.state_dict(opt)  # the wrapper's hooks, torch's packing, over the inner's state
    state: dict[Any, Any] = {pid: dict(entry) for pid, entry in sd["state"].items()}  # never alias inner.state
    for info in opt._infos:
        if info.has_master and info.index in state:
            state[info.index][MASTER_KEY] = opt._read_master(info)
    if snapshot:
        state = {pid: {k: _host_copy(v) for k, v in entry.items()} for pid, entry in state.items()}
    sd["state"] = state
    return sd


def _host_copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    return value


def load(opt: ChunkedOffloadOptimizer, state_dict: Any) -> None:
    """Validate ``state_dict`` completely, then copy it into the host copies and the param groups.

    Raises:
        TypeError, ValueError: the checkpoint does not fit this optimizer; nothing has been modified.
    """
    for pre_hook in opt._optimizer_load_state_dict_pre_hooks.values():
        out = pre_hook(opt, state_dict)
        if out is not None:
            state_dict = out
    hparams, entries, saved_groups = _validate(opt, state_dict)
    saved_ids = [pid for g in saved_groups for pid in g["params"]]

    opt._drain()
    inner = opt.inner
    for group, values in zip(inner.param_groups, hparams, strict=True):
        for k in [k for k in group if k != "params"]:
            del group[k]
        group.update(values)
    for info in opt._infos:
        entry = entries.get(info.index)
        if not entry:
            inner.state.pop(info.param, None)
            continue
        values = {}
        for key, value in entry.items():
            if key == MASTER_KEY:
                continue
            if isinstance(value, torch.Tensor) and not opt.adapter.is_offloaded(key, value):
                value = _place_scalar(info.param, value, saved_ids[info.index], saved_groups, key)
            values[key] = value
        state = inner.state[info.param]
        state.clear()
        state.update(values)
    # The inner's own fix-ups for loaded checkpoints (defaults for new hyperparameters, float `step` -> tensor).
    inner.__setstate__({"state": inner.state, "param_groups": inner.param_groups})
    opt._build()  # re-plans if the layout changed, then copies each checkpoint tensor into its host view
    for info in opt._infos:
        if info.has_master:
            entry = entries.get(info.index) or {}
            master = entry.get(MASTER_KEY)
            opt._write_master(info, master if master is not None else info.param.detach().float())
    for post_hook in opt._optimizer_load_state_dict_post_hooks.values():
        post_hook(opt)


def _place_scalar(
    param: torch.Tensor, value: torch.Tensor, pid: Any, saved_groups: list[Any], key: str
) -> torch.Tensor:
    """Put a small state tensor (``step``) where the inner optimizer expects it, exactly as torch does."""
    policy = getattr(torch.optim.Optimizer, "_process_value_according_to_param_policy", None)
    placed = policy(param, value, pid, saved_groups, key) if policy is not None else value
    # `.to()` returns its input when nothing changes: never share a counter with the checkpoint's owner.
    return placed.clone() if placed is value else placed


def _validate(
    opt: ChunkedOffloadOptimizer, sd: Any
) -> tuple[list[dict[str, Any]], dict[int, dict[str, Any]], list[Any]]:
    if not isinstance(sd, Mapping):
        raise TypeError(f"state_dict must be a mapping with 'state' and 'param_groups', got {type(sd).__name__}")
    missing = [k for k in ("state", "param_groups") if k not in sd]
    if missing:
        raise ValueError(f"state_dict lacks {missing}; got keys {sorted(map(str, sd.keys()))}")
    saved_groups, state = sd["param_groups"], sd["state"]
    if not isinstance(saved_groups, (list, tuple)) or not all(
        isinstance(g, Mapping) and isinstance(g.get("params"), (list, tuple)) for g in saved_groups
    ):
        raise ValueError("state_dict['param_groups'] must be a list of dicts, each with a 'params' list")
    if not isinstance(state, Mapping):
        raise ValueError(f"state_dict['state'] must be a mapping from param id to state, got {type(state).__name__}")
    groups = opt.inner.param_groups
    if len(saved_groups) != len(groups):
        raise ValueError(f"the checkpoint has {len(saved_groups)} param groups but the optimizer has {len(groups)}")
    for gi, (saved, group) in enumerate(zip(saved_groups, groups, strict=True)):
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(
                f"param group {gi} has {len(saved['params'])} params in the checkpoint but {len(group['params'])} in "
                "the optimizer; the checkpoint belongs to another model or another grouping"
            )
    ids = [pid for g in saved_groups for pid in g["params"]]
    if len(set(ids)) != len(ids):
        raise ValueError("the checkpoint's param_groups list a param id more than once")
    index_of = {pid: i for i, pid in enumerate(ids)}
    unknown = [pid for pid in state if pid not in index_of]
    if unknown:
        raise ValueError(f"the checkpoint has state for param ids {unknown[:5]}, which no param group lists")

    hparams = []
    for saved, group in zip(saved_groups, groups, strict=True):
        values = {k: v for k, v in group.items() if k != "params"}
        values.update({k: v for k, v in saved.items() if k != "params"})
        hparams.append(values)

    entries: dict[int, dict[str, Any]] = {}
    for pid, entry in state.items():
        index = index_of[pid]
        info = opt._infos[index]
        if not isinstance(entry, Mapping):
            raise TypeError(f"state of param id {pid!r} must be a mapping, got {type(entry).__name__}")
        where = f"param {index} (checkpoint id {pid!r}, shape {tuple(info.param.shape)})"
        expected = {
            s.key: s for s in opt.adapter.predict_state(opt._stepped_like(info.param), hparams[info.group_index])
        }
        got = {k: v for k, v in entry.items() if k != MASTER_KEY and opt.adapter.is_offloaded(k, v)}
        lacking = sorted(set(expected) - set(got))
        if lacking:
            raise ValueError(f"{where}: the checkpoint lacks state {lacking}")
        extra = sorted(set(got) - set(expected))
        if extra:
            raise ValueError(
                f"{where}: the checkpoint has state {extra} that {type(opt.inner).__name__} with these "
                f"hyperparameters does not create (expected {sorted(expected)})"
            )
        for key, value in got.items():
            _check_tensor(where, key, value, expected[key])
        master = entry.get(MASTER_KEY)
        if master is not None and info.has_master:
            master_spec = TensorSpec(MASTER_KEY, Role.MASTER, tuple(info.param.shape), (), torch.float32)
            _check_tensor(where, MASTER_KEY, master, master_spec)
        entries[index] = dict(entry)
    return hparams, entries, list(saved_groups)


def _check_tensor(where: str, key: str, value: Any, spec: TensorSpec) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{where}: state {key!r} must be a tensor, got {type(value).__name__}")
    if tuple(value.shape) != spec.shape:
        raise ValueError(
            f"{where}: state {key!r} has shape {tuple(value.shape)} in the checkpoint, expected {spec.shape}"
        )
    if value.dtype != spec.dtype:
        raise ValueError(f"{where}: state {key!r} has dtype {value.dtype} in the checkpoint, expected {spec.dtype}")
    if not is_dense(value):
        raise ValueError(f"{where}: state {key!r} is not a dense tensor in the checkpoint")
