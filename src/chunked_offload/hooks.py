"""The hooks the wrapper puts on modules and params: thin, opaque to dynamo, each calling into the step runtime."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

__all__ = ["AttachHandle", "HookSet", "Runtime", "attach", "opaque", "register_grad_hooks", "weak_callback"]

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

    step_in_backward: bool

    def wait_for(self, indices: list[int], streams: Sequence[torch.cuda.Stream] = ()) -> None: ...

    def flush(self) -> None: ...

    def join(self) -> None: ...

    def forward_done(self) -> None: ...

    def grad_final(self, param: torch.Tensor) -> None: ...

    def index_of(self, param: torch.Tensor) -> int | None: ...

    def attached(self, handle: int, params: list[torch.Tensor] | None) -> None: ...


class _Hook:
    """A hook the wrapper puts on a module or a param: it calls ``fn(runtime, *args)`` while the runtime lives.

    [Note: Hooks in copies]
    ``copy.deepcopy``, ``pickle`` and ``torch.save`` of a hooked module (``AveragedModel(model)``, an eval copy, a
    whole-model checkpoint) copy its hook dicts with it. A hook is an object of this class, so a copy of it is the
    inert ``_inert`` instead: the copy carries no live hook into the wrapper (its forward neither waits for nor steps
    anything of the original's), pickles by reference, and loads anywhere the package is installed. Copying a hook
    first joins the step, so the params the copy is made from are updated: a module's hook dicts are copied before
    its children, and the root module's own params, which come before its hooks, are never left to an overlapped
    step ([Note: Deferred chunks] in schedule.py).
    """

    __slots__ = ("_fn", "_runtime")

    def __init__(self, fn: Callable[..., Any], runtime: weakref.ref[Runtime]) -> None:
        self._fn = fn
        self._runtime = runtime

    @opaque  # [Note: Opaque to dynamo]
    def __call__(self, *args: Any) -> Any:
        target = self._runtime()
        return None if target is None else self._fn(target, *args)

    def _join(self) -> None:
        target = self._runtime()
        if target is not None:
            target.join()

    def __deepcopy__(self, memo: dict[int, Any]) -> Callable[..., None]:
        self._join()
        return _inert

    def __reduce_ex__(self, protocol: Any) -> tuple[Callable[[], Callable[..., None]], tuple[()]]:
        self._join()
        return _the_inert_hook, ()


def _inert(*args: Any) -> None:
    """What a copy of one of the wrapper's hooks is ([Note: Hooks in copies])."""
    return None


def _the_inert_hook() -> Callable[..., None]:
    return _inert


def _is_container(model: torch.nn.Module) -> bool:
    """Whether ``model``'s forward never runs (``nn.ModuleList``, ``nn.ModuleDict``: their elements are called)."""
    return getattr(type(model), "forward", None) is getattr(torch.nn.Module, "forward", None)


def _is_ddp(model: torch.nn.Module) -> bool:
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:  # a torch built without distributed
        return False
    return any(isinstance(m, DistributedDataParallel) for m in model.modules())


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
    join the step first: they read or write the params. Copies of the model carry none of these hooks ([Note: Hooks
    in copies]).

    With ``blocks=True`` each element of an ``nn.ModuleList`` (a transformer's layers) is gated as a whole: its
    forward waits for every param of its subtree, and the modules inside it have no hook of their own. Under
    torch.compile that is one graph break per block instead of one per module with params ([Note: Opaque to
    dynamo]), at the price of a block's first module waiting for the block's last chunk.

    ``attach()`` refuses a module whose forward never runs (a container: attach the module that calls it), one that
    holds none of the optimizer's params, and, with ``step_in_backward=True``, a DDP model.
    """
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
    own = [p for p in model.parameters() if runtime.index_of(p) is not None]
    if not own:
        total = sum(1 for _ in model.parameters())
        raise ValueError(
            f"attach() got a {type(model).__name__} that holds none of this optimizer's params (it holds {total} "
            "params of its own): its forward would wait for nothing while the step updates params it does not "
            "hold. Attach the model whose parameters the optimizer steps"
        )
    if runtime.step_in_backward and _is_ddp(model):
        raise ValueError(
            "attach() of a DistributedDataParallel model with step_in_backward=True: DDP all-reduces the grads after "
            "their hooks, so a step in the backward would update each rank with its local grads. Use "
            "step_in_backward=False with DDP (overlap=True hides most of the step), or FSDP2 (fully_shard)"
        )
    ref = weakref.ref(runtime)  # the model must not keep the wrapper (and its host memory) alive
    units = _fsdp_units(model)
    gates = _gates(model, units, blocks)

    def params_of(module: torch.nn.Module) -> list[torch.Tensor]:
        gated = gates.get(module)
        if gated is None:
            return []  # a shallow copy of a gated module
        if module in units:
            prefetched = getattr(_fsdp_state(module), "_states_to_forward_prefetch", [])
            extra = [p for state in prefetched for m in getattr(state, "_modules", ()) for p in units.get(m, [])]
            return [*gated, *extra]
        return gated

    def before_forward(target: Runtime, module: torch.nn.Module, args: Any) -> None:
        own = (target.index_of(p) for p in params_of(module))
        target.wait_for([i for i in own if i is not None], _all_gather_streams(module) if module in units else ())

    def after_forward(target: Runtime, module: torch.nn.Module, args: Any, output: Any) -> None:
        target.forward_done()

    def before_state_dict(target: Runtime, module: torch.nn.Module, *args: Any) -> None:
        target.join()

    gated_modules = list(gates)
    pre = _Hook(before_forward, ref)
    handles = [m.register_forward_pre_hook(pre, prepend=True) for m in gated_modules]
    readers = []
    reader = _Hook(before_state_dict, ref)
    for module in {id(m): m for m in [model, *gated_modules]}.values():
        readers.append(module.register_state_dict_pre_hook(reader))
        readers.append(module.register_load_state_dict_pre_hook(reader))
    root_own = {id(p) for p in model._parameters.values() if p is not None}  # [Note: Hooks in copies]
    waited = [p for ps in gates.values() for p in ps if id(p) not in root_own]
    handle = AttachHandle(handles, model.register_forward_hook(_Hook(after_forward, ref)), readers, ref)
    runtime.attached(handle.serial, waited)
    return handle


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

    _serials = itertools.count()

    def __init__(self, handles: list[Any], done: Any, readers: list[Any], runtime: weakref.ref[Runtime]) -> None:
        self.serial = next(self._serials)
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
                target.attached(self.serial, None)
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

    def grad_final(target: Runtime, param: torch.Tensor) -> None:
        target.grad_final(param)

    hook = _Hook(grad_final, weakref.ref(runtime))
    return [p.register_post_accumulate_grad_hook(hook) for p in params if p.requires_grad]


# Params stepped in the backward by a live wrapper (id -> the param, weakly, and that wrapper's hooks): a second
# wrapper would step them twice in each backward.
_STEPPED_IN_BACKWARD: dict[int, tuple[weakref.ref[torch.Tensor], HookSet]] = {}


class HookSet:
    """Every hook one wrapper has put on modules and params; ``release`` takes them all off.

    The wrapper's finalizer calls ``release`` when the wrapper is dropped, so a dropped wrapper leaves no hook behind
    (a hook of a dropped wrapper would cost every forward and backward, and step nothing). It holds nothing that
    holds the wrapper.
    """

    def __init__(self, step_in_backward: bool) -> None:
        self._step_in_backward = step_in_backward
        self.runtime: weakref.ref[Any] | None = None  # the step runtime, set once it exists
        self._grad_hooks: list[Any] = []
        self._handles: list[AttachHandle] = []

    def on_install(self, layout: Any) -> None:
        """A new layout was installed: with ``step_in_backward``, grad hooks go on its params."""
        runtime = None if self.runtime is None else self.runtime()
        if self._step_in_backward and runtime is not None:
            self.set_grad_hooks([info.param for info in layout.infos], runtime)

    def set_grad_hooks(self, params: Sequence[torch.Tensor], runtime: Runtime) -> None:
        """Put the post-accumulate-grad hooks on ``params``, instead of those on the previous ones."""
        for p in params:
            param, other = _STEPPED_IN_BACKWARD.get(id(p), (None, None))
            if other is not None and other is not self and param is not None and param() is p:
                raise ValueError(
                    f"a param (shape {tuple(p.shape)}) is already stepped in the backward by another live "
                    "ChunkedOffloadOptimizer (step_in_backward=True); both would step it. Drop the other wrapper "
                    "first, or wrap disjoint params"
                )
        self._remove_grad_hooks()
        self._grad_hooks = register_grad_hooks(params, runtime)
        for p in params:
            _STEPPED_IN_BACKWARD[id(p)] = (weakref.ref(p), self)

    def _remove_grad_hooks(self) -> None:
        for handle in self._grad_hooks:
            handle.remove()
        self._grad_hooks = []
        for key in [k for k, (_, owner) in _STEPPED_IN_BACKWARD.items() if owner is self]:
            del _STEPPED_IN_BACKWARD[key]

    def add(self, handle: AttachHandle) -> AttachHandle:
        self._handles.append(handle)
        return handle

    def release(self, runtime: Any = None) -> None:
        """Land what the step left (``runtime.synchronize()``), then take every hook off."""
        try:
            if runtime is not None:
                runtime.synchronize()
        finally:
            self._remove_grad_hooks()
            for handle in self._handles:
                handle.remove()
            self._handles.clear()


def weak_callback(method: Callable[[Any], None]) -> Callable[[Any], None]:
    """A bound ``method`` that holds its object weakly (a part calling back into the wrapper), a no-op once gone."""
    ref = weakref.WeakMethod(method)

    def call(arg: Any) -> None:
        bound = ref()
        if bound is not None:
            bound(arg)

    return call
