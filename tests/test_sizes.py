"""Modules stay under 500 lines and functions under 80 (docs/architecture.md, "Layout"): the walk
counts every module of the package and every function in it, nested ones and methods included,
from its ``def`` (decorators excluded) to its last line. The native sources (``ffi/``, ``.cc`` and
``.h``) keep the same limits: every file, and every function body at namespace or class scope
from its signature's first line to its closing brace (lambdas and blocks inside a function count
as its lines, as a nested ``def`` counts in its enclosing one)."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jaxascend"
NATIVE = ROOT / "ffi"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def python_functions(text: str, path: Path) -> list[tuple[str, int, int]]:
    """``(name, first line, lines)`` of every function in Python ``text``, nested ones and methods included."""
    return [(node.name, node.lineno, node.end_lineno - node.lineno + 1)
            for node in ast.walk(ast.parse(text, filename=str(path)))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _over_limits(path: Path, unit: str, functions) -> list[str]:
    """One line for ``path`` (a ``unit``: "module", "file") over :data:`MAX_MODULE_LINES` and one per
    function of ``functions(text)`` over :data:`MAX_FUNCTION_LINES`."""
    text = path.read_text()
    found = []
    lines = len(text.splitlines())
    if lines > MAX_MODULE_LINES:
        found.append(f"{path}: {unit} of {lines} lines (at most {MAX_MODULE_LINES})")
    for name, first, length in functions(text):
        if length > MAX_FUNCTION_LINES:
            found.append(f"{path}:{first}: function {name} of {length} lines (at most {MAX_FUNCTION_LINES})")
    return found


def oversized(path: Path) -> list[str]:
    """One line per module over :data:`MAX_MODULE_LINES` or function over :data:`MAX_FUNCTION_LINES`."""
    return _over_limits(path, "module", lambda text: python_functions(text, path))


# Comments, string and character literals, and preprocessor lines (continuations included): blanked
# out before braces are counted, newlines kept.
_CPP_NOISE = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|^[ \t]*#(?:\\\n|[^\n])*',
                        re.S | re.M)
_ACCESS = re.compile(r"^(?:(?:public|private|protected)\s*:(?!:)\s*)+")
_CONTROL = re.compile(r"(?:if|for|while|switch|do|else|try|catch)\b")


def _blank(match: re.Match) -> str:
    text = match.group(0)
    if text[0] in "\"'":
        return text[0] + re.sub(r"[^\n]", " ", text[1:-1]) + text[-1]
    return re.sub(r"[^\n]", " ", text)


def _without_template(header: str) -> str:
    """``header`` without a leading ``template <...>`` (angle brackets balanced)."""
    if not re.match(r"template\s*<", header):
        return header
    depth = 0
    for i, ch in enumerate(header):
        depth += (ch == "<") - (ch == ">")
        if ch == ">" and depth == 0:
            return header[i + 1:].lstrip()
    return header


def _opens(header: str) -> str:
    """What a ``{`` at namespace or class scope opens, from the text since the last ``;``, ``{``, ``}``."""
    header = _without_template(_ACCESS.sub("", header))
    if re.match(r'(?:inline\s+)?namespace\b|extern\s*"', header):
        return "namespace"
    if re.match(r"(?:class|struct|union|enum)\b", header):
        return "class"
    if "(" in header and not header.endswith("=") and not _CONTROL.match(header):
        return "function"
    return "other"  # a braced initializer: "int primes[] = {2, 3}"


def cpp_functions(text: str) -> list[tuple[str, int, int]]:
    """``(name, first line, lines)`` of each function body at namespace or class scope in C++ ``text``."""
    code = _CPP_NOISE.sub(_blank, text)
    found, scopes, header_at = [], [], 0
    for i, ch in enumerate(code):
        if ch == "{":
            raw = code[header_at:i]
            header = raw.strip()
            outer = scopes[-1][0] if scopes else "namespace"
            kind = _opens(header) if outer in ("namespace", "class") else "inner"
            access = _ACCESS.match(header)
            start = header_at + len(raw) - len(raw.lstrip()) + (len(access.group(0)) if access else 0)
            scopes.append((kind, start, header))
        elif ch == "}" and scopes:
            kind, start, header = scopes.pop()
            if kind == "function":
                names = re.findall(r"[~\w]+(?=\s*\()", header.split("(")[0] + "(")
                first = code.count("\n", 0, start) + 1
                found.append((names[-1] if names else header, first, code.count("\n", 0, i) + 2 - first))
        elif ch != ";":
            continue
        header_at = i + 1
    return found


def oversized_native(path: Path) -> list[str]:
    """One line per native source over :data:`MAX_MODULE_LINES` or function over :data:`MAX_FUNCTION_LINES`."""
    return _over_limits(path, "file", cpp_functions)


def test_no_module_or_function_is_too_long():
    found = [line for path in sorted(PACKAGE.rglob("*.py")) for line in oversized(path)]
    assert not found, "\n".join(found)


def test_no_native_file_or_function_is_too_long():
    sources = sorted(p for p in NATIVE.rglob("*") if p.suffix in (".cc", ".h"))
    assert len(sources) > 40, f"the walk found {len(sources)} native sources under {NATIVE}"
    found = [line for path in sources for line in oversized_native(path)]
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


def test_the_native_walk_counts_functions_not_namespaces_classes_or_blocks(tmp_path):
    source = """#include <string>
#define TWICE(x) \\
  { x; x; }
namespace jaxascend {
namespace {
template <typename T, typename Ref = std::shared_ptr<T>>
class Table {
 public:
  explicit Table(int n) : n_(n) {}
  int Get(int i) const {
    if (i < 0) {
      return 0;  // a { in a comment
    }
    auto f = [&](int j) { return j + n_; };
    return f(i) + static_cast<int>(std::string("}{").size()) + ('{' == '}');
  }

 private:
  int n_;
};
constexpr int kPrimes[] = {2, 3, 5};
}  // namespace

ffi::Error
Dispatch(int x,
         int y) {
""" + "  x += y;\n" * 3 + """  return ffi::Error::Success();
}
}  // namespace jaxascend
"""
    assert cpp_functions(source) == [("Table", 9, 1), ("Get", 10, 7), ("Dispatch", 24, 8)]
    long_function = tmp_path / "f.cc"
    long_function.write_text("struct S {\n  void F() {\n" + "    x++;\n" * 79 + "  }\n};\n")
    assert oversized_native(long_function) == [f"{long_function}:2: function F of 81 lines (at most 80)"]
    long_file = tmp_path / "m.h"
    long_file.write_text("int x;\n" * 501)
    assert oversized_native(long_file) == [f"{long_file}: file of 501 lines (at most 500)"]
