"""ChunkStepper: run the inner optimizer's own step on one chunk of parameters, as a transaction."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch.autograd.profiler import record_function

from .adapters import Adapter, is_dense
from .dtensor import like_param, local, same_tensor
from .failures import add_note
from .layout import BACKUP, Layout, ParamInfo, Views
from .masters import (
    MASTER,
    REMAINDER,
    TIE_BITS,
    MasterMode,
    decode_remainder,
    reconcile_and_back_up,
)
from .notices import warn
from .planner import Chunk, Home, TensorSpec
from .state_table import bind
from .transaction import ABSENT, ChunkTxn, UpdateWatch, swap_in_masters, swap_out_masters

__all__ = ["ChunkHooks", "ChunkStepper", "ChunkTxn", "raw_step"]

# Whether resident chunks that the inner updates in one op step without a copy of their homes ([Note: One-op
# updates]); the benchmarks turn it off to time the copy.
ONE_OP_UPDATES = True


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

    A failure in steps 2-7 rolls the chunk back before the exception propagates, or after a one-op update rolls it
    forward and leaves the exception to the commit ([Note: One-op updates]). After ``run`` returns, the caller
    enqueues the write-back and then drops the returned transaction, or rolls it back if that fails.

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
        self._one_group: dict[int, int] = {}  # chunk index -> its one param group, or -1 ([Note: One-op updates])

    def run(
        self,
        chunk: Chunk,
        views: Views,
        counters: ChunkHooks,
        *,
        fresh: bool,
        restores: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
        one_op: bool = False,
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], ChunkTxn]:
        """Step one chunk; return the ``(home, device tensor)`` pairs of fresh state to write back, and the txn.

        ``restores``: ``(home, copy)`` pairs that a rollback copies back, for views that are the homes themselves.
        ``one_op``: the views are the homes, with no copy of them: the inner updates the chunk in one op
        ([Note: One-op updates]).
        """
        infos = [self.infos[i] for i in chunk.params]
        txn = self._record(infos)
        txn.restores = restores
        watch: UpdateWatch | None = None
        try:
            stepped = self._prepare(infos, views, txn, back_up=not one_op)
            if not fresh:
                self._bind(infos, views)
            self.adapter.verify_bound([info.param for info in infos], self.inner.state)
            if one_op:
                watch = UpdateWatch(self._updated_by_inner(stepped), reporting=self.adapter.watching)
            counters.before_chunk()
            with record_function("chunked_offload::step_chunk"), watch or contextlib.nullcontext():
                self.inner_step(chunk, infos, txn)
            if watch is not None and not watch.in_one_op:
                self._refute_one_op(chunk, watch)
            return self._complete(infos, views, fresh, counters, txn), txn
        except BaseException as exc:
            if watch is None or not watch.updated:
                txn.rollback()
                raise
            return self._roll_forward(exc, chunk, watch, infos, views, counters, txn), txn

    def in_one_op(self, chunk: Chunk) -> bool:
        """Whether a resident chunk steps in its homes with no copy of them.

        [Note: One-op updates]
        A resident chunk steps in its homes ([Note: Resident chunks step in place] in pipeline.py); a copy of them
        (24 bytes moved per element for AdamW with fp32 masters) lets a failure roll it back. That copy is not
        needed where the inner updates the chunk in one op after all of its checks (``Adapter.updates_in_one_op``:
        torch's fused Adam and AdamW run one ``_fused_adam(w)_`` per param group, device and dtype; Transformer
        Engine's FusedAdam with fp32 moments one multi-tensor kernel), so such a chunk (resident, one param group, one
        dtype and device as the inner sees them, masters none or fp32) takes none. ``UpdateWatch``, a dispatch mode
        around the inner step, tells when that op has returned (an extension's kernel, which the dispatcher does not
        see, is reported to it by the adapter: ``Adapter.watching``). A failure before it rolls the chunk back: the
        homes are untouched (the reconcile of [Note: Edited params] stays, which the next step would apply again),
        and the counters are restored by value. A failure after it rolls the chunk forward: the stepper completes the
        chunk (masters rounded into the params, state rebound) and the commit raises the failure once the chunk
        counts as committed; after a failure inside the inner's step it holds what the inner left, as plain torch
        would. A step whose update took more than one op refutes the adapter's promise: the wrapper warns, and from
        then on every resident chunk takes the copy.
        """
        if chunk.home != Home.DEVICE or self.mode is MasterMode.REMAINDER or not ONE_OP_UPDATES:
            return False
        group = self._one_group.get(chunk.index)
        if group is None:
            infos = [self.infos[i] for i in chunk.params]
            kinds = {(torch.float32 if i.has_master else i.param.dtype, local(i.param).device) for i in infos}
            groups = {i.group_index for i in infos}
            group = self._one_group[chunk.index] = groups.pop() if len(groups) == len(kinds) == 1 else -1
        return group >= 0 and self.adapter.updates_in_one_op(self.inner.param_groups[group])

    def _prepare(self, infos: Sequence[ParamInfo], views: Views, txn: ChunkTxn, *, back_up: bool) -> list[ParamInfo]:
        """Steps 2 and 3 for the params with grads (returned): masters ready, params backed up, masters shown."""
        stepped = [info for info in infos if self.adapter.grad_of(info.param) is not None]
        mastered = [(info, views[info.index]) for info in stepped if info.has_master]
        if mastered:
            self._prepare_masters(mastered, back_up)  # which also backs up their params
        plain = [(local(i.param).detach(), views[i.index][BACKUP]) for i in stepped if back_up and not i.has_master]
        if plain:
            torch._foreach_copy_([b for _, b in plain], [p for p, _ in plain])
        if back_up:
            txn.backups = [(info.param, views[info.index][BACKUP]) for info in stepped]
        if mastered:
            swap_in_masters(mastered, txn.swaps, self.adapter.grad_of)
        return stepped

    def _complete(
        self, infos: Sequence[ParamInfo], views: Views, fresh: bool, counters: ChunkHooks, txn: ChunkTxn
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Steps 6 and 7, after the inner step; running them again changes nothing."""
        counters.after_chunk()
        txn.drop_extras()
        swap_out_masters(txn.swaps, self.mode)
        txn.swaps.clear()
        return self.rescan(infos, views, fresh)

    def _updated_by_inner(self, stepped: Sequence[ParamInfo]) -> list[torch.Tensor]:
        """What the inner's update writes: the stepped params as it sees them, and their state tensors."""
        state = self.inner.state
        entries = [state.get(info.param) or {} for info in stepped]
        return [info.param for info in stepped] + [
            v for entry in entries for k, v in entry.items() if self.adapter.is_offloaded(k, v)
        ]

    def _refute_one_op(self, chunk: Chunk, watch: UpdateWatch) -> None:
        if self.adapter.one_op_refuted:
            return  # warned already (a failure after a refuting step's inner step comes here twice)
        self.adapter.one_op_refuted = True
        warn(
            f"chunked_offload: {self.adapter.name} promises to update a chunk in one op, but {watch.ops} op(s) wrote "
            f"{len(watch.written & watch.watched)} of the {len(watch.watched)} tensors of chunk {chunk.index}; "
            "resident chunks now take a copy of their homes for rollback"
        )

    def _roll_forward(
        self,
        exc: BaseException,
        chunk: Chunk,
        watch: UpdateWatch,
        infos: Sequence[ParamInfo],
        views: Views,
        counters: ChunkHooks,
        txn: ChunkTxn,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The failure came after the chunk's update op: complete the chunk; the commit raises ``exc``."""
        if not watch.in_one_op:
            self._refute_one_op(chunk, watch)
            add_note(exc, f"chunked_offload: chunk {chunk.index} holds what the inner optimizer left when it failed")
        txn.failure = exc
        try:
            return self._complete(infos, views, False, counters, txn)
        except BaseException as again:
            add_note(
                again,
                f"chunked_offload: chunk {chunk.index} was updated, but completing it failed after {exc!r}: its params "
                "may not hold their masters; load a checkpoint",
            )
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
                txn.entries[info.param] = ABSENT
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

    def _prepare_masters(self, mastered: Sequence[tuple[ParamInfo, dict[str, torch.Tensor]]], back_up: bool) -> None:
        params = [local(info.param).detach() for info, _ in mastered]
        if self.mode is MasterMode.REMAINDER:
            for p, (_, v) in zip(params, mastered, strict=True):
                decode_remainder(p, v[REMAINDER], v[TIE_BITS], v[MASTER])
        masters, backups = [v[MASTER] for _, v in mastered], [v[BACKUP] for _, v in mastered]
        reconcile_and_back_up(params, masters, backups, back_up=back_up)

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
