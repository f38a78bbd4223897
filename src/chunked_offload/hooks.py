"""The hooks the wrapper puts on modules and params: thin, opaque to dynamo, each calling into the step runtime."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

__all__ = ["AttachHandle", "Runtime", "attach", "opaque", "register_grad_hooks", "weak_callback"]

# [Note: Opaque to dynamo]
# torch.compile must never trace the wrapper's own code. Traced, the forward hooks that wait for (and enqueue) the
# step's chunks would be specialised to what they did at trace time: a compiled forward then skips the waits (a race)
# or runs a deferred chunk's inner step as a compiled graph (other arithmetic: NaN params were seen). A compiled
# step() would likewise fuse the inner optimizer's kernels differently from the eager step. So every entry point that
# dynamo can reach (the hooks registered here on modules and params, and step()) is wrapped in torch.compiler.disable:
# dynamo breaks the graph there and runs it eagerly. Each attached module with params costs at most one graph break.
opaque = torch.compiler.disable


class Runtime(Protocol):
    """What the hooks call (``runner.StepRunner``)."""

    def wait_for(self, indices: list[int], streams: Sequence[torch.cuda.Stream] = ()) -> None: ...

    def flush(self) -> None: ...

    def join(self) -> None: ...

    def forward_done(self) -> None: ...

    def grad_final(self, param: torch.Tensor) -> None: ...

    def index_of(self, param: torch.Tensor) -> int | None: ...

    def attached(self, delta: int) -> None: ...


def attach(model: torch.nn.Module, runtime: Runtime, *, blocks: bool = False) -> AttachHandle:
    """Gate the forward of every module of ``model`` that holds params on the updates of those params.

    [Note: Attached forward]
    Each module with params of its own gets a forward pre-hook, prepended so that it runs before any other, that
    makes the stream running the forward wait for the chunks of those params, enqueuing them first if they were
    deferred. An FSDP2 unit (``fully_shard``) waits for every param it manages (its subtree's, less nested units'),
    and makes FSDP2's all-gather streams wait too, before its own pre-forward hook all-gathers them; with explicit
    forward prefetching it waits for the units it prefetches as well. The model's own forward hook enqueues what is
    left of a deferred step and orders the backward after the whole step (so nothing of the step runs beside the
    backward's writes into the grads). ``state_dict()`` and ``load_state_dict()`` of the model and of those modules
    join the step first: they read or write the params.

    With ``blocks=True`` each element of an ``nn.ModuleList`` (a transformer's layers) is gated as a whole: its
    forward waits for every param of its subtree, and the modules inside it have no hook of their own. Under
    torch.compile that is one graph break per block instead of one per module with params ([Note: Opaque to
    dynamo]), at the price of a block's first module waiting for the block's last chunk.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"attach() takes a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(blocks, bool):
        raise TypeError(f"blocks must be True or False, got {blocks!r}")
    ref = weakref.ref(runtime)  # the model must not keep the wrapper (and its host memory) alive
    units = _fsdp_units(model)
    gates = _gates(model, units, blocks)

    def params_of(module: torch.nn.Module) -> list[torch.Tensor]:
        if module in units:
            prefetched = getattr(_fsdp_state(module), "_states_to_forward_prefetch", [])
            extra = [p for state in prefetched for m in getattr(state, "_modules", ()) for p in units.get(m, [])]
            return [*gates[module], *extra]
        return gates[module]

    @opaque
    def before_forward(module: torch.nn.Module, args: Any) -> None:
        target = ref()
        if target is not None:
            own = (target.index_of(p) for p in params_of(module))
            target.wait_for([i for i in own if i is not None], _all_gather_streams(module) if module in units else ())

    @opaque
    def after_forward(module: torch.nn.Module, args: Any, output: Any) -> None:
        target = ref()
        if target is not None:
            target.forward_done()

    @opaque
    def before_state_dict(module: torch.nn.Module, *args: Any) -> None:
        target = ref()
        if target is not None:
            target.join()

    gated = list(gates)
    handles = [m.register_forward_pre_hook(before_forward, prepend=True) for m in gated]
    readers = []
    for module in {id(m): m for m in [model, *gated]}.values():
        readers.append(module.register_state_dict_pre_hook(before_state_dict))
        readers.append(module.register_load_state_dict_pre_hook(before_state_dict))
    runtime.attached(+1)
    return AttachHandle(handles, model.register_forward_hook(after_forward), readers, ref)


def _gates(
    model: torch.nn.Module, units: dict[torch.nn.Module, list[torch.Tensor]], blocks: bool
) -> dict[torch.nn.Module, list[torch.Tensor]]:
    """The modules whose forward waits, in ``model.modules()`` order, and the params each waits for.

    FSDP2 units wait for what they manage; with ``blocks``, each element of an ``nn.ModuleList`` that is not inside
    another block waits for its subtree's params (less those of units inside it); every other module with params of
    its own, outside the blocks, waits for those.
    """
    block_ids = {id(b) for c in model.modules() if isinstance(c, torch.nn.ModuleList) for b in c.children()}
    gates: dict[torch.nn.Module, list[torch.Tensor]] = {}
    inside: set[int] = set()  # modules within a block (the block itself excluded)
    for m in model.modules():  # parents before their children
        if m in units:
            gates[m] = units[m]
        elif id(m) in inside:
            continue
        elif blocks and id(m) in block_ids:
            gates[m] = _subtree_params(m, units.__contains__)
            inside.update(id(n) for n in m.modules() if n is not m)
        else:
            own: list[torch.Tensor] = [p for p in m._parameters.values() if p is not None]
            if own:
                gates[m] = own
    return gates


def _subtree_params(module: torch.nn.Module, is_unit: Callable[[torch.nn.Module], bool]) -> list[torch.Tensor]:
    """The params of ``module``'s subtree, less those of the FSDP2 units nested in it."""
    nested = {id(p) for n in module.modules() if n is not module and is_unit(n) for p in n.parameters()}
    return [p for p in module.parameters() if id(p) not in nested]


def _fsdp_units(model: torch.nn.Module) -> dict[torch.nn.Module, list[torch.Tensor]]:
    """Each FSDP2 unit of ``model`` and the (sharded) params it manages: its subtree's, less nested units'."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        return {}

    def is_unit(module: torch.nn.Module) -> bool:
        return isinstance(module, FSDPModule)

    return {m: _subtree_params(m, is_unit) for m in model.modules() if is_unit(m)}


def _fsdp_state(module: torch.nn.Module) -> Any:
    get_state = getattr(module, "_get_fsdp_state", None)
    return get_state() if get_state is not None else None


def _all_gather_streams(module: torch.nn.Module) -> list[torch.cuda.Stream]:
    """FSDP2's all-gather streams (created at its first forward), which read the sharded params beside the forward."""
    context = getattr(_fsdp_state(module), "_comm_ctx", None)
    names = ("all_gather_copy_in_stream", "all_gather_stream")
    return [s for s in (getattr(context, n, None) for n in names) if isinstance(s, torch.cuda.Stream)]


class AttachHandle:
    """What ``opt.attach(model)`` returns: ``remove()`` takes the hooks off again.

    ``len()`` is the number of modules whose forward waits for its params.
    """

    def __init__(self, handles: list[Any], done: Any, readers: list[Any], runtime: weakref.ref[Runtime]) -> None:
        self._handles = handles
        self._done: Any = done  # the model's own forward hook, which enqueues what is left of a deferred step
        self._readers = readers  # state_dict / load_state_dict pre-hooks, which join the step
        self._runtime = runtime

    def __len__(self) -> int:
        return len(self._handles)

    def remove(self) -> None:
        if self._done is not None:
            target = self._runtime()
            if target is not None:
                target.attached(-1)
                target.flush()  # nothing will ask for the deferred chunks any more
            self._done.remove()
            self._done = None
        for h in [*self._handles, *self._readers]:
            h.remove()
        self._handles.clear()
        self._readers.clear()


def register_grad_hooks(params: Sequence[torch.Tensor], runtime: Runtime) -> list[Any]:
    """A post-accumulate-grad hook on every param that requires grad ([Note: Step in backward]).

    Through a weak reference, so that params do not keep the wrapper alive.
    """
    ref = weakref.ref(runtime)

    @opaque
    def grad_final(param: torch.Tensor) -> None:
        target = ref()
        if target is not None:
            target.grad_final(param)

    return [p.register_post_accumulate_grad_hook(grad_final) for p in params if p.requires_grad]


def weak_callback(method: Callable[[Any], None]) -> Callable[[Any], None]:
    """A bound ``method`` that holds its object weakly (a part calling back into the wrapper), a no-op once gone."""
    ref = weakref.WeakMethod(method)

    def call(arg: Any) -> None:
        bound = ref()
        if bound is not None:
            bound(arg)

    return call
