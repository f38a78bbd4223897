"""The hooks ``attach()`` puts on a model's modules: thin, traceable by dynamo, each calling into the step runtime."""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch

from . import compiled, fsdp
from .callbacks import Call, Hook, Runtime, opaque, run_eagerly_at_the_top
from .handles import AttachHandle, HookSet

__all__ = ["AttachHandle", "HookSet", "attach"]


class _Gate(Hook):
    """The forward pre-hook of one gated module: its forward waits for the updates of its params.

    Traced by dynamo it adds nothing to the graph, and notes the trace ([Note: Gates in compiled graphs]).
    """

    __slots__ = ("params", "_key")

    def __init__(self, runtime: weakref.ref[Runtime], params: list[torch.Tensor], key: int) -> None:
        super().__init__(runtime)
        self.params = params
        self._key = key

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            compiled.note_trace(self._key)
        else:
            self.run()

    @opaque  # [Note: Opaque to dynamo]
    def run(self, *args: Any) -> None:
        target = self.runtime()
        if target is not None:
            target.wait_for([i for i in (target.index_of(p) for p in self.params) if i is not None])


class _UnitGate(Hook):
    """Runs before every ``unshard()`` of one FSDP2 param group: the updates of its params come before the copies that
    read them, on every stream that reads them ([Note: FSDP2 reads deferred params] in fsdp.py)."""

    __slots__ = ("params", "_group", "_key")

    def __init__(self, runtime: weakref.ref[Runtime], group: Any, key: int) -> None:
        super().__init__(runtime)
        self.params = fsdp.params_of(group)
        self._group = group
        self._key = key

    def __call__(self) -> None:
        if torch.compiler.is_compiling():
            compiled.note_trace(self._key)
        else:
            self.run()

    @opaque  # [Note: Opaque to dynamo]
    def run(self) -> None:
        target = self.runtime()
        if target is not None:
            indices = [i for i in (target.index_of(p) for p in self.params) if i is not None]
            target.wait_for(indices, fsdp.all_gather_streams(self._group))


