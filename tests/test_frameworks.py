"""Real training frameworks drive the wrapper: Lightning (fit, checkpoint, resume) and accelerate (prepare).

On the CPU these prove the results are bitwise those of the plain optimizer; tests/cuda/test_frameworks_cuda.py
measures the GPU memory of the same flows on a GPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from chunked_offload import ChunkedOffloadOptimizer
from reference import assert_equal


def make_model(seed: int, width: int = 32, device: str = "cpu") -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(16, width), torch.nn.GELU(), torch.nn.Linear(width, width), torch.nn.Linear(width, 1)
    ).to(device)


def make_data(n: int = 64, device: str = "cpu") -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(n, 16, generator=gen), torch.randn(n, 1, generator=gen))


def make_inner(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def wrap(inner: torch.optim.Optimizer) -> ChunkedOffloadOptimizer:
    return ChunkedOffloadOptimizer(inner, chunk_size_mb=0.002)


# ---------------------------------------------------------------------------------------------------- Lightning
def lightning_module(seed: int, wrapped: bool, **model_kw: Any) -> Any:
    pl = pytest.importorskip("pytorch_lightning")

    class Module(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model(seed, **model_kw)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            inner = make_inner(self.net)
            return wrap(inner) if wrapped else inner

    return Module()


def lightning_fit(module: Any, steps: int, ckpt_path: Path | None = None, **trainer_kw: Any) -> Any:
    pl = pytest.importorskip("pytorch_lightning")
    trainer = pl.Trainer(
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **{"accelerator": "cpu", "devices": 1, **trainer_kw},
    )
    loader = torch.utils.data.DataLoader(make_data(), batch_size=8, shuffle=False)
    trainer.fit(module, loader, ckpt_path=str(ckpt_path) if ckpt_path else None)
    return trainer


def lightning_resume(tmp_path: Path, first_wrapped: bool, then_wrapped: bool, **model_kw: Any) -> Any:
    """Fit one epoch (8 batches), save a checkpoint, resume into a fresh module and fit a second epoch."""
    first = lightning_module(0, wrapped=first_wrapped, **model_kw)
    trainer = lightning_fit(first, 8)
    trainer.save_checkpoint(tmp_path / f"{first_wrapped}.ckpt")
    resumed = lightning_module(1, wrapped=then_wrapped, **model_kw)  # other weights: the checkpoint restores them
    trainer = lightning_fit(resumed, 16, ckpt_path=tmp_path / f"{first_wrapped}.ckpt")
    return resumed, trainer


def test_lightning_fit_matches_the_plain_optimizer() -> None:
    plain, wrapped = lightning_module(0, wrapped=False), lightning_module(0, wrapped=True)
    lightning_fit(plain, 16)
    lightning_fit(wrapped, 16)
    for a, b in zip(plain.parameters(), wrapped.parameters(), strict=True):
        assert_equal(a, b)


@pytest.mark.parametrize("first_wrapped", [True, False], ids=["wrapper-ckpt", "plain-ckpt"])
def test_lightning_resume_matches_the_plain_optimizer(tmp_path: Path, first_wrapped: bool) -> None:
    (tmp_path / "plain").mkdir()
    reference, _ = lightning_resume(tmp_path / "plain", first_wrapped=False, then_wrapped=False)
    resumed, trainer = lightning_resume(tmp_path, first_wrapped=first_wrapped, then_wrapped=True)
    opt = trainer.optimizers[0]
    assert isinstance(getattr(opt, "_optimizer", opt), ChunkedOffloadOptimizer)
    for a, b in zip(reference.parameters(), resumed.parameters(), strict=True):
        assert_equal(a, b)


# ---------------------------------------------------------------------------------------------------- accelerate
def accelerate_run(wrapped: bool, steps_before: int, steps_after: int, cpu: bool = True) -> torch.nn.Module:
    accelerate = pytest.importorskip("accelerate")
    device = "cpu" if cpu else "cuda"
    model = make_model(0, device=device)
    inner = make_inner(model)
    opt: Any = wrap(inner) if wrapped else inner
    data = make_data(device=device)
    x, y = (t.to(device) for t in data.tensors)
    for step in range(steps_before):  # state exists before prepare()
        torch.nn.functional.mse_loss(model(x[step::8]), y[step::8]).backward()
        opt.step()
        opt.zero_grad()
    accelerator = accelerate.Accelerator(cpu=cpu)
    model, opt = accelerator.prepare(model, opt)
    for step in range(steps_before, steps_before + steps_after):
        accelerator.backward(torch.nn.functional.mse_loss(model(x[step % 8 :: 8]), y[step % 8 :: 8]))
        opt.step()
        opt.zero_grad()
    accelerate.state.AcceleratorState._reset_state(True)
    return model


def test_accelerate_prepare_of_an_optimizer_with_state_matches_the_plain_optimizer() -> None:
    plain = accelerate_run(False, 3, 5)
    wrapped = accelerate_run(True, 3, 5)
    for a, b in zip(plain.parameters(), wrapped.parameters(), strict=True):
        assert_equal(a, b)


@pytest.mark.parametrize("mode", ["overlap", "backward"])
def test_accelerate_with_an_attached_model_matches_the_plain_optimizer(mode: str) -> None:
    """The recipe: wrap, attach the model, then hand both to accelerate.prepare()."""
    accelerate = pytest.importorskip("accelerate")

    def run(wrapped: bool) -> torch.nn.Module:
        model = make_model(0)
        opt: Any = make_inner(model)
        if wrapped:
            opt = ChunkedOffloadOptimizer(
                opt, chunk_size_mb=0.002, overlap=mode == "overlap", step_in_backward=mode == "backward"
            )
            opt.attach(model)
        accelerator = accelerate.Accelerator(cpu=True)
        model, opt = accelerator.prepare(model, opt)
        x, y = make_data().tensors
        for step in range(8):
            accelerator.backward(torch.nn.functional.mse_loss(model(x[step::8]), y[step::8]))
            opt.step()
            opt.zero_grad()
        if wrapped:
            opt.optimizer.wait_step()  # the params are read below, outside the model's forward
        accelerate.state.AcceleratorState._reset_state(True)
        return model

    for a, b in zip(run(False).parameters(), run(True).parameters(), strict=True):
        assert_equal(a, b)


# ---------------------------------------------------------------------------------------------------- HF transformers
def tiny_llama(seed: int = 0) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=16,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    model.config.use_cache = False
    return model


def test_hf_trainer_with_an_overlapped_wrapper_matches_the_plain_optimizer(tmp_path: Path) -> None:
    """The recipe: build the wrapper, attach the model, then pass the optimizer to the Trainer."""
    transformers = pytest.importorskip("transformers")
    ids = torch.randint(0, 64, (16, 12), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]

    def run(wrapped: bool) -> torch.nn.Module:
        model = tiny_llama()
        opt: Any = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if wrapped:
            opt = ChunkedOffloadOptimizer(opt, chunk_size_mb=0.01, overlap=True)
            opt.attach(model)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / str(wrapped)), max_steps=6, per_device_train_batch_size=4, use_cpu=True,
            report_to=[], save_strategy="no", logging_strategy="no", seed=0, dataloader_num_workers=0,
        )  # fmt: skip
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, sched))
        trainer.train()
        return model

    plain, wrapped = run(False), run(True)
    for (name, a), b in zip(plain.named_parameters(), wrapped.parameters(), strict=True):
        assert_equal(a, b, name)


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("mode", ["overlap", "backward"])
def test_hf_gradient_checkpointing_matches_the_synchronous_loop(mode: str, reentrant: bool) -> None:
    def run(mode: str) -> torch.nn.Module:
        model = tiny_llama()
        kwargs = {"use_reentrant": reentrant}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers 5.2x; the older name is deprecated there
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        model.train()
        opt = ChunkedOffloadOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-2),
            chunk_size_mb=0.01,
            overlap=mode == "overlap",
            step_in_backward=mode == "backward",
        )
        if mode != "sync":
            opt.attach(model)
        gen = torch.Generator().manual_seed(1)
        for _ in range(4):
            ids = torch.randint(0, 64, (2, 12), generator=gen)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        opt.wait_step()
        return model

    for (name, a), b in zip(run("sync").named_parameters(), run(mode).parameters(), strict=True):
        assert_equal(a, b, name)
