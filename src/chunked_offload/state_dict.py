"""The state-dict gate: save from the host copies, validate a whole checkpoint, load straight into host memory."""

from __future__ import annotations

import copy
from collections import OrderedDict, defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .adapters import Adapter, is_dense
from .dtensor import like_param, local
from .layout import stepped_like
from .placement import Placement, Prepared
from .planner import Role, TensorSpec
from .state_table import bind

__all__ = ["MASTER_KEY", "CheckpointEntry", "load", "portable", "rebuild", "save"]

# Where a wrapper-owned fp32 master goes in a checkpoint: one extra key in the param's own state entry. Plain
# optimizers carry unknown keys along and never read them; DCP's optimizer state dict keeps them too.
MASTER_KEY = "chunked_offload.master_fp32"


class CheckpointEntry(dict):  # type: ignore[type-arg]
    """One param's entry in ``opt.state_dict()["state"]``: a dict that keeps its tensors in host memory.

    A device tensor stored into it, or passed when one is built (``type(entry)({...})``), is copied to the host at
    once. Frameworks that move a whole checkpoint to the GPU before loading it, entry by entry (accelerate's
    ``AcceleratedOptimizer`` does at ``prepare()``), so never hold more than one param's state there. The entry
    pickles as an ``OrderedDict``, which ``torch.load(weights_only=True)`` accepts.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.update(*args, **kwargs)

    @classmethod
    def of(cls, items: Mapping[Any, Any]) -> CheckpointEntry:
        """An entry holding ``items`` as they are (the wrapper's own packing, resident state included)."""
        entry = cls()
        for k, v in items.items():
            dict.__setitem__(entry, k, v)
        return entry

    def __setitem__(self, key: Any, value: Any) -> None:
        if isinstance(value, torch.Tensor) and value.device.type != "cpu":
            value = value.to("cpu")
        dict.__setitem__(self, key, value)

    def update(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def __reduce_ex__(self, protocol: Any) -> Any:
        return (OrderedDict, (), None, None, iter(self.items()))

    def __copy__(self) -> CheckpointEntry:
        return CheckpointEntry.of(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> CheckpointEntry:
        return CheckpointEntry.of({copy.deepcopy(k, memo): copy.deepcopy(v, memo) for k, v in self.items()})


def save(opt: torch.optim.Optimizer, placement: Placement, *, snapshot: bool) -> dict[str, Any]:
    """The inner optimizer's native state dict, read from the host copies (``opt`` is the wrapper).

    ``state`` maps param ids (positions in ``param_groups`` order) to the state entries; ``param_groups`` holds the
    hyperparameters. Offloaded tensors are views of the host copies (or copies, with ``snapshot``); no device memory
    is allocated. Hooks registered on the inner optimizer run around the wrapper's own.
    """
    inner = placement.inner
    for pre_hook in list(inner._optimizer_state_dict_pre_hooks.values()):
        pre_hook(inner)
    placement.synchronize()  # every in-flight D2H lands before its host view is handed out
    placement.require().check()  # a store whose files failed a check: its views would be wrong, or SIGBUS
    sd = torch.optim.Optimizer.state_dict(opt)  # the wrapper's hooks, torch's packing, over the inner's state
    to_checkpoint, own = placement.adapter.to_checkpoint, placement.exported
    state = {  # never alias inner.state; tensors in the inner optimizer's own checkpoint dtypes
        pid: {k: own(pid, to_checkpoint(k, v)) if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
        for pid, entry in sd["state"].items()
    }
    for info in placement.infos:
        if info.has_master and info.index in state:
            state[info.index][MASTER_KEY] = own(info.index, like_param(placement.read_master(info), info.param))
    if snapshot:
        state = {pid: {k: _host_copy(v) for k, v in entry.items()} for pid, entry in state.items()}
    sd["state"] = {pid: CheckpointEntry.of(entry) for pid, entry in state.items()}
    for post_hook in list(inner._optimizer_state_dict_post_hooks.values()):
        out = post_hook(inner, sd)
        if out is not None:
            sd = out
    return sd


def _host_copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    return value


def load(opt: torch.optim.Optimizer, placement: Placement, state_dict: Any) -> None:
    """Validate ``state_dict`` completely, plan its layout, then copy it into the host copies and the param groups.

    ``opt`` is the wrapper (its own load hooks run around the inner's).

    Raises:
        TypeError, ValueError: the checkpoint does not fit this optimizer; nothing has been modified.
        RuntimeError: its layout cannot be allocated (host RAM); nothing has been modified.
    """
    inner = placement.inner
    for owner in (opt, inner):
        for pre_hook in list(owner._optimizer_load_state_dict_pre_hooks.values()):
            out = pre_hook(owner, state_dict)
            if out is not None:
                state_dict = out
    hparams, entries, saved_groups = _validate(placement, state_dict)
    placement.require().check()  # the homes of a store whose files failed a check cannot be written either
    # What the inner optimizer makes of the checkpoint (its own fix-ups in __setstate__), on copies.
    groups = [{**values, "params": g["params"]} for g, values in zip(inner.param_groups, hparams, strict=True)]
    groups, state = _fixed_up(inner, groups, _placed_state(placement, entries, saved_groups))
    prepared = placement.build(groups, state)  # may raise (host RAM): nothing is modified yet
    _apply(placement, groups, state, prepared)
    for info in placement.infos:
        if info.has_master:
            master = (entries.get(info.index) or {}).get(MASTER_KEY)
            placement.write_master(info, master if master is not None else info.param.detach().float())
    placement.trim()  # what went into the disk tier's maps is on the disk now, not in memory
    for owner in (opt, inner):
        for post_hook in list(owner._optimizer_load_state_dict_post_hooks.values()):
            post_hook(owner)


def _placed_state(
    placement: Placement, entries: dict[int, dict[str, Any]], saved_groups: list[Any]
) -> dict[torch.Tensor, dict[str, Any]]:
    """The checkpoint's entries by param, small tensors placed where the inner optimizer expects them."""
    saved_ids = [pid for g in saved_groups for pid in g["params"]]
    state: dict[torch.Tensor, dict[str, Any]] = {}
    for info in placement.infos:
        entry = entries.get(info.index)
        if not entry:
            continue
        values = {}
        # Small tensors are placed as for the tensor the inner steps: under masters the fp32 master, not the param.
        stepped = torch.empty(0, dtype=placement.stepped_dtype(info.param), device=info.param.device)
        for key, value in entry.items():
            if key == MASTER_KEY:
                continue
            if isinstance(value, torch.Tensor) and not placement.adapter.is_offloaded(key, value):
                value = _place_scalar(stepped, value, saved_ids[info.index], saved_groups, key)
            values[key] = value
        state[info.param] = values
    return state


def _apply(
    placement: Placement, groups: list[dict[str, Any]], state: dict[torch.Tensor, dict[str, Any]], prepared: Prepared
) -> None:
    """Write the checked groups and state into the inner optimizer and install their layout (cannot fail)."""
    inner = placement.inner
    placement.pipeline.drain()
    for group, new in zip(inner.param_groups, groups, strict=True):
        for k in [k for k in group if k != "params"]:
            del group[k]
        group.update({k: v for k, v in new.items() if k != "params"})
    table = inner.state
    for info in placement.infos:
        new_entry = state.get(info.param)
        if new_entry is None:
            table.pop(info.param, None)
            continue
        entry = table[info.param]
        dict.clear(entry)
        for k, v in new_entry.items():
            bind(entry, k, v)  # offloaded tensors are the checkpoint's; install copies them into their homes
    placement.install(prepared)
    placement.adapter.after_load([info.param for info in placement.infos if info.param in table])


def _fixed_up(
    inner: torch.optim.Optimizer, groups: list[dict[str, Any]], state: dict[torch.Tensor, dict[str, Any]]
) -> tuple[list[dict[str, Any]], dict[torch.Tensor, dict[str, Any]]]:
    """Run the inner optimizer's ``__setstate__`` (defaults for new hyperparameters, float ``step`` -> tensor) on a
    throwaway copy of it, so that its fix-ups apply to ``groups`` and ``state`` and to nothing else."""
    scratch = object.__new__(type(inner))
    scratch.__dict__.update(inner.__dict__)
    scratch.__dict__["defaults"] = dict(inner.defaults)
    type(inner).__setstate__(scratch, {"state": defaultdict(dict, state), "param_groups": groups})
    return scratch.param_groups, dict(scratch.state)


def _place_scalar(
    param: torch.Tensor, value: torch.Tensor, pid: Any, saved_groups: list[Any], key: str
) -> torch.Tensor:
    """Put a small state tensor (``step``) where the inner optimizer expects it, exactly as torch does."""
    policy = getattr(torch.optim.Optimizer, "_process_value_according_to_param_policy", None)
    placed = policy(param, value, pid, saved_groups, key) if policy is not None else value
    # `.to()` returns its input when nothing changes: never share a counter with the checkpoint's owner.
    return placed.clone() if placed is value else placed


def _validate(placement: Placement, sd: Any) -> tuple[list[dict[str, Any]], dict[int, dict[str, Any]], list[Any]]:
    """The checkpoint's hyperparameters per group, its entries by param index (converted), and its groups."""
    saved_groups, state, index_of = _check_structure(placement, sd)
    hparams = []
    for saved, group in zip(saved_groups, placement.inner.param_groups, strict=True):
        values = {k: v for k, v in group.items() if k != "params"}
        values.update({k: v for k, v in saved.items() if k != "params"})
        hparams.append(values)
    entries: dict[int, dict[str, Any]] = {}
    for pid, entry in state.items():
        index = index_of[pid]
        entries[index] = _checked_entry(placement, pid, index, entry, hparams)
    return hparams, entries, list(saved_groups)


def _check_structure(placement: Placement, sd: Any) -> tuple[Sequence[Any], Mapping[Any, Any], dict[Any, int]]:
    """The checkpoint's groups and state, and each param id's index, once its structure fits the optimizer's."""
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
    groups = placement.inner.param_groups
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
    return saved_groups, state, index_of


def _checked_entry(
    placement: Placement, pid: Any, index: int, entry: Any, hparams: list[dict[str, Any]]
) -> dict[str, Any]:
    """One param's checkpoint entry, checked against what the inner optimizer steps, tensors converted."""
    adapter, info = placement.adapter, placement.infos[index]
    if not isinstance(entry, Mapping):
        raise TypeError(f"state of param id {pid!r} must be a mapping, got {type(entry).__name__}")
    where = f"param {index} (checkpoint id {pid!r}, shape {tuple(info.param.shape)})"
    group = hparams[info.group_index]
    expected = {s.key: s for s in adapter.predict_state(stepped_like(info.param, placement.mode), group)}
    got = {k: v for k, v in entry.items() if k != MASTER_KEY and adapter.is_offloaded(k, v)}
    lacking = sorted(set(expected) - set(got) - adapter.lazy_keys(group)) if entry else []
    if lacking:
        raise ValueError(f"{where}: the checkpoint lacks state {lacking}")
    converted = {}
    for key, value in got.items():
        spec = expected.get(key)
        if isinstance(value, torch.Tensor) and spec is not None:
            value = adapter.from_checkpoint(key, value, spec)
        _check_tensor(where, key, local(value) if isinstance(value, torch.Tensor) else value, spec)
        converted[key] = value
    master = entry.get(MASTER_KEY)
    if master is not None and info.has_master:
        master_spec = TensorSpec(MASTER_KEY, Role.MASTER, tuple(info.param.shape), (), torch.float32)
        _check_tensor(where, MASTER_KEY, master, master_spec)
    return {**entry, **converted}


def _check_tensor(where: str, key: str, value: Any, spec: TensorSpec | None) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{where}: state {key!r} must be a tensor, got {type(value).__name__}")
    if spec is not None and tuple(value.shape) != spec.shape:
        raise ValueError(
            f"{where}: state {key!r} has shape {tuple(value.shape)} in the checkpoint, expected {spec.shape}"
        )
    if spec is not None and value.dtype != spec.dtype:
        raise ValueError(f"{where}: state {key!r} has dtype {value.dtype} in the checkpoint, expected {spec.dtype}")
    if not is_dense(value):
        raise ValueError(
            f"{where}: state {key!r} with strides {tuple(value.stride())} is not a dense tensor in the checkpoint"
        )


def portable(placement: Placement, adapter_given: bool) -> tuple[torch.optim.Optimizer, Adapter | None]:
    """The inner optimizer without its state, and its adapter if one was given: what a copy is rebuilt around.

    The copy's state comes from the state dict (the host copies); the inner's own ``state`` holds views of this
    wrapper's homes and is left out. An adapter passed explicitly goes with the copy, rebound to the copy's inner.
    """
    inner = placement.inner
    bare = object.__new__(type(inner))
    bare.__dict__.update({k: v for k, v in inner.__dict__.items() if k != "state"})
    bare.__dict__["state"] = defaultdict(dict)
    adapter = None
    if adapter_given:
        adapter = copy.copy(placement.adapter)
        adapter.inner = bare
    return bare, adapter


def rebuild(cls: type, inner: torch.optim.Optimizer, options: dict[str, Any], state: dict[str, Any]) -> Any:
    """A wrapper of class ``cls`` from what its ``__reduce_ex__`` gave: the inner without state, the options it was
    built with, and its state dict."""
    opt = cls(inner, **options)
    opt.load_state_dict(state)
    return opt
