"""Transformer Engine's FusedAdam: its state dtypes, its own masters, its group step, its raw-pointer kernels."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any

import torch

from ..planner import Role, TensorSpec, dense_spec
from .base import Adapter

__all__ = ["TEFusedAdamAdapter", "is_te_fused_adam"]

_MOMENTS = ("exp_avg", "exp_avg_sq")
_SUPPORTED_MOMENTS = (torch.float32, torch.bfloat16)
# The multi-tensor kernels FusedAdam's step calls, as its instance attributes.
_KERNELS = (
    "multi_tensor_adam",
    "multi_tensor_adam_param_remainder",
    "multi_tensor_adam_fp8",
    "multi_tensor_adam_capturable",
    "multi_tensor_adam_capturable_master",
)


def is_te_fused_adam(inner: torch.optim.Optimizer) -> bool:
    """Whether ``inner`` is ``transformer_engine.pytorch.optimizers.FusedAdam``, without importing TE."""
    cls = type(inner)
    return cls.__name__ == "FusedAdam" and cls.__module__.startswith("transformer_engine.")


class TEFusedAdamAdapter(Adapter):
    """``transformer_engine.pytorch.optimizers.FusedAdam`` (transformer-engine 2.x).

    State per param: ``exp_avg`` and ``exp_avg_sq`` in TE's configured dtypes (fp32 or bf16), and with
    ``master_weights=True`` TE's own master, ``master_param``: fp32, or int16 remainders with
    ``store_param_remainders=True`` for bf16 params. All of them are offloaded and chunked like any state.

    - TE's step counter lives in ``param_groups[i]["step"]``; the wrapper's ``GroupCounters`` advance it once per
      outer step, for every group, as TE does.
    - TE's kernels take raw pointers and check neither device nor layout, so before each chunk every state tensor
      is checked to be on the GPU and contiguous.
    - Checkpoints are TE's native format (bf16 moments as fp32, as ``FusedAdam.state_dict()`` returns them), packed
      from the host copies: TE's own ``state_dict()`` and ``load_state_dict()`` are never called, since they launch
      kernels on every state tensor and rebuild fp32 copies on the GPU.
    - Refused: fp16/fp8 moments or fp16 masters (their scales live outside ``state``), ``capturable=True`` (CUDA
      graphs replay fixed pointers).
    """

    name = "transformer_engine.FusedAdam"
    strict = True

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        super().__init__(inner)
        self.grad_attr = "decoupled_grad" if getattr(inner, "use_decoupled_grad", False) else "grad"
        self._unscaled: set[torch.Tensor] = set()  # params with state from a checkpoint, whose scales are due

    def check_config(self) -> None:
        inner: Any = self.inner
        for attr in ("exp_avg_dtype", "exp_avg_sq_dtype"):
            dtype = getattr(inner, attr)
            if dtype not in _SUPPORTED_MOMENTS:
                raise ValueError(
                    f"FusedAdam({attr}={dtype}) keeps a per-param scale for these moments in FusedAdam._scales, "
                    "outside `state`, which offloading would not move with them; supported: torch.float32, "
                    "torch.bfloat16"
                )
        if inner.master_weights and inner.master_weight_dtype != torch.float32:
            raise ValueError(
                f"FusedAdam(master_weight_dtype={inner.master_weight_dtype}) keeps per-param scales outside `state`; "
                "use master_weight_dtype=torch.float32 (optionally with store_param_remainders=True)"
            )
        if inner.capturable:
            raise ValueError(
                "FusedAdam(capturable=True) is meant to be replayed in a CUDA graph on fixed pointers, but chunked "
                "offload rebinds every state tensor to staging memory on each step; use capturable=False"
            )

    def _one_op(self, group: dict[str, Any]) -> bool:
        # With fp32 moments FusedAdam updates a group's params of one dtype, their moments and masters in one call of
        # a multi-tensor kernel, after its checks ([Note: One-op updates]); bf16 moments are written back after it.
        # With masters, an fp32 param's ``master_param`` is kept but not stepped (TE steps the param itself). The
        # kernel must be an attribute of the instance, where ``watching`` reports its calls.
        inner: Any = self.inner
        fp32_moments = inner.exp_avg_dtype == inner.exp_avg_sq_dtype == torch.float32
        unstepped = inner.master_weights and any(p.dtype == torch.float32 for p in group["params"])
        kernel = "multi_tensor_adam_param_remainder" if inner.store_param_remainders else "multi_tensor_adam"
        return not inner.capturable and fp32_moments and not unstepped and kernel in vars(inner)

    @contextlib.contextmanager
    def watching(self, watch: Any) -> Iterator[None]:
        """FusedAdam's kernels (instance attributes it calls through ``multi_tensor_applier``) report to ``watch``:
        each call is one op that writes every list but the grads' (the first)."""
        inner: Any = self.inner
        kernels = {name: inner.__dict__[name] for name in _KERNELS if name in inner.__dict__}

        def reported(kernel: Callable[..., Any]) -> Callable[..., Any]:
            def call(chunk_size: int, noop: torch.Tensor, lists: Sequence[Sequence[Any]], *args: Any) -> Any:
                written = [t for tensors in lists[1:] for t in tensors]
                return watch.kernel(kernel, written, chunk_size, noop, lists, *args)

            return call

        for name, kernel in kernels.items():
            setattr(inner, name, reported(kernel))
        try:
            yield
        finally:
            for name, kernel in kernels.items():
                setattr(inner, name, kernel)

    def owns_masters(self) -> bool:
        return bool(getattr(self.inner, "master_weights", False))

    def _predict(self, stepped: torch.Tensor, group: dict[str, Any]) -> list[TensorSpec]:
        inner: Any = self.inner
        specs = [
            dense_spec("exp_avg", Role.STATE, stepped, inner.exp_avg_dtype),
            dense_spec("exp_avg_sq", Role.STATE, stepped, inner.exp_avg_sq_dtype),
        ]
        if inner.master_weights:
            remainders = inner.store_param_remainders and stepped.dtype == torch.bfloat16
            specs.append(dense_spec("master_param", Role.STATE, stepped, torch.int16 if remainders else torch.float32))
        return specs

    def workspace_nbytes(self, stepped: Sequence[tuple[dict[str, Any], int]]) -> int:
        return 0  # multi-tensor-apply kernels on the state in place

    def layout_signature(self, group: dict[str, Any]) -> Hashable:
        return "fused_adam"  # the state depends on the optimizer's attributes, not on group hyperparameters

    def verify_bound(self, params: Sequence[torch.Tensor], state: Mapping[torch.Tensor, Any]) -> None:
        for p in params:
            for key, value in (state.get(p) or {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    if value.device != p.device or not value.is_contiguous():
                        raise RuntimeError(
                            f"FusedAdam state {key!r} of a param of shape {tuple(p.shape)} on {p.device} is on "
                            f"{value.device} with strides {tuple(value.stride())} at its chunk's step; TE's kernels "
                            "need contiguous memory on the param's GPU and would write through the raw pointer "
                            "regardless"
                        )

    def after_load(self, params: Sequence[torch.Tensor]) -> None:
        # FusedAdam keeps a scale per non-fp32 moment in _scales, created by its own state initialisation; for bf16
        # moments it stays 1 (the bf16 path never rescales). State installed from a checkpoint needs it too: it is
        # created at the next step (begin_step), so that loading costs no device memory.
        self._unscaled.update(params)

    def begin_step(self, stepped_dtype: Callable[[torch.Tensor], torch.dtype]) -> None:
        inner: Any = self.inner
        for p in self._unscaled:
            state = inner.state.get(p) or {}
            for key in _MOMENTS:
                if key in state and inner.name_to_dtype_map[key] != torch.float32:
                    scales = inner._scales.setdefault(p, {})
                    if key not in scales:
                        scales[key] = torch.ones([1], dtype=torch.float32, device=p.device)
        self._unscaled.clear()

    def to_checkpoint(self, key: str, value: torch.Tensor) -> torch.Tensor:
        if key in _MOMENTS and value.dtype == torch.bfloat16:
            return value.float()  # exact, as FusedAdam.get_unscaled_state returns it
        return value

    def from_checkpoint(self, key: str, value: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
        if key in _MOMENTS and spec.dtype == torch.bfloat16 and value.dtype == torch.float32:
            # Round to nearest even, as FusedAdam.set_scaled_state does; on the host, so that a checkpoint held on
            # the GPU (TE's own) costs no GPU memory to convert.
            return value.to("cpu").to(torch.bfloat16)
        return value
