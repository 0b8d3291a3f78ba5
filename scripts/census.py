"""A census of the code's shape (issue 38's "must show"), printed as JSON.

    python scripts/census.py                   # this checkout
    python scripts/census.py --root /tmp/head  # another tree, e.g. `git archive HEAD | tar -x -C /tmp/head`

* ``mode_conditions``: conditions in ``jaxascend/offload/`` that name a mode: the test of every
  ``if``/``elif``/``while``, ternary and comprehension ``if``, and every ``and``/``or`` outside
  those, whose expression names a mode (see :data:`MODE_NAMES`, :data:`PLAN_FIELDS`); per file,
  with how many are about data parallelism (:data:`PARALLEL_NAMES`) and the lines. Each is one
  of three kinds: ``plan`` (in ``step_plan.py``, where the plan decides the modes),
  ``leaf`` (a property of one leaf: ``leaf.streamed`` or a local ``streamed`` of a pass over
  such leaves, which leaves are held as raw bits: ``as_bits``, ``table_as_bits``, ``bits``), or
  ``runtime`` (the rest, ``weights.kind``, the compute weights' copy of ``plan.weight_source``,
  included: a part testing a mode while it runs); ``runtime`` is the issue's "runtime mode
  conditions";
* ``engine_config_reads``: reads of the whole config in ``offload/engine.py``: every ``cfg`` and
  ``self.cfg`` (``cfg.offload.params`` counts once);
* ``trainer_streamed_tests``: conditions in ``trainer.py`` naming ``streamed``, and its reads;
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
MODE_NAMES = {"data_parallel", "dp", "partitioned", "partition", "placement", "host_callbacks", "via_host",
              "streamed", "fp32_grad_buffer", "post_backward", "post_backward_overflow_check", "scatter"}
LEAF_NAMES = {"leaf.streamed", "as_bits", "table_as_bits", "bits"}  # one leaf's property, not a run's mode
PARALLEL_NAMES = {"data_parallel", "dp", "partitioned", "partition", "placement", "scatter", "local_devices",
                  "processes"}
# The modules of the job's layout, chosen once (the placement and its mesh, partitions and reads).
PLACEMENT_PART = ("placement.py", "partition.py")
# Fields of the step's plan, read as ``plan.X`` or ``self.plan.X``.
PLAN_FIELDS = {"overlap", "weights", "gradients", "weight_source", "table_per_use", "engine", "partition",
               "partitioned", "local_devices", "processes", "host_callbacks", "grad_accum"}


def _names(node: ast.AST) -> set[str]:
    """The mode names ``node`` mentions ("plan.X" for a plan field)."""
    found = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            name = sub.id.lstrip("_")
            if name == "streamed":
                name = "leaf.streamed"  # in offload/ a local `streamed` is a leaf's, or a pass's of such leaves
        elif isinstance(sub, ast.Attribute):
            base = sub.value
            base_name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) \
                else ""
            if base_name.lstrip("_") == "plan" and sub.attr in PLAN_FIELDS:
                found.add(f"plan.{sub.attr}")
            name = sub.attr.lstrip("_")
            if name == "streamed" and base_name.lstrip("_") not in ("plan", "cfg", "offload"):
                name = "leaf.streamed"  # a leaf's own
            elif name == "kind":
                name = "weights.kind"  # the compute weights' copy of plan.weight_source
        else:
            continue
        if name in MODE_NAMES or name in ("leaf.streamed", "weights.kind") or "bits" in name:
            found.add(name)
    return found


def _tests(tree: ast.AST) -> list[ast.AST]:
    """Every condition's expression: if/while/ternary/comprehension tests (a ternary inside
    another test is part of it), and and/or outside them."""
    tests = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.While, ast.IfExp)):
            tests.append(node.test)
        elif isinstance(node, ast.comprehension):
            tests.extend(node.ifs)
    nested = {id(sub) for test in tests for sub in ast.walk(test) if sub is not test}
    tests = [test for test in tests if id(test) not in nested]
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
            kind = "plan" if path.name == "step_plan.py" else "leaf" if names <= LEAF_NAMES else "runtime"
            hits.append({"line": test.lineno, "names": sorted(names), "data_parallel": parallel, "kind": kind})
    hits.sort(key=lambda h: h["line"])
    kinds = {k: sum(h["kind"] == k for h in hits) for k in ("runtime", "leaf", "plan")}
    return {"count": len(hits), "data_parallel": sum(h["data_parallel"] for h in hits), **kinds, "conditions": hits}


def _summary(per_file: dict, placement_part: tuple[str, ...]) -> dict:
    runtime = [(f, h) for f, v in per_file.items() for h in v["conditions"] if h["kind"] == "runtime"]
    return {"total": sum(v["count"] for v in per_file.values()),
            "data_parallel": sum(v["data_parallel"] for v in per_file.values()),
            "by_kind": {k: sum(v[k] for v in per_file.values()) for k in ("runtime", "leaf", "plan")},
            "runtime": len(runtime),
            "runtime_data_parallel": sum(h["data_parallel"] for _, h in runtime),
            "runtime_data_parallel_outside_placement": sum(h["data_parallel"] for f, h in runtime
                                                           if f not in placement_part),
            "placement_part": list(placement_part),
            "per_file": per_file}


def config_reads(path: Path) -> int:
    """Uses of the whole config: every ``cfg`` read and every ``self.cfg`` read (``cfg.offload.params``
    counts once, ``StepPlan.resolve(cfg, ...)`` too)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    count = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == "cfg" and isinstance(node.ctx, ast.Load):
            count += 1
        elif isinstance(node, ast.Attribute) and node.attr == "cfg" and isinstance(node.ctx, ast.Load) \
                and isinstance(node.value, ast.Name) and node.value.id == "self":
            count += 1
    return count


def streamed_tests(path: Path) -> dict:
    """The conditions naming ``streamed`` (lines) and every read of it (lines: ``not r.streamed``
    and ``stream_layers=r.streamed`` decide too)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    reads = [n.lineno for n in ast.walk(tree) if isinstance(n, (ast.Name, ast.Attribute)) and isinstance(n.ctx, ast.Load)
             and (getattr(n, "id", None) or getattr(n, "attr", None)) == "streamed"]
    return {"conditions": sorted(t.lineno for t in _tests(tree) if _names(t) & {"streamed", "leaf.streamed"}),
            "reads": sorted(reads)}


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
        "mode_conditions": _summary(per_file, PLACEMENT_PART),
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
