"""ChunkStepper: run the inner optimizer's own step on one chunk of parameters, as a transaction."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.autograd.profiler import record_function

from .adapters import Adapter, is_dense
from .dtensor import like_param, local, same_tensor, show
from .layout import BACKUP, Layout, ParamInfo, Views
from .masters import (
    GRAD32,
    MASTER,
    REMAINDER,
    TIE_BITS,
    MasterMode,
    decode_remainder,
    encode_remainder,
    reconcile_and_back_up,
)
from .planner import Chunk, TensorSpec
from .state_table import bind

__all__ = ["ChunkHooks", "ChunkStepper", "ChunkTxn", "raw_step"]

_ABSENT = object()  # a param that had no state entry before the chunk


class ChunkHooks(Protocol):
    """What an outer step runs around each chunk's inner step (its group counters: ``context.GroupCounters``)."""

    def before_chunk(self) -> None: ...

    def after_chunk(self) -> None: ...


def raw_step(inner: torch.optim.Optimizer) -> Callable[[], Any]:
    """The inner optimizer's step without torch's per-call hook wrapper: its hooks run once per outer step."""
    fn: Any = type(inner).step
    if getattr(fn, "hooked", False) and hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return lambda: fn(inner)


@dataclass
class _MasterSwap:
    """A param that shows its fp32 master (and the fp32 grad) to the inner optimizer, until undone."""

    param: torch.Tensor
    data: torch.Tensor
    grad: torch.Tensor
    views: dict[str, torch.Tensor]
    parts: Any = None  # what a DTensor param shows besides ``.data`` (``layout.show``)
    active: bool = True


@dataclass
class ChunkTxn:
    """Everything needed to undo one chunk's step until its write-back is enqueued.

    [Note: Chunk transactions]
    A chunk commits whole or not at all: params, offloaded state, 0-dim counters, non-tensor state and masters
    together. Before the inner step the stepper records each param's state entry (0-dim tensors by value) and
    copies each stepped param into its slot's backup region. Offloaded state and masters need no copy: their
    homes are untouched until the write-back. A resident chunk steps in its homes ([Note: Resident chunks step in
    place] in pipeline.py), so its slot holds a copy of them, which a rollback copies back. Rolling back restores
    the params from the backups, puts every entry back as it was (removing entries and keys the step created), and
    leaves the slot's bytes to be overwritten. Once the write-back is enqueued the chunk is committed and the record
    is dropped.

    Attributes:
        state: the inner optimizer's state.
        entries: param -> its entry and the entry's items before the step, or ``_ABSENT``.
        scalars: 0-dim state tensors and copies of their values before the step.
        backups: (param, backup view) of every stepped param.
        swaps: master swaps still in effect.
        extras: throwaway params whose state is dropped.
        restores: (home, copy of it before the step) of a chunk stepped in its homes.
    """

    state: Any
    entries: dict[torch.Tensor, Any] = field(default_factory=dict)
    scalars: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    backups: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    swaps: list[_MasterSwap] = field(default_factory=list)
    extras: list[torch.Tensor] = field(default_factory=list)
    restores: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()

    def rollback(self) -> None:
        """Undo the chunk: the params, their state entries and the counters are as before its step."""
        for home, before in self.restores:
            home.copy_(before)
        for swap in reversed(self.swaps):
            _undo_swap(swap)
        for p, backup in self.backups:
            local(p).detach().copy_(backup)
        for t, saved in self.scalars:
            t.copy_(saved)
        for p, before in self.entries.items():
            if before is _ABSENT:
                self.state.pop(p, None)
                continue
            entry, items = before
            dict.__setitem__(self.state, p, entry)  # the inner may have replaced the entry object itself
            dict.clear(entry)
            for k, v in items.items():
                bind(entry, k, v)
        self.drop_extras()

    def drop_extras(self) -> None:
        for extra in self.extras:
            self.state.pop(extra, None)
        self.extras.clear()


def _undo_swap(swap: _MasterSwap) -> None:
    if swap.active:
        p = swap.param
        p.grad = None
        show(p, swap.data, swap.parts)
        p.grad = swap.grad
        swap.active = False