class _Done(Hook):
    """The attached model's forward hook: the rest of a deferred step is enqueued, the caller waits for all of it."""

    __slots__ = ()

    def __call__(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not torch.compiler.is_compiling():  # traced: its gates made the step join ([Note: Gates in compiled graphs])
            self.run()

    @opaque  # [Note: Opaque to dynamo]
    def run(self) -> None:
        target = self.runtime()
        if target is not None:
            target.forward_done()


run_eagerly_at_the_top(_Gate.__call__, _Done.__call__)


def _join_hook(target: Runtime, *args: Any) -> None:
    target.join()


def _is_container(model: torch.nn.Module) -> bool:
    """Whether ``model``'s forward never runs (``nn.ModuleList``, ``nn.ModuleDict``: their elements are called)."""
    return getattr(type(model), "forward", None) is getattr(torch.nn.Module, "forward", None)


def _is_ddp(model: torch.nn.Module) -> bool:
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:  # a torch built without distributed
        return False
    return any(isinstance(m, DistributedDataParallel) for m in model.modules())


def _is_fsdp1(model: torch.nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # a torch built without distributed
        return False
    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


def attach(
    model: torch.nn.Module,
    runtime: Runtime,
    *,
    blocks: bool = False,
    views: Mapping[torch.Tensor, torch.Tensor] | None = None,
) -> AttachHandle:
    """Gate the forward of the modules of ``model`` that hold params on the updates of those params (or of the
    optimizer params that ``views`` names as views of their memory).

    [Note: Attached forward]
    Each gated module gets a forward pre-hook, prepended so that it runs before any other, that makes the stream
    running the forward wait for the chunks of its params, enqueuing them first if they were deferred. The params of
    an FSDP2 unit (``fully_shard``) are waited for where they are read: before every ``unshard()`` of the unit, on the
    current stream and FSDP2's all-gather streams ([Note: FSDP2 reads deferred params] in fsdp.py); modules gate only
    the params no unit manages. What is gated (``_gates``), parents first:
    - a compiled module (``torch.compile(block)``) waits for its subtree's params at its boundary ([Note: Gates in
      compiled graphs] in compiled.py), and so, with ``blocks=True``, does each element of a ``ModuleList``,
      ``ModuleDict`` or ``Sequential`` (a transformer's layers), at the price of a block's first module waiting for
      the block's last chunk;
    - every other module waits for the params it holds itself.
    The model's own forward hook enqueues what is left of a deferred step and orders the backward after the whole
    step (so nothing of the step runs beside the backward's writes into the grads). ``state_dict()`` and
    ``load_state_dict()`` of the model, of the gated modules and of the FSDP2 units join the step first: they read or
    write the params.
    Under torch.compile the hooks add no graph break, and the gated modules get classes of their own so that code
    compiled before is not reused without them ([Note: Gates in compiled graphs]). Copies of the model carry none of
    the hooks ([Note: Hooks in copies]).

    Whose reads this orders: the forward on the caller's stream, compiled graphs (at their boundary), FSDP2's copies
    on its own streams, and DDP's (its forward reads no param on a stream of its own). ``attach()`` refuses a module
    whose forward never runs (a container: attach the module that calls it), one that holds none of the optimizer's
    params, with ``overlap=True`` an FSDP1 model (its all-gather stream is not ordered after a deferred chunk), and,
    with ``step_in_backward=True``, a DDP model.
    """
    views = _check_views(model, runtime, views)
    _check_attachable(model, runtime, blocks, views)
    ref = weakref.ref(runtime)  # the model must not keep the wrapper (and its host memory) alive
    key = compiled.register(ref)
    units = fsdp.units(model)
    groups = [group for unit in units for group in unit.groups]
    unit_gates = [_UnitGate(ref, group, key) for group in groups]
    gates = _gates(model, {id(p) for g in unit_gates for p in g.params}, blocks)
    gates = {m: [views.get(p, p) for p in params] for m, params in gates.items()}  # what the optimizer steps
    hooks = {m: _Gate(ref, ps, key) for m, ps in gates.items()}
    # A module compiled in place runs its hooks inside the compiled code: its gate runs from its class instead.
    inplace = {m: hooks[m].run for m in gates if compiled.is_compiled_module(m) and not compiled.is_compiled_wrapper(m)}
    handles: list[Any] = [m.register_forward_pre_hook(h, prepend=True) for m, h in hooks.items() if m not in inplace]
    handles.extend(fsdp.UnshardHook(group, gate) for group, gate in zip(groups, unit_gates, strict=True))
    handles.append(model.register_forward_hook(_Done(ref)))
    reader = Call(_join_hook, ref)
    for module in {id(m): m for m in [model, *gates, *(m for unit in units for m in unit.modules)]}.values():
        handles.append(module.register_state_dict_pre_hook(reader))
        handles.append(module.register_load_state_dict_pre_hook(reader))
    # Modules dynamo may trace get classes of their own; a torch.compile wrapper's own hooks run eagerly.
    traced = [m for m in {id(m): m for m in [model, *gates]}.values() if not compiled.is_compiled_wrapper(m)]
    handle = AttachHandle(len(gates) + len(groups), handles, compiled.gate_classes(traced, ref, inplace), ref, key)
    runtime.attached(handle.serial, [p for ps in [*gates.values(), *(g.params for g in unit_gates)] for p in ps])
    return handle


def _check_views(
    model: torch.nn.Module, runtime: Runtime, views: Mapping[torch.Tensor, torch.Tensor] | None
) -> dict[torch.Tensor, torch.Tensor]:
    """``views`` checked: each key a param of ``model``, each value an optimizer param in that param's memory."""
    if views is None:
        return {}
    if not isinstance(views, Mapping):
        raise TypeError(f"views must map params of the model to optimizer params, got {type(views).__name__}")
    held = {id(p) for p in model.parameters()}
    for param, view in views.items():
        why = None
        if not isinstance(param, torch.Tensor) or id(param) not in held:
            why = "a key is not a param of the model"
        elif not isinstance(view, torch.Tensor) or runtime.index_of(view) is None:
            why = "a value is not a param of this optimizer"
        elif view.untyped_storage().data_ptr() != param.untyped_storage().data_ptr():
            why = "a value is not a view of its key's memory (the forward would not read what the optimizer updates)"
        if why is not None:
            raise ValueError(f"attach(views=...): {why}; pass {{model param: the optimizer param viewing it}}")
    return dict(views)


def _check_attachable(
    model: torch.nn.Module, runtime: Runtime, blocks: bool, views: Mapping[torch.Tensor, torch.Tensor]
) -> None:
    """Refuse what ``attach()`` cannot gate, before anything is hooked."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"attach() takes a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(blocks, bool):
        raise TypeError(f"blocks must be True or False, got {blocks!r}")
    if _is_container(model):
        raise ValueError(
            f"attach() got a {type(model).__name__}, whose own forward never runs (its elements are called by "
            "another module's forward), so the hook that finishes the step after the forward would never fire. "
            "Attach the module whose forward calls it (the whole model)"
        )
    if not any(runtime.index_of(views.get(p, p)) is not None for p in model.parameters()):
        total = sum(1 for _ in model.parameters())
        raise ValueError(
            f"attach() got a {type(model).__name__} that holds none of this optimizer's params (it holds {total} "
            "params of its own): its forward would wait for nothing while the step updates params it does not "
            "hold. Attach the model whose parameters the optimizer steps"
        )
    if not runtime.mode.in_backward and _is_fsdp1(model):
        raise ValueError(
            "attach() of a model wrapped in FSDP1 (FullyShardedDataParallel) with overlap=True: FSDP1 all-gathers its "
            "flat params on a stream of its own that waits for the caller's stream once per forward, before any "
            "module's gate, so a deferred chunk's update could land after the all-gather read its params. Shard with "
            "FSDP2 (fully_shard), whose every unshard waits for the updates of its params, or use overlap=False"
        )
    if runtime.mode.in_backward and _is_ddp(model):
        raise ValueError(
            "attach() of a DistributedDataParallel model with step_in_backward=True: DDP all-reduces the grads after "
            "their hooks, so a step in the backward would update each rank with its local grads. Use "
            "step_in_backward=False with DDP (overlap=True hides most of the step), or FSDP2 (fully_shard)"
        )


def _gates(model: torch.nn.Module, managed: set[int], blocks: bool) -> dict[torch.nn.Module, list[torch.Tensor]]:
    """The modules whose forward waits, in ``model.modules()`` order, and the params each waits for ([Note: Attached
    forward]); ``managed``: the ids of the params FSDP2 units manage, which their unshard hooks wait for instead."""
    containers = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)
    block_ids = {id(b) for c in model.modules() if isinstance(c, containers) for b in c.children()}
    gates: dict[torch.nn.Module, list[torch.Tensor]] = {}
    inside: set[int] = set()  # modules within a compiled region or block (the gated module excluded)
    for m in model.modules():  # parents before their children
        if id(m) in inside:
            continue
        if compiled.is_compiled_module(m) or (blocks and id(m) in block_ids):
            gates[m] = [p for p in m.parameters() if id(p) not in managed]
            inside.update(id(n) for n in m.modules() if n is not m)
        else:
            gates[m] = [p for p in _own(m) if id(p) not in managed]
    return {m: params for m, params in gates.items() if params}


def _own(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p for p in module._parameters.values() if p is not None]
