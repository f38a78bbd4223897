"""torch.compile as trainers use it: in every mode the wrapper adds no graph break, so each compiled loop is bitwise the
same compiled loop with the plain optimizer, whatever the module structure ([Note: Gates in compiled graphs]).

The matrix varies one factor at a time around a base case (a ``ModuleList`` of blocks, the whole model compiled with
``fullgraph=True``, attached before compiling, one AdamW wrapper, no checkpointing), in both fast modes, plus the
combination torchtitan runs (a ``ModuleDict`` of blocks compiled one by one, attached after compiling).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters
from torch.utils.checkpoint import checkpoint

from chunked_offload import ChunkedOffloadOptimizer
from reference import assert_equal, internals

_KIB = 1 / 1024  # MiB
WIDTH = 24


class Block(torch.nn.Module):
    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up, self.down = torch.nn.Linear(width, 2 * width), torch.nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Net(torch.nn.Module):
    """Blocks held in a ``ModuleList``, a ``ModuleDict`` (torchtitan), or a flat ``Sequential`` of Linear and GELU."""

    def __init__(self, structure: str, checkpointing: str, width: int = WIDTH, depth: int = 3) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(8, width)
        if structure == "list":
            self.layers: Any = torch.nn.ModuleList(Block(width) for _ in range(depth))
        elif structure == "dict":
            self.layers = torch.nn.ModuleDict({str(i): Block(width) for i in range(depth)})
        else:
            self.layers = torch.nn.Sequential(
                *[m for _ in range(depth) for m in (torch.nn.Linear(width, width), torch.nn.GELU())]
            )
        self.head = torch.nn.Linear(width, 8)
        self.structure, self.checkpointing = structure, checkpointing

    def blocks(self) -> list[torch.nn.Module]:
        return list(self.layers.values()) if self.structure == "dict" else list(self.layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointing == "reentrant-no-grad-input":  # the first segment's input does not require grad
            x = checkpoint(self.embed, x, use_reentrant=True)
        else:
            x = self.embed(x)
        for block in self.blocks():
            if self.checkpointing == "none":
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.checkpointing != "non-reentrant")
        return self.head(x)


@dataclass(frozen=True)
class Case:
    structure: str = "list"  # list, dict, sequential
    fullgraph: bool = True
    scope: str = "model"  # model: torch.compile(model); blocks: torch.compile(block) (torchtitan 0.2); inplace:
    # block.compile() (torchtitan 0.3)
    attach: str = "before"  # before compiling, after compiling, after another instance of the same code ran
    wrappers: str = "adamw"  # adamw (bf16 params, fp32 masters); muon+adamw (fp32, two wrappers on one model)
    checkpointing: str = "none"  # none, non-reentrant, reentrant, reentrant-no-grad-input

    def __str__(self) -> str:
        base = Case()
        return "-".join(f"{k}={v}" for k, v in vars(self).items() if getattr(base, k) != v) or "base"


BASE = Case()
CASES = [
    BASE,
    replace(BASE, structure="dict"),
    replace(BASE, structure="sequential"),
    replace(BASE, fullgraph=False),
    replace(BASE, scope="blocks"),
    replace(BASE, attach="after"),
    replace(BASE, attach="after-another"),
    replace(BASE, wrappers="muon+adamw"),
    replace(BASE, checkpointing="non-reentrant"),
    replace(BASE, checkpointing="reentrant", fullgraph=False),
    replace(BASE, checkpointing="reentrant-no-grad-input", fullgraph=False),
    replace(BASE, scope="inplace"),
    replace(BASE, structure="dict", scope="blocks", attach="after", checkpointing="non-reentrant"),  # torchtitan 0.2
    replace(BASE, structure="dict", scope="inplace", attach="after", checkpointing="non-reentrant"),  # torchtitan 0.3
    replace(BASE, structure="sequential", scope="blocks", attach="after-another", wrappers="muon+adamw"),
]


def _optimizers(model: Net, case: Case, mode: str, chunk_mb: float) -> list[Any]:
    """The optimizers of the loop: plain (``mode="plain"``), or the wrappers in ``mode``."""
    fast = {"overlap": mode == "overlap", "step_in_backward": mode == "backward"}
    fused = next(model.parameters()).is_cuda
    if case.wrappers == "adamw":
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=fused)
        # bf16 params with fp32 masters: the synchronous wrapper is the plain loop (it attaches nothing)
        return [ChunkedOffloadOptimizer(inner, chunk_size_mb=chunk_mb, master_weights="fp32", **fast)]
    matrices = [p for p in model.parameters() if p.dim() == 2]
    others = [p for p in model.parameters() if p.dim() != 2]
    inners = [torch.optim.Muon(matrices, lr=1e-2), torch.optim.AdamW(others, lr=1e-2, fused=fused)]
    if mode == "plain":
        return inners
    return [ChunkedOffloadOptimizer(inner, chunk_size_mb=chunk_mb, **fast) for inner in inners]


def _compile(model: Net, case: Case) -> Any:
    if case.scope == "model":
        return torch.compile(model, fullgraph=case.fullgraph)
    if case.scope == "inplace":
        for block in model.blocks():
            if any(True for _ in block.parameters()):
                block.compile(fullgraph=case.fullgraph)
        return model
    if case.structure == "dict":
        for name, block in list(model.layers.items()):
            model.layers[name] = torch.compile(block, fullgraph=case.fullgraph)
    else:
        for i, block in enumerate(list(model.layers)):
            if any(True for _ in block.parameters()):
                model.layers[i] = torch.compile(block, fullgraph=case.fullgraph)
    return model


def _train(
    case: Case, mode: str, steps: int = 4, device: str = "cpu", width: int = WIDTH, batch: int = 6, chunk_mb: float = 0
) -> tuple[list[torch.Tensor], int, int, bool]:
    """Params after ``steps`` compiled iterations, the graphs and graph breaks dynamo made for them, and whether the
    wrappers' steps had to wait for all their chunks (a gate was traced). The defaults are the CPU's sizes."""
    torch._dynamo.reset()
    if case.attach == "after-another":  # another instance of the same code, compiled and run first
        other = Net(case.structure, case.checkpointing, width).to(device)
        _compile(other, case)(torch.randn(4, 8, device=device)).sum().backward()
    counters.clear()
    torch.manual_seed(0)
    model = Net(case.structure, case.checkpointing, width).to(device)
    if case.wrappers == "adamw":
        model = model.to(torch.bfloat16)
    opts = _optimizers(model, case, mode, chunk_mb or 4 * _KIB)
    attached = mode in ("overlap", "backward")
    if attached and case.attach == "before":
        for opt in opts:
            opt.attach(model)
    forward = _compile(model, case)
    if attached and case.attach != "before":
        for opt in opts:
            opt.attach(model)
    gen = torch.Generator(device=device).manual_seed(1)
    dtype = next(model.parameters()).dtype
    for _ in range(steps):
        x = torch.randn(batch, 8, generator=gen, device=device).to(dtype)
        x.requires_grad_(case.checkpointing == "reentrant")
        forward(x).float().square().mean().backward()
        for opt in opts:
            opt.step()
        for opt in opts:
            opt.zero_grad(set_to_none=True)
    for opt in opts:
        if hasattr(opt, "wait_step"):
            opt.wait_step()
    breaks = sum(counters["graph_break"].values())
    joined = any(internals(opt).gate.compiled_forward for opt in opts if isinstance(opt, ChunkedOffloadOptimizer))
    return [p.detach().clone() for p in model.parameters()], counters["stats"]["unique_graphs"], breaks, joined


@pytest.mark.parametrize("mode", ["overlap", "backward"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_compiled_loops_match_the_plain_compiled_loop_with_no_more_graph_breaks(case: Case, mode: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own: reentrant checkpointing without inputs that require grad
        plain, plain_graphs, plain_breaks, _ = _train(case, "plain")
        got, graphs, breaks, joined = _train(case, mode)
    assert (graphs, breaks) == (plain_graphs, plain_breaks)
    # Compiled blocks attached after compiling are gated at their boundary: the overlap is kept.
    assert joined is not (case.scope != "model" and case.attach != "before")
    for i, (a, b) in enumerate(zip(plain, got, strict=True)):
        assert_equal(a, b, f"param {i}")


def test_reentrant_checkpointing_of_a_segment_whose_input_needs_no_grad_trains_it_when_compiled() -> None:
    """Dynamo traces the checkpoint, so every param trains; a graph break at the wrapper's hook would send the
    segment back to eager reentrant checkpointing, which gives it no grads (what the plain compiled loop would not)."""
    case = replace(BASE, checkpointing="reentrant-no-grad-input", fullgraph=False)
    torch.manual_seed(0)
    before = [p.detach().clone() for p in Net(case.structure, case.checkpointing).to(torch.bfloat16).parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got, _, _, _ = _train(case, "overlap")
    assert not torch.equal(before[0], got[0])  # the embedding, inside the first segment, trained


class _Stack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(8, WIDTH)
        self.layers = torch.nn.ModuleList(Block() for _ in range(3))
        self.head = torch.nn.Linear(WIDTH, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@pytest.mark.parametrize("holder", ["ModuleList", "ModuleDict", "Sequential", "compiled"])
def test_blocks_are_gated_whole_however_they_are_held(holder: str) -> None:
    torch._dynamo.reset()
    model = _Stack()
    if holder == "ModuleDict":
        model.layers = torch.nn.ModuleDict({str(i): b for i, b in enumerate(model.layers)})  # type: ignore[assignment]
        model.forward = lambda x: model.head(  # type: ignore[method-assign]
            model.layers["2"](model.layers["1"](model.layers["0"](model.embed(x))))
        )
    elif holder == "Sequential":
        model.layers = torch.nn.Sequential(*model.layers)  # type: ignore[assignment]
    elif holder == "compiled":
        for i, layer in enumerate(list(model.layers)):
            model.layers[i] = torch.compile(layer)
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(model.parameters()), chunk_size_mb=4 * _KIB, overlap=True)
    handle = opt.attach(model, blocks=holder != "compiled")  # a compiled block is gated whole anyway
    assert len(handle) == 2 + 3  # embed, the three layers, head
    x = torch.randn(3, 8)
    model(x).sum().backward()
    opt.step()
    waited: list[list[int]] = []
    original = internals(opt).gate.wait_params
    internals(opt).gate.wait_params = lambda indices, streams=(): (waited.append(list(indices)), original(indices))[1]  # type: ignore
    model(x)
    assert [len(w) for w in waited] == [2, 6, 6, 6, 2]  # a layer waits for its six params at once
    assert sorted(i for w in waited for i in w) == list(range(len(opt.plan.bundles)))
    with pytest.raises(TypeError, match="blocks must be True or False"):
        opt.attach(model, blocks="yes")  # type: ignore[arg-type]


def test_attach_gives_each_gated_module_a_class_of_its_own_and_remove_restores_it() -> None:
    """[Note: Gates in compiled graphs]: dynamo guards on the class, so code compiled before attach() is not reused."""
    model = _Stack()
    classes = {name: type(m) for name, m in model.named_modules()}
    opt = ChunkedOffloadOptimizer(torch.optim.AdamW(model.parameters()), overlap=True)
    handle = opt.attach(model)
    changed = [name for name, m in model.named_modules() if type(m) is not classes[name]]
    assert "" in changed and "layers.0.up" in changed and "layers" not in changed  # the root and the gated ones
    assert all(isinstance(m, classes[name]) and type(m).__name__ == classes[name].__name__ for name, m in
               model.named_modules())  # fmt: skip
    handle.remove()
    assert all(type(m) is classes[name] for name, m in model.named_modules())


def test_compiling_the_wrapped_step_runs_it_eagerly_and_bitwise() -> None:
    """The "compile the optimizer step" recipe: the wrapper's step is opaque, so it equals the eager plain step."""

    def run(wrap: bool, compiled: bool) -> list[torch.Tensor]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s)) for s in [(33, 17), (101,), (7, 3)]]
        opt: Any = torch.optim.AdamW(params, lr=1e-2)
        if wrap:
            opt = ChunkedOffloadOptimizer(opt, chunk_size_mb=1 * _KIB)
        step = torch.compile(lambda: opt.step()) if compiled else opt.step
        for s in range(3):
            gen = torch.Generator().manual_seed(s)
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            step()
            opt.zero_grad()
        return params

    eager = run(wrap=False, compiled=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dynamo notes the profiler ranges it skips
        wrapped = run(wrap=True, compiled=True)
    for i, (a, b) in enumerate(zip(eager, wrapped, strict=True)):
        assert_equal(a, b, f"param {i}")