class ChunkStepper:
    """Binds a chunk's device views into the inner optimizer's state and runs the inner step on just that chunk.

    The steps for one chunk (the contracts "keep parameter identity", "restore each tensor exactly",
    "re-scan after every chunk" and "whole parameters only" in docs/design.md; [Note: Chunk transactions]):
    1. record every state entry of the chunk's params (0-dim tensors by value);
    2. for params with a wrapper-owned master: rebuild it if stored as a remainder, apply
       [Note: Edited params], cast the grad to fp32 into scratch;
    3. copy every stepped param into its backup, then point ``p.data`` / ``p.grad`` of master params at the master
       and the fp32 grad (as ``Module.half()`` swaps ``.data``), so the inner optimizer updates the master under
       the param's own state entry;
    4. rebind each existing state tensor to its device view (values only; the ``inner.state[p]`` dicts and the
       parameter objects stay the same);
    5. narrow every ``param_groups[i]["params"]`` to the chunk's params (plus any throwaway params the adapter
       asks for), step, restore them;
    6. put each param back, set it to the master rounded to nearest even, re-encode the remainder;
    7. re-scan the state: lazily created tensors are checked against the plan and either copied into the slot
       (staged chunk) or handed back for a direct D2H (fresh chunk); every state tensor is rebound to its home.

    A failure in steps 2-7 rolls the chunk back before the exception propagates. After ``run`` returns, the
    caller enqueues the write-back and then drops the returned transaction, or rolls it back if that fails.

    Args:
        inner: the wrapped optimizer.
        adapter: its adapter.
        mode: the master-weights mode.
        layout: every parameter, and its homes.
    """

    def __init__(self, inner: torch.optim.Optimizer, adapter: Adapter, mode: MasterMode, layout: Layout) -> None:
        self.inner = inner
        self.adapter = adapter
        self.mode = mode
        self.layout = layout
        self.infos = layout.infos
        self._step = raw_step(inner)
        self._narrowed: dict[int, list[list[torch.Tensor]]] = {}  # chunk index -> its params, group by group

    def run(
        self,
        chunk: Chunk,
        views: Views,
        counters: ChunkHooks,
        *,
        fresh: bool,
        restores: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], ChunkTxn]:
        """Step one chunk; return the ``(home, device tensor)`` pairs of fresh state to write back, and the txn.

        ``restores``: ``(home, copy)`` pairs that a rollback copies back, for views that are the homes themselves.
        """
        infos = [self.infos[i] for i in chunk.params]
        txn = self._record(infos)
        txn.restores = restores
        try:
            stepped = [info for info in infos if self.adapter.grad_of(info.param) is not None]
            mastered = [(info, views[info.index]) for info in stepped if info.has_master]
            if mastered:
                self._prepare_masters(mastered)  # which also backs up their params
            plain = [(local(i.param).detach(), views[i.index][BACKUP]) for i in stepped if not i.has_master]
            if plain:
                torch._foreach_copy_([b for _, b in plain], [p for p, _ in plain])
            txn.backups = [(info.param, views[info.index][BACKUP]) for info in stepped]
            if mastered:
                self._swap_in_masters(mastered, txn.swaps)
            if not fresh:
                self._bind(infos, views)
            self.adapter.verify_bound([info.param for info in infos], self.inner.state)
            counters.before_chunk()
            with record_function("chunked_offload::step_chunk"):
                self.inner_step(chunk, infos, txn)
            counters.after_chunk()
            txn.drop_extras()
            self._swap_out_masters(txn.swaps)
            txn.swaps.clear()
            return self.rescan(infos, views, fresh), txn
        except BaseException:
            txn.rollback()
            raise

    def run_empty(self, counters: ChunkHooks) -> None:
        """The inner step over empty groups, for an outer step in which no param has a grad.

        It changes no param, but it advances what the inner advances on every call, as plain torch would
        (Transformer Engine's ``group["step"]``).
        """
        counters.before_chunk()
        self._step_groups([[] for _ in self.inner.param_groups])
        counters.after_chunk()

    def _record(self, infos: Sequence[ParamInfo]) -> ChunkTxn:
        state = self.inner.state
        txn = ChunkTxn(state)
        scalars: list[torch.Tensor] = []
        for info in infos:
            entry = state.get(info.param)
            if entry is None:
                txn.entries[info.param] = _ABSENT
                continue
            txn.entries[info.param] = (entry, dict(entry))
            scalars += [v for v in entry.values() if isinstance(v, torch.Tensor) and v.dim() == 0]
        by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for t in scalars:
            by_kind.setdefault((t.dtype, t.device), []).append(t)
        for (dtype, device), kind in by_kind.items():
            saved = list(torch.empty(len(kind), dtype=dtype, device=device).unbind())  # one block per kind
            torch._foreach_copy_(saved, kind)
            txn.scalars += list(zip(kind, saved, strict=True))
        return txn

    def _bind(self, infos: Sequence[ParamInfo], views: Views) -> None:
        for info in infos:
            entry = self.inner.state.get(info.param)
            if not entry:
                continue
            for spec in info.state_specs:
                if spec.key in entry:
                    bind(entry, spec.key, like_param(views[info.index][spec.key], info.param))

    def _prepare_masters(self, mastered: Sequence[tuple[ParamInfo, dict[str, torch.Tensor]]]) -> None:
        params = [local(info.param).detach() for info, _ in mastered]
        if self.mode is MasterMode.REMAINDER:
            for p, (_, v) in zip(params, mastered, strict=True):
                decode_remainder(p, v[REMAINDER], v[TIE_BITS], v[MASTER])
        reconcile_and_back_up(params, [v[MASTER] for _, v in mastered], [v[BACKUP] for _, v in mastered])

    def _swap_in_masters(self, mastered: Sequence[tuple[ParamInfo, dict[str, torch.Tensor]]], swaps: list) -> None:
        """Cast the grads to fp32, then show each master and its fp32 grad as the param's data and grad."""
        grads = [info.param.grad for info, _ in mastered if info.param.grad is not None]
        if len(grads) < len(mastered):
            index = next(info.index for info, _ in mastered if info.param.grad is None)
            raise RuntimeError(f"param {index} has no grad; it should not have been swapped to its master")
        torch._foreach_copy_([v[GRAD32] for _, v in mastered], [local(g) for g in grads])
        for (info, views), grad in zip(mastered, grads, strict=True):
            p = info.param
            swap = _MasterSwap(p, p.data, grad, views)
            p.grad = None
            swap.parts = show(p, like_param(views[MASTER], p))  # a DTensor param: a DTensor over the master
            p.grad = like_param(views[GRAD32], p)
            swaps.append(swap)  # only once it is in effect: a rollback undoes what is in the list

    def _swap_out_masters(self, swaps: Sequence[_MasterSwap]) -> None:
        for swap in reversed(swaps):
            _undo_swap(swap)
        datas = [local(swap.data) for swap in swaps]
        if swaps:  # round to nearest even, exactly as `master.to(param.dtype)`
            torch._foreach_copy_(datas, [swap.views[MASTER] for swap in swaps])
        if self.mode is MasterMode.REMAINDER:
            for swap, data in zip(swaps, datas, strict=True):
                v = swap.views
                encode_remainder(v[MASTER], data, v[REMAINDER], v[TIE_BITS], work=v[GRAD32])

    def inner_step(self, chunk: Chunk, infos: Sequence[ParamInfo], txn: ChunkTxn) -> None:
        groups = self.inner.param_groups
        narrowed = self._narrowed.get(chunk.index)
        if narrowed is None:
            narrowed = [[] for _ in groups]
            for info in infos:
                narrowed[info.group_index].append(info.param)
            self._narrowed[chunk.index] = narrowed
        calls = []
        for gi, params in enumerate(narrowed):
            extras = self.adapter.extra_params(gi, params) if params else []
            txn.extras += extras
            calls.append(params + extras if extras else params)
        self._step_groups(calls)

    def _step_groups(self, calls: Sequence[list[torch.Tensor]]) -> None:
        """The inner step with each ``param_groups[i]["params"]`` narrowed to ``calls[i]``, restored afterwards."""
        groups = self.inner.param_groups
        saved = [g["params"] for g in groups]
        try:
            for g, params in zip(groups, calls, strict=True):
                g["params"] = params
            self._step()
        finally:
            for g, params in zip(groups, saved, strict=True):
                g["params"] = params

    def rescan(self, infos: Sequence[ParamInfo], views: Views, fresh: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
        fresh_pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for info in infos:
            entry = self.inner.state.get(info.param)
            if not entry:
                continue
            specs = {s.key: s for s in info.state_specs}
            unplanned = [k for k, v in entry.items() if self.adapter.is_offloaded(k, v) and k not in specs]
            if unplanned:
                raise RuntimeError(
                    f"the inner optimizer created state {unplanned} for param {info.index}, which the chunk plan "
                    f"does not hold (planned: {sorted(specs)}); the adapter does not match the optimizer"
                )
            for key, spec in specs.items():
                value = entry.get(key)
                if value is None:
                    continue
                t = local(value)
                home = self.layout.homes[info.index][key]
                view = None if fresh else views[info.index][key]
                if view is None or not same_tensor(t, view):
                    _check_matches(t, spec, info.index)
                    if t.stride() != home.stride() and t.numel() > 1:
                        # The inner made the state in another dense layout (the grad's): the home and the slot
                        # bytes take that layout, so that the state keeps its strides as in plain torch.
                        home = self.layout.relayout(info.index, key, t.stride())
                        view = None if view is None else view.as_strided(view.shape, t.stride())
                    if view is None:
                        fresh_pairs.append((home, t))
                    else:
                        view.copy_(t)
                bind(entry, key, self.layout.bound[info.index][key])
        return fresh_pairs


def _check_matches(t: torch.Tensor, spec: TensorSpec, index: int) -> None:
    """A state tensor the inner created fits its home: the planned shape and dtype, in any dense layout."""
    if tuple(t.shape) != spec.shape or t.dtype != spec.dtype or not is_dense(t):
        raise RuntimeError(
            f"the inner optimizer created state {spec.key!r} for param {index} with shape {tuple(t.shape)}, strides "
            f"{tuple(t.stride())} and dtype {t.dtype}, but the chunk plan expected shape {spec.shape} and dtype "
            f"{spec.dtype}, in a dense layout (such as strides {spec.stride}); the adapter does not match the optimizer"
        )
