"""The package's dependency order (docs/architecture.md, "Layout") holds: no module imports from a
layer above its own, and the modules of one subpackage import each other without a cycle.

Every import counts, including those inside functions and under ``TYPE_CHECKING``: a lazy import
is still a dependency, it only moves the failure to run time.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "jaxascend"

# Bottom to top. A module may import from its own layer and the layers below it. Top-level
# modules are named as modules, subpackages by their name.
LAYERS = [
    ("jaxascend._native", "jaxascend.native", "jaxascend.config", "jaxascend.kill_points", "jaxascend.console",
     "jaxascend.distributed"),
    ("jaxascend.ssd",),
    ("jaxascend.models",),
    ("jaxascend.data",),
    ("jaxascend.hf",),
    ("jaxascend.optim",),
    ("jaxascend.checkpoint",),
    ("jaxascend.engine_contract",),
    ("jaxascend.offload",),
    ("jaxascend.metrics", "jaxascend.in_memory_engine", "jaxascend.generation", "jaxascend.preparation"),
    ("jaxascend.trainer",),
    ("jaxascend.train", "jaxascend.export", "jaxascend.plan", "jaxascend.plot", "jaxascend.generate",
     "jaxascend.launch"),
    ("jaxascend",),  # the package's own __init__: re-exports from below
]
RANK = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit_of(module: str) -> str:
    """The layer unit a module belongs to: its subpackage, or itself at the top level."""
    parts = module.split(".")
    if len(parts) >= 2 and (PACKAGE / parts[1]).is_dir():
        return ".".join(parts[:2])
    return module if module in RANK else ".".join(parts[:2])


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every jaxascend import in ``path``; ``from pkg import mod`` names the
    submodule when ``mod`` is one."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "jaxascend"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] == "jaxascend":
            base = PACKAGE.parent.joinpath(*node.module.split("."))
            for a in node.names:
                is_sub = (base / f"{a.name}.py").exists() or (base / a.name).is_dir() or \
                    (node.module == "jaxascend" and a.name == "_native")
                found.append((node.lineno, f"{node.module}.{a.name}" if is_sub else node.module))
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path}:{node.lineno}: relative import; use the absolute jaxascend path")
    return found


SOURCES = sorted(PACKAGE.rglob("*.py"))


def test_every_module_has_a_layer():
    missing = sorted({unit_of(module_name(p)) for p in SOURCES} - set(RANK))
    assert not missing, f"modules outside the dependency order (add them to LAYERS and docs/architecture.md): {missing}"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_no_import_from_a_higher_layer(path):
    own = unit_of(module_name(path))
    upward = [f"{path.relative_to(PACKAGE.parent)}:{line}: {own} (layer {RANK[own]}) imports {target} "
              f"(layer {RANK[unit_of(target)]})"
              for line, target in imported_modules(path)
              if unit_of(target) in RANK and RANK[unit_of(target)] > RANK[own]]
    assert not upward, "\n".join(upward)


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return []


@pytest.mark.parametrize("subpackage", sorted(p.name for p in PACKAGE.iterdir()
                                              if p.is_dir() and (p / "__init__.py").exists()))
def test_no_import_cycle_inside_a_subpackage(subpackage):
    prefix = f"jaxascend.{subpackage}."
    graph = {}
    for path in (PACKAGE / subpackage).glob("*.py"):
        name = module_name(path)
        if path.name != "__init__.py":
            graph[name] = {t for _, t in imported_modules(path) if t.startswith(prefix) and t != name}
    cycle = _cycle(graph)
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_only_native_imports_the_extension():
    # The extension is reached one way: jaxascend.native loads it and registers its FFI targets
    # on first use; a module importing jaxascend._native itself could call a target before that.
    repo = PACKAGE.parent
    found = [f"{path.relative_to(repo)}:{line}" for folder in ("jaxascend", "scripts", "tests")
             for path in sorted((repo / folder).rglob("*.py")) if path != PACKAGE / "native.py"
             for line, target in imported_modules(path) if target == "jaxascend._native"]
    assert not found, "import the extension as `from jaxascend.native import extension`: " + ", ".join(found)


def test_the_checker_sees_a_violation(tmp_path):
    # The walk itself must notice an upward import, a lazy one included.
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from jaxascend.trainer import run\n")
    assert imported_modules(bad) == [(2, "jaxascend.trainer")]
    bad.write_text("import jaxascend._native\nfrom jaxascend import _native\n")
    assert imported_modules(bad) == [(1, "jaxascend._native"), (2, "jaxascend._native")]
    assert RANK[unit_of("jaxascend.trainer")] > RANK[unit_of("jaxascend.ssd.store")]
    assert _cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
