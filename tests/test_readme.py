"""Every jaxascend name the README shows works from the path it shows it at: the modules run
with ``python -m`` and the flags given to them, the names imported in its Python blocks, the
config fields it sets with ``--set``, the scripts, configs and docs it names, and its links. Its
first screen holds the two commands that work on a fresh machine and a table of contents whose
links reach the README's headings; its walkthrough installs for CUDA with an extra that exists.
docs/benchmarks.md, where the measurements live, is held to the same paths and links."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import re
import subprocess
import sys
import tomllib
import typing
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
BENCHMARKS = REPO / "docs" / "benchmarks.md"
PYTHON_BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)

# The two commands of the first screen: set up and train the bundled default; run the tests.
SETUP_AND_RUN = ("python3 -m venv .venv && . .venv/bin/activate && pip install -e . && "
                 "python -m jaxascend.train --config configs/tiny.yaml")
RUN_TESTS = ('python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[test]" && '
             "python -m pytest tests")
FIRST_SCREEN = 40  # lines
WALKTHROUGH = "Fine-tune a model on your chat data"


def _without_code(text: str) -> str:
    """The Markdown outside fenced code blocks (a ``# comment`` in a bash block is no heading)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _headings(text: str) -> list[tuple[int, str]]:
    return [(len(m[1]), m[2].strip()) for m in re.finditer(r"^(#{1,6}) +(.+?) *#*$", _without_code(text), re.M)]


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation (backticks, colons, dots, ...) dropped,
    spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def _anchors(text: str) -> set[str]:
    """Every heading's anchor, repeated ones numbered as GitHub numbers them (``-1``, ``-2``)."""
    seen: dict[str, int] = {}
    anchors = set()
    for _, heading in _headings(text):
        slug = _slug(heading)
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def _links(text: str) -> list[str]:
    """The targets of the Markdown links and images outside code blocks."""
    return re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", _without_code(text))


def _section(text: str, heading: str) -> str:
    """The text under a level-2 heading, up to the next one."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"README has no '## {heading}' section"
    return match[1]


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


def _commands() -> list[str]:
    """Every ``python -m jaxascend...`` command the README shows, continuation lines joined: in its
    code blocks, and in inline code spans."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", README, re.S | re.M)
    blocks += re.findall(r"`([^`\n]*python -m jaxascend[^`\n]*)`", _without_code(README))
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    return [line[line.index("python -m jaxascend"):] for line in lines if "python -m jaxascend" in line]


def _flags_by_module() -> dict[str, set[str]]:
    flags: dict[str, set[str]] = {}
    for command in _commands():
        command = re.split(r" -- | && | \| |  +# | #", command)[0]  # its own part: not a launched command, a comment
        module = re.match(r"python -m (jaxascend[\w.]*)", command)[1]
        flags.setdefault(module, set()).update(re.findall(r"(?<![\w-])(--[a-z][\w-]*)", command))
    return {module: found for module, found in flags.items() if found}


@pytest.mark.parametrize("module,flags", sorted((m, tuple(sorted(f))) for m, f in _flags_by_module().items()),
                         ids=lambda x: x if isinstance(x, str) else " ".join(x))
def test_readme_cli_flags_exist(module, flags):
    """Each flag the README gives a tool is one its --help lists."""
    out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, cwd=REPO,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    known = set(re.findall(r"(?<![\w-])(--[a-z][\w-]*)", out.stdout))
    unknown = sorted(set(flags) - known)
    assert not unknown, f"README: `python -m {module}` has no {unknown} (its --help: {sorted(known)})"


PATH_PATTERN = r"\b((?:scripts|configs|docs)/[\w.\-/]+\.(?:py|yaml|md|svg|png|json|jinja|sh))"


@pytest.mark.parametrize("path", sorted(set(re.findall(PATH_PATTERN, README) +
                                            re.findall(PATH_PATTERN, BENCHMARKS.read_text()))))
def test_readme_files_exist(path):
    assert (REPO / path).is_file(), f"README or docs/benchmarks.md names {path}, which does not exist"


