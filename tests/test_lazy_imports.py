"""The package's face is lazy: ``import jaxascend.config`` and the CLIs' ``--help`` load no JAX
(checked in fresh processes, by what they imported, not by the clock), and the names
``jaxascend`` re-exports still resolve, on their first access."""

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


@pytest.mark.parametrize("cli", ["jaxascend.train", "jaxascend.plan", "jaxascend.config"])
def test_help_imports_no_jax(cli):
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", cli, "--help"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: python -m {cli}")
    # -X importtime writes one "import time: self | cumulative | [indent]module" line per import.
    imported = [line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")]
    assert "jaxascend" in imported  # the check sees the package's own imports
    assert [m for m in imported if any(m == h or m.startswith(h + ".") for h in HEAVY)] == []


def test_the_re_exports_resolve_on_first_access():
    from jaxascend.config import load_config
    from jaxascend.ssd import SsdStore

    assert jaxascend.load_config is load_config and jaxascend.SsdStore is SsdStore
    for name in jaxascend.__all__:
        assert getattr(jaxascend, name) is not None, name
    assert set(jaxascend.__all__) <= set(dir(jaxascend))
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        jaxascend.no_such_name  # noqa: B018
