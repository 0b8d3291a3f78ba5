"""A census of the code's shape (issue 38's "must show"), printed as JSON.

    python scripts/census.py                   # this checkout
    python scripts/census.py --root /tmp/head  # another tree, e.g. `git archive HEAD | tar -x -C /tmp/head`

* ``mode_conditions``: conditions in ``jaxascend/offload/`` that test a mode at run time: the
  test of every ``if``/``elif``/``while``, ternary and comprehension ``if``, and every
  ``and``/``or`` outside those, whose expression names a mode (see :data:`MODE_NAMES`,
  :data:`PLAN_FIELDS`); per file, with how many are about data parallelism
  (:data:`PARALLEL_NAMES`) and the lines;
* ``engine_config_reads``: ``cfg.``/``self.cfg.`` attribute reads in ``offload/engine.py``
  (``cfg.offload.params`` counts once);
* ``trainer_streamed_tests``: conditions in ``trainer.py`` naming ``streamed``;
* ``largest``: the largest Python module of the package and the largest ``ffi/`` file, in lines;
* ``imports``: edges between the modules of ``offload/``; edges between the package's units (a
  subpackage, or a top-level module: ``tests/test_layering.py``'s units) and the longest import
  chain between units (``depth``, in units).
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
from pathlib import Path

# Names that say which mode a run is in (leading underscores dropped; any name holding "bits"
# counts: the 16-bit weights handed over as uint16).
MODE_NAMES = {"data_parallel", "dp", "partitioned", "partition", "placement", "host_callbacks", "streamed",
              "fp32_grad_buffer", "post_backward", "post_backward_overflow_check", "scatter"}
PARALLEL_NAMES = {"data_parallel", "dp", "partitioned", "partition", "placement", "scatter", "local_devices",
                  "processes"}
# Fields of the step's plan, read as ``plan.X`` or ``self.plan.X``.
PLAN_FIELDS = {"overlap", "weights", "gradients", "weight_source", "table_per_use", "engine", "partition",
               "partitioned", "local_devices", "processes", "host_callbacks", "grad_accum"}


def _names(node: ast.AST) -> set[str]:
    """The mode names ``node`` mentions ("plan.X" for a plan field)."""
    found = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            name = sub.id.lstrip("_")
        elif isinstance(sub, ast.Attribute):
            base = sub.value
            base_name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) \
                else ""
            if base_name.lstrip("_") == "plan" and sub.attr in PLAN_FIELDS:
                found.add(f"plan.{sub.attr}")
            name = sub.attr.lstrip("_")
        else:
            continue
        if name in MODE_NAMES or "bits" in name:
            found.add(name)
    return found


def _tests(tree: ast.AST) -> list[ast.AST]:
    """Every condition's expression: if/while/ternary/comprehension tests, and and/or outside them."""
    tests = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.While, ast.IfExp)):
            tests.append(node.test)
        elif isinstance(node, ast.comprehension):
            tests.extend(node.ifs)
    inside = {id(sub) for test in tests for sub in ast.walk(test)}
    for node in ast.walk(tree):
        if isinstance(node, ast.BoolOp) and id(node) not in inside:
            tests.append(node)
            inside.update(id(sub) for sub in ast.walk(node))
    return tests


def mode_conditions(path: Path) -> dict:
    tree = ast.parse(path.read_text(), filename=str(path))
    hits = []
    for test in _tests(tree):
        names = _names(test)
        if names:
            parallel = any(n.split(".")[-1] in PARALLEL_NAMES for n in names)
            hits.append({"line": test.lineno, "names": sorted(names), "data_parallel": parallel})
    hits.sort(key=lambda h: h["line"])
    return {"count": len(hits), "data_parallel": sum(h["data_parallel"] for h in hits), "conditions": hits}


