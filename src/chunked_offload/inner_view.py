"""InnerView: a torch.optim.Optimizer whose param groups and defaults are another optimizer's own objects."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

__all__ = ["InnerView"]


class InnerView(torch.optim.Optimizer):
    """The facade's base: it is a ``torch.optim.Optimizer`` (LR schedulers, hooks and ``isinstance`` checks take it)
    whose ``param_groups`` and ``defaults`` are the inner optimizer's own objects, not copies, so a scheduler's write
    reaches the inner. A subclass sets ``_inner`` and calls ``_init_optimizer_tables`` instead of
    ``Optimizer.__init__``, which would build groups of its own.
    """

    _inner: torch.optim.Optimizer

    def _init_optimizer_tables(self) -> None:
        """torch.optim.Optimizer's bookkeeping, without building groups of our own: the inner's are shared."""
        for table in ("step", "state_dict", "load_state_dict"):
            for when in ("pre", "post"):
                setattr(self, f"_optimizer_{table}_{when}_hooks", OrderedDict())
        self._patch_step_function()
        self._warned_capturable_if_run_uncaptured = True
        self._step_supports_amp_scaling = getattr(self._inner, "_step_supports_amp_scaling", False)

    @property
    def inner(self) -> torch.optim.Optimizer:
        """The wrapped optimizer."""
        return self._inner

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self._inner.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._inner.param_groups = value

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        return self._inner.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self._inner.defaults = value
