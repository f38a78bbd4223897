"""One chunk's step as a transaction: ChunkTxn, its master swaps, Pending, and the UpdateWatch of the inner."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .dtensor import like_param, local, show
from .layout import ParamInfo
from .masters import GRAD32, MASTER, REMAINDER, TIE_BITS, MasterMode, encode_remainder
from .staging import Slot
from .state_table import bind

__all__ = [
    "ABSENT",
    "ChunkTxn",
    "MasterSwap",
    "Pending",
    "UpdateWatch",
    "swap_in_masters",
    "swap_out_masters",
    "undo_swap",
]

ABSENT = object()  # a param that had no state entry before the chunk


@dataclass
class MasterSwap:
    """A param that shows its fp32 master (and the fp32 grad) to the inner optimizer, until undone."""

    param: torch.Tensor
    data: torch.Tensor
    grad: torch.Tensor | None  # the param's own .grad, put back after the step
    views: dict[str, torch.Tensor]
    parts: Any = None  # what a DTensor param shows besides ``.data`` (``layout.show``)
    active: bool = True


def undo_swap(swap: MasterSwap) -> None:
    """Show the param's own data and grad again (once)."""
    if swap.active:
        p = swap.param
        p.grad = None
        show(p, swap.data, swap.parts)
        p.grad = swap.grad
        swap.active = False


def swap_in_masters(
    mastered: Sequence[tuple[ParamInfo, dict[str, torch.Tensor]]],
    swaps: list[MasterSwap],
    grad_of: Callable[[torch.Tensor], torch.Tensor | None],
) -> None:
    """Show each master and its fp32 grad as the param's data and grad.

    The grads are ``grad_of``'s (the adapter's rule). A 16-bit one is cast into the chunk's fp32 scratch. An fp32
    one, where an integration keeps them so (Megatron's ``decoupled_grad``, which Megatron's own step hands its
    inner as it is; or the copy an overlapped step owns), is shown as it is: a copy would only move 8 bytes per
    element more.
    """
    grads = [g for info, _ in mastered if (g := grad_of(info.param)) is not None]
    if len(grads) < len(mastered):
        index = next(info.index for info, _ in mastered if grad_of(info.param) is None)
        raise RuntimeError(f"param {index} has no grad; it should not have been swapped to its master")
    as_is = [type(g) is torch.Tensor and g.dtype == torch.float32 and g.shape == info.param.shape
             for (info, _), g in zip(mastered, grads, strict=True)]  # fmt: skip
    cast = [(v[GRAD32], local(g)) for (_, v), g, keep in zip(mastered, grads, as_is, strict=True) if not keep]
    if cast:
        torch._foreach_copy_([scratch for scratch, _ in cast], [g for _, g in cast])
    for (info, views), g, keep in zip(mastered, grads, as_is, strict=True):
        p = info.param
        swap = MasterSwap(p, p.data, p.grad, views)
        p.grad = None
        swap.parts = show(p, like_param(views[MASTER], p))  # a DTensor param: a DTensor over the master
        p.grad = g if keep else like_param(views[GRAD32], p)
        swaps.append(swap)  # only once it is in effect: a rollback undoes what is in the list


def swap_out_masters(swaps: Sequence[MasterSwap], mode: MasterMode) -> None:
    """Undo the swaps, set each param to its master rounded to nearest even, re-encode remainders."""
    for swap in reversed(swaps):
        undo_swap(swap)
    datas = [local(swap.data) for swap in swaps]
    if swaps:  # round to nearest even, exactly as `master.to(param.dtype)`
        torch._foreach_copy_(datas, [swap.views[MASTER] for swap in swaps])
    if mode is MasterMode.REMAINDER:
        for swap, data in zip(swaps, datas, strict=True):
            v = swap.views
            encode_remainder(v[MASTER], data, v[REMAINDER], v[TIE_BITS], work=v[GRAD32])


@dataclass
class ChunkTxn:
    """Everything needed to undo one chunk's step until its write-back is enqueued.

    [Note: Chunk transactions]
    A chunk commits whole or not at all: params, offloaded state, 0-dim counters, non-tensor state and masters
    together. Before the inner step the stepper records each param's state entry (0-dim tensors by value) and
    copies each stepped param into its slot's backup region. Offloaded state and masters need no copy: their
    homes are untouched until the write-back. A resident chunk steps in its homes ([Note: Resident chunks step in
    place] in pipeline.py), so its slot holds a copy of them, which a rollback copies back, unless the inner
    updates the chunk in one op ([Note: One-op updates]): then a failure before that op rolls the chunk back with
    nothing to copy, and one after it rolls the chunk forward (``failure``). Rolling back restores the params from
    the backups, puts every entry back as it was (removing entries and keys the step created), and leaves the
    slot's bytes to be overwritten. Once the write-back is enqueued the chunk is committed and the record is
    dropped.

    Attributes:
        state: the inner optimizer's state.
        entries: param -> its entry and the entry's items before the step, or ``ABSENT``.
        scalars: 0-dim state tensors and copies of their values before the step.
        backups: (param, backup view) of every stepped param.
        swaps: master swaps still in effect.
        extras: throwaway params whose state is dropped.
        restores: (home, copy of it before the step) of a chunk stepped in its homes.
        failure: what failed after the chunk's one-op update had run: the chunk was completed instead of rolled
            back, and the commit raises this once the chunk counts as committed.
    """

    state: Any
    entries: dict[torch.Tensor, Any] = field(default_factory=dict)
    scalars: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    backups: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    swaps: list[MasterSwap] = field(default_factory=list)
    extras: list[torch.Tensor] = field(default_factory=list)
    restores: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()
    failure: BaseException | None = None

    def rollback(self) -> None:
        """Undo the chunk: the params, their state entries and the counters are as before its step."""
        for home, before in self.restores:
            home.copy_(before)
        for swap in reversed(self.swaps):
            undo_swap(swap)
        for p, backup in self.backups:
            local(p).detach().copy_(backup)
        for t, saved in self.scalars:
            t.copy_(saved)
        for p, before in self.entries.items():
            if before is ABSENT:
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


