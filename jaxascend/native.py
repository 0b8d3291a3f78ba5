"""The native extension: loads ``jaxascend._native`` and registers its FFI targets with JAX.

Importing :mod:`jaxascend` imports this module once; every target in the extension's
``registrations()`` dict becomes callable with :func:`jax.ffi.ffi_call` on the CPU platform.
The extension is compiled by the package build (``pip install -e .``), never at first use.
"""

from __future__ import annotations

import jax

try:
    from jaxascend import _native
except ImportError as err:  # pragma: no cover - only hit on a broken install
    raise ImportError(
        "jaxascend's native extension (jaxascend._native) is not built; "
        "install the package with `pip install -e .` from the project root"
    ) from err

_REGISTERED: set[str] = set()


def register_targets() -> frozenset[str]:
    """Registers every FFI target of the extension for the CPU platform (idempotent)."""
    for name, capsule in _native.registrations().items():
        if name not in _REGISTERED:
            jax.ffi.register_ffi_target(name, capsule, platform="cpu")
            _REGISTERED.add(name)
    return frozenset(_REGISTERED)


register_targets()
