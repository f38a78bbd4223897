"""Hook objects: what the wrapper registers on modules and params, holding the step runtime weakly."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar, cast

import torch

from .mode import StepMode

__all__ = ["Call", "Hook", "Runtime", "inert", "opaque", "prepare_for_dynamo", "run_eagerly_at_the_top"]

# [Note: Opaque to dynamo]
# torch.compile must never trace the wrapper's own code: traced, the step's waits and launches would be specialised
# to what they did at trace time, and a compiled step() would fuse the inner optimizer's kernels differently from the
# eager step. Entry points that run eagerly only (step(), the grad and state-dict hooks, the eager body of a forward
# hook) are wrapped in torch.compiler.disable. The forward hooks are traced with the module: under dynamo they record
# a custom op instead of calling the runtime, and add no graph break ([Note: Gates in compiled graphs] in compiled.py).
# Importing dynamo costs most of a second, so ``import chunked_offload`` does not: ``opaque`` and
# ``run_eagerly_at_the_top`` take effect in ``prepare_for_dynamo``, which a wrapper's construction calls. No hook or
# method they mark can run before a wrapper exists.

F = TypeVar("F", bound=Callable[..., Any])
_pending: list[Callable[[], None]] = []  # what prepare_for_dynamo does once


def opaque(fn: F) -> F:
    """``fn`` behind ``torch.compiler.disable``, made by ``prepare_for_dynamo`` ([Note: Opaque to dynamo])."""
    disabled: list[Callable[..., Any]] = []

    def disable() -> None:
        if not disabled:
            disabled.append(torch.compiler.disable(fn))

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        disable()  # a no-op once prepared
        return disabled[0](*args, **kwargs)

    _pending.append(disable)
    return cast(F, call)


def prepare_for_dynamo() -> None:
    """Import dynamo and apply what ``opaque`` and ``run_eagerly_at_the_top`` asked for (once)."""
    while _pending:
        _pending.pop()()


class Runtime(Protocol):
    """What the hooks call (``runner.StepRunner``)."""

    mode: StepMode

    def wait_for(self, indices: list[int], streams: Sequence[torch.cuda.Stream] = ()) -> None: ...

    def flush(self) -> None: ...

    def join(self) -> None: ...

    def forward_done(self) -> None: ...

    def forward_compiled(self) -> None: ...

    def grad_final(self, param: torch.Tensor) -> None: ...

    def index_of(self, param: torch.Tensor) -> int | None: ...

    def attached(self, handle: int, params: list[torch.Tensor] | None) -> None: ...

    def keep_grads(self, keep: bool) -> None: ...

    def hold(self, write: Callable[[], None]) -> None: ...


class Hook:
    """A hook the wrapper puts on a module or a param, holding the step runtime weakly.

    [Note: Hooks in copies]
    ``copy.deepcopy``, ``pickle`` and ``torch.save`` of a hooked module (``AveragedModel(model)``, an eval copy, a
    whole-model checkpoint) copy its hook dicts with it. A hook is an object of this class, so a copy of it is the
    inert ``inert`` instead: the copy carries no live hook into the wrapper (its forward neither waits for nor steps
    anything of the original's), pickles by reference, and loads anywhere the package is installed. A gated module
    itself joins the step before it is copied, so its params are copied updated, and the copy has the module's
    original class ([Note: Gates in compiled graphs] in compiled.py).
    """

    __slots__ = ("runtime",)

    def __init__(self, runtime: weakref.ref[Any]) -> None:  # a Runtime, or the step runner (``join``)
        self.runtime = runtime

    def join(self) -> None:
        target = self.runtime()
        if target is not None:
            target.join()

    def __deepcopy__(self, memo: dict[int, Any]) -> Callable[..., None]:
        self.join()
        return inert

    def __reduce_ex__(self, protocol: Any) -> tuple[Callable[[], Callable[..., None]], tuple[()]]:
        self.join()
        return the_inert_hook, ()


class Call(Hook):
    """A hook that runs eagerly only: ``fn(runtime, *args)`` while the runtime lives."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any], runtime: weakref.ref[Any]) -> None:
        super().__init__(runtime)
        self.fn = fn

    @opaque  # [Note: Opaque to dynamo]
    def __call__(self, *args: Any) -> Any:
        target = self.runtime()
        return None if target is None else self.fn(target, *args)


def inert(*args: Any) -> None:
    """What a copy of one of the wrapper's hooks is ([Note: Hooks in copies])."""
    return None


def the_inert_hook() -> Callable[..., None]:
    return inert


def run_eagerly_at_the_top(*methods: Callable[..., Any]) -> None:
    """Dynamo compiles a frame it meets outside a graph being traced (a hook the eager part of a compiled module's
    ``_call_impl`` calls), here into a graph of one op; running these eagerly there instead costs nothing. Traced
    inside a graph, they still record their ops ([Note: Gates in compiled graphs]). Applied by
    ``prepare_for_dynamo``."""

    def skip() -> None:
        import torch._dynamo

        skip_code = getattr(getattr(torch._dynamo, "eval_frame", None), "skip_code", None)
        if skip_code is not None:
            for method in methods:
                skip_code(method.__code__)

    _pending.append(skip)
