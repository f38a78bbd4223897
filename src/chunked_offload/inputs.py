"""What a step reads after the caller's code has moved on: the grads it owns, and what it verifies by content."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from .dtensor import local, rewrap

__all__ = ["GradComparison", "GradRecord", "GroupSnapshot", "KeptGrads", "OwnedGrads", "ParamWatch", "fingerprints"]

# [Note: Inputs of a step]
# A step that runs, or finishes, after the caller's code has moved on reads what that code may change next. Each mode
# owns what it reads, or verifies it by content before the step counts; neither trusts version counters, module hooks
# or the garbage collector to say that nothing changed.
# - overlap=True: step() returns before its chunks have read their grads (they run on the step stream, or wait for the
#   forward's hooks). So the step owns them: before step() returns, every grad it has still to read is copied on the
#   caller's stream (``OwnedGrads``), and each chunk steps with the copies. The caller may zero, scale, replace or
#   free its grads at once, in place or not (1 device copy of those grads, freed as their chunks step). A param
#   written in place between step() and its chunk's update (weight clipping, ``p.copy_``) would be updated on top of
#   the write, where plain torch writes over the update: ``ParamWatch`` compares version counters and refuses before
#   that chunk steps, or at the next read, with the call to make first (``opt.wait_step()``). Where the code around
#   the wrapper declares the one write it makes to the grads before the next forward (Megatron's reset of its grad
#   buffer, ``AttachHandle.zero_grads_with``), the step reads them in place instead, with no copy beside the
#   forward: that write is held until the caller's stream is ordered after the whole step (the attached model's
#   forward end joins it), and ``KeptGrads`` refuses, at that join, a grad written in place in between (a write
#   through ``.data`` is not seen).
# - step_in_backward=True: each chunk steps during the backward, before the caller's code between backward() and
#   step() has run. ``GradRecord`` keeps a fingerprint of every grad a chunk read (the sum of its bits as 64-bit
#   words, modulo 2**64: a change to any one element always shows, changes to several escape only if their
#   differences sum to a multiple of 2**64, which a scaling of a dense grad never does), and step() compares them
#   with the grads as they are then. Any difference (clipping in any form, an all-reduce, an unscale, a replaced,
#   dropped or hand-set grad) is refused, and so is a group value written between backward() and step()
#   (``GroupSnapshot``). The first backward of a wrapper steps nothing and observes the loop instead ([Note: Observed
#   backward] in backward_watch.py), so a loop that does either on every iteration is refused before any param is
#   updated. At the end of the backward the caller's stream is ordered after every chunk's step, so nothing the caller
#   enqueues after backward() races the reads.

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _words(t: torch.Tensor) -> torch.Tensor:
    """The bits of ``t`` as the integers its fingerprint sums: 64-bit words where its bytes allow (a reduction over
    int64 reads 4.3 TB/s on the H200, one over int16 0.4 TB/s); 8-byte elements as 32-bit halves (scaling one by 2**k
    changes its word by a multiple of 2**52, so 4096 of them would cancel modulo 2**64); else one per element."""
    nbytes = t.element_size()
    if nbytes == 8:
        return t.contiguous().reshape(-1).view(torch.int32)
    if t.is_contiguous() and (t.numel() * nbytes) % 8 == 0 and (t.storage_offset() * nbytes) % 8 == 0:
        return t.reshape(-1).view(torch.int64)
    return t.view(_INT_OF_SIZE[nbytes])


def fingerprints(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One int64 per tensor: the sum of its bits as integers (``_words``), modulo 2**64, on the current stream."""
    sums = []
    for t in tensors:
        t = local(t).detach()
        if t.is_complex():
            t = torch.view_as_real(t)
        sums.append(_words(t).sum(dtype=torch.int64))
    if not sums:
        return torch.zeros(0, dtype=torch.int64)
    return torch.stack(sums)


class OwnedGrads:
    """Copies of the grads an overlapped step reads after ``step()`` has returned ([Note: Inputs of a step]).

    Args:
        keep_alive: marks tensors the step stream reads, so that their memory is not reused before it has.
    """

    def __init__(self, keep_alive: Callable[[Iterable[torch.Tensor]], None]) -> None:
        self._keep_alive = keep_alive
        self.grads: dict[int, torch.Tensor] = {}  # param index -> the step's own copy of its grad

    def take(self, grads: Sequence[tuple[int, torch.Tensor]], *, copy: bool = True) -> None:
        """Copy ``(param index, grad)`` on the current stream: the step reads the copies from now on. Without
        ``copy`` the step reads the grads themselves (``KeptGrads`` watches them)."""
        if not copy:
            self.grads.update(grads)
            return
        if not grads:
            return
        sources = [local(g).detach() for _, g in grads]
        copies = [torch.empty_like(s) for s in sources]  # dense grads keep their strides
        torch._foreach_copy_(copies, sources)
        self._keep_alive(copies)
        for (i, g), c in zip(grads, copies, strict=True):
            self.grads[i] = rewrap(c, g)

    def release(self, indices: Iterable[int]) -> None:
        """The chunk of these params has stepped: its copies go back to the allocator."""
        for i in indices:
            self.grads.pop(i, None)

    def clear(self) -> None:
        self.grads.clear()


