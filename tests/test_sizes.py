"""Modules stay under 500 lines and functions under 80 (docs/architecture.md, "Layout"): the walk
counts every module of the package and every function in it, nested ones and methods included,
from its ``def`` (decorators excluded) to its last line."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "jaxascend"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def oversized(path: Path) -> list[str]:
    """One line per module over :data:`MAX_MODULE_LINES` or function over :data:`MAX_FUNCTION_LINES`."""
    text = path.read_text()
    found = []
    lines = len(text.splitlines())
    if lines > MAX_MODULE_LINES:
        found.append(f"{path}: module of {lines} lines (at most {MAX_MODULE_LINES})")
    for node in ast.walk(ast.parse(text, filename=str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{path}:{node.lineno}: function {node.name} of {length} lines (at most "
                             f"{MAX_FUNCTION_LINES})")
    return found


def test_no_module_or_function_is_too_long():
    found = [line for path in sorted(PACKAGE.rglob("*.py")) for line in oversized(path)]
    assert not found, "\n".join(found)


def test_the_walk_sees_a_long_function_and_a_long_module(tmp_path):
    long_function = tmp_path / "f.py"
    long_function.write_text("class A:\n    def f(self):\n" + "        x = 1\n" * 80)
    assert len(oversized(long_function)) == 1 and "function f of 81 lines" in oversized(long_function)[0]
    long_module = tmp_path / "m.py"
    long_module.write_text("x = 1\n" * 501)
    assert oversized(long_module) == [f"{long_module}: module of 501 lines (at most 500)"]
    fine = tmp_path / "ok.py"
    fine.write_text("def g():\n" + "    y = 2\n" * 79)
    assert oversized(fine) == []
