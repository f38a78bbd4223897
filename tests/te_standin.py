"""A CPU stand-in for Transformer Engine's ``FusedAdam`` on Megatron's precision-aware path (test-only).

Megatron-Core builds TE's ``FusedAdam(master_weights=True, use_decoupled_grad=True)`` for
``use_precision_aware_optimizer=True``, and insists on importing it. ``standing_in()`` makes Megatron, in this
process, build this class instead. It keeps what the real one keeps, in the same keys and dtypes (fp32 ``exp_avg``,
``exp_avg_sq`` and ``master_param``, the step in ``group["step"]``), reads ``decoupled_grad``, and rounds each master
into its 16-bit param after the update. As TE's, its step calls one kernel per group and kind of param (16-bit with
masters, the rest), an instance attribute (``multi_tensor_adam``, here torch ops). Its arithmetic is AdamW's in fp32,
the same in a wrapped and a resident run, which is all the bitwise tests compare. The wrapper recognizes it by its
module, as it does TE's own class. tests/cuda/ and benchmarks/bench_megatron.py --te run the real one.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch


class FusedAdam(torch.optim.Optimizer):
    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adam_w_mode: bool = True,
        capturable: bool = False,
        master_weights: bool = False,
        master_weight_dtype: torch.dtype = torch.float32,
        exp_avg_dtype: torch.dtype = torch.float32,
        exp_avg_sq_dtype: torch.dtype = torch.float32,
        use_decoupled_grad: bool = False,
        store_param_remainders: bool = False,
    ) -> None:
        if store_param_remainders or exp_avg_dtype != torch.float32 or exp_avg_sq_dtype != torch.float32:
            raise NotImplementedError("the stand-in keeps fp32 moments and fp32 masters only")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.adam_w_mode, self.capturable, self.master_weights = adam_w_mode, capturable, master_weights
        self.master_weight_dtype, self.exp_avg_dtype, self.exp_avg_sq_dtype = (
            master_weight_dtype,
            exp_avg_dtype,
            exp_avg_sq_dtype,
        )
        self.use_decoupled_grad, self.store_param_remainders = use_decoupled_grad, store_param_remainders
        self.name_to_dtype_map = {
            "exp_avg": exp_avg_dtype,
            "exp_avg_sq": exp_avg_sq_dtype,
            "master_param": master_weight_dtype,
        }
        self._scales: dict[torch.Tensor, Any] = {}
        self._dummy_overflow_buf = torch.zeros(1, dtype=torch.int)
        self.multi_tensor_adam = _adam_kernel  # an instance attribute, as TE's kernels are

    def initialize_state(self, param: torch.Tensor, store_param_remainders: bool = False) -> None:
        state = self.state[param]
        state["exp_avg"] = torch.zeros_like(param, dtype=torch.float32)
        state["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.float32)
        if self.master_weights:
            state["master_param"] = param.detach().float().clone()

    def get_unscaled_state(self, param: torch.Tensor, state_name: str) -> torch.Tensor:
        return self.state[param][state_name]  # type: ignore[no-any-return]

    def set_scaled_state(self, param: torch.Tensor, state_name: str, unscaled_state: torch.Tensor) -> None:
        if state_name not in self.state[param]:
            self.state[param][state_name] = torch.empty_like(param, dtype=torch.float32)
        self.state[param][state_name].copy_(unscaled_state)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            if not group["params"]:
                continue
            group["step"] = group.get("step", 0) + 1
            beta1, beta2 = group["betas"]
            lists: dict[bool, list[list[torch.Tensor]]] = {}  # 16-bit with masters, and the rest, as TE splits them
            for p in group["params"]:
                if len(self.state[p]) == 0:
                    self.initialize_state(p)
                grad = getattr(p, "decoupled_grad", None) if self.use_decoupled_grad else p.grad
                if grad is None:
                    continue
                state = self.state[p]
                mastered = self.master_weights and p.dtype != torch.float32
                tensors = [grad.data, p.data, state["exp_avg"], state["exp_avg_sq"]]
                tensors += [state["master_param"].data] if mastered else []
                kind = lists.setdefault(mastered, [[] for _ in tensors])
                for k, t in enumerate(tensors):
                    kind[k].append(t)
            for tensor_lists in lists.values():  # one kernel call per kind, as TE's multi_tensor_applier
                self.multi_tensor_adam(
                    2048 * 32, self._dummy_overflow_buf, tensor_lists, group["lr"], beta1, beta2, group["eps"],
                    group["step"], int(self.adam_w_mode), 1, group["weight_decay"],
                )  # fmt: skip


def _adam_kernel(
    chunk_size: int,
    noop: torch.Tensor,
    lists: list[list[torch.Tensor]],
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    step: int,
    adam_w_mode: int,
    bias_correction: int,
    weight_decay: float,
) -> None:
    """TE's ``multi_tensor_adam`` in torch ops: lists of grads, params, moments and (with masters) fp32 masters,
    updated in place, each master rounded into its param."""
    grads, params, exp_avgs, exp_avg_sqs = lists[:4]
    masters = lists[4] if len(lists) > 4 else params
    c1, c2 = (1 - beta1**step, 1 - beta2**step) if bias_correction else (1.0, 1.0)
    for grad, p, exp_avg, exp_avg_sq, master in zip(grads, params, exp_avgs, exp_avg_sqs, masters, strict=True):
        grad = grad.float()
        if adam_w_mode:
            master.mul_(1 - lr * weight_decay)
        else:
            grad = grad + weight_decay * master
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (exp_avg_sq / c2).sqrt_().add_(eps)
        master.addcdiv_(exp_avg, denom, value=-lr / c1)
        if master is not p:
            p.copy_(master)


FusedAdam.__module__ = "transformer_engine.pytorch.optimizers.fused_adam"


@contextlib.contextmanager
def standing_in() -> Iterator[None]:
    """Megatron builds ``FusedAdam`` above where it would build TE's, in this process, until the block ends."""
    import megatron.core.optimizer as mcore_optimizer
    import megatron.core.optimizer.distrib_optimizer as mcore_distrib
    import megatron.core.optimizer.optimizer_config as mcore_config

    names = ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.optimizers")
    modules = {name: types.ModuleType(name) for name in names}
    modules[names[-1]].FusedAdam = FusedAdam  # type: ignore[attr-defined]
    saved_modules = {name: sys.modules.get(name) for name in names}
    saved = (mcore_optimizer.Adam, mcore_optimizer.USING_PYTORCH_OPTIMIZER, mcore_optimizer.is_te_min_version)
    saved_config = getattr(mcore_config, "is_te_min_version", None), mcore_distrib.HAVE_APEX_OR_TE
    sys.modules.update(modules)
    mcore_optimizer.Adam, mcore_optimizer.USING_PYTORCH_OPTIMIZER = FusedAdam, False
    mcore_optimizer.is_te_min_version = lambda *a, **k: True
    mcore_config.is_te_min_version = lambda *a, **k: True
    mcore_distrib.HAVE_APEX_OR_TE = True  # its checkpoint loader then takes the step from the param groups
    try:
        yield
    finally:
        mcore_optimizer.Adam, mcore_optimizer.USING_PYTORCH_OPTIMIZER, mcore_optimizer.is_te_min_version = saved
        mcore_config.is_te_min_version, mcore_distrib.HAVE_APEX_OR_TE = saved_config
        for name, module in saved_modules.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
