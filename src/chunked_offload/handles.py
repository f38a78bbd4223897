"""What ``opt.attach(model)`` returns, and the set of every hook a wrapper has put on modules and params."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from typing import Any

from . import compiled
from .callbacks import Runtime
from .grad_hooks import GradHooks

__all__ = ["AttachHandle", "HookSet"]


class _HeldWrite:
    """``zero`` of ``AttachHandle.zero_grads_with``: held until no step reads the grads in place."""

    __slots__ = ("_runtime", "_write")

    def __init__(self, runtime: weakref.ref[Runtime], write: Callable[[], None]) -> None:
        self._runtime, self._write = runtime, write

    def __call__(self) -> None:
        target = self._runtime()
        if target is None:
            self._write()
        else:
            target.hold(self._write)


class AttachHandle:
    """What ``opt.attach(model)`` returns: ``remove()`` takes the hooks off again.

    ``len()`` is the number of modules whose forward waits for its params.
    """

    _serials = itertools.count()

    def __init__(
        self,
        gated: int,
        handles: list[Any],
        restore: Callable[[], None],
        runtime: weakref.ref[Runtime],
        key: int,
    ) -> None:
        self.serial = next(self._serials)
        self._gated = gated
        self._handles = handles
        self._restore: Callable[[], None] | None = restore  # gives the gated modules their classes back
        self._runtime = runtime
        self._key = key  # what traced gates tell ([Note: Gates in compiled graphs])
        self._keeps = False  # the step reads the grads in place (``zero_grads_with``)

    def __len__(self) -> int:
        return self._gated

    def zero_grads_with(self, zero: Callable[[], None]) -> Callable[[], None]:
        """Declare ``zero`` (it zeroes the model's grads in place, as Megatron's reset of its grad buffer does) the
        only write the model's code makes to the grads between ``step()`` and the model's next forward.

        An overlapped step then reads its grads in place, with no copy of them beside the next forward ([Note:
        Inputs of a step]). Returns what to call instead of ``zero``: it zeroes at once if no step is reading the
        grads, else once the caller's stream is ordered after the whole step (the model's forward end, ``wait_step()``
        or the next ``step()``). Another in-place write to those grads before then is refused there.
        """
        target = self._runtime()
        if target is not None:
            target.keep_grads(True)
            self._keeps = True
        return _HeldWrite(self._runtime, zero)

    def remove(self) -> None:
        if self._restore is None:
            return
        target = self._runtime()
        if target is not None:
            target.attached(self.serial, None)
            target.flush()  # nothing will ask for the deferred chunks any more
            if self._keeps:
                target.keep_grads(False)  # no forward of the model joins the step any more
        for h in self._handles:
            h.remove()
        if self._restore is not None:
            self._restore()
        compiled.forget(self._key)
        self._handles, self._restore = [], None


class HookSet:
    """Every hook one wrapper has put on modules and params; ``release`` takes them all off.

    The wrapper's finalizer calls ``release`` when the wrapper is dropped, so a dropped wrapper leaves no hook behind
    (a hook of a dropped wrapper would cost every forward and backward, and step nothing). It holds nothing that
    holds the wrapper.
    """

    def __init__(self, grad_hooks: GradHooks) -> None:
        self.grad_hooks = grad_hooks
        self._handles: list[AttachHandle] = []

    def add(self, handle: AttachHandle) -> AttachHandle:
        self._handles.append(handle)
        return handle

    def release(self, runtime: Any = None) -> None:
        """Land what the step left (``runtime.synchronize()``), then take every hook off."""
        try:
            if runtime is not None:
                runtime.synchronize()
        finally:
            self.grad_hooks.remove()
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
