"""ChunkedOffloadOptimizer: the facade that wires planner, arena, staging, transfers and adapters together."""

from __future__ import annotations

import logging
import weakref
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.optim.optimizer as torch_optimizer

from . import state_dict as _state_dict
from .adapters import Adapter, GroupCounters, check_groups, resolve_adapter
from .checks import (
    Notices,
    check_inner,
    check_master_mode,
    check_not_wrapped,
    check_options,
    check_params,
    check_sharding,
    common_device,
)
from .host_arena import HostArena
from .in_backward import BackwardStep
from .layout import (
    IncompatibleStateError,
    Layout,
    ParamInfo,
    Views,
    chunk_views,
    describe,
    local,
    place,
    plan_layout,
    rehome_state,
    stale_reason,
)
from .masters import (
    MasterMode,
    needs_master,
    read_master,
    write_master,
)
from .overlap import AttachHandle, StepGate, opaque
from .planner import Chunk, ChunkPlan, Role
from .schedule import StepSchedule
from .staging import StagingPool
from .state_table import StateBinding, StateTable, bind
from .stepping import ChunkStepper
from .telemetry import StepRecord, StepStats
from .transfer import MoveHandle, TransferEngine

__all__ = ["ChunkedOffloadOptimizer"]

_MOVING = tuple(role for role in Role if role.moves)  # what a home holds: scratch lives in the slots only

logger = logging.getLogger(__name__)

_MIB = 2**20