def config_reads(path: Path) -> int:
    """Outermost ``cfg.X...`` / ``self.cfg.X...`` attribute reads."""
    tree = ast.parse(path.read_text(), filename=str(path))
    inner = set()
    count = 0
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or id(node) in inner:
            continue
        chain = node
        while isinstance(chain, ast.Attribute):
            inner.add(id(chain))
            root = chain
            chain = chain.value
        is_cfg = (isinstance(chain, ast.Name) and chain.id == "cfg" and root is not node) or \
            (isinstance(chain, ast.Name) and chain.id == "self" and root.attr == "cfg" and root is not node)
        count += bool(is_cfg)
    return count


def streamed_tests(path: Path) -> list[int]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return sorted(t.lineno for t in _tests(tree) if "streamed" in _names(t))


def largest(root: Path) -> dict:
    py = max((len(p.read_text().splitlines()), str(p.relative_to(root))) for p in (root / "jaxascend").rglob("*.py"))
    native = [p for p in (root / "ffi").iterdir() if p.suffix in (".cc", ".h")]
    cc = max((len(p.read_text().splitlines()), str(p.relative_to(root))) for p in native)
    return {"python": {"path": py[1], "lines": py[0]}, "native": {"path": cc[1], "lines": cc[0]}}


def _module(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(root: Path, path: Path) -> set[str]:
    """The jaxascend modules ``path`` imports (``from pkg import mod`` names the submodule)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "jaxascend"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "jaxascend":
            base = root.joinpath(*node.module.split("."))
            for a in node.names:
                sub = (base / f"{a.name}.py").exists() or (base / a.name).is_dir()
                found.add(f"{node.module}.{a.name}" if sub else node.module)
    return found


def _unit(root: Path, module: str) -> str:
    parts = module.split(".")
    if len(parts) >= 2 and (root / "jaxascend" / parts[1]).is_dir():
        return ".".join(parts[:2])
    return ".".join(parts[:2]) if len(parts) >= 2 else module


def _depth(graph: dict[str, set[str]]) -> int:
    """Nodes on the longest import chain (cycles broken by not revisiting a node on the path)."""
    memo: dict[str, int] = {}

    def longest(node, path):
        if node in memo:
            return memo[node]
        best = 1 + max((longest(n, path | {node}) for n in graph.get(node, ()) if n not in path), default=0)
        memo[node] = best
        return best

    return max((longest(n, frozenset()) for n in graph), default=0)


def import_census(root: Path) -> dict:
    offload = root / "jaxascend" / "offload"
    modules = {_module(root, p): p for p in (root / "jaxascend").rglob("*.py")}
    inside = {}
    for name, path in modules.items():
        if path.parent == offload and path.name != "__init__.py":
            inside[name] = {t for t in _imports(root, path) if t.startswith("jaxascend.offload.") and t != name}
    units: dict[str, set[str]] = {}
    for name, path in modules.items():
        own = _unit(root, name)
        units.setdefault(own, set())
        units[own] |= {_unit(root, t) for t in _imports(root, path)} - {own, "jaxascend"}
    units.pop("jaxascend", None)  # the package's own __init__ re-exports everything
    return {"offload_modules": len(inside), "offload_module_edges": sum(len(v) for v in inside.values()),
            "offload_module_depth": _depth(inside),
            "units": len(units), "unit_edges": sum(len(v) for v in units.values()), "unit_depth": _depth(units),
            "package_modules": len(modules)}


def census(root: Path) -> dict:
    offload = root / "jaxascend" / "offload"
    per_file = {p.name: mode_conditions(p) for p in sorted(offload.glob("*.py"))}
    per_file = {k: v for k, v in per_file.items() if v["count"]}
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    return {
        "commit": commit,
        "mode_conditions": {"total": sum(v["count"] for v in per_file.values()),
                            "data_parallel": sum(v["data_parallel"] for v in per_file.values()),
                            "per_file": per_file},
        "engine_config_reads": config_reads(offload / "engine.py"),
        "trainer_streamed_tests": streamed_tests(root / "jaxascend" / "trainer.py"),
        "largest": largest(root),
        "imports": import_census(root),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--commit", help="the commit the tree is a snapshot of (recorded as is)")
    args = parser.parse_args()
    out = census(args.root.resolve())
    if args.commit:
        out["commit"] = args.commit
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
