"""The package layout is the architecture: public import paths, and imports that run one way.

integrations -> memory (planning) -> recompute / accumulate -> ops (kernels). Every import
counts, the ones inside functions too, so no module can lean on a lazy import to hide a circle.
"""

import ast
import importlib
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "gradaccel"
# A room may import from its own rank or below; recompute and accumulate never import each other.
RANK = {"ops": 0, "recompute": 1, "accumulate": 1, "memory": 2, "integrations": 3}

PUBLIC = [
    ("gradaccel", ["checkpoint", "checkpoint_sequential", "checkpoint_blocks", "plan_report", "plan_rows",
                   "reset_plans", "FusedAccumOptimizer", "WindowScheduler", "hf", "ops"]),
    ("gradaccel.hf", ["enable"]),
    ("gradaccel.fit", ["fit", "main"]),
    ("gradaccel.ops", ["scale_accumulate_", "fold_", "finalize_", "wgrad_accumulate_", "embedding_accumulate_"]),
    ("gradaccel.memory", ["LiveBytes"]),
]


@pytest.mark.parametrize("module,names", PUBLIC, ids=[m for m, _ in PUBLIC])
def test_public_import_paths(module, names):
    mod = importlib.import_module(module)
    for name in names:
        assert callable(getattr(mod, name)) or hasattr(mod, name), f"{module}.{name}"


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        yield ".".join(parts), path


def _imports(name, path):
    """Every gradaccel module that ``name`` imports, at any depth of its code."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("gradaccel"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if not base.startswith("gradaccel"):
                continue
            for a in node.names:  # `from gradaccel.x import y`: y may be a module of its own
                sub = f"{base}.{a.name}"
                found.add(sub if (PACKAGE.parent / (sub.replace(".", "/") + ".py")).exists()
                          or (PACKAGE.parent / sub.replace(".", "/")).is_dir() else base)
    return found


def _room(module):
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in RANK else None


GRAPH = {name: _imports(name, path) for name, path in _modules()}


def test_rooms_import_downwards_only():
    wrong = []
    for importer, imported in GRAPH.items():
        a = _room(importer)
        for target in imported:
            b = _room(target)
            if a is None or b is None or a == b:
                continue
            if RANK[b] > RANK[a] or RANK[b] == RANK[a]:
                wrong.append(f"{importer} -> {target}")
    assert not wrong, "imports against the layering:\n" + "\n".join(sorted(wrong))


def test_no_import_circles():
    # Depth-first search over module imports; a package's __init__ importing its own
    # submodules is the one allowed edge back (the submodule's import of the package name is
    # resolved by Python before the package body finishes).
    graph = {m: {t for t in ts if t in GRAPH and not m.startswith(t + ".") and not t == m} for m, ts in GRAPH.items()}
    state, cycles = {}, []

    def visit(m, stack):
        state[m] = "open"
        for t in graph[m]:
            if state.get(t) == "open":
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t, stack + [t])
        state[m] = "done"

    for m in graph:
        if m not in state:
            visit(m, [m])
    assert not cycles, "import circles:\n" + "\n".join(cycles)


def _private_uses(name, path, room):
    """``name``'s uses of underscore names of gradaccel.<room>: imported (``from
    gradaccel.<room>.x import _y``) or read off an imported module (``x._y``)."""
    prefix = f"gradaccel.{room}"
    tree = ast.parse(path.read_text())
    modules, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(prefix):
            for a in node.names:
                if a.name.startswith("_"):
                    found.append(f"{name}: from {node.module} import {a.name}")
                elif (PACKAGE.parent / f"{node.module}.{a.name}".replace(".", "/")).with_suffix(".py").exists():
                    modules.add(a.asname or a.name)
        elif isinstance(node, ast.Import):
            modules.update(a.asname or a.name for a in node.names if a.name.startswith(prefix))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = ast.unparse(node.value)
            if owner in modules or owner.startswith(prefix + "."):
                found.append(f"{name}: {owner}.{node.attr}")
    return found


def test_memory_calls_recompute_through_public_names():
    # memory/ plans with recompute's public functions (trace_call, plan_graph, module_kind,
    # find_blocks, ...), so recompute's insides can change without breaking the planner.
    wrong = [use for name, path in _modules() if _room(name) == "memory"
             for use in _private_uses(name, path, "recompute")]
    assert not wrong, "memory/ uses recompute's private names:\n" + "\n".join(sorted(wrong))
