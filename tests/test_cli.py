"""The ``jaxascend`` command (``jaxascend.cli``; ``python -m jaxascend``): it lists the CLIs, runs
the one named with the remaining arguments and the usage line of that name, passes its exit
status through, and refuses an unknown one in one line. Its --help loading no JAX is checked in
tests/test_lazy_imports.py."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

import jaxascend
from jaxascend import cli
from jaxascend.config import __main__ as config_cli

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = (REPO / "pyproject.toml").read_text()
# [project.scripts]'s entry, and what pip's console-script wrapper for `jaxascend = "module:function"` runs.
ENTRY = re.search(r'^\[project\.scripts\]\njaxascend = "([\w.:]+)"', PYPROJECT, re.M).group(1)
MODULE, FUNCTION = ENTRY.split(":")
SCRIPT = f"import sys\nfrom {MODULE} import {FUNCTION}\nsys.argv[0] = 'jaxascend'\nsys.exit({FUNCTION}())"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """``cli.main(argv)`` in this process: (exit status, stdout, stderr)."""
    try:
        code = cli.main(list(argv))
    except SystemExit as exit_:  # argparse's --help, --version and usage errors
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def test_the_console_script_is_the_cli():
    assert ENTRY == "jaxascend.cli:main"
    done = subprocess.run([sys.executable, "-c", SCRIPT, "train", "--help"], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: jaxascend train [-h] --config CONFIG")


def test_help_lists_every_command_on_one_line(capsys):
    code, out, err = run(capsys, "--help")
    assert code == 0 and err == ""
    assert out.startswith("usage: jaxascend [-h] [--version] COMMAND [ARG ...]\n")
    listing = out.split("commands:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert [line.split()[0] for line in listing] == ["train", "plan", "export", "generate", "plot", "launch",
                                                     "config"]
    for line, command in zip(listing, cli.COMMANDS.values()):
        assert line.endswith(f"  {command.summary}")
    assert "`jaxascend COMMAND ARG ...` is the same as `python -m jaxascend.COMMAND ARG ...`" in out


def test_every_command_is_a_module_main_that_takes_its_usage_name():
    for name, command in cli.COMMANDS.items():
        main = __import__(command.module, fromlist=["main"]).main
        usage_name = inspect.signature(main).parameters["prog"].default
        assert usage_name == f"python -m {command.module.removesuffix('.__main__')}", name


@pytest.mark.parametrize("name", list(cli.COMMANDS))
def test_a_commands_usage_line_names_it_as_invoked(capsys, name):
    code, out, err = run(capsys, name, "--help")
    assert code == 0, err
    assert out.startswith(f"usage: jaxascend {name} ")


def test_python_m_jaxascend_names_itself_so():
    done = subprocess.run([sys.executable, "-m", "jaxascend", "plot", "--help"], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m jaxascend plot [-h] [--out DIR] RUN [RUN ...]")


def test_version(capsys):
    code, out, err = run(capsys, "--version")
    assert code == 0 and out == f"jaxascend {jaxascend.__version__}\n"
    assert f'\nversion = "{jaxascend.__version__}"\n' in PYPROJECT


def test_no_command_prints_the_help_and_exits_2(capsys):
    code, out, err = run(capsys)
    assert code == 2 and out == ""
    assert err.startswith("usage: jaxascend ") and "commands:\n  train " in err


@pytest.mark.parametrize("argv, message", [
    (["tarin", "--config", "x.yaml"], "error: tarin: unknown command; did you mean 'train'? "
                                      "(commands: train, plan, export, generate, plot, launch, config)\n"),
    (["frobnicate"], "error: frobnicate: unknown command (commands: train, plan, export, generate, plot, launch, "
                     "config)\n"),
    (["--verbose", "train"], "error: unrecognized arguments: --verbose\n"),
])
def test_an_unknown_command_or_option_is_one_line_and_status_2(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert (code, out, err) == (2, "", message)


@pytest.mark.parametrize("name", list(cli.COMMANDS))
def test_every_commands_usage_error_is_one_line_and_status_2(capsys, name):
    code, out, err = run(capsys, name, "--no-such-option", "x")
    assert code == 2 and out == "" and len(err.splitlines()) == 1 and err.startswith("error: "), err


def test_a_command_runs_as_its_module_does(capsys):
    code, out, err = run(capsys, "config", "optimizer")
    assert code == 0 and err == ""
    assert config_cli.main(["optimizer"]) == 0
    assert capsys.readouterr().out == out and out.startswith("[optimizer] ")


@pytest.mark.parametrize("argv, status", [
    (["config", "no_such_section"], 2),  # the command's own bad input
    (["launch", "--nproc", "1", "--", sys.executable, "-c", "import sys; sys.exit(3)"], 3),  # a child's status
])
def test_exit_statuses_pass_through(capsys, argv, status):
    code, out, err = run(capsys, *argv)
    assert code == status, err
