"""Every jaxascend name the README shows works from the path it shows it at: the modules run
with ``python -m``, the names imported in its Python blocks, and the scripts and configs it names."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
PYTHON_BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)


def _imports():
    found = []
    for block in PYTHON_BLOCKS:
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.ImportFrom) and node.module.split(".")[0] == "jaxascend":
                found += [(node.module, a.name) for a in node.names]
    return found


def test_the_readme_has_python_examples():
    assert len(_imports()) >= 4, "the README's Python blocks import fewer jaxascend names than expected"


@pytest.mark.parametrize("module,name", _imports(), ids=lambda x: str(x))
def test_readme_import_resolves(module, name):
    assert hasattr(importlib.import_module(module), name), f"README: `from {module} import {name}` fails"


@pytest.mark.parametrize("module", sorted(set(re.findall(r"python -m (jaxascend[\w.]*)", README))))
def test_readme_cli_module_has_main(module):
    mod = importlib.import_module(module)
    if hasattr(mod, "__path__"):  # a package runs its __main__ module
        mod = importlib.import_module(module + ".__main__")
    assert callable(getattr(mod, "main", None)), f"README: `python -m {module}` has no main()"


@pytest.mark.parametrize("path", sorted(set(re.findall(r"\b((?:scripts|configs|docs)/[\w.\-/]+\.(?:py|yaml|md|svg))", README))))
def test_readme_files_exist(path):
    assert (REPO / path).is_file(), f"README names {path}, which does not exist"
