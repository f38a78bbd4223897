"""ChunkedOffloadOptimizer: the facade that wires planner, arena, staging, transfers and adapters together."""

from __future__ import annotations

import math
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch

from . import state_dict as _state_dict
from .adapters import Adapter, GroupCounters, resolve_adapter
from .host_arena import HostArena
from .layout import Layout, ParamInfo, Views, chunk_views, describe, place, plan_layout, rehome_state, stepped_like
from .masters import MASTER, REMAINDER, TIE_BITS, MasterMode, decode_remainder, encode_remainder
from .planner import Chunk, ChunkPlan, Role
from .staging import Slot, StagingPool
from .stepping import ChunkStepper
from .transfer import TransferEngine

__all__ = ["ChunkedOffloadOptimizer"]

_MIB = 2**20


class ChunkedOffloadOptimizer(torch.optim.Optimizer):
    """Keeps an optimizer's state (and optional fp32 masters) in host memory and steps it chunk by chunk.

    Between steps the inner optimizer's per-parameter state tensors live in one exact-size, page-locked host arena.
    ``step()`` streams bounded chunks of whole parameters through ``num_slots`` device slots, runs the inner
    optimizer's own ``step()`` on each chunk, and writes the chunk back, overlapping H2D, compute and D2H. For
    optimizers whose update of each parameter depends on that parameter alone the result is bitwise identical
    to stepping the unwrapped optimizer.

    Example::

        inner = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
        opt = ChunkedOffloadOptimizer(inner, chunk_size_mb=256)
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)

    ``opt.param_groups`` and ``opt.state`` are the inner optimizer's own objects, so LR schedulers, ``zero_grad``
    and ``add_param_group`` act on the inner optimizer. Register step hooks and schedulers on the wrapper.

    Args:
        inner: the optimizer instance to wrap (for example ``torch.optim.AdamW(..., fused=True)``).
        chunk_size_mb: staging budget per chunk in MiB; a parameter larger than this forms a chunk of its own.
        offload_fraction: share of the bundle bytes (whole bundles, in parameter order) kept on the host; the rest
            stays resident on the device and is never moved.
        num_slots: device staging slots; 2 overlaps H2D, compute and D2H; 1 runs them one after another.
        pin_memory: page-lock the host arena; None means "when the params are on a CUDA device".
        master_weights: ``"none"`` steps the params directly; ``"fp32"`` keeps an fp32 master for every bf16/fp16
            param in the host arena; ``"remainder"`` keeps only a lossless 16-bit remainder of it (bf16 params).
        adapter: an explicit :class:`~chunked_offload.adapters.Adapter`; by default one is chosen from the
            inner optimizer's class.
    """

    def __init__(
        self,
        inner: torch.optim.Optimizer,
        *,
        chunk_size_mb: float = 256.0,
        offload_fraction: float = 1.0,
        num_slots: int = 2,
        pin_memory: bool | None = None,
        master_weights: str = "none",
        adapter: Adapter | None = None,
    ) -> None:
        _check_inner(inner)
        if isinstance(chunk_size_mb, bool) or not isinstance(chunk_size_mb, (int, float)):
            raise TypeError(f"chunk_size_mb must be a number of MiB, got {type(chunk_size_mb).__name__}")
        if not (math.isfinite(chunk_size_mb) and chunk_size_mb > 0):
            raise ValueError(f"chunk_size_mb must be a finite number > 0, got {chunk_size_mb}")
        if isinstance(offload_fraction, bool) or not isinstance(offload_fraction, (int, float)):
            raise TypeError(f"offload_fraction must be a number in [0, 1], got {type(offload_fraction).__name__}")
        if not 0.0 <= offload_fraction <= 1.0:
            raise ValueError(f"offload_fraction must be in [0, 1], got {offload_fraction}")
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots must be an int >= 1, got {num_slots!r}")
        if pin_memory is not None and not isinstance(pin_memory, bool):
            raise TypeError(f"pin_memory must be True, False or None, got {pin_memory!r}")
        modes = [m.value for m in MasterMode]
        if master_weights not in modes:
            raise ValueError(f"master_weights must be one of {modes}, got {master_weights!r}")
        self._mode = MasterMode(master_weights)
        self._inner = inner
        self._adapter = resolve_adapter(inner, adapter)
        self.device = _common_device(inner)
        _check_master_mode(inner, self._adapter, self._mode)
        if pin_memory and self.device.type != "cuda":
            raise ValueError(f"pin_memory=True needs params on a CUDA device, but they are on {self.device}")
        self._pin = self.device.type == "cuda" if pin_memory is None else pin_memory

        # torch.optim.Optimizer bookkeeping, without building groups of our own: the inner's are shared.
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._patch_step_function()
        self._warned_capturable_if_run_uncaptured = True
        self._step_supports_amp_scaling = getattr(inner, "_step_supports_amp_scaling", False)

        self.chunk_size_mb = float(chunk_size_mb)
        self.offload_fraction = float(offload_fraction)
        self.num_slots = num_slots
        self._engine = TransferEngine(self.device)
        self._pool = StagingPool(num_slots, self.device)
        self._layout: Layout | None = None
        self._view_cache: dict[tuple[int, int], Views] = {}
        self._offloaded = False
        self._build()

    # ------------------------------------------------------------------ the inner optimizer's objects
    @property
    def inner(self) -> torch.optim.Optimizer:
        """The wrapped optimizer."""
        return self._inner

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self._inner.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._inner.param_groups = value

    @property  # type: ignore[override]
    def state(self) -> defaultdict[torch.Tensor, Any]:
        return self._inner.state

    @state.setter
    def state(self, value: defaultdict[torch.Tensor, Any]) -> None:
        self._inner.state = value

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        return self._inner.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self._inner.defaults = value

    @property
    def plan(self) -> ChunkPlan:
        """The chunk plan: chunks, their bytes, and ``window_bound_nbytes``."""
        return self._require_layout().plan

    @property
    def master_weights(self) -> str:
        return self._mode.value

    @property
    def adapter(self) -> Adapter:
        return self._adapter

    def __repr__(self) -> str:
        return (
            f"ChunkedOffloadOptimizer(inner={type(self._inner).__name__}, chunk_size_mb={self.chunk_size_mb}, "
            f"offload_fraction={self.offload_fraction}, num_slots={self.num_slots}, "
            f"master_weights={self._mode.value!r}, device={self.device}, chunks={len(self.plan.chunks)})"
        )

    # ------------------------------------------------------------------ layout
    def _stepped_like(self, p: torch.Tensor) -> torch.Tensor:
        return stepped_like(p, self._mode)

    def replan(self) -> None:
        """Re-derive the chunk plan from the current params and state, moving the host copies if it changed.

        Needed only after changing a hyperparameter that adds state (``amsgrad``, ``momentum``, ``centered``).
        """
        self._build()

    def _build(self) -> None:
        self._drain()
        _check_params(self._inner)
        infos = describe(self._inner, self._adapter, self._mode)
        plan = plan_layout(
            infos,
            chunk_bytes=max(1, int(self.chunk_size_mb * _MIB)),
            num_slots=self.num_slots,
            offload_fraction=self.offload_fraction,
        )
        if self._layout is None or plan != self._layout.plan:
            self._layout = place(plan, infos, self._layout, pin=self._pin, device=self.device, mode=self._mode)
            self._pool.release()
            self._view_cache.clear()
            self._offloaded = False
        self._layout.infos = infos
        rehome_state(self._inner, infos, self._layout.homes)
        self._stepper = ChunkStepper(self._inner, self._adapter, self._mode, infos, self._layout.homes)

    @property
    def _infos(self) -> list[ParamInfo]:
        return self._require_layout().infos

    @property
    def _homes(self) -> Views:
        return self._require_layout().homes

    @property
    def _arena(self) -> HostArena:
        return self._require_layout().arena

    def _require_layout(self) -> Layout:
        if self._layout is None:
            raise RuntimeError("the chunk plan has not been built")
        return self._layout

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Run one optimizer step over every chunk; return the closure's loss, if a closure was given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_can_step()
        if self._offloaded:
            self.reload()
        plan = self.plan
        counters = GroupCounters(self._inner.param_groups)
        with self._amp_attrs_forwarded():
            try:
                if plan.resident is not None and self._any_grad(plan.resident):
                    self._stepper.run(plan.resident, self._homes, counters, fresh=False)
                self._step_offloaded([c for c in plan.chunks if self._any_grad(c)], counters)
            finally:
                counters.finish()
        return loss

    def _step_offloaded(self, active: list[Chunk], counters: GroupCounters) -> None:
        if not active:
            return
        engine, pool, arena = self._engine, self._pool, self._arena
        fresh = [not self._has_state(c) for c in active]
        if not all(fresh):
            pool.allocate(self.plan.slot_nbytes)
        engine.begin_step()
        events: dict[int, torch.cuda.Event | None] = {}

        def stage(pos: int) -> None:  # H2D of a chunk that has state; see [Note: Two-slot staging]
            chunk, slot = active[pos], pool.slot_for(pos)
            if slot.buffer is None:
                raise RuntimeError("the staging pool was not allocated before staging a chunk")
            n = chunk.transfer_nbytes
            pairs = [(slot.buffer[:n], arena.region(chunk.host_offset, n))] if n else []
            events[pos] = engine.stage_in(slot, pairs)

        lookahead = self.num_slots - 1
        for pos in range(min(lookahead, len(active))):
            if not fresh[pos]:
                stage(pos)
        for pos, chunk in enumerate(active):
            ahead = pos + lookahead
            if ahead < len(active) and not fresh[ahead] and ahead not in events:
                stage(ahead)
            slot = pool.slot_for(pos)
            if fresh[pos]:
                self._step_fresh(chunk, slot, counters)
                continue
            if pos not in events:
                stage(pos)
            engine.wait_staged(slot, events.pop(pos))
            buffer = cast(torch.Tensor, slot.buffer)  # stage() checked it
            views = self._staged_views(chunk, slot.index, buffer)
            self._stepper.run(chunk, views, counters, fresh=False)
            n = chunk.transfer_nbytes
            engine.write_back(slot, [(arena.region(chunk.host_offset, n), buffer[:n])] if n else [])
        engine.end_step(pool.slots)

    def _step_fresh(self, chunk: Chunk, slot: Slot, counters: GroupCounters) -> None:
        """First step of a chunk: the inner optimizer creates its state on the device; D2H reads it directly."""
        engine, arena = self._engine, self._arena
        engine.reclaim(slot)  # bound: at most num_slots chunks of fresh tensors exist at once
        wrapper_nbytes = chunk.region_nbytes[1]
        extra = wrapper_nbytes + chunk.region_nbytes[2]
        temp = torch.empty(extra, dtype=torch.uint8, device=self.device) if extra else None
        host_wrapper = arena.region(chunk.host_offset + chunk.state_nbytes, wrapper_nbytes)
        h2d = [(temp[:wrapper_nbytes], host_wrapper)] if temp is not None and wrapper_nbytes else []
        event = engine.stage_in(slot, h2d, fresh_memory=True)
        engine.wait_staged(slot, event)
        views = (
            chunk_views(chunk, self._infos, temp, shift=chunk.state_nbytes, roles=_NON_STATE)
            if temp is not None
            else {i: {} for i in chunk.params}
        )
        fresh_pairs = self._stepper.run(chunk, views, counters, fresh=True)
        d2h = list(fresh_pairs)
        retain = [t for _, t in fresh_pairs]
        if temp is not None:
            if wrapper_nbytes:
                d2h.append((host_wrapper, temp[:wrapper_nbytes]))
            retain.append(temp)
        engine.write_back(slot, d2h, retain)

    def _staged_views(self, chunk: Chunk, slot_index: int, buffer: torch.Tensor) -> Views:
        key = (slot_index, chunk.index)
        views = self._view_cache.get(key)
        if views is None:
            views = self._view_cache[key] = chunk_views(chunk, self._infos, buffer)
        return views

    def _any_grad(self, chunk: Chunk) -> bool:
        return any(self._infos[i].param.grad is not None for i in chunk.params)

    def _has_state(self, chunk: Chunk) -> bool:
        if chunk.state_nbytes == 0:
            return True
        for i in chunk.params:
            info = self._infos[i]
            state = self._inner.state.get(info.param)
            if state and any(s.key in state for s in info.state_specs):
                return True
        return False

    def _check_can_step(self) -> None:
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "ChunkedOffloadOptimizer.step() cannot be captured in a CUDA graph: it rebinds state tensors to "
                "staging memory on every step. Capture the forward/backward only"
            )
        params = [p for g in self._inner.param_groups for p in g["params"]]
        planned = [info.param for info in self._infos]
        if len(params) != len(planned) or any(p is not q for p, q in zip(params, planned, strict=True)):
            raise RuntimeError(
                "param_groups changed since the chunk plan was built; add params with opt.add_param_group(...) or "
                "call opt.replan() after editing param_groups by hand"
            )
        for info in self._infos:
            grad = info.param.grad
            if grad is not None and grad.is_sparse:
                raise RuntimeError(
                    f"param {info.index} (shape {tuple(info.param.shape)}) has a sparse gradient; chunked offload "
                    "stages dense state only. Use dense gradients (e.g. nn.Embedding(sparse=False))"
                )

    @contextmanager
    def _amp_attrs_forwarded(self) -> Iterator[None]:
        """Hand GradScaler's ``grad_scale`` / ``found_inf`` (set on the wrapper) to the inner optimizer."""
        names = [n for n in ("grad_scale", "found_inf") if n in self.__dict__]
        saved = {n: self._inner.__dict__[n] for n in names if n in self._inner.__dict__}
        for n in names:
            setattr(self._inner, n, self.__dict__[n])
        try:
            yield
        finally:
            for n in names:
                if n in saved:
                    setattr(self._inner, n, saved[n])
                else:
                    delattr(self._inner, n)

    # ------------------------------------------------------------------ the rest of the Optimizer API
    def zero_grad(self, set_to_none: bool = True) -> None:
        self._inner.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the inner optimizer and extend the chunk plan (the host copies move once)."""
        self._inner.add_param_group(param_group)
        try:
            self._build()
        except Exception:
            self._inner.param_groups.pop()
            raise

    def state_dict(self, snapshot: bool = False) -> dict[str, Any]:  # type: ignore[override]
        """The inner optimizer's native state dict, read from the host copies (no device memory is allocated).

        Args:
            snapshot: copy every tensor into fresh host memory, so that the result stays valid while training
                continues (for example a background ``torch.save``). Costs one extra host copy of the state. By
                default the tensors are views of the live host copies, valid until the next ``step()``, as with
                a plain optimizer.
        """
        return _state_dict.save(self, snapshot=snapshot)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Validate a checkpoint in full, then copy it straight into the host copies (see docs/state-dict.md)."""
        _state_dict.load(self, state_dict)

    def synchronize(self) -> None:
        """Wait until every write-back has landed, so the host copies in ``opt.state`` can be read."""
        self._engine.synchronize()

    def _drain(self) -> None:
        self._engine.drain(self._pool.slots)

    def offload(self) -> None:
        """Free the optimizer's device memory (staging slots and resident state) until the next step or reload().

        Host copies stay canonical. Use it around phases that need the whole GPU (RL rollouts, evaluation).
        """
        self._drain()
        self._pool.release()
        self._view_cache.clear()
        flat = self._require_layout().resident_flat
        if flat is not None and flat.device != torch.device("cpu"):
            self._rehome_resident(flat.to("cpu"))
        self._offloaded = True

    def reload(self) -> None:
        """Bring back what ``offload()`` freed: the resident state and the staging slots."""
        flat = self._require_layout().resident_flat
        if flat is not None and flat.device != self.device:
            self._rehome_resident(flat.to(self.device))
        if self.plan.chunks and any(self._has_state(c) for c in self.plan.chunks):
            self._pool.allocate(self.plan.slot_nbytes)
        self._offloaded = False

    def _rehome_resident(self, flat: torch.Tensor) -> None:
        resident = self.plan.resident
        if resident is None:
            return
        new_homes = chunk_views(resident, self._infos, flat)
        for i, views in new_homes.items():
            state = self._inner.state.get(self._infos[i].param)
            if state:
                for key, view in views.items():
                    if key in state:
                        state[key] = view
            self._homes[i].clear()
            self._homes[i].update(views)
        self._require_layout().resident_flat = flat

    # ------------------------------------------------------------------ masters
    def master_params(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield ``(param, fp32 master)`` for every param with a wrapper-owned master.

        Masters of offloaded params are host tensors (a view of the host copy in ``"fp32"`` mode, a freshly
        decoded tensor in ``"remainder"`` mode); nothing is materialised on the GPU. Treat them as read-only.
        """
        self.synchronize()
        for info in self._infos:
            if info.has_master:
                yield info.param, self._read_master(info)

    def _read_master(self, info: ParamInfo) -> torch.Tensor:
        home = self._homes[info.index]
        if self._mode is MasterMode.FP32:
            return home[MASTER]
        device = home[REMAINDER].device
        out = torch.empty_strided(
            tuple(info.param.shape), tuple(info.param.stride()), dtype=torch.float32, device=device
        )
        decode_remainder(info.param.detach().to(device), home[REMAINDER], home[TIE_BITS], out)
        return out

    def _write_master(self, info: ParamInfo, master: torch.Tensor) -> None:
        """Set a param's master and the param itself (the master rounded to nearest even)."""
        home = self._homes[info.index]
        device = home[MASTER if self._mode is MasterMode.FP32 else REMAINDER].device
        master = master.to(device=device, dtype=torch.float32)
        rounded = master.to(info.param.dtype)
        info.param.detach().copy_(rounded)
        if self._mode is MasterMode.FP32:
            home[MASTER].copy_(master)
        else:
            encode_remainder(master, rounded, home[REMAINDER], home[TIE_BITS], work=torch.empty_like(master))


_NON_STATE = (Role.MASTER, Role.REMAINDER, Role.TIE_BITS, Role.SCRATCH)


def _check_inner(inner: object) -> None:
    if isinstance(inner, ChunkedOffloadOptimizer):
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


def _check_params(inner: torch.optim.Optimizer) -> None:
    for gi, group in enumerate(inner.param_groups):
        for p in group["params"]:
            if p.is_sparse or p.layout != torch.strided:
                raise ValueError(
                    f"param group {gi} holds a param with layout {p.layout}; only dense params are supported"
                )


def _common_device(inner: torch.optim.Optimizer) -> torch.device:
    devices = {p.device for g in inner.param_groups for p in g["params"]}
    if len(devices) != 1:
        raise ValueError(
            f"all params must be on one device, got {sorted(str(d) for d in devices)}; wrap one optimizer per device"
        )
    device = devices.pop()
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"params must be on a CUDA device or the CPU, got {device}")
    return device


def _check_master_mode(inner: torch.optim.Optimizer, adapter: Adapter, mode: MasterMode) -> None:
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
