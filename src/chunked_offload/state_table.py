"""StateTable: the inner optimizer's ``state``, whose entries copy assigned tensors into their host homes."""

from __future__ import annotations

import weakref
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

__all__ = ["StateBinding", "StateEntry", "StateTable", "bind", "plain_copy"]


def bind(entry: dict[Any, Any], key: Any, value: Any) -> None:
    """Store ``value`` in a state entry without absorbing it: the wrapper's own (re)binding of views."""
    dict.__setitem__(entry, key, value)


class StateBinding:
    """What a :class:`StateTable` needs from its wrapper: the homes, and when they may be written.

    [Note: Absorbing writes]
    Between steps every offloaded state tensor is a view of its home (host memory, or device memory for resident
    chunks). A tensor assigned into a state entry, ``opt.state[p]["exp_avg"] = t``, is copied into that home at
    once and the entry keeps the home. So writes take effect as with a plain optimizer (values, not the object),
    and frameworks that move every state tensor to the GPU one by one (Lightning's ``_optimizer_to_device`` on
    resume) never hold more than one of them there. A tensor that does not fit its home (a new key, another shape
    or dtype) is stored as given and marks the binding ``dirty``: the next step re-plans, or refuses, before
    anything is modified. During ``step()`` assignments pass through untouched: the inner optimizer creates and
    rebinds its state in the staging slots, and the wrapper re-scans it after each chunk.

    Args:
        synchronize: called before the host writes into a home: waits until no write-back into the homes is in
            flight (and marks bytes staged earlier stale).
        is_offloaded: whether a state value moves (the adapter's rule).
        stepping: whether the inner optimizer's step runs now (the wrapper's phase).
    """

    def __init__(
        self,
        synchronize: Callable[[], None],
        is_offloaded: Callable[[str, object], bool],
        stepping: Callable[[], bool],
    ) -> None:
        self.homes: dict[int, dict[str, torch.Tensor]] = {}
        self.bound: dict[int, dict[str, torch.Tensor]] = {}  # what entries hold: the home, or a DTensor over it
        self.index_by_id: dict[int, int] = {}
        self.dirty = False
        self._synchronize = synchronize
        self._is_offloaded = is_offloaded
        self._stepping = stepping

    @property
    def stepping(self) -> bool:
        """Whether assignments pass through untouched (the inner optimizer's step runs)."""
        return self._stepping()

    def index_of(self, param: object) -> int | None:
        return self.index_by_id.get(id(param))

    def absorb(self, index: int | None, key: Any, value: Any) -> Any:
        """The value a state entry should keep when ``value`` is assigned to ``key`` (see [Note: Absorbing writes])."""
        if self.stepping or index is None or not self._is_offloaded(key, value):
            return value
        home, held = self.homes.get(index, {}).get(key), self.bound.get(index, {}).get(key)
        if value is held or held is None:
            self.dirty = self.dirty or held is None
            return value
        shard = getattr(value, "_local_tensor", value)  # a DTensor's local shard
        if home is None or shard.shape != home.shape or shard.dtype != home.dtype:
            self.dirty = True
            return value
        self._synchronize()  # the last step's write-back into this home must land before it is overwritten
        home.copy_(shard)
        return held


class StateEntry(dict):  # type: ignore[type-arg]
    """One param's state: a dict whose assigned tensors are absorbed into their homes ([Note: Absorbing writes]).

    It pickles as an ``OrderedDict`` (which ``torch.load(weights_only=True)`` accepts) and copies as a plain dict.
    """

    __slots__ = ("_table", "_param")

    def __init__(self, table: StateTable, param: Any, items: Mapping[Any, Any] | None = None) -> None:
        super().__init__()
        self._table = table
        self._param = param
        if items:
            self.update(items)

    def __setitem__(self, key: Any, value: Any) -> None:
        dict.__setitem__(self, key, self._table.absorb(self._param, key, value))

    def update(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]

    def __ior__(self, other: Any) -> StateEntry:  # type: ignore[override,misc]
        self.update(other)
        return self

    def __reduce_ex__(self, protocol: Any) -> Any:
        return (OrderedDict, (), None, None, iter(self.items()))

    def __copy__(self) -> dict[Any, Any]:
        return dict(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> dict[Any, Any]:
        import copy

        return {copy.deepcopy(k, memo): copy.deepcopy(v, memo) for k, v in self.items()}


class StateTable(defaultdict):  # type: ignore[type-arg]
    """The inner optimizer's ``state``: a ``defaultdict`` of :class:`StateEntry`, one per param.

    Assigning a whole entry (``opt.state[p] = {...}``) absorbs its tensors too. The table holds its binding weakly:
    once the wrapper is gone its entries behave as plain dicts.

    Args:
        binding: the wrapper's binding.
        items: entries to adopt (for example a plain ``defaultdict`` the inner optimizer's own
            ``load_state_dict`` installed).
    """

    def __init__(self, binding: StateBinding, items: Iterable[tuple[Any, Any]] = ()) -> None:
        super().__init__(dict)
        self._binding = weakref.ref(binding)
        for key, value in items:
            self[key] = value

    @property
    def binding(self) -> StateBinding | None:
        return self._binding()

    def absorb(self, param: Any, key: Any, value: Any) -> Any:
        binding = self._binding()
        return value if binding is None else binding.absorb(binding.index_of(param), key, value)

    def __missing__(self, key: Any) -> StateEntry:
        entry = StateEntry(self, key)
        dict.__setitem__(self, key, entry)
        return entry

    def __setitem__(self, key: Any, value: Any) -> None:
        if isinstance(value, Mapping) and not (
            isinstance(value, StateEntry) and value._table is self and value._param is key
        ):
            value = StateEntry(self, key, value)
        dict.__setitem__(self, key, value)

    def __reduce_ex__(self, protocol: Any) -> Any:
        return (defaultdict, (dict,), None, None, iter(self.items()))

    def __copy__(self) -> defaultdict[Any, Any]:  # type: ignore[override]
        return plain_copy(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> defaultdict[Any, Any]:
        import copy

        return copy.deepcopy(plain_copy(self), memo)


def plain_copy(state: Mapping[Any, Any]) -> defaultdict[Any, Any]:
    """A plain ``defaultdict(dict)`` with plain-dict entries, detached from any wrapper."""
    out: defaultdict[Any, Any] = defaultdict(dict)
    for key, value in state.items():
        out[key] = dict(value) if isinstance(value, Mapping) else value
    return out
