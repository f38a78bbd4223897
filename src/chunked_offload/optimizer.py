"""ChunkedOffloadOptimizer: the facade; it checks its options, wires the parts and speaks torch.optim's API."""

from __future__ import annotations

import logging
import os
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Literal, NoReturn

import torch

from . import state_dict as checkpoint
from .adapters import Adapter, resolve_adapter
from .checks import check_inner, check_options, check_setup, check_wrappable
from .context import scaler_tensors
from .hooks import AttachHandle, attach, opaque
from .inner_view import InnerView
from .masters import MasterMode
from .phase import Phase
from .planner import ChunkPlan
from .telemetry import StepStats
from .transfer import MoveHandle
from .wiring import Options, build_parts

__all__ = ["ChunkedOffloadOptimizer"]

logger = logging.getLogger(__name__)


class ChunkedOffloadOptimizer(InnerView):
    """Keeps an optimizer's state (and optional fp32 masters) in host memory and steps it chunk by chunk.

    Between steps the inner optimizer's per-parameter state tensors live in one exact-size, page-locked host arena.
    ``step()`` streams bounded chunks of whole parameters through ``num_slots`` device slots, runs the inner
    optimizer's own ``step()`` on each chunk, and writes the chunk back, overlapping H2D, compute and D2H. For
    optimizers whose update of each parameter depends on that parameter alone the result is bitwise identical
    to stepping the unwrapped optimizer.

    Example:
        ```python
        inner = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
        opt = ChunkedOffloadOptimizer(inner, chunk_size_mb=256)
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
        ```

    ``opt.param_groups`` and ``opt.state`` are the inner optimizer's own objects, so LR schedulers, ``zero_grad``
    and ``add_param_group`` act on the inner optimizer. Tensors assigned into ``opt.state`` are copied into the host
    copies at once. Edits of ``param_groups``, params and hyperparameters are picked up at the next step, which
    re-plans where plain torch would carry on and refuses, before anything is modified, where it would fail.

    Args:
        inner: the optimizer instance to wrap (for example ``torch.optim.AdamW(..., fused=True)``).
        chunk_size_mb: staging budget per chunk in MiB; a parameter larger than this forms a chunk of its own.
        offload_fraction: share of the bundle bytes (whole bundles, in parameter order) kept on the host; the rest
            (the last params) stays resident on the device and never crosses the link. Default 1.0.
        gpu_budget_mb: instead of ``offload_fraction``: device memory in MiB the wrapper may hold, staging window
            included. What the window leaves holds the state of the first params resident, whole bundles as far
            as they fit ([Note: What stays resident]); the rest is offloaded. ``"auto"``: from the second step on,
            the device memory the training leaves unused, less ``gpu_headroom_mb`` ([Note: Auto budget]).
        gpu_headroom_mb: with ``gpu_budget_mb="auto"``, MiB left free beside the measured peak (default 2048).
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
        spill_dir: a directory on a local disk: the offloaded state beyond ``host_budget_mb`` lives in files there
            ([Note: Disk tier]). None (default): all of it stays in host memory.
        host_budget_mb: with ``spill_dir``, MiB of host memory the offloaded state and the disk tier's bounce buffers
            may take; ``"auto"`` (default): what the host has available, less a headroom, shared by the node's ranks.
    """

    def __init__(
        self,
        inner: torch.optim.Optimizer,
        *,
        chunk_size_mb: float = 256.0,
        offload_fraction: float | None = None,
        num_slots: int = 2,
        pin_memory: bool | None = None,
        master_weights: Literal["none", "fp32", "remainder"] = "none",
        adapter: Adapter | None = None,
        gpu_budget_mb: float | Literal["auto"] | None = None,
        overlap: bool = False,
        step_in_backward: bool = False,
        gpu_headroom_mb: float | None = None,
        spill_dir: str | os.PathLike[str] | None = None,
        host_budget_mb: float | Literal["auto"] | None = None,
    ) -> None:
        check_inner(inner, ChunkedOffloadOptimizer)
        # What a copy of the wrapper is built with (__reduce_ex__), checked here.
        self._options: dict[str, Any] = dict(
            chunk_size_mb=chunk_size_mb, offload_fraction=offload_fraction, num_slots=num_slots, overlap=overlap,
            master_weights=master_weights, gpu_budget_mb=gpu_budget_mb, step_in_backward=step_in_backward,
            gpu_headroom_mb=gpu_headroom_mb, spill_dir=spill_dir, host_budget_mb=host_budget_mb,
        )  # fmt: skip
        check_options(**self._options, pin_memory=pin_memory)
        check_wrappable(inner)
        self._inner = inner
        self._adapter, self._adapter_given = resolve_adapter(inner, adapter), adapter is not None
        self.device = check_setup(inner, self._adapter, MasterMode(master_weights), pin_memory)
        self._init_optimizer_tables()

        options = Options.parse(self.device, pin_memory=pin_memory, **self._options)
        # These options are read-only: they shaped the parts below.
        self.overlap, self.step_in_backward, self.num_slots = overlap, step_in_backward, num_slots
        self.chunk_size_mb, self.offload_fraction = float(chunk_size_mb), options.plan.offload_fraction
        self.gpu_budget_mb, self.gpu_headroom_mb = options.budget_mb, options.headroom_mb
        self._mode = options.masters
        self._parts = parts = build_parts(inner, self._adapter, self.device, options, self._optimizer_step_post_hooks)
        self._placement, self._runner, self._waits = parts.placement, parts.runner, parts.waits
        # A wrapper dropped with deferred chunks still updates its params: they are enqueued, and land, before the
        # parts go; then its hooks come off the model and the params (the finalizer holds neither the wrapper nor
        # anything that holds it, so dropping the last reference runs it).
        weakref.finalize(self, parts.hooks.release, self._waits)
        with self._runner.installing():
            self._placement.install_first()
        logger.info("%s, window bound %.1f MiB", self, self.plan.window_bound_nbytes / 2**20)
        logger.debug("%s", self.plan.summary())

    # ------------------------------------------------------------------ the inner optimizer's objects
    @property  # type: ignore[override]
    def state(self) -> defaultdict[torch.Tensor, Any]:
        """The inner's state (host views); a write-back held by the backward lands first ([Note: Held write-back])."""
        if (waits := self.__dict__.get("_waits")) is not None:
            waits.land_held_write_back()
        return self._inner.state

    @state.setter
    def state(self, value: Mapping[torch.Tensor, Any]) -> None:
        self._inner.state = value  # type: ignore[assignment]
        self._placement.adopt_state()

    @property
    def plan(self) -> ChunkPlan:
        """The chunk plan: chunks, their bytes, and ``window_bound_nbytes``."""
        return self._placement.plan

    @property
    def phase(self) -> Phase:
        """What the wrapper is doing now ([Note: Phases] in phase.py)."""
        return self._waits.current_phase()

    @property
    def master_weights(self) -> str:
        return self._mode.value

    @property
    def adapter(self) -> Adapter:
        return self._adapter

    def __repr__(self) -> str:
        layout, budget = self._placement.layout, self.gpu_budget_mb is not None
        residency = f"gpu_budget_mb={self.gpu_budget_mb!r}" if budget else f"offload_fraction={self.offload_fraction}"
        return (
            f"ChunkedOffloadOptimizer(inner={type(self._inner).__name__}, chunk_size_mb={self.chunk_size_mb}, "
            f"{residency}, num_slots={self.num_slots}, master_weights={self._mode.value!r}, overlap={self.overlap}, "
            f"step_in_backward={self.step_in_backward}, device={self.device}, "
            f"chunks={0 if layout is None else len(layout.plan.chunks)})"
        )

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        """``pickle``, ``copy.deepcopy`` and ``torch.save``: a copy is a new wrapper, with an arena and streams of its
        own, around a copy of the inner optimizer, loaded from this one's host copies (docs/state-dict.md)."""
        self._runner.join()
        self._runner.sync()
        inner, adapter = checkpoint.portable(self._placement, self._adapter_given)
        return (checkpoint.rebuild, (type(self), inner, {**self._options, "adapter": adapter}, self.state_dict()))

    def __copy__(self) -> NoReturn:
        raise TypeError("a shallow copy of a wrapper would share its host memory and streams; use copy.deepcopy(opt)")

    # ------------------------------------------------------------------ stepping
    @opaque  # [Note: Opaque to dynamo]: torch.compile(opt.step) runs this step eagerly
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Run one optimizer step over every chunk; return the closure's loss, if a closure was given.

        Hooks registered on the inner optimizer run once, around the whole step. If the step raises, the chunks
        before the failing one are committed, the rest are untouched, and the exception says which.
        """
        return self._runner.step(closure, scaler_tensors(self.__dict__))

    def replan(self) -> None:
        """Re-plan from the current params and state now (``step()`` does it when needed; this pays it early)."""
        self._waits.between_steps("opt.replan()")
        self._runner.join()
        self._runner.sync(force=True)

    @contextmanager
    def accumulating(self) -> Iterator[None]:
        """Backward passes inside do not step (gradient accumulation with ``step_in_backward=True``).

        The backward of the last micro-batch, outside the block, steps with the accumulated grads.
        """
        with self._runner.accumulating():
            yield

    def prefetch(self) -> None:
        """Start bringing in the first chunk(s) of the next step now, for example right after backward.

        The next ``step()`` takes the copies over; the slots hold their memory until then. If the grads change or
        the state is written before it, the step stages again. A no-op before the first step.
        """
        self._runner.prefetch()

    @property
    def stats(self) -> StepStats | None:
        """Figures of the last ``step()`` (None before the first): bytes moved, seconds, GB/s, window, memory, disk.
        Reading it on a GPU waits for the last step to finish (its times come from CUDA events)."""
        return self._waits.stats()

    def attach(
        self, model: torch.nn.Module, *, blocks: bool = False, views: Mapping[torch.Tensor, torch.Tensor] | None = None
    ) -> AttachHandle:
        """Make each module's forward wait until its own params have been updated by the last step.

        Needed with ``overlap=True``: ``step()`` then returns before its chunks finish, and the next forward
        overlaps them ([Note: Overlapped step]). ``model.state_dict()`` and ``model.load_state_dict()`` wait for the
        step too. Returns a handle whose ``remove()`` takes the hooks off (``zero_grads_with()``: the step reads
        grads zeroed in place without copying them). Any other read of a param outside the forward of a module that
        holds it needs ``opt.wait_step()`` first (docs/modes.md lists them).
        ``blocks=True`` gates each repeated block (a transformer layer) as a whole. ``views`` maps a param of the
        model to the optimizer param that views its memory (a shard, as Megatron's DistributedOptimizer steps).
        """
        if not (self.overlap or self.step_in_backward):
            self._parts.notices.warn(
                "attach",
                "opt.attach(model) does nothing without overlap=True or step_in_backward=True: every step has "
                "finished when step() returns. Pass overlap=True, or leave the call out",
            )
        return self._parts.hooks.add(attach(model, self._waits, blocks=blocks, views=views))

    def wait_step(self, params: Iterable[torch.Tensor] | None = None) -> None:
        """Order the current CUDA stream after every update of the last step (without blocking the host).

        With ``overlap=True``, call it before reading params outside the forward of an attached module: an EMA of
        the weights, a functional call, logging their norms. A no-op without overlap. With ``params`` (the
        optimizer's own), only after their updates, enqueuing their chunks if the step deferred them: for a reader
        of a few params (a collective over a shard) that should not wait for the whole step.
        """
        if params is None:
            self._runner.join()
        else:
            self._waits.wait_for([i for i in map(self._waits.index_of, params) if i is not None])

    def synchronize(self) -> None:
        """Block until the last step has finished and every write-back has landed (``opt.state`` can be read)."""
        self._runner.synchronize()

    # ------------------------------------------------------------------ the rest of the Optimizer API
    def zero_grad(self, set_to_none: bool = True) -> None:
        self._waits.before_zero_grad(set_to_none)
        self._inner.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the inner optimizer and extend the chunk plan (the host copies move once)."""
        self._waits.between_steps("opt.add_param_group()")
        self._runner.join()
        self._inner.add_param_group(param_group)
        try:
            self._runner.sync(force=True)  # checks the groups and params before it re-plans
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
        self._waits.between_steps("opt.state_dict()")
        self._runner.join()
        self._runner.sync(strict=False)
        return checkpoint.save(self, self._placement, snapshot=snapshot)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:  # type: ignore[override]
        """Validate a checkpoint in full, then copy it straight into the host copies (see docs/state-dict.md).

        Nothing is modified if the checkpoint does not fit, or if its layout cannot be allocated.
        """
        self._waits.between_steps("opt.load_state_dict()")
        self._runner.join()
        self._runner.sync()
        with self._runner.installing():
            checkpoint.load(self, self._placement, state_dict)

    def offload(self, non_blocking: bool = False) -> MoveHandle:
        """Free the optimizer's device memory (resident state, and slots a ``prefetch()`` took) until ``reload()``.

        Use it around phases that need the whole GPU (RL rollouts, evaluation). The resident state is copied to
        page-locked host memory on a copy stream; its device memory goes back to torch's allocator, which reuses it
        once the copy has read it. The handle's ``wait()`` blocks until the copy has landed (on return, with
        ``non_blocking=False``). A second call is a no-op that returns the first call's handle.

        A state tensor read from ``opt.state`` before the call keeps its device memory while it is referenced.
        """
        return self._runner.move_resident(True, non_blocking)

    def reload(self, non_blocking: bool = False) -> MoveHandle:
        """Bring back what ``offload()`` freed: the resident state (the slots come back with the next step).

        The copy runs on a copy stream that the caller's stream and the next step wait for; host code that reads
        the resident state calls the handle's ``wait()`` first. A no-op when nothing is offloaded.
        """
        return self._runner.move_resident(False, non_blocking)

    def master_of(self, param: torch.Tensor) -> torch.Tensor:
        """``param``'s wrapper-owned fp32 master, as :meth:`master_params` yields it (read-only)."""
        return self._placement.read_master(self._master_info(param, "master_of"))

    def set_master(self, param: torch.Tensor, master: torch.Tensor) -> None:
        """Set ``param``'s wrapper-owned fp32 master to ``master`` (and ``param`` to its rounding), as a checkpoint's
        master does: for frameworks that keep their own fp32 copies (Megatron-Core's main params)."""
        self._placement.write_master(self._master_info(param, "set_master"), master)

    def _master_info(self, param: torch.Tensor, name: str) -> Any:
        self._waits.between_steps(f"opt.{name}()")
        self._runner.synchronize()
        self._runner.sync()
        info = self._placement.info_of(param)
        if info is None or not info.has_master:
            raise ValueError(f"{name}() takes a param of this wrapper that has a wrapper-owned master")
        return info

    def master_params(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield ``(param, fp32 master)`` for every param with a wrapper-owned master.

        Masters of offloaded params are host tensors. A master is read as the next step will use it
        ([Note: Edited params]); nothing is materialised on the GPU. Treat them as read-only.
        """
        self._waits.between_steps("opt.master_params()")
        self._runner.synchronize()
        self._runner.sync()
        yield from self._placement.masters()
