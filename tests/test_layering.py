"""The package's dependency order (docs/architecture.md, "Layout") holds: no module imports from a
layer above its own, and the modules of one subpackage import each other without a cycle. Its
faces are narrow: a subpackage is imported only through its ``__init__`` by everything outside it
(the package, the scripts, the other subpackages' tests), no private name crosses a module
boundary, and a face exports only what something outside the subpackage uses.

Every import counts, including those inside functions and under ``TYPE_CHECKING``: a lazy import
is still a dependency, it only moves the failure to run time.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "jaxascend"

# Bottom to top. A module may import from its own layer and the layers below it. Top-level
# modules are named as modules, subpackages by their name.
LAYERS = [
    ("jaxascend._native", "jaxascend.native", "jaxascend.config", "jaxascend.kill_points", "jaxascend.console",
     "jaxascend.distributed", "jaxascend.stopping", "jaxascend.formats", "jaxascend.provenance",
     "jaxascend.devices"),
    ("jaxascend.ssd",),
    ("jaxascend.models",),
    ("jaxascend.data",),
    ("jaxascend.hf",),
    ("jaxascend.optim",),
    ("jaxascend.checkpoint",),
    ("jaxascend.engine_contract",),
    ("jaxascend.offload",),
    ("jaxascend.planning",),
    ("jaxascend.metrics", "jaxascend.reporting", "jaxascend.in_memory_engine", "jaxascend.generation",
     "jaxascend.preparation",
     "jaxascend.resuming", "jaxascend.training_loop", "jaxascend.run_outputs", "jaxascend.finishing"),
    ("jaxascend.trainer",),
    ("jaxascend.train", "jaxascend.export", "jaxascend.plan", "jaxascend.plot", "jaxascend.generate",
     "jaxascend.launch"),
    ("jaxascend",),  # the package's own __init__: re-exports from below
    ("jaxascend.cli", "jaxascend.__main__"),  # the jaxascend command: runs the CLIs above
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


REPO = PACKAGE.parent
SUBPACKAGES = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists())


def _own_subpackage(where: Path):
    """The subpackage a file (``where``: its path in the repository) belongs to: its own
    (``jaxascend/<sub>/``) or the one it tests (``tests/<sub>/``); None for the rest."""
    parts = where.parts
    return parts[1] if parts[0] in ("jaxascend", "tests") and len(parts) > 2 and parts[1] in SUBPACKAGES else None


def _from_imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] == "jaxascend":
            yield node
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "jaxascend":
                    yield ast.ImportFrom(module=a.name, names=[], level=0, lineno=node.lineno)


def past_the_face(path: Path, where: Path = None) -> list[str]:
    """``path``'s imports that reach past another subpackage's ``__init__``: a module of it
    (``jaxascend.offload.state``), or, in the package and the scripts, a module as a name that
    the face does not export (``from jaxascend.offload import state``). ``where``: the file's
    place in the repository (default: ``path``'s)."""
    where = where or path.relative_to(REPO)
    own, found = _own_subpackage(where), []
    in_code = where.parts[0] != "tests"
    for node in _from_imports(path):
        parts = node.module.split(".")
        if len(parts) < 2 or parts[1] not in SUBPACKAGES or parts[1] == own:
            continue
        if len(parts) > 2:
            found.append(f"{where}:{node.lineno}: {node.module}")
        elif in_code:
            found += [f"{where}:{node.lineno}: {node.module}.{a.name}" for a in node.names
                      if (PACKAGE / parts[1] / f"{a.name}.py").exists() and a.name not in face_names(parts[1])]
    return found


def private_imports(path: Path, own: str = None) -> list[str]:
    """``path``'s imports of a private name (``_x``) from another module than its own (``own``:
    its module name; the extension aside)."""
    own = own or module_name(path)
    return [f"{path.name}:{node.lineno}: {node.module}.{a.name}" for node in _from_imports(path)
            if node.module != own for a in node.names
            if a.name.startswith("_") and not a.name.startswith("__") and a.name != "_native"]


def test_a_subpackage_is_imported_only_through_its_face():
    found = [line for folder in ("jaxascend", "scripts", "tests") for path in sorted((REPO / folder).rglob("*.py"))
             for line in past_the_face(path)]
    assert not found, "import these through the subpackage's __init__:\n" + "\n".join(found)


def test_no_private_name_crosses_a_module_boundary():
    found = [line for path in SOURCES for line in private_imports(path)]
    assert not found, "\n".join(found)


def face_names(subpackage: str) -> list[str]:
    tree = ast.parse((PACKAGE / subpackage / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
            return [ast.literal_eval(e) for e in node.value.elts]
    return []


def test_each_face_exports_only_what_others_use():
    # Users: the package outside the subpackage, the scripts, the other subpackages' tests and
    # the README. What only the subpackage and its own tests use stays in its modules.
    used: dict[str, set[str]] = {sub: set() for sub in SUBPACKAGES}
    for folder in ("jaxascend", "scripts", "tests"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in _from_imports(path):
                parts = node.module.split(".")
                if len(parts) == 2 and parts[1] in SUBPACKAGES and parts[1] != _own_subpackage(path.relative_to(REPO)):
                    used[parts[1]].update(a.name for a in node.names)
    readme = set(re.findall(r"\w+", (REPO / "README.md").read_text()))
    unused = [f"jaxascend.{sub}.{name}" for sub in SUBPACKAGES for name in face_names(sub)
              if name not in used[sub] and name not in readme]
    assert not unused, "exported but used by nothing outside the subpackage: " + ", ".join(unused)


def test_the_face_checks_see_violations(tmp_path):
    bad = tmp_path / "probe.py"
    bad.write_text("from jaxascend.offload.state import OffloadedAdamState\n"
                   "from jaxascend.offload import state\nfrom jaxascend.offload import JobShape\n"
                   "from jaxascend.optim import state_codes\n")
    assert past_the_face(bad, Path("scripts/probe.py")) == ["scripts/probe.py:1: jaxascend.offload.state",
                                                            "scripts/probe.py:2: jaxascend.offload.state"]
    assert past_the_face(bad, Path("jaxascend/offload/probe.py")) == []  # a subpackage's own modules
    assert past_the_face(bad, Path("tests/test_x.py")) == ["tests/test_x.py:1: jaxascend.offload.state"]
    bad.write_text("from jaxascend.offload.step import _first_key\nfrom jaxascend.native import extension as _native\n")
    assert private_imports(bad, "jaxascend.offload.engine") == ["probe.py:1: jaxascend.offload.step._first_key"]
    assert private_imports(bad, "jaxascend.offload.step") == []