def test_readme_configs_exist():
    """Every shipped config the README names (the walkthrough's, the ones it lists) is there."""
    named = set(re.findall(r"\bconfigs/[\w.\-]+\.yaml", README))
    assert "configs/qwen2.5-0.5b.yaml" in named and "configs/tiny.yaml" in named
    missing = sorted(p for p in named if not (REPO / p).is_file())
    assert not missing, f"README names configs that do not exist: {missing}"


@pytest.mark.parametrize("doc", ["README.md", "docs/benchmarks.md"])
def test_links_reach_a_file_and_heading(doc):
    """Each relative link or image names a file that exists and, with a #fragment, one of that
    file's headings."""
    path = REPO / doc
    bad = []
    for target in _links(path.read_text()):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        if not linked.exists():
            bad.append(f"{target}: no file {linked.relative_to(REPO) if linked.is_relative_to(REPO) else linked}")
        elif anchor and anchor not in _anchors(linked.read_text()):
            bad.append(f"{target}: no heading with that anchor in {linked.name}")
    assert not bad, f"{doc}: broken links: {bad}"


def test_the_first_screen_holds_the_two_commands_and_the_contents():
    lines = README.splitlines()
    first = lines[:FIRST_SCREEN]
    assert SETUP_AND_RUN in first, f"the first {FIRST_SCREEN} lines lack the setup-and-run command on a line of its own"
    assert RUN_TESTS in first, f"the first {FIRST_SCREEN} lines lack the test command on a line of its own"
    assert "## Contents" in first, f"no '## Contents' heading in the first {FIRST_SCREEN} lines"
    start = lines.index("## Contents")
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("## "))
    last = max(i for i in range(start, end) if lines[i].strip())
    assert last < FIRST_SCREEN, f"the table of contents runs to line {last + 1}, past line {FIRST_SCREEN}"
    toc = "\n".join(lines[start:end])
    anchors = _anchors(README)
    links = [t[1:] for t in _links(toc) if t.startswith("#")]
    assert len(links) >= 10, f"the table of contents links {len(links)} headings"
    assert not [a for a in links if a not in anchors], \
        f"table of contents links without a heading: {[a for a in links if a not in anchors]}"
    # every section of the README is reachable from it
    sections = {_slug(h) for level, h in _headings(README) if level == 2 and h != "Contents"}
    assert not sections - set(links), f"sections missing from the table of contents: {sorted(sections - set(links))}"


def test_the_commands_come_before_the_contents():
    """Above the contents: the title, what jaxascend is, and the two commands; nothing else."""
    head = README[:README.index("## Contents")]
    assert [h for _, h in _headings(head)] == ["jaxascend"], "a section above the table of contents"
    assert len(re.findall(r"^```", head, re.M)) == 4, "above the table of contents: the two commands' blocks only"


def test_the_walkthrough_installs_for_cuda_with_an_extra_that_exists():
    walkthrough = _section(README, WALKTHROUGH)
    assert 'pip install -e ".[cuda12]"' in walkthrough, "the walkthrough does not install for CUDA (.[cuda12])"
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    named = {e for group in re.findall(r"\.\[([\w,-]+)\]", README) for e in group.split(",")}
    assert not named - set(extras), f"README installs extras pyproject.toml lacks: {sorted(named - set(extras))}"


def _config_field(name: str) -> bool:
    """Whether ``section.field[.field]`` is a field of jaxascend.config.Config (nested sections such
    as train.distributed included)."""
    from jaxascend.config import Config

    cls = Config
    for part in name.split("."):
        if cls is None or not dataclasses.is_dataclass(cls):
            return False
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return False
        tp = hints[part]
        cls = next((a for a in (typing.get_args(tp) or (tp,)) if dataclasses.is_dataclass(a)), None)
    return True


SET_FIELDS = sorted(set(re.findall(r"--set\s+[\"']?([A-Za-z_][\w.]*)=", README)))


def test_the_readme_sets_fields():
    assert {"model.path", "data.paths", "train.distributed.process_id"} <= set(SET_FIELDS)


@pytest.mark.parametrize("name", SET_FIELDS)
def test_readme_set_names_a_config_field(name):
    assert _config_field(name), f"README: `--set {name}=...` names no config field (python -m jaxascend.config)"