@dataclass
class Pending:
    """A stepped chunk whose write-back is not enqueued yet (``committing`` once it is being enqueued)."""

    slot: Slot
    txn: ChunkTxn
    pairs: list[tuple[torch.Tensor, torch.Tensor]]
    retain: list[torch.Tensor] = field(default_factory=list)
    committing: bool = False


class UpdateWatch(TorchDispatchMode):
    """Counts the inner optimizer's ops that have written a chunk's params or state, as they return.

    A dispatch mode sees every op of the inner's step before its kernel runs and after it returns; it runs each op
    as it comes (the same kernels, the same results). An op writes a tensor where its schema marks the argument
    written (``Tensor(a!)``). A write counts when it reaches a watched tensor or its memory (a view the inner made
    of one: ``view_as_real``): the storage, not only the object, decides. A kernel the dispatcher does not see (an
    extension's, called with raw tensors) is one op too, where the adapter reports it (:meth:`kernel`).

    Args:
        watched: the tensors the inner updates: the params as it sees them and their state tensors.
        reporting: entered with the watch: a context in which the inner's extension kernels report to it
            (``Adapter.watching``).
    """

    def __init__(
        self,
        watched: Iterable[torch.Tensor],
        reporting: Callable[[UpdateWatch], AbstractContextManager[Any]] | None = None,
    ) -> None:
        super().__init__()
        self._reporting: Callable[[UpdateWatch], AbstractContextManager[Any]] | None = reporting
        self._reported: AbstractContextManager[Any] | None = None
        tensors = list(watched)
        self.watched = {id(t) for t in tensors}
        self.storages = {_storage(t) for t in tensors} - {0}  # empty tensors own no memory
        self.ops = 0  # ops that returned having written a watched tensor
        self.written: set[int] = set()
        self._tensors = tensors
        self._inside_kernel = self._wrote_inside = False

    def __enter__(self) -> UpdateWatch:
        super().__enter__()
        if self._reporting is not None:
            reported = self._reporting(self)
            try:
                reported.__enter__()
            except BaseException:
                super().__exit__(None, None, None)
                raise
            self._reported = reported
        return self

    def __exit__(self, *exc: Any) -> None:
        reported, self._reported = self._reported, None
        try:
            if reported is not None:
                reported.__exit__(*exc)
        finally:
            super().__exit__(*exc)

    @property
    def updated(self) -> bool:
        """Whether an op has written the chunk: from here on it cannot be rolled back without a copy."""
        return self.ops > 0

    @property
    def in_one_op(self) -> bool:
        """Whether one op wrote every watched tensor, and no other op wrote any."""
        return self.ops == 1 and self.written >= self.watched

    def kernel(self, call: Callable[..., Any], written: Sequence[torch.Tensor], *args: Any) -> Any:
        """Run ``call(*args)``, a kernel that writes ``written`` (objects of their own, such as ``p.data``), as one
        op: once it returns, its writes count as the op's. What it dispatches inside does not count apart; a kernel
        that fails counts as the op if a write to the chunk was seen inside it (an extension's own checks come
        before its writes, which the dispatcher does not see)."""
        self._inside_kernel, self._wrote_inside = True, False
        try:
            out = call(*args)
        except BaseException:
            if self._wrote_inside:
                self._count_kernel(written)
            raise
        finally:
            self._inside_kernel = False
        self._count_kernel(written)
        return out

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func._schema.is_mutable:
            written = _written(func, args, kwargs)
            if self._inside_kernel:
                self._wrote_inside |= self._reaches(written)
            else:
                self._count(written)
        return out

    def _reaches(self, written: Sequence[torch.Tensor]) -> bool:
        return any(id(t) in self.watched or _storage(t) in self.storages for t in written)

    def _count_kernel(self, written: Sequence[torch.Tensor]) -> None:
        by_memory = {_memory(t): id(t) for t in self._tensors}
        self._count([t for t in written if isinstance(t, torch.Tensor)], by_memory)

    def _count(self, written: Sequence[torch.Tensor], by_memory: dict[Any, int] | None = None) -> None:
        if self._reaches(written):
            self.ops += 1
            self.written |= {by_memory.get(_memory(t), id(t)) if by_memory else id(t) for t in written}


def _written(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors an op's schema marks written."""
    found: list[torch.Tensor] = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        values = value if isinstance(value, (list, tuple)) else [value]
        found += [v for v in values if isinstance(v, torch.Tensor)]
    return found


def _memory(t: torch.Tensor) -> tuple[Any, ...]:
    """What makes two tensor objects the same tensor: their memory, dtype, shape and strides."""
    t = local(t)
    return (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))


def _storage(t: torch.Tensor) -> int:
    """Where a tensor's memory starts (a DTensor's: its local shard's)."""
    return local(t).untyped_storage().data_ptr()
