"""The native extension, reached one way, and the one place that decides how jitted code calls it.

``extension`` is ``jaxascend._native`` with every target of its ``registrations()`` dict
registered for the CPU platform, so that :func:`jax.ffi.ffi_call` can call them. It is loaded
on first access, not at ``import jaxascend`` (which then needs no JAX)::

    from jaxascend.native import extension as _native   # loads it and registers the targets
    _native.crc32c(data)

:func:`ffi_call` is :func:`jax.ffi.ffi_call` once the targets are registered: every FFI call
goes through it, so no call can precede the registration.

The extension is compiled by the package build (``pip install -e .``), never at first use.
"""

from __future__ import annotations

import threading
from types import ModuleType

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

