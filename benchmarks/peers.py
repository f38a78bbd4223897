"""The peers bench_train.py times beside the wrapper (not bitwise): torchao's CPU offload and DeepSpeed ZeRO-Offload.

Each is optimizer-like (``step``, ``zero_grad``, ``wait_step``, ``prefetch``); their wheels: scripts/peers-prepare.sh.
"""

from __future__ import annotations

import os

import torch

PEERS = ("torchao", "deepspeed")  # run after ours: DeepSpeed leaves its hooks on the model it wraps (a copy)


class TorchaoOffload:
    """torchao's CPUOffloadOptimizer: fused AdamW on the host CPU over host copies of the (bf16) params."""

    def __init__(self, model: torch.nn.Module, lr: float) -> None:
        from torchao.optim import CPUOffloadOptimizer

        self.inner = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=lr, weight_decay=0.01, fused=True)

    def step(self) -> None:
        self.inner.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none)

    def wait_step(self) -> None:
        pass

    def prefetch(self) -> None:
        pass


class DeepSpeedZeroOffload:
    """DeepSpeed ZeRO stage 2 with the optimizer on the host (DeepSpeedCPUAdam, fp32 masters there), bf16, one rank."""

    def __init__(self, model: torch.nn.Module, lr: float, batch: int) -> None:
        import deepspeed

        for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1").items():
            os.environ.setdefault(key, value)
        os.environ.setdefault("MASTER_PORT", "29518")
        config = {
            "train_micro_batch_size_per_gpu": batch,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 1.0,
            "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01, "betas": [0.9, 0.999]}},
            "zero_optimization": {
                "stage": 2,
                "offload_optimizer": {"device": "cpu", "pin_memory": True},
                "contiguous_gradients": True,
                "overlap_comm": True,
            },
            "steps_per_print": 2**31,
        }
        params = [p for p in model.parameters() if p.requires_grad]
        self.engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=config)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def step(self) -> None:
        self.engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass  # the engine clears its gradient buffers in step()

    def wait_step(self) -> None:
        pass

    def prefetch(self) -> None:
        pass


def peer_missing(variant: str) -> str | None:
    """Why a peer variant cannot run here, or None."""
    module = {"torchao": "torchao.optim", "deepspeed": "deepspeed"}[variant]
    if not torch.cuda.is_available():
        return "needs a GPU"
    try:
        __import__(module)
    except Exception as exc:  # ImportError, or an incompatible build
        return f"{module} is not importable ({type(exc).__name__}: {str(exc)[:80]}); see scripts/peers-prepare.sh"
    return None