def _versions(t: torch.Tensor) -> tuple[int, int]:
    return t._version, local(t)._version


class ParamWatch:
    """The version counters of params an overlapped step updates after ``step()`` returned.

    A param in the watch was written by no one since the step recorded it; ``check`` refuses one that was. A write
    through ``.data`` bypasses version counters and is not seen, and so does one before a forward that compiled code
    runs: its ops declare that they write the params ([Note: Gates in compiled graphs]), and the compiled code counts
    them as writes more than once. ([Note: Inputs of a step])
    """

    def __init__(self) -> None:
        self._params: dict[int, tuple[torch.Tensor, tuple[int, int]]] = {}

    def record(self, params: Iterable[tuple[int, torch.Tensor]]) -> None:
        for i, p in params:
            self._params[i] = (p, _versions(p))

    def check(self, indices: Iterable[int] | None = None) -> None:
        """Refuse if a watched tensor (of ``indices``, or any) was written since it was recorded."""
        if not self._params:  # the common case: nothing watched (every deferred chunk's enqueue asks)
            return
        for i in self._params if indices is None else indices:
            entry = self._params.get(i)
            if entry is not None and _versions(entry[0]) != entry[1]:
                self._params.clear()
                raise RuntimeError(self._refusal(i, entry[0]))

    def _refusal(self, index: int, p: torch.Tensor) -> str:
        return (
            f"param {index} (shape {tuple(p.shape)}) was written in place after step() returned and before its "
            "update had run (overlap=True): plain torch would write over the update, the overlapped step would "
            "update the written value. Call opt.wait_step() before writing params outside the forward (weight "
            "clipping, copies into params)"
        )

    def settle(self) -> None:
        """Check every watched param, then watch none: the caller is ordered after their updates from here on."""
        try:
            self.check()
        finally:
            self.release()

    def release(self) -> None:
        """Watch none."""
        self._params.clear()

    def forget(self, indices: Iterable[int] | None = None) -> None:
        if indices is None:
            self._params.clear()
        else:
            for i in indices:
                self._params.pop(i, None)

    def __len__(self) -> int:
        return len(self._params)


class KeptGrads(ParamWatch):
    """The grads an overlapped step reads where they are, with no copies ([Note: Inputs of a step]), and the writes
    to them the caller's code has asked to hold until the step has read them.

    Used where the code around the wrapper declares the one write it makes to its grads before the next forward
    (``AttachHandle.zero_grads_with``: Megatron's reset of its grad buffer): that write is held (``hold``) until the
    caller's stream is ordered after the whole step, and any other write to a kept grad is refused when the step is
    joined (``settle``: the check, then ``release``), before the grads are read again.

    Args:
        join: orders the caller's stream after the whole last step.
    """

    def __init__(self, join: Callable[[], None]) -> None:
        super().__init__()
        self._join = join
        self._held: list[Callable[[], None]] = []

    def hold(self, write: Callable[[], None]) -> None:
        """Run ``write`` (on the caller's stream) once no step reads the kept grads: now, or at the next join."""
        if self._params or self._held:
            self._held.append(write)
        else:
            write()

    def release(self) -> None:
        """Keep no grad any more: the caller's stream waits for the step, then the held writes run."""
        self._params.clear()
        if self._held:
            self._join()
            held, self._held = self._held, []
            for write in held:
                write()

    def _refusal(self, index: int, p: torch.Tensor) -> str:
        return (
            f"the grad of param {index} (shape {tuple(p.shape)}) was written after step() returned and before the "
            "step had read it (overlap=True, grads read in place): the step would read the written value, plain "
            "torch the one it had. Its zeroing waits for the step; write grads only after the attached model's "
            "forward, or call opt.wait_step() first"
        )