@dataclass
class _Prepared:
    """A layout built for given groups and state, not installed yet."""

    infos: list[ParamInfo]
    layout: Layout
    new_memory: bool


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
    and ``add_param_group`` act on the inner optimizer. Tensors assigned into ``opt.state`` are copied into the host
    copies at once. Edits of ``param_groups``, params and hyperparameters are picked up at the next step, which
    re-plans where plain torch would carry on and refuses, before anything is modified, where it would fail. A
    ``step()`` that raises leaves the chunks before the failing one committed and the rest untouched.

    Args:
        inner: the optimizer instance to wrap (for example ``torch.optim.AdamW(..., fused=True)``).
        chunk_size_mb: staging budget per chunk in MiB; a parameter larger than this forms a chunk of its own.
        offload_fraction: share of the bundle bytes (whole bundles, in parameter order) kept on the host; the rest
            (the last params) stays resident on the device and never crosses the link. Default 1.0.
        gpu_budget_mb: instead of ``offload_fraction``: device memory in MiB the wrapper may hold, staging window
            included. What the window leaves holds the state of the first params resident, whole bundles as far
            as they fit ([Note: What stays resident]); the rest is offloaded.
        num_slots: device staging slots; 2 overlaps H2D, compute and D2H; 1 runs them one after another.
        pin_memory: page-lock the host arena; None means "when the params are on a CUDA device".
        master_weights: ``"none"`` steps the params directly; ``"fp32"`` keeps an fp32 master for every bf16/fp16
            param in the host arena; ``"remainder"`` keeps only a lossless 16-bit remainder of it (bf16 params).
        adapter: an explicit :class:`~chunked_offload.adapters.Adapter`; by default one is chosen from the
            inner optimizer's class.
        overlap: run the step on a stream of its own and return before it finishes, so that the next forward
            overlaps it; call ``opt.attach(model)`` so that each module waits for its own params
            ([Note: Overlapped step]). Bitwise identical to ``overlap=False``.
        step_in_backward: step each chunk during the backward pass, as soon as its params' grads are final
            ([Note: Step in backward]); ``step()`` then only checks and returns. Implies a stream of its own, as
            ``overlap``. For loops without gradient clipping or loss scaling; ``opt.accumulating()`` marks backward
            passes that must not step (gradient accumulation).
    """

    def __init__(
        self,
        inner: torch.optim.Optimizer,
        *,
        chunk_size_mb: float = 256.0,
        offload_fraction: float | None = None,
        num_slots: int = 2,
        pin_memory: bool | None = None,
        master_weights: str = "none",
        adapter: Adapter | None = None,
        gpu_budget_mb: float | None = None,
        overlap: bool = False,
        step_in_backward: bool = False,
    ) -> None:
        check_inner(inner)
        check_options(
            chunk_size_mb=chunk_size_mb,
            offload_fraction=offload_fraction,
            num_slots=num_slots,
            pin_memory=pin_memory,
            master_weights=master_weights,
            gpu_budget_mb=gpu_budget_mb,
            overlap=overlap,
            step_in_backward=step_in_backward,
        )
        if offload_fraction is None:
            offload_fraction = 1.0
        check_not_wrapped(inner)
        check_groups(inner)
        check_params(inner.param_groups)
        self._mode = MasterMode(master_weights)
        self._inner = inner
        self._adapter = resolve_adapter(inner, adapter)
        self._adapter.check_config()
        check_sharding(inner.param_groups, self._adapter, self._mode, overlap or step_in_backward)
        self.device = common_device(inner)
        check_master_mode(inner, self._adapter, self._mode)
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
        self.gpu_budget_mb = None if gpu_budget_mb is None else float(gpu_budget_mb)
        self.num_slots = num_slots
        self.overlap = overlap
        self.step_in_backward = step_in_backward
        self._engine = TransferEngine(self.device)
        self._pool = StagingPool(num_slots, self.device)
        self._gate = StepGate(self.device, overlap or step_in_backward)
        self._grad_hooks: list[Any] = []
        self._backward_step: BackwardStep | None = None
        self._stepped_in_backward: dict[int, int] | None = None  # param index -> grad version, until step()
        self._accumulating = False
        # The engine, not the wrapper: a reference back to the wrapper would keep it (and its arena) alive in a cycle.
        gate, engine = self._gate, self._engine

        def before_home_write() -> None:
            gate.flush()  # a deferred chunk must not stage what the caller writes after the step
            engine.before_home_write()

        self._binding = StateBinding(before_home_write, self._adapter.is_offloaded)
        self._deferred_grads: dict[int, torch.Tensor | None] = {}  # the grads the deferred chunks step with
        self._layout: Layout | None = None
        self._schedule: StepSchedule | None = None
        self._offloaded = False
        self._last_move = MoveHandle()
        self._last_step: StepRecord | None = None
        self._notices = Notices()
        original_state = inner.state
        try:
            self._adopt_state()
            self._install(self._prepare(inner.param_groups, inner.state))
        except BaseException:
            inner.state = original_state  # nothing was copied anywhere: the inner is as it was
            raise
        logger.info("%s\n%s", self, self.plan.summary())

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
    def state(self, value: Mapping[torch.Tensor, Any]) -> None:
        self._inner.state = value  # type: ignore[assignment]
        self._adopt_state()

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
        chunks = len(self._layout.plan.chunks) if self._layout is not None else 0
        return (
            f"ChunkedOffloadOptimizer(inner={type(self._inner).__name__}, chunk_size_mb={self.chunk_size_mb}, "
            f"{self._residency()}, num_slots={self.num_slots}, master_weights={self._mode.value!r}, "
            f"overlap={self.overlap}, step_in_backward={self.step_in_backward}, device={self.device}, chunks={chunks})"
        )

    def _residency(self) -> str:
        if self.gpu_budget_mb is not None:
            return f"gpu_budget_mb={self.gpu_budget_mb}"
        return f"offload_fraction={self.offload_fraction}"

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        raise TypeError(
            "a ChunkedOffloadOptimizer cannot be pickled, deep-copied or torch.save()d: it owns page-locked host "
            "memory and CUDA streams. Save opt.state_dict() instead, and rebuild the wrapper around a new inner "
            "optimizer before opt.load_state_dict(...)"
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> NoReturn:
        self.__reduce_ex__(4)

    # ------------------------------------------------------------------ layout
    def _stepped_dtype(self, p: torch.Tensor) -> torch.dtype:
        return torch.float32 if needs_master(p, self._mode) else p.dtype

    def replan(self) -> None:
        """Re-derive the chunk plan from the current params and state now, moving the host copies if it changed.

        ``step()`` does this on its own when something changed; call it to pay the cost (and see errors) earlier.
        """
        self._gate.join()
        self._sync(force=True)

    def _adopt_state(self) -> None:
        """Make the inner's ``state`` this wrapper's :class:`StateTable` (after a swap by the inner or a user)."""
        state = self._inner.state
        if not (isinstance(state, StateTable) and state.binding is self._binding):
            self._inner.state = StateTable(self._binding, list(state.items()))  # type: ignore[assignment]
            self._binding.dirty = True

    def _sync(self, *, force: bool = False, strict: bool = True) -> None:
        """Bring the layout in line with the inner optimizer before anything is modified ([Note: Absorbing writes]).

        With ``strict=False`` (reading a state dict) state the inner optimizer could not step is reported as it is,
        with the current layout, instead of raising.
        """
        self._adopt_state()
        groups = self._inner.param_groups
        layout = self._require_layout()
        reason = "forced" if force else None
        if self._binding.dirty:
            reason = "state was assigned that does not fit its home"
        reason = reason or stale_reason(layout, groups, self._inner.state, self._adapter)
        if reason is not None:
            logger.debug("re-planning: %s", reason)
            check_groups(self._inner)
            check_params(groups)
            check_sharding(groups, self._adapter, self._mode, self.overlap or self.step_in_backward)
            try:
                prepared = self._prepare(groups, self._inner.state)
            except IncompatibleStateError:
                if strict:
                    raise
                return
            self._install(prepared)

    def _prepare(self, groups: Sequence[Mapping[str, Any]], state: Mapping[torch.Tensor, Any]) -> _Prepared:
        """Describe, plan and place a layout for ``groups`` and ``state``; modifies nothing of the optimizer."""
        infos = describe(groups, state.get, self._adapter, self._mode)
        plan = plan_layout(
            infos,
            chunk_bytes=max(1, int(self.chunk_size_mb * _MIB)),
            num_slots=self.num_slots,
            offload_fraction=self.offload_fraction,
            gpu_budget=None if self.gpu_budget_mb is None else int(self.gpu_budget_mb * _MIB),
        )
        signatures = [self._adapter.layout_signature(dict(g)) for g in groups]
        old = self._layout
        same_params = (
            old is not None
            and len(old.infos) == len(infos)
            and all(a.param is b.param for a, b in zip(old.infos, infos, strict=True))  # identity: == compares values
        )
        if old is not None and same_params and plan == old.plan and not self._offloaded:
            same = Layout(plan, infos, old.homes, old.arena, old.resident_flat, signatures, old.bound)
            return _Prepared(infos, same, False)
        self._drain()  # the previous layout's homes are read below; no write-back may still be in flight
        layout = place(plan, infos, old, signatures, pin=self._pin, device=self.device, mode=self._mode)
        return _Prepared(infos, layout, True)

    def _install(self, prepared: _Prepared) -> None:
        """Switch to a prepared layout: move every state tensor into its new home."""
        if self._schedule is not None:
            self._schedule.drop_prefetch()
        self._drain()
        self._gate.clear()
        layout = prepared.layout
        rehome_state(self._inner.state, layout)
        if prepared.new_memory:
            self._offloaded = False
        self._layout = layout
        self._binding.homes, self._binding.bound = layout.homes, layout.bound
        self._binding.index_by_id = {id(info.param): info.index for info in prepared.infos}
        self._binding.dirty = False
        stepper = ChunkStepper(self._inner, self._adapter, self._mode, layout)
        self._schedule = StepSchedule(layout, stepper, self._engine, self._pool, self._gate)
        if self.step_in_backward:
            self._register_grad_hooks()

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

    def _require_schedule(self) -> StepSchedule:
        if self._schedule is None:
            raise RuntimeError("the chunk plan has not been built")
        return self._schedule

    # ------------------------------------------------------------------ step
    @opaque  # [Note: Opaque to dynamo]: torch.compile(opt.step) runs this step eagerly
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Run one optimizer step over every chunk; return the closure's loss, if a closure was given.

        Hooks registered on the inner optimizer run once, around the whole step. If the step raises, the chunks
        before the failing one are committed, the rest are untouched, and the exception says which.
        """
        args, kwargs = self._inner_hooks("_optimizer_step_pre_hooks", (closure,) if closure is not None else (), {})
        closure = args[0] if args else kwargs.get("closure")
        loss = None
        if self._stepped_in_backward is not None:
            if closure is not None:
                raise ValueError("step(closure) with step_in_backward=True: the backward pass has already stepped")
            self._finish_step_in_backward()
            self._inner_hooks("_optimizer_step_post_hooks", args, kwargs)
            return None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        chunks = self._chunks_to_step()
        skip_staged = self._step_skipped_by_grad_scaler()
        defer = self._may_defer(skip_staged)
        self._adapter.begin_step(self._stepped_dtype)
        self._gate.keep_alive(local(g) for c in chunks for i in c.params if (g := self._grad(i)) is not None)
        self._binding.stepping = True
        try:
            with self._amp_attrs_forwarded(), self._gate.hyperparameter_copies(self._inner.param_groups):
                # Inside the block: the counters restore the groups to what the inner is to see, the copies.
                counters = GroupCounters(self._inner.param_groups)
                try:
                    record = self._require_schedule().run(chunks, counters, skip_staged=skip_staged, defer=defer)
                finally:
                    counters.finish()
                self._hold_deferred()
        except BaseException:
            self._gate.join()  # the caller's stream goes on only after whatever the failed step enqueued
            raise
        finally:
            self._binding.stepping = False
        record.overlapped = self._gate.stream is not None
        self._last_step = record
        if self.overlap and not self._gate.attached:
            self._notices.warn(
                "overlap-unattached",
                "overlap=True without an attached model: step() makes the caller's stream wait for the whole step, "
                "so nothing overlaps it. Call opt.attach(model) so that each module's forward waits for its own params",
            )
            self._gate.join()  # no module waits for its own params: the next forward must wait for the whole step
        logger.debug(
            "step: %d of %d chunks, %.1f MiB H2D, %.1f MiB D2H, %.1f MiB D2D, window %.1f MiB",
            record.chunks, len(self.plan.all_chunks), record.h2d / _MIB, record.d2h / _MIB, record.d2d / _MIB,
            record.window / _MIB,
        )  # fmt: skip
        self._inner_hooks("_optimizer_step_post_hooks", args, kwargs)
        return loss

    def _chunks_to_step(self) -> list[Chunk]:
        """Check that a step can run, bring the layout up to date; the chunks with at least one grad."""
        self._gate.flush()  # the last step's deferred chunks go first
        self._check_can_step()
        self._sync()
        self._check_grads()
        if self._offloaded:
            self.reload()
        return [c for c in self.plan.all_chunks if self._any_grad(c)]

    def _grad(self, index: int) -> torch.Tensor | None:
        return self._adapter.grad_of(self._infos[index].param)

    # ------------------------------------------------------------------ deferred chunks
    def _may_defer(self, skip_staged: bool) -> bool:
        """Whether this step may leave its later chunks to the forwards that read them ([Note: Deferred chunks])."""
        post_hooks = (
            self._optimizer_step_post_hooks,
            getattr(self._inner, "_optimizer_step_post_hooks", {}),
            torch_optimizer._global_optimizer_post_hooks,
        )
        return (
            self.overlap
            and self._gate.attached > 0
            and not skip_staged
            and not any(n in self.__dict__ for n in ("grad_scale", "found_inf"))
            and type(self._adapter).grad_of is Adapter.grad_of
            and not any(post_hooks)  # a post-hook expects the step done (an EMA of the weights)
        )

    def _hold_deferred(self) -> None:
        """After ``step()`` enqueued its first chunks: keep the grads the rest need, and let the gate enqueue them."""
        run = self._require_schedule().deferred
        if run is None:
            return
        self._deferred_grads = {i: self._grad(i) for c in run.chunks[run.next :] for i in c.params}
        ref = weakref.ref(self)

        def advance(indices: list[int] | None) -> None:
            opt = ref()
            if opt is not None:
                opt._advance_deferred(indices)

        self._gate.deferred = advance

    def _advance_deferred(self, indices: list[int] | None) -> None:
        """Enqueue the deferred chunks that hold ``indices`` and the next ``num_slots`` after them (None: all)."""
        schedule = self._require_schedule()
        run = schedule.deferred
        if run is None:
            self._end_deferred()
            return
        until = None
        if indices is not None:
            last = schedule.deferred_position(indices)
            if last < 0:
                return
            until = last + self.num_slots  # the link keeps working ahead of the forward
        stop = len(run.chunks) if until is None else min(until + 1, len(run.chunks))
        swapped = []
        for c in run.chunks[run.next : stop]:
            for i in c.params:
                param, grad = self._infos[i].param, self._deferred_grads[i]
                if param.grad is not grad:
                    swapped.append((param, param.grad))
                    param.grad = grad  # the grad of the step, which the caller may have let go since
        self._binding.stepping = True
        try:
            # As inside step(): a forward's autocast must not change the inner's arithmetic, nor its grad mode ours.
            with torch.no_grad(), torch.autocast(self.device.type, enabled=False), run.counters.deferred():
                schedule.advance(until)
        finally:
            self._binding.stepping = False
            for param, grad in swapped:
                param.grad = grad
            if schedule.deferred is None:
                self._end_deferred()

    def _end_deferred(self) -> None:
        self._deferred_grads = {}
        self._gate.deferred = None

    # ------------------------------------------------------------------ step in backward
    def _register_grad_hooks(self) -> None:
        """A post-accumulate-grad hook on every param; through a weak reference, so params do not keep us alive."""
        for handle in self._grad_hooks:
            handle.remove()
        ref = weakref.ref(self)

        @opaque
        def hook(param: torch.Tensor) -> None:
            opt = ref()
            if opt is not None:
                opt._grad_final(param)

        self._grad_hooks = [
            info.param.register_post_accumulate_grad_hook(hook) for info in self._infos if info.param.requires_grad
        ]

    def _grad_final(self, param: torch.Tensor) -> None:
        if self._accumulating:
            return
        index = self._binding.index_of(param)
        if index is None:
            return
        step = self._backward_step
        if step is None:
            step = self._open_step_in_backward()
        step.close_with_backward()
        step.grad_ready(index)

    def _open_step_in_backward(self) -> BackwardStep:
        """The first final grad of a backward: the checks and set-up of ``step()``, then the first H2D."""
        if self._stepped_in_backward is not None:
            raise RuntimeError(
                "a second backward pass would step again before step() was called for the first; call step() after "
                "each backward, or run the backward passes that must not step inside opt.accumulating()"
            )
        self._check_can_step()
        self._sync()
        if self._offloaded:
            self.reload()
        self._require_schedule().drop_prefetch()
        self._inner_hooks("_optimizer_step_pre_hooks", (), {})
        stack = ExitStack()
        stack.enter_context(self._gate.hyperparameter_copies(self._inner.param_groups))
        self._adapter.begin_step(self._stepped_dtype)
        counters = GroupCounters(self._inner.param_groups)
        self._binding.stepping = True
        record = StepRecord(self._engine, self.device)
        record.overlapped = self._gate.stream is not None

        def on_close(aborted: bool) -> None:
            try:
                counters.finish()
            finally:
                stack.close()
                self._binding.stepping = False
                self._backward_step = None
                if aborted:  # the exception leaves the backward; a later step() steps what has grads, as plain torch
                    self._stepped_in_backward = None

        step = BackwardStep(self._require_schedule(), list(reversed(self.plan.all_chunks)), counters, record, on_close)
        self._backward_step = step
        self._stepped_in_backward = step.versions
        self._last_step = record
        step.begin()
        return step

    def _finish_step_in_backward(self) -> None:
        """``step()`` after a backward that stepped: refuse what changed the grads after their update."""
        if self._backward_step is not None:
            self._backward_step.close()  # its backward was nested in one that never reached a hook (checkpointing)
        versions, self._stepped_in_backward = self._stepped_in_backward, None
        if "found_inf" in self.__dict__ or "grad_scale" in self.__dict__:
            raise RuntimeError(
                "GradScaler with step_in_backward=True: the backward pass stepped with the scaled grads before the "
                "scaler could unscale them or skip the step. Use step_in_backward=False with loss scaling"
            )
        changed = [
            i for i, version in (versions or {}).items() if (g := self._grad(i)) is not None and g._version != version
        ]
        if changed:
            raise RuntimeError(
                f"the grads of {len(changed)} params (first: param {changed[0]}) were changed after the backward pass "
                "had stepped with them (gradient clipping or unscaling?); with step_in_backward=True the update "
                "uses the grads as the backward leaves them. Use step_in_backward=False to clip"
            )
        if not self._gate.attached:
            self._gate.join()  # no module waits for its own params: the next forward waits for the whole step

    @contextmanager
    def accumulating(self) -> Iterator[None]:
        """Backward passes inside do not step (gradient accumulation with ``step_in_backward=True``).

        The backward of the last micro-batch, outside the block, steps with the accumulated grads.
        """
        previous, self._accumulating = self._accumulating, True
        try:
            yield
        finally:
            self._accumulating = previous

    def prefetch(self) -> None:
        """Start bringing in the first chunk(s) of the next step now, for example right after backward.

        The next ``step()`` takes the copies over, so its first chunk does not wait for the link. The staging slots
        hold their memory from now until that step. If the grads change before it, or the state is written, the
        step stages again what it needs. A no-op before the first step (its state is created on the device).
        """
        if self.step_in_backward:
            return  # the backward pass brings the chunks in itself
        chunks = self._chunks_to_step()
        self._require_schedule().prefetch(chunks)

    @property
    def stats(self) -> StepStats | None:
        """Figures of the last ``step()`` (None before the first): bytes moved, seconds, GB/s, window, memory.

        Reading it on a GPU waits for the last step to finish (its times come from CUDA events).
        """
        self._gate.flush()
        if self._last_step is None:
            return None
        layout = self._require_layout()
        resident = layout.resident_flat
        resident_bytes = 0 if resident is None or resident.device.type == "cpu" else resident.numel()
        pinned = layout.arena.nbytes if layout.arena.pinned else 0
        return self._last_step.stats(resident_bytes, pinned)

    def attach(self, model: torch.nn.Module) -> AttachHandle:
        """Make each module's forward wait until its own params have been updated by the last step.

        Needed with ``overlap=True`` (a no-op gate otherwise): ``step()`` then returns before its chunks finish, and
        the next forward overlaps them ([Note: Overlapped step]). Returns a handle whose ``remove()`` takes the
        hooks off. A param read outside the forward of a module that holds it needs ``opt.wait_step()`` first.
        """
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"attach() takes a torch.nn.Module, got {type(model).__name__}")
        return self._gate.attach(model, self._binding.index_of)

    def wait_step(self) -> None:
        """Order the current CUDA stream after every update of the last step (without blocking the host).

        With ``overlap=True``, call it before reading params outside the forward of an attached module: saving
        the model, an EMA of the weights, a functional call. A no-op without overlap.
        """
        self._gate.join()

    def _inner_hooks(
        self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Run the inner optimizer's own step hooks once per outer step; pre-hooks may replace the arguments."""
        for hook in list(getattr(self._inner, name, {}).values()):
            out = hook(self._inner, args, kwargs)
            if name.endswith("pre_hooks") and out is not None:
                if not (isinstance(out, tuple) and len(out) == 2):
                    raise RuntimeError(f"a step pre-hook must return None or (args, kwargs), got {out!r}")
                args, kwargs = out
        return args, kwargs

    def _any_grad(self, chunk: Chunk) -> bool:
        infos, grad_of = self._infos, self._adapter.grad_of
        return any(grad_of(infos[i].param) is not None for i in chunk.params)

    def _step_skipped_by_grad_scaler(self) -> bool:
        """Whether GradScaler handed a fused inner ``found_inf`` set: its kernels would change nothing staged.

        Reading it waits for the device; it spares the step moving every chunk both ways for nothing. Chunks without
        state still run, since the inner creates their (zero) state even on a skipped step.
        """
        found_inf = self.__dict__.get("found_inf")
        return isinstance(found_inf, torch.Tensor) and bool(found_inf.item())

    def _check_can_step(self) -> None:
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "ChunkedOffloadOptimizer.step() cannot be captured in a CUDA graph: it rebinds state tensors to "
                "staging memory on every step. Capture the forward/backward only"
            )

    def _check_grads(self) -> None:
        """Every grad fits its param; checked for all chunks before any is modified."""
        for info in self._infos:
            p, grad = info.param, self._adapter.grad_of(info.param)
            if grad is None:
                continue
            where = f"param {info.index} (shape {tuple(p.shape)}, dtype {p.dtype}, device {p.device})"
            if grad.is_sparse or grad.layout != torch.strided:
                raise RuntimeError(
                    f"{where} has a {grad.layout} gradient; chunked offload stages dense state only. Use dense "
                    "gradients (e.g. nn.Embedding(sparse=False))"
                )
            if grad.shape != p.shape or grad.dtype != p.dtype or grad.device != p.device:
                raise RuntimeError(
                    f"{where} has a grad of shape {tuple(grad.shape)}, dtype {grad.dtype} on {grad.device}; a grad "
                    "must match its param (was the param resized or converted after backward?). Zero the grads "
                    "(opt.zero_grad()) and run backward again"
                )

    @contextmanager
    def _amp_attrs_forwarded(self) -> Iterator[None]:
        """Hand GradScaler's ``grad_scale`` / ``found_inf`` (set on the wrapper) to the inner optimizer."""
        names = [n for n in ("grad_scale", "found_inf") if n in self.__dict__]
        saved = {n: self._inner.__dict__[n] for n in names if n in self._inner.__dict__}
        for n in names:
            # scaler.update() rewrites its scale in place while an overlapped step may still read it.
            setattr(self._inner, n, self._gate.private_copy(self.__dict__[n]))
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
        if not set_to_none:
            self._gate.join()  # zeroing in place on the caller's stream must wait until the step has read the grads
        self._inner.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the inner optimizer and extend the chunk plan (the host copies move once)."""
        self._gate.join()
        self._inner.add_param_group(param_group)
        try:
            self._sync(force=True)  # checks the groups and params before it re-plans
        except BaseException:
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
        self._gate.join()
        self._sync(strict=False)
        return _state_dict.save(self, snapshot=snapshot)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:  # type: ignore[override]
        """Validate a checkpoint in full, then copy it straight into the host copies (see docs/state-dict.md).

        Nothing is modified if the checkpoint does not fit, or if its layout cannot be allocated.
        """
        self._gate.join()
        self._sync()
        _state_dict.load(self, state_dict)

    def synchronize(self) -> None:
        """Block until the last step has finished and every write-back has landed (``opt.state`` can be read)."""
        self._gate.synchronize()
        self._engine.synchronize()

    def _drain(self) -> None:
        self._engine.drain(self._pool.slots)

    def offload(self, non_blocking: bool = False) -> MoveHandle:
        """Free the optimizer's device memory (resident state, and slots a ``prefetch()`` took) until ``reload()``.

        Host copies stay canonical. Use it around phases that need the whole GPU (RL rollouts, evaluation). The
        resident state is copied to page-locked host memory on a copy stream; its device memory goes back to
        torch's allocator at once, which reuses it as soon as the copy has read it. Returns a handle whose
        ``wait()`` blocks until the copy has landed; with ``non_blocking=False`` (default) that has happened on
        return. A second call is a no-op that returns the first call's handle.

        A state tensor read from ``opt.state`` before the call keeps its device memory while it is referenced, as
        any tensor does; read ``opt.state`` again after the call.
        """
        self._gate.join()
        self._sync()
        if self._offloaded:
            return self._last_move
        self._require_schedule().drop_prefetch()
        flat = self._require_layout().resident_flat
        handle = MoveHandle()
        if flat is not None and flat.device.type != "cpu":
            host = torch.empty(flat.numel(), dtype=torch.uint8, pin_memory=self._pin)
            handle = self._engine.move(host, flat)
            self._rehome_resident(host)
        self._offloaded = True
        self._last_move = handle.wait() if not non_blocking else handle
        return handle

    def reload(self, non_blocking: bool = False) -> MoveHandle:
        """Bring back what ``offload()`` freed: the resident state (the slots come back with the next step).

        The copy runs on a copy stream; the caller's stream and the next step are ordered after it, so only host
        code that reads the resident state needs ``wait()`` on the returned handle (with ``non_blocking=False``, the
        default, it has landed on return). A call when nothing is offloaded is a no-op.
        """
        self._gate.join()
        if not self._offloaded:
            return self._last_move
        flat = self._require_layout().resident_flat
        handle = MoveHandle()
        if flat is not None and flat.device != self.device:
            device_flat = torch.empty(flat.numel(), dtype=torch.uint8, device=self.device)
            handle = self._engine.move(device_flat, flat)
            self._rehome_resident(device_flat)
        self._offloaded = False
        self._last_move = handle.wait() if not non_blocking else handle
        return handle

    def _rehome_resident(self, flat: torch.Tensor) -> None:
        layout = self._require_layout()
        for chunk in layout.plan.resident_chunks:
            views = chunk_views(chunk, layout.infos, flat, shift=-chunk.home_offset, roles=_MOVING)
            for i, new_homes in views.items():
                home, old_bound = layout.homes[i], dict(layout.bound[i])
                for key in list(home):
                    home[key] = new_homes[key]
                layout.rebind(i)
                entry = self._inner.state.get(layout.infos[i].param)
                for key, held in old_bound.items():
                    if entry and entry.get(key) is held:
                        bind(entry, key, layout.bound[i][key])
        layout.resident_flat = flat

    # ------------------------------------------------------------------ masters
    def master_params(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield ``(param, fp32 master)`` for every param with a wrapper-owned master.

        Masters of offloaded params are host tensors. A master is read as the next step will use it
        ([Note: Edited params]); nothing is materialised on the GPU. Treat them as read-only.
        """
        self._gate.join()
        self._sync()
        self.synchronize()
        for info in self._infos:
            if info.has_master:
                yield info.param, self._read_master(info)

    def _read_master(self, info: ParamInfo) -> torch.Tensor:
        return read_master(self._homes[info.index], info.param, self._mode)

    def _write_master(self, info: ParamInfo, master: torch.Tensor) -> None:
        write_master(self._homes[info.index], info.param, master, self._mode)
