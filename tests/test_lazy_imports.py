"""The package's face is lazy: ``import jaxascend.config`` and every CLI's ``--help`` and bad usage
(``python -m jaxascend.<cli>``, ``python -m jaxascend <command>``) load no JAX (checked in fresh
processes, by what they imported, not by the clock), and the names ``jaxascend`` re-exports still
resolve, on their first access."""

import json
import subprocess
import sys

import pytest

import jaxascend

HEAVY = ("jax", "jaxlib", "flax", "optax", "jaxascend._native")


def _loaded_heavy(code: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    modules = json.loads(done.stdout.strip().splitlines()[-1])
    return [m for m in modules if any(m == h or m.startswith(h + ".") for h in HEAVY)]


@pytest.mark.parametrize("code", ["import jaxascend.config", "import jaxascend", "import jaxascend.native",
                                  "from jaxascend.config import load_config; load_config('configs/tiny.yaml')"])
def test_importing_the_config_loads_no_jax(code):
    assert _loaded_heavy(code) == []


CLIS = ["jaxascend.train", "jaxascend.plan", "jaxascend.export", "jaxascend.generate", "jaxascend.plot",
        "jaxascend.launch", "jaxascend.config"]


def _run_imports(args: list[str]) -> tuple[subprocess.CompletedProcess, list[str]]:
    """``python -X importtime args``: the finished process and the heavy modules it imported."""
    done = subprocess.run([sys.executable, "-X", "importtime", *args], capture_output=True, text=True, timeout=120)
    # -X importtime writes one "import time: self | cumulative | [indent]module" line per import.
    imported = [line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")]
    assert "jaxascend" in imported  # the check sees the package's own imports
    return done, [m for m in imported if any(m == h or m.startswith(h + ".") for h in HEAVY)]


@pytest.mark.parametrize("cli", CLIS)
def test_help_imports_no_jax(cli):
    done, heavy = _run_imports(["-m", cli, "--help"])
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: python -m {cli}")
    assert heavy == []


@pytest.mark.parametrize("cli", CLIS)
def test_bad_usage_imports_no_jax(cli):
    done, heavy = _run_imports(["-m", cli, "--no-such-option"])
    assert done.returncode == 2 and done.stdout == ""
    assert "unrecognized arguments: --no-such-option" in done.stderr or \
        "the following arguments are required" in done.stderr, done.stderr
    assert heavy == []


@pytest.mark.parametrize("command", ["", "train", "plan", "export", "generate", "plot", "launch", "config"])
def test_the_jaxascend_commands_help_imports_no_jax(command):
    done, heavy = _run_imports(["-m", "jaxascend", *command.split(), "--help"])
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: python -m jaxascend {command}".rstrip() + " ")
    assert heavy == []


def test_the_re_exports_resolve_on_first_access():
    from jaxascend.config import load_config
    from jaxascend.ssd import SsdStore

    assert jaxascend.load_config is load_config and jaxascend.SsdStore is SsdStore
    for name in jaxascend.__all__:
        assert getattr(jaxascend, name) is not None, name
    assert set(jaxascend.__all__) <= set(dir(jaxascend))
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        jaxascend.no_such_name  # noqa: B018


def test_the_help_shows_the_constants_the_files_are_written_with():
    # The CLIs read them from jaxascend.formats (no JAX); jaxascend.hf writes with the same objects,
    # under the names it always exported.
    from jaxascend import formats
    from jaxascend.hf import DEFAULT_SHARD_BYTES, DTYPE_NAMES, PARAMS_FILE

    assert DEFAULT_SHARD_BYTES is formats.DEFAULT_SHARD_BYTES and DTYPE_NAMES is formats.DTYPE_NAMES
    assert PARAMS_FILE is formats.PARAMS_FILE
