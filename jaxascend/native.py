"""The native extension, reached one way, and the one place that decides how jitted code calls it.

``extension`` is ``jaxascend._native`` with every target of its ``registrations()`` dict
registered for the CPU platform, so that :func:`jax.ffi.ffi_call` can call them. It is loaded
on first access, not at ``import jaxascend`` (which then needs no JAX)::

    from jaxascend.native import extension as _native   # loads it and registers the targets
    _native.crc32c(data)

:func:`ffi_call` is :func:`jax.ffi.ffi_call` once the targets are registered: every FFI call
goes through it, so no call can precede the registration.

:func:`host_callbacks` says which way jitted code reaches the native side: the FFI targets on
the CPU backend; host callbacks (``io_callback``, ``pure_callback``) everywhere else, where the
targets, registered for the CPU platform, cannot run. ``JAXASCEND_HOST_CALLBACKS=1`` forces the
host callbacks on the CPU, so that a CPU-only machine runs the path a GPU runs. The extension is
compiled by the package build (``pip install -e .``), never at first use.
"""

from __future__ import annotations

import os
import threading
from types import ModuleType

HOST_CALLBACKS_ENV = "JAXASCEND_HOST_CALLBACKS"

_lock = threading.Lock()


def __getattr__(name: str):
    # PEP 562: ``extension`` is loaded (and the targets registered) on its first access only;
    # from then on it is a plain module attribute and this is not called for it again.
    if name == "extension":
        return _load()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _load() -> ModuleType:
    with _lock:
        module = globals().get("extension")
        if module is None:
            try:
                from jaxascend import _native as module
            except ImportError as err:  # pragma: no cover - only hit on a broken install
                raise ImportError(
                    "jaxascend's native extension (jaxascend._native) is not built; "
                    "install the package with `pip install -e .` from the project root"
                ) from err
            import jax

            for name, capsule in module.registrations().items():
                jax.ffi.register_ffi_target(name, capsule, platform="cpu")
            globals()["extension"] = module
        return module


def ffi_call(target: str, result_shape_dtypes, **kwargs):
    """:func:`jax.ffi.ffi_call` of one of the extension's targets, registered first if need be."""
    import jax

    _load()
    return jax.ffi.ffi_call(target, result_shape_dtypes, **kwargs)


def host_callbacks() -> bool:
    """True when jitted code must reach the native side through host callbacks instead of the
    FFI targets: on every backend but the CPU, or when ``JAXASCEND_HOST_CALLBACKS=1``.

    Read when a step is traced: set the variable before the first step of a run."""
    import jax

    forced = os.environ.get(HOST_CALLBACKS_ENV, "0")
    if forced not in ("0", "1"):
        raise ValueError(f"{HOST_CALLBACKS_ENV}={forced!r}: expected 0 or 1")
    return forced == "1" or jax.default_backend() != "cpu"