class GradRecord:
    """Fingerprints of the grads a step read, compared with the grads as they are later.

    ``record`` runs on the stream that read the grads, right after it read them (a param recorded again keeps its
    latest record); ``compare`` on a stream ordered after those and after the caller's work ([Note: Inputs of a
    step]).
    """

    def __init__(self) -> None:
        self._meta: dict[int, tuple[tuple[int, ...], torch.dtype] | None] = {}  # None: read with no grad
        self._where: dict[int, int] = {}  # param index -> position of its latest fingerprint in ``_sums``
        self._sums: list[torch.Tensor] = []
        self._count = 0

    def record(self, items: Sequence[tuple[int, torch.Tensor | None]]) -> None:
        """Record ``(param index, grad or None)`` as read now."""
        present = [(i, g) for i, g in items if g is not None]
        for i, g in items:
            self._meta[i] = None if g is None else (tuple(g.shape), g.dtype)
        if present:
            self._sums.append(fingerprints([g for _, g in present]))
            for k, (i, _) in enumerate(present):
                self._where[i] = self._count + k
            self._count += len(present)

    def __contains__(self, index: int) -> bool:
        return index in self._meta

    def compare(self, grad_of: Callable[[int], torch.Tensor | None], indices: Iterable[int]) -> GradComparison:
        """Compare the params among ``indices`` with their grads now, on the current stream; the host does not wait
        for the outcome ([Note: Checks off the host])."""
        changed: list[int] = []
        for i in indices:
            meta, g = self._meta.get(i), grad_of(i)
            if (g is None) != (meta is None) or (g is not None and meta != (tuple(g.shape), g.dtype)):
                changed.append(i)
        if changed or not self._where:
            return GradComparison(changed)
        order = list(self._where)
        if self._sums[0].is_cuda:  # recorded on the step stream: not reused before the current one has read them
            stream = torch.cuda.current_stream(self._sums[0].device)
            for t in self._sums:
                t.record_stream(stream)
        recorded = torch.cat(self._sums)
        if len(order) < self._count:  # some were recorded again: keep each one's latest
            recorded = recorded[torch.tensor([self._where[i] for i in order], device=recorded.device)]
        now = fingerprints([grad_of(i) for i in order])  # type: ignore[misc]
        return GradComparison(order, now != recorded)

    def changed(self, grad_of: Callable[[int], torch.Tensor | None], indices: Iterable[int]) -> list[int]:
        """The params among ``indices`` whose grad now differs from the recorded one (or has appeared or gone)."""
        return self.compare(grad_of, indices).result()


class GradComparison:
    """The outcome of ``GradRecord.compare``: the params whose grads changed, read once the device has computed it.

    [Note: Checks off the host]
    Reading a comparison's outcome on the host waits for the device to run everything enqueued before it: after a
    backward that stepped, that is the rest of the backward and the chunks still stepping, 0.19 s of a 0.53 s
    iteration at 16 x 2048 on the H200, and the device then idles while the host enqueues the next forward (3.3% of
    the iteration). So the outcome is copied to the host behind an event, and ``step()`` reads it only if the device
    has already computed it (always on the CPU); otherwise the first call that must not run on a changed input reads
    it: the next backward's first step, ``step()``, or anything that joins the step (``wait_step()``,
    ``state_dict()``, ...). A change is refused there, before any param is updated again. The comparison runs on the
    caller's stream, which the end of the backward ordered after every chunk's records: so nothing the caller does
    next overwrites the grads before they are read (an in-place ``zero_grad``, or the next replay of a CUDA graph,
    which reuses its outputs' memory: under ``mode="reduce-overhead"`` a comparison that did not order the caller
    after it found changes that never happened, on the H200), and the next forward waits for nothing else.
    """

    def __init__(self, order: Sequence[int], differs: torch.Tensor | None = None) -> None:
        self._order = list(order)
        self._changed: list[int] | None = None if differs is not None else self._order
        self._event: torch.cuda.Event | None = None
        if differs is not None and differs.is_cuda:
            differs = differs.to("cpu", non_blocking=True)  # page-locked: the copy is ordered on this stream
            self._event = torch.cuda.Event()
            self._event.record()
        self._differs = differs

    def ready(self) -> bool:
        """Whether ``result()`` can be read without waiting for the device."""
        return self._event is None or self._event.query()

    def result(self) -> list[int]:
        """The params whose grads changed (waits for the device if not ``ready()``)."""
        if self._changed is None:
            assert self._differs is not None
            if self._event is not None:
                self._event.synchronize()
            self._changed = [self._order[k] for k in self._differs.nonzero().flatten().tolist()]
            self._differs = self._event = None
        return self._changed


def _group_values(group: Mapping[str, Any]) -> dict[str, Any]:
    values = {}
    for k, v in group.items():
        if k != "params":
            values[k] = v.detach().clone() if isinstance(v, torch.Tensor) else v
    return values


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and torch.equal(a.detach().cpu(), b.detach().cpu())
        )
    try:
        return a is b or bool(a == b)
    except Exception:
        return False


class GroupSnapshot:
    """The values of the param groups (all but ``params``) at one moment, to find writes made since."""

    def __init__(self, groups: Sequence[Mapping[str, Any]]) -> None:
        self._values = [_group_values(g) for g in groups]

    def changes(self, groups: Sequence[Mapping[str, Any]]) -> list[str]:
        """What differs now, as ``param_groups[i]['key']: before -> now`` lines."""
        if len(groups) != len(self._values):
            return [f"len(param_groups): {len(self._values)} -> {len(groups)}"]
        out = []
        for gi, (before, group) in enumerate(zip(self._values, groups, strict=True)):
            for key in sorted({*before, *(k for k in group if k != "params")}, key=str):
                old, new = before.get(key, "<absent>"), group.get(key, "<absent>")
                if not _same(old, new):
                    out.append(f"param_groups[{gi}][{key!r}]: {old!r} -> {new!r}")
        return out
