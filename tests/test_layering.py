"""The package's layering, read from its source with ``ast``: imports go one way, and no module reads another's
private names (docs/design.md lists the modules in this order)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "chunked_offload"

# Lowest first: a module may import only modules before it.
ORDER = [
    "notices",
    "mode",
    "callbacks",
    "emulated",
    "streams",
    "specs",
    "chunks",
    "planner",
    "tier_dirs",
    "spill",
    "failures",
    "host_arena",
    "storage",
    "step_stats",
    "disk_io",
    "sums",
    "bounced",
    "disk",
    "fused",
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
    "planning",
    "checks",
    "staging",
    "transfer",
    "telemetry",
    "transaction",
    "stepping",
    "gate",
    "held",
    "phase",
    "prefetch",
    "pipeline",
    "placement",
    "budget",
    "context",
    "schedule",
    "backward_watch",
    "in_backward",
    "backward_loop",
    "grad_hooks",
    "runner",
    "waits",
    "compiled",
    "fsdp",
    "handles",
    "hooks",
    "state_dict",
    "wiring",
    "memory",
    "inner_view",
    "optimizer",
    "torchtitan",
    "integrations.megatron_overlap",
    "integrations.megatron",
    "integrations",
    "",  # the package's __init__
    "__main__",
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


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name != "_"


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
    # torch.optim.Optimizer's own attributes (its hook tables ``_optimizer_step_pre_hooks``..., what GradScaler reads)
    # are torch's protocol, not ours; so are the DistributedOptimizer methods integrations/megatron.py replaces.
    foreign = {"_step_supports_amp_scaling", "_warned_capturable_if_run_uncaptured", "_patch_step_function"}
    foreign |= {
        "_copy_model_grads_to_main_grads", "_get_main_param_and_optimizer_states",
        "_set_main_param_and_optimizer_states", "_init_optimizer_states_with_dummy_values",
    }  # fmt: skip
    return {n for n in names if _is_private(n) and not n.startswith("_optimizer_") and n not in foreign}


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
def test_no_module_is_over_350_lines(module: str) -> None:
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= 350, f"{module or '__init__'} has {lines} lines (at most 350)"


@pytest.mark.parametrize("module", ORDER)
def test_no_function_is_over_60_lines(module: str) -> None:
    long = [
        f"{node.name} (line {node.lineno}): {node.end_lineno - node.lineno + 1} lines"
        for node in ast.walk(TREES[module])
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 60
    ]
    assert not long, f"{module or '__init__'}: functions over 60 lines: {long}"


def _phase_changes(tree: ast.AST) -> list[int]:
    """Lines that change a PhaseMachine: ``<...>.phase.to/rest/accumulating(...)`` or ``<...>.phase.phase = ...``."""

    def is_phase(node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "phase") or (
            isinstance(node, ast.Name) and node.id == "phase"
        )

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in ("to", "rest", "accumulating") and is_phase(node.func.value):
                lines.append(node.lineno)
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Attribute) and target.attr in ("phase", "_resume") and is_phase(target.value):
                    lines.append(node.lineno)
    return lines


@pytest.mark.parametrize("module", ORDER)
def test_only_the_runner_changes_the_phase(module: str) -> None:
    if module in ("runner", "phase"):
        assert module != "runner" or _phase_changes(TREES[module]), "the check finds nothing in the runner itself"
        return
    assert not _phase_changes(TREES[module]), f"{module} changes the phase at lines {_phase_changes(TREES[module])}"


@pytest.mark.parametrize("module", ORDER)
def test_every_slot_change_goes_through_slot_advance(module: str) -> None:
    writes = [
        node.lineno
        for node in ast.walk(TREES[module])
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Attribute) and target.attr == "state"
        and isinstance(node.value, ast.Attribute) and isinstance(node.value.value, ast.Name)
        and node.value.value.id == "SlotState"
        and not (module == "staging" and isinstance(target.value, ast.Name) and target.value.id == "self")
    ]  # fmt: skip
    assert not writes, f"{module} sets a slot's state directly at lines {writes}; use Slot.advance"


TESTS = Path(__file__).resolve().parent
# The one place where tests reach the internals: ``tests/reference.py`` (``internals(opt)``); this file names them.
TEST_FILES = sorted(p for p in TESTS.rglob("*.py") if p.name not in ("reference.py", "test_layering.py"))


# Private names of other projects that tests read on purpose: torch's module hook tables and its dynamo, the AMP
# protocol flag, ``torch.cuda._sleep`` (a GPU busy-wait), TE's per-tensor scales, accelerate's state reset, torch's
# fused AdamW op (patched to fail around a one-op update).
FOREIGN_PRIVATE = {
    "_dynamo", "_forward_hooks", "_forward_pre_hooks", "_load_state_dict_pre_hooks", "_state_dict_pre_hooks",
    "_step_supports_amp_scaling", "_sleep", "_scales", "_reset_state", "_fused_adamw_",
    "_exit", "_exitfunc",  # a forked child's exit: os._exit, and the finalizers weakref.finalize runs at exit
    "_get_main_param_and_optimizer_states",  # Megatron's checkpoint form of a shard (tests/megatron_cases.py)
}  # fmt: skip


def _src_private_names() -> dict[str, str]:
    names: dict[str, str] = {}
    for module in MODULES:
        for name in _private_definitions(module):
            names.setdefault(name, module or "__init__")
    return names


@pytest.mark.parametrize("path", TEST_FILES, ids=lambda p: str(p.relative_to(TESTS)))
def test_no_test_reads_the_packages_private_names(path: Path) -> None:
    tree = ast.parse(path.read_text())
    own = {n for n in ast.walk(tree) for n in [getattr(n, "name", None) or getattr(n, "id", None)] if n}
    own |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)}
    src = {k: v for k, v in _src_private_names().items() if k not in own}
    allowed = own | FOREIGN_PRIVATE  # a name the package no longer has is caught too: only foreign ones may be read
    reads = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in src:
            reads.append(f"line {node.lineno}: .{node.attr} (of {src[node.attr]})")
        elif isinstance(node, ast.Attribute) and _is_private(node.attr) and node.attr not in allowed:
            reads.append(f"line {node.lineno}: .{node.attr} (not a name of torch, TE or accelerate that tests use)")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("chunked_offload"):
            reads += [f"line {node.lineno}: imports {a.name}" for a in node.names if a.name in src]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in src:
            reads.append(f"line {node.lineno}: {node.value!r} (of {src[node.value]}; getattr or monkeypatch by name)")
    assert not reads, f"{path.name} reads private names of the package (use tests/reference.py's internals): {reads}"


_NOTE_DEFINITION = re.compile(r"^\s*(#\s*)?\[Note: ([^\]]+)\]\s*$")
_NOTE_REFERENCE = re.compile(r"\[Note: ([^\]]+)\](?: in `?([\w/.]+\.py)`?| \(([\w/.]+\.py)\))?")


def test_every_note_is_defined_once_and_found_where_references_say() -> None:
    """A ``[Note: ...]`` is defined on a line of its own in one module; every reference (in src, tests, benchmarks,
    docs) names a defined note, and the module it names, if any, is the one that defines it."""
    defined: dict[str, list[str]] = {}
    for path in MODULES.values():
        for line in path.read_text().splitlines():
            if match := _NOTE_DEFINITION.match(line):
                defined.setdefault(match.group(2), []).append(path.name)
    assert {k: v for k, v in defined.items() if len(v) > 1} == {}, "notes defined twice"
    root = SRC.parents[1]
    tests = [p for p in TESTS.rglob("*.py") if p.name != "test_layering.py"]
    texts = [*MODULES.values(), *tests, *root.glob("benchmarks/*.py"), *root.glob("docs/*.md")]
    wrong = []
    for path in [*texts, root / "README.md"]:
        flat = re.sub(r"\s*\n\s*(#\s*)?", " ", path.read_text())  # references wrap across comment lines
        for match in _NOTE_REFERENCE.finditer(flat):
            name, where = match.group(1), match.group(2) or match.group(3)
            if name == "...":
                continue
            if name not in defined:
                wrong.append(f"{path.name}: [Note: {name}] is defined nowhere")
            elif where and Path(where).name not in defined[name]:
                wrong.append(f"{path.name}: [Note: {name}] is in {defined[name]}, not {where}")
    assert not wrong, wrong
