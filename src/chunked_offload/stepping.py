"""ChunkStepper: run the inner optimizer's own step on one chunk of parameters, in place on device views."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.profiler import record_function

from .adapters import Adapter, GroupCounters
from .layout import ParamInfo, Views
from .masters import GRAD32, MASTER, REMAINDER, TIE_BITS, MasterMode, decode_remainder, encode_remainder
from .planner import Chunk, TensorSpec

__all__ = ["ChunkStepper", "raw_step"]


@dataclass
class _MasterSwap:
    param: torch.Tensor
    data: torch.Tensor
    grad: torch.Tensor
    views: dict[str, torch.Tensor]


def raw_step(inner: torch.optim.Optimizer) -> Callable[[], Any]:
    """The inner optimizer's step without torch's per-call hook wrapper: its hooks run once per outer step."""
    fn: Any = type(inner).step
    if getattr(fn, "hooked", False) and hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return lambda: fn(inner)


class ChunkStepper:
    """Binds a chunk's device views into the inner optimizer's state and runs the inner step on just that chunk.

    The steps for one chunk (DESIGN.md, "Inner step on a chunk" and contracts 1-4):
    1. rebind each existing state tensor of the chunk's params to its device view (values only; the
       ``inner.state[p]`` dicts and the parameter objects stay the same);
    2. for params with a wrapper-owned master: rebuild it if stored as a remainder, cast the grad to fp32 into
       scratch, and point ``p.data`` / ``p.grad`` at the master and the fp32 grad (as ``Module.half()`` swaps
       ``.data``), so the inner optimizer updates the master under the param's own state entry;
    3. narrow every ``param_groups[i]["params"]`` to the chunk's params, step, restore them;
    4. put each param back, set it to the master rounded to nearest even, re-encode the remainder;
    5. re-scan the state: lazily created tensors (first step) are checked against the plan and either copied into
       the slot (staged chunk) or handed back for a direct D2H (fresh chunk); every state tensor is rebound to
       its home view.

    Args:
        inner: the wrapped optimizer.
        adapter: its adapter.
        mode: the master-weights mode.
        infos: every parameter, by index.
        homes: home views of every parameter (host views for offloaded params, device views for resident ones).
    """

    def __init__(
        self, inner: torch.optim.Optimizer, adapter: Adapter, mode: MasterMode, infos: Sequence[ParamInfo], homes: Views
    ) -> None:
        self.inner = inner
        self.adapter = adapter
        self.mode = mode
        self.infos = infos
        self.homes = homes
        self._step = raw_step(inner)
        self._narrowed: dict[int, list[list[torch.Tensor]]] = {}  # chunk index -> its params, group by group

    def run(
        self, chunk: Chunk, views: Views, counters: GroupCounters, *, fresh: bool
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Step one chunk; return ``(home, device tensor)`` pairs of fresh state still to be written back."""
        infos = [self.infos[i] for i in chunk.params]
        if not fresh:
            self._bind(infos, views)
        swaps: list[_MasterSwap] = []
        ok = False
        try:
            for info in infos:
                if info.has_master and info.param.grad is not None:
                    swaps.append(self._enter_master(info, views[info.index]))
            counters.before_chunk()
            with record_function("chunked_offload::step_chunk"):
                self._narrowed_step(chunk, infos)
            counters.after_chunk(sorted({info.group_index for info in infos}))
            ok = True
        finally:
            for swap in reversed(swaps):
                self._exit_master(swap, ok)
            if not ok:
                self._rebind_homes(infos)
        return self._rescan(infos, views, fresh)

    def _bind(self, infos: Sequence[ParamInfo], views: Views) -> None:
        for info in infos:
            state = self.inner.state.get(info.param)
            if not state:
                continue
            for spec in info.state_specs:
                if spec.key in state:
                    state[spec.key] = views[info.index][spec.key]

    def _enter_master(self, info: ParamInfo, views: dict[str, torch.Tensor]) -> _MasterSwap:
        p = info.param
        grad = p.grad
        if grad is None:
            raise RuntimeError(f"param {info.index} has no grad; it should not have been swapped to its master")
        master = views[MASTER]
        if self.mode is MasterMode.REMAINDER:
            decode_remainder(p.detach(), views[REMAINDER], views[TIE_BITS], master)
        grad32 = views[GRAD32]
        grad32.copy_(grad)
        swap = _MasterSwap(p, p.data, grad, views)
        p.grad = None
        p.data = master
        p.grad = grad32
        return swap

    def _exit_master(self, swap: _MasterSwap, ok: bool) -> None:
        p = swap.param
        master = p.data
        p.grad = None
        p.data = swap.data
        p.grad = swap.grad
        if not ok:
            return
        swap.data.copy_(master)  # round to nearest even, exactly as `master.to(param.dtype)`
        if self.mode is MasterMode.REMAINDER:
            v = swap.views
            encode_remainder(master, swap.data, v[REMAINDER], v[TIE_BITS], work=v[GRAD32])

    def _narrowed_step(self, chunk: Chunk, infos: Sequence[ParamInfo]) -> None:
        groups = self.inner.param_groups
        narrowed = self._narrowed.get(chunk.index)
        if narrowed is None:
            narrowed = [[] for _ in groups]
            for info in infos:
                narrowed[info.group_index].append(info.param)
            self._narrowed[chunk.index] = narrowed
        saved = [g["params"] for g in groups]
        try:
            for g, params in zip(groups, narrowed, strict=True):
                g["params"] = params
            self._step()
        finally:
            for g, params in zip(groups, saved, strict=True):
                g["params"] = params

    def _rescan(self, infos: Sequence[ParamInfo], views: Views, fresh: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
        fresh_pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for info in infos:
            state = self.inner.state.get(info.param)
            if not state:
                continue
            specs = {s.key: s for s in info.state_specs}
            unplanned = [k for k, v in state.items() if self.adapter.is_offloaded(k, v) and k not in specs]
            if unplanned:
                raise RuntimeError(
                    f"the inner optimizer created state {unplanned} for param {info.index}, which the chunk plan "
                    f"does not hold (planned: {sorted(specs)}). If hyperparameters that add state (amsgrad, "
                    "momentum, centered) changed, call opt.replan(); otherwise the adapter does not match the optimizer"
                )
            for key, spec in specs.items():
                t = state.get(key)
                if t is None:
                    continue
                home = self.homes[info.index][key]
                if fresh:
                    _check_matches(t, spec, info.index)
                    fresh_pairs.append((home, t))
                else:
                    view = views[info.index][key]
                    if t is not view:
                        _check_matches(t, spec, info.index)
                        view.copy_(t)
                state[key] = home
        return fresh_pairs

    def _rebind_homes(self, infos: Sequence[ParamInfo]) -> None:
        for info in infos:
            state = self.inner.state.get(info.param)
            if state:
                for spec in info.state_specs:
                    if spec.key in state:
                        state[spec.key] = self.homes[info.index][spec.key]


def _check_matches(t: torch.Tensor, spec: TensorSpec, index: int) -> None:
    if tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
        raise RuntimeError(
            f"the inner optimizer created state {spec.key!r} for param {index} with shape {tuple(t.shape)} and dtype "
            f"{t.dtype}, but the chunk plan expected shape {spec.shape} and dtype {spec.dtype}; the adapter does not "
            "match the optimizer"
        )
