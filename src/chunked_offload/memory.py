"""The memory planner: what a wrapper would take on the GPU, in page-locked host memory and on disk, before it exists.

``plan_memory`` runs the wrapper's own planning (``planning.describe``, ``plan_layout``, ``spill``) over params on
the meta device, so its numbers are the ones the wrapper then allocates: ``python -m chunked_offload plan``.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .adapters import resolve_adapter
from .masters import MasterMode
from .planner import ChunkPlan
from .planning import describe, plan_layout
from .spill import auto_host_budget, meminfo, spill

__all__ = ["OPTIMIZERS", "MemoryPlan", "free_bytes", "plan_memory"]

_MIB, _GIB = 2**20, 2**30

OPTIMIZERS: dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]] = {
    "adamw": lambda ps: torch.optim.AdamW(ps, foreach=False),
    "adam": lambda ps: torch.optim.Adam(ps, foreach=False),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=False),
    "muon": lambda ps: torch.optim.Muon(ps),
}


@dataclass(frozen=True)
class MemoryPlan:
    """What a configuration needs, in bytes.

    Attributes:
        params: the number of param elements.
        plan: the wrapper's chunk plan.
        model_gpu: the params and their grads on the GPU (the model's own dtype), as without the wrapper.
        resident_gpu: the optimizer state (and masters) the plan keeps on the GPU.
        window_gpu: the staging window a step adds (``plan.window_bound_nbytes``).
        grad_copies_gpu: with ``mode="overlap"``, the step's own copies of the grads of the chunks it leaves to the
            next forward (at most the offloaded params' grads).
        activations_gpu: with ``inputs`` (a batch), what one forward of the model saves for the backward; else 0
            (not counted).
        pinned_host: the host arena and the disk tier's bounce buffers (``opt.stats.pinned_host_bytes``).
        disk: the state in files under ``spill_dir``, and one more generation of its largest chunk (a step writes a
            chunk's new file beside the old one).
        unwrapped_gpu: the same model with the state and masters resident, as without the wrapper.
    """

    params: int
    plan: ChunkPlan
    model_gpu: int
    resident_gpu: int
    window_gpu: int
    grad_copies_gpu: int
    activations_gpu: int
    pinned_host: int
    disk: int
    unwrapped_gpu: int

    @property
    def gpu(self) -> int:
        """On the GPU: the model, the resident state, the window, and what the mode and the batch add."""
        return self.model_gpu + self.resident_gpu + self.window_gpu + self.grad_copies_gpu + self.activations_gpu

    @property
    def _host_fix(self) -> str:
        if self.plan.disk_chunks:
            return "lower host_budget_mb (more of the state on disk)"
        return "pass spill_dir (a disk tier), use master_weights='remainder', or shard with FSDP2"

    def report(self, gpu_free: int | None, host_free: int | None, disk_free: int | None) -> str:
        """The plan as text, with what this machine has free and what to change where it falls short."""
        rows = [
            ("GPU", self.gpu, gpu_free, "lower chunk_size_mb or gpu_budget_mb, or use master_weights='remainder'"),
            ("pinned host", self.pinned_host, host_free, self._host_fix),
            ("disk", self.disk, disk_free, "free space in spill_dir, or raise host_budget_mb"),
        ]
        lines = [
            f"{self.params / 1e9:.3g} B params: {len(self.plan.all_chunks)} chunks "
            f"({len(self.plan.resident_chunks)} resident, {len(self.plan.disk_chunks)} on disk)",
            f"  GPU: model and grads {self.model_gpu / _GIB:.2f} GiB + resident state {self.resident_gpu / _GIB:.2f} "
            f"GiB + window {self.window_gpu / _GIB:.2f} GiB"
            + (f" + grad copies {self.grad_copies_gpu / _GIB:.2f} GiB" if self.grad_copies_gpu else "")
            + (
                f" + activations {self.activations_gpu / _GIB:.2f} GiB"
                if self.activations_gpu
                else " (activations not counted)"
            )
            + "; unwrapped "
            f"{self.unwrapped_gpu / _GIB:.2f} GiB",
        ]
        for name, need, free, fix in rows:
            if need == 0:
                continue
            have = "unknown here" if free is None else f"{free / _GIB:.2f} GiB free"
            verdict = "" if free is None or need <= free else f": short, {fix}"
            lines.append(f"  {name}: needs {need / _GIB:.2f} GiB, {have}{verdict}")
        return "\n".join(lines)


def plan_memory(
    model: torch.nn.Module | int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    optimizer: str = "adamw",
    master_weights: str = "none",
    mode: str = "sync",
    chunk_size_mb: float = 256.0,
    num_slots: int = 2,
    gpu_budget_mb: float | None = None,
    spill_dir: str | Path | None = None,
    host_budget_mb: float | None = None,
    width: int = 4096,
    inputs: Sequence[torch.Tensor] = (),
) -> MemoryPlan:
    """Plan a wrapper's memory before anything is allocated.

    Args:
        model: a model (its params may be on the meta device), or a param count, taken as ``width x width`` matrices
            and one vector for the rest.
        dtype: the params' dtype (a model's own params keep theirs).
        optimizer: one of ``OPTIMIZERS``.
        master_weights, chunk_size_mb, num_slots, gpu_budget_mb, host_budget_mb: the wrapper's options
            (``host_budget_mb`` None with ``spill_dir``: this machine's ``"auto"``).
        mode: ``"sync"``, ``"overlap"`` (adds the grad copies of deferred chunks) or ``"backward"``.
        spill_dir: where a disk tier would go (only its free space is read).
        width: the matrices' side for a param count.
        inputs: a batch on the meta device, for a model built there: one forward counts what it saves for the backward.

    Raises:
        ValueError: an unknown optimizer, or options the wrapper would refuse (with the wrapper's message).
    """
    if mode not in ("sync", "overlap", "backward"):
        raise ValueError(f"mode={mode!r} is not one of 'sync', 'overlap', 'backward'")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r} is not one of {sorted(OPTIMIZERS)}")
    params = _meta_params(model, dtype, width)
    activations = _activation_bytes(model, inputs) if inputs else 0
    budget = None if gpu_budget_mb is None else int(gpu_budget_mb * _MIB)
    plan = _chunk_plan(OPTIMIZERS[optimizer](params), MasterMode(master_weights), chunk_size_mb, num_slots, budget)
    if spill_dir is not None:
        host_budget = auto_host_budget() if host_budget_mb is None else int(host_budget_mb * _MIB)
        plan = spill(plan, host_budget)
    bounces = (plan.num_slots + 1) * plan.bounce_nbytes if plan.disk_chunks else 0
    model_gpu = sum(2 * p.numel() * p.element_size() for p in params)  # params and grads
    offloaded = {i for c in plan.chunks for i in c.params} if mode == "overlap" else set()
    grad_copies = sum(p.numel() * p.element_size() for i, p in enumerate(params) if i in offloaded)
    moving = sum(b.host_nbytes for b in plan.bundles)  # the state and masters, wherever they live
    return MemoryPlan(
        params=sum(p.numel() for p in params),
        plan=plan,
        model_gpu=model_gpu,
        resident_gpu=plan.resident_nbytes,
        window_gpu=plan.window_bound_nbytes,
        grad_copies_gpu=grad_copies,
        activations_gpu=activations,
        pinned_host=plan.host_nbytes + bounces,
        disk=plan.disk_nbytes + plan.bounce_nbytes if plan.disk_chunks else 0,
        unwrapped_gpu=model_gpu + moving,
    )


def _chunk_plan(
    inner: torch.optim.Optimizer, masters: MasterMode, chunk_size_mb: float, num_slots: int, gpu_budget: int | None
) -> ChunkPlan:
    """The plan the wrapper would make for ``inner`` before its first step (no state yet: the adapter predicts it)."""
    adapter = resolve_adapter(inner, None)
    infos = describe(inner.param_groups, lambda p: None, adapter, masters)
    chunk_bytes = max(1, int(chunk_size_mb * _MIB))
    return plan_layout(
        infos, inner.param_groups, adapter, masters, chunk_bytes=chunk_bytes, num_slots=num_slots,
        offload_fraction=1.0, gpu_budget=gpu_budget,
    )  # fmt: skip


def free_bytes(spill_dir: str | Path | None) -> tuple[int | None, int | None, int | None]:
    """What this machine has free: GPU memory (None without CUDA), ``MemAvailable``, and space in ``spill_dir``."""
    gpu = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else None
    host = meminfo().get("MemAvailable")
    disk = shutil.disk_usage(spill_dir).free if spill_dir is not None and Path(spill_dir).exists() else None
    return gpu, host, disk


def _activation_bytes(model: torch.nn.Module | int, inputs: Sequence[torch.Tensor]) -> int:
    """The bytes one forward of ``model`` (on the meta device) saves for the backward, params excluded."""
    if not isinstance(model, torch.nn.Module):
        raise ValueError("inputs= needs a model (built on the meta device), not a param count")
    if any(t.device.type != "meta" for t in inputs):
        raise ValueError("inputs= takes tensors on the meta device (torch.empty(shape, device='meta')): nothing is run")
    if any(p.device.type != "meta" for p in model.parameters()):
        raise ValueError(
            "inputs= runs one forward of the model: build it on the meta device (with torch.device('meta'): ...) or "
            "pass model.to('meta') of a copy; the model given has params on another device, and is left as it is"
        )
    params = {id(p) for p in model.parameters()}
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        if id(t) not in params and id(getattr(t, "_base", None)) not in params:
            saved += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(*inputs)
    return saved


def _meta_params(model: torch.nn.Module | int, dtype: torch.dtype, width: int) -> list[torch.Tensor]:
    if isinstance(model, torch.nn.Module):
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError(f"plan_memory() got a {type(model).__name__} with no params that require grad")
        return [torch.nn.Parameter(torch.empty_like(p, device="meta")) for p in params]
    if isinstance(model, bool) or not isinstance(model, int) or model < 1:
        raise ValueError(f"plan_memory() takes a model or a positive param count, got {model!r}")
    if width < 1:
        raise ValueError(f"width must be at least 1, got {width}")
    count, rest = divmod(model, width * width)
    shapes = [(width, width)] * count + ([(rest,)] if rest else [])
    return [torch.nn.Parameter(torch.empty(shape, dtype=dtype, device="meta")) for shape in shapes]
