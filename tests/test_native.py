"""The native extension is reached one way (``jaxascend.native``), its FFI targets are registered
on its first use, and one function decides whether jitted code calls them or goes through host
callbacks (the path of a GPU, forced on the CPU by ``JAXASCEND_HOST_CALLBACKS=1``)."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxascend import native
from jaxascend.offload import fetch_layer, sink_gradient

ON_CPU = jax.default_backend() == "cpu"


def _fresh(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_extension_is_loaded_and_registered_on_first_use():
    out = _fresh(
        "import sys\n"
        "import jaxascend.native as native\n"
        "print('jaxascend._native' in sys.modules, 'jax' in sys.modules)\n"
        "from jaxascend.optim import grad_stats\n"  # no explicit registration: the FFI call asks for it
        "import jax.numpy as jnp\n"
        "print(float(grad_stats(jnp.array([3.0, 4.0]))[0]), native.extension is sys.modules['jaxascend._native'])\n")
    assert out.splitlines() == ["False False", "25.0 True"]


@pytest.mark.skipif(not ON_CPU, reason="off the CPU the host callbacks are the only path")
def test_the_ffi_path_is_the_default_on_the_cpu(monkeypatch):
    monkeypatch.delenv(native.HOST_CALLBACKS_ENV, raising=False)
    assert native.host_callbacks() is False
    monkeypatch.setenv(native.HOST_CALLBACKS_ENV, "0")
    assert native.host_callbacks() is False


def test_the_environment_forces_host_callbacks(monkeypatch):
    monkeypatch.setenv(native.HOST_CALLBACKS_ENV, "1")
    assert native.host_callbacks() is True


def test_a_bad_value_of_the_variable_is_an_error_naming_it(monkeypatch):
    monkeypatch.setenv(native.HOST_CALLBACKS_ENV, "yes")
    with pytest.raises(ValueError, match=r"^JAXASCEND_HOST_CALLBACKS='yes': expected 0 or 1$"):
        native.host_callbacks()


def _lowered_text(fn, *args) -> str:
    return jax.jit(fn).lower(*args).as_text()


@pytest.mark.skipif(not ON_CPU, reason="the FFI targets are registered for the CPU platform only")
@pytest.mark.parametrize("forced", [False, True], ids=["default", "forced"])
def test_the_decision_routes_the_sink_and_the_source(monkeypatch, forced):
    # Read when the step is traced: the same call lowers to the FFI target or to a host callback.
    monkeypatch.setenv(native.HOST_CALLBACKS_ENV, "1" if forced else "0")
    g = jnp.ones((4,), jnp.bfloat16)
    sink = _lowered_text(lambda g: sink_gradient(g, 0, sink=1, tensor=0), g)
    specs = (jax.ShapeDtypeStruct((2, 3), jnp.bfloat16),)
    source = _lowered_text(lambda i: fetch_layer(1, i, specs)[0], np.int32(0))
    assert ("jaxascend_grad_sink" in sink, "jaxascend_param_source" in source) == (not forced, not forced)
    assert ("callback" in sink, "callback" in source) == (forced, forced)
