"""The package's layering, read from its source with ``ast``: imports go one way, and no module reads another's
private names (docs/design.md lists the modules in this order)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "chunked_offload"

# Lowest first: a module may import only modules before it.
ORDER = [
    "notices",
    "mode",
    "streams",
    "planner",
    "host_arena",
    "storage",
    "masters",
    "adapters.base",
    "adapters.torch_optim",
    "adapters.generic",
    "adapters.transformer_engine",
    "adapters.emerging",
    "adapters",
    "state_table",
    "dtensor",
    "inputs",
    "layout",
    "checks",
    "staging",
    "transfer",
    "telemetry",
    "stepping",
    "gate",
    "phase",
    "pipeline",
    "placement",
    "budget",
    "context",
    "schedule",
    "backward_watch",
    "in_backward",
    "runner",
    "compiled",
    "hooks",
    "state_dict",
    "wiring",
    "optimizer",
    "torchtitan",
    "",  # the package's __init__
]


def _name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_name(p): p for p in sorted(SRC.rglob("*.py"))}
TREES = {name: ast.parse(path.read_text()) for name, path in MODULES.items()}


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _resolve(module: str, node: ast.ImportFrom) -> list[str]:
    """The package modules an import names, relative imports resolved."""
    if node.level == 0:
        base = node.module or ""
        if not base.startswith("chunked_offload"):
            return []
        target = base.removeprefix("chunked_offload").lstrip(".")
    else:
        parts = module.split(".") if module else []
        if not _is_package(module):
            parts = parts[:-1]
        parts = parts[: len(parts) - (node.level - 1)] if node.level > 1 else parts
        target = ".".join([*parts, *([node.module] if node.module else [])])
    submodules = [f"{target}.{a.name}" if target else a.name for a in node.names]
    names = [n for n in submodules if n in MODULES] or [target]  # `from . import x` imports module x
    return [n for n in names if n in MODULES and n != module]


def _imports(module: str) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.ImportFrom):
            found.update(_resolve(module, node))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("chunked_offload."):
                    target = alias.name.removeprefix("chunked_offload.")
                    if target in MODULES:
                        found.add(target)
    return found


def _private_definitions(module: str) -> set[str]:
    """Single-underscore names a module defines: functions, classes, attributes (``self._x = ...`` included)."""
    names: set[str] = set()
    for node in ast.walk(TREES[module]):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    # torch.optim.Optimizer's own hook tables (``_optimizer_step_pre_hooks``...) are torch's protocol, not ours.
    return {n for n in names if n.startswith("_") and not n.startswith("__") and not n.startswith("_optimizer_")}


def test_every_module_is_in_the_layer_order() -> None:
    assert set(MODULES) == set(ORDER), set(MODULES) ^ set(ORDER)


@pytest.mark.parametrize("module", ORDER)
def test_no_module_imports_one_above_it(module: str) -> None:
    rank = ORDER.index(module)
    above = sorted(m for m in _imports(module) if ORDER.index(m) > rank and not m.startswith(f"{module}."))
    assert not above, f"{module or '__init__'} imports {above}, which come after it in the layer order"


def test_there_is_no_import_cycle() -> None:
    graph = {m: _imports(m) for m in MODULES}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        if state.get(m) == 1:
            raise AssertionError(f"import cycle: {' -> '.join([*path, m])}")
        if state.get(m) == 2:
            return
        state[m] = 1
        for n in sorted(graph[m]):
            if not (_is_package(m) and n.startswith(f"{m}.")):  # a package may import its own modules
                visit(n, [*path, m])
        state[m] = 2

    for m in sorted(graph):
        visit(m, [])


@pytest.mark.parametrize("module", ORDER)
def test_no_module_reads_another_modules_private_names(module: str) -> None:
    own = _private_definitions(module)
    others: dict[str, str] = {}
    for other in MODULES:
        if other != module:
            for name in _private_definitions(other):
                others.setdefault(name, other)
    reads = []
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.Attribute) and node.attr in others and node.attr not in own:
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                reads.append(f"line {node.lineno}: .{node.attr} (defined in {others[node.attr]})")
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if alias.name in others and alias.name not in own:
                    reads.append(f"line {node.lineno}: imports {alias.name} (defined in {others[alias.name]})")
    assert not reads, f"{module or '__init__'} reads private names of other modules: {reads}"


@pytest.mark.parametrize("module", ORDER)
def test_modules_stay_small_and_the_facade_thin(module: str) -> None:
    lines = len(MODULES[module].read_text().splitlines())
    limit = 400 if module == "optimizer" else 450
    assert lines <= limit, f"{module} has {lines} lines (at most {limit})"
