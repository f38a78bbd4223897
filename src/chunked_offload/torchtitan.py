"""torchtitan: the wrapper inside torchtitan's ``OptimizersContainer``, before its LR schedulers are built."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .hooks import AttachHandle
from .optimizer import ChunkedOffloadOptimizer

__all__ = ["wrap_optimizers"]


def wrap_optimizers(
    container: Any, model_parts: Sequence[torch.nn.Module] = (), *, blocks: bool = True, **options: Any
) -> list[AttachHandle]:
    """Wrap each optimizer of a torchtitan ``OptimizersContainer`` in a :class:`ChunkedOffloadOptimizer`, in place.

    Call it right after ``build_optimizers`` (``config.optimizer.build(model_parts=...)``) and before the LR
    schedulers are built, so that they schedule the wrappers. With ``overlap=True`` or ``step_in_backward=True`` each
    wrapper attaches every model part (``blocks=True``: each transformer block waits as a whole, at its boundary when
    torchtitan compiled it). torchtitan clips the grads in every step, so its loops need ``overlap=True``
    (``step_in_backward=True`` refuses the clip); ``gpu_budget_mb="auto"`` keeps resident what the GPU has room for.

    Args:
        container: torchtitan's ``OptimizersContainer`` (anything with a list in ``.optimizers``).
        model_parts: the model parts the optimizers step (``trainer.model_parts``).
        blocks: attach with ``blocks=True``.
        **options: the wrapper's options (``overlap``, ``master_weights``, ``gpu_budget_mb``, ...).

    Returns:
        The attach handles (empty in the synchronous mode).

    Raises:
        TypeError: ``container`` has no ``optimizers`` list, or one of them is wrapped already.
    """
    optimizers = getattr(container, "optimizers", None)
    if not isinstance(optimizers, list):
        raise TypeError(
            f"wrap_optimizers() takes torchtitan's OptimizersContainer (with a list in .optimizers), got "
            f"{type(container).__name__}"
        )
    wrapped = [ChunkedOffloadOptimizer(o, **options) for o in optimizers]
    container.optimizers[:] = wrapped
    if not (options.get("overlap") or options.get("step_in_backward")):
        return []
    return [w.attach(part, blocks=blocks) for w in wrapped for part in model_parts]
