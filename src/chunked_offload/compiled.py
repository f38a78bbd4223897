"""Gates and torch.compile: compiled modules gated at their boundary, traced gates noted at trace time."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["forget", "gate_classes", "is_compiled_module", "is_compiled_wrapper", "note_trace", "register"]

# [Note: Gates in compiled graphs]
# Under torch.compile a module's forward hooks are traced with it. A hook dynamo cannot trace breaks the graph, and
# a graph break changes what inductor fuses, so the numerics (and ``fullgraph=True`` refuses it). An op the hook put
# into the graph would split inductor's fusions as well (a residual add fused with the next block's norm is
# computed in fp32 in one kernel; with an op between them the sum is rounded to bf16 first). So the wrapper adds
# nothing to a compiled graph, and gates compiled code at its boundary instead:
# - a compiled module (``torch.compile(block)``, an ``OptimizedModule``: torchtitan compiles each block so) gets its
#   gate on the wrapper, whose hooks run eagerly before the compiled code; nothing inside it is hooked;
# - a gate dynamo traces (the module was hooked, then compiled with its parent, or in place) records nothing in the
#   graph. At trace time (``torch._dynamo.comptime``) it tells its runtime, which enqueues what is deferred and orders
#   the caller's stream after the step before the compiled code first runs, and from then on makes each ``step()``
#   of that wrapper wait for all its chunks before returning: the compiled forward reads params only after their
#   update. Compiled in-backward loops lose nothing (the backward's end waits for the chunks anyway).
# Dynamo does not guard on a module's hooks, so code compiled before attach() (for another instance of the same
# class: a reference run, an eval copy) would be reused, with no trace to note. attach() therefore gives each module
# it hooks a subclass of its class made for that attach (same name and behaviour; FSDP2's fully_shard does the same):
# the type guard fails and the module is traced again. Removing the handle restores the class. Copies and pickles of a
# gated module first join the step, then are made as of the original class ([Note: Hooks in copies] in callbacks.py).

_RUNTIMES: dict[int, weakref.ref[Any]] = {}  # attach key -> the runtime its traced gates tell
_keys = itertools.count()


def register(runtime: weakref.ref[Any]) -> int:
    """A key for one attach's gates: an int a traced gate passes to ``note_trace``, the same for every layer (a
    constant dynamo guards on: one per layer would compile each layer anew)."""
    key = next(_keys)
    _RUNTIMES[key] = runtime
    return key


def forget(key: int) -> None:
    _RUNTIMES.pop(key, None)


def _traced(ctx: Any) -> None:  # runs at trace time, not in the graph
    ref = _RUNTIMES.get(ctx.get_local("key").as_python_constant())
    target = ref() if ref is not None else None
    if target is not None:
        target.forward_compiled()


def note_trace(key: int) -> None:
    """Called from a gate while dynamo traces it: nothing goes into the graph; ``_traced`` runs now."""
    from torch._dynamo.comptime import comptime

    comptime(_traced)


def is_compiled_module(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a compiled region with a boundary of its own: ``torch.compile(module)`` (an
    ``OptimizedModule``) or ``module.compile()`` (compiled in place)."""
    return is_compiled_wrapper(module) or getattr(module, "_compiled_call_impl", None) is not None


def is_compiled_wrapper(module: torch.nn.Module) -> bool:
    """``torch.compile(module)``: an ``OptimizedModule``, whose own hooks run eagerly before the compiled code."""
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # pragma: no cover - a torch without dynamo
        return False
    return isinstance(module, OptimizedModule)


def _reduce_as_original(self: torch.nn.Module, protocol: Any) -> Any:
    """``__reduce_ex__`` of a gated class: join the step, then reduce as the class the module had before attach()."""
    cls = type(self)
    join = getattr(cls, "_chunked_offload_join", None)
    if join is not None and (target := join()) is not None:
        target.join()
    while cls.__dict__.get("_chunked_offload_gated"):
        cls = cls.__bases__[0]
    # object.__new__ and the module's own state: loading the copy needs the module's class, not this package.
    return object.__new__, (cls,), self.__getstate__()


def gate_classes(
    modules: list[torch.nn.Module],
    runtime: weakref.ref[Any],
    boundaries: Mapping[torch.nn.Module, Callable[[torch.nn.Module], None]],
) -> Callable[[], None]:
    """Give each of ``modules`` a subclass of its class made for one attach, one per class, so that the layers of a
    model still share their compiled code ([Note: Gates in compiled graphs]); returns what restores the classes.

    A module compiled in place (``module.compile()``) runs its hooks inside the compiled code; its gate, in
    ``boundaries``, runs instead from its class's ``__call__``, eagerly, before the compiled code.
    """
    made: dict[type, type] = {}
    swapped = []
    for module in modules:
        before = type(module)
        gated = made.get(before)
        if gated is None:
            own: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()  # module -> its boundary gate
            attributes = {
                "__module__": before.__module__,
                "__qualname__": before.__qualname__,
                "__reduce_ex__": _reduce_as_original,
                "_chunked_offload_gated": True,
                "_chunked_offload_join": runtime,
                "_chunked_offload_boundaries": own,
            }
            if any(type(m) is before for m in boundaries):
                attributes["__call__"] = _boundary_call(before, own)
            gated = made[before] = type(before.__name__, (before,), attributes)
        if module in boundaries:
            gated.__dict__["_chunked_offload_boundaries"][module] = boundaries[module]
        module.__class__ = gated
        swapped.append((weakref.ref(module), before, gated))  # the wrapper's finalizer must not keep the model

    def restore() -> None:
        for ref, before, gated in swapped:
            module = ref()
            if module is not None and type(module) is gated:
                module.__class__ = before

    return restore


def _boundary_call(before: type, gates: weakref.WeakKeyDictionary[Any, Any]) -> Callable[..., Any]:
    """The ``__call__`` of a gated class with modules compiled in place: their gates run eagerly first."""
    call = before.__call__

    def __call__(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        gate = gates.get(self)
        if gate is not None and not torch.compiler.is_compiling():
            gate(self)
        return call(self, *args, **kwargs)

    return __call__
