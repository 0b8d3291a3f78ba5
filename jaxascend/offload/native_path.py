"""How jitted code reaches the native side, chosen once: the FFI targets (the CPU backend), or
host callbacks (every other backend, a GPU; forced on the CPU by ``JAXASCEND_HOST_CALLBACKS=1``,
see :func:`jaxascend.native.host_callbacks`).

A :class:`NativePath` carries the three things that differ between the two ways: how a gradient
reaches its sink, how a served layer is fetched, and how a jitted step is called (the 16-bit
stack viewed as raw bits around an FFI step; as it is around host callbacks). A step's placement
(:mod:`~jaxascend.offload.placement`) holds the one its plan chose; nothing else tests which.

    path = native_path(plan.host_callbacks)     # None: the environment's, at this call
    stats = path.send(g, layer, sink=handle, tensor=0)
    leaves = path.fetch(source.handle, layer, specs)
    step = path.called(jax.jit(fn, static_argnames="bit_dtypes"), routing)
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from jaxascend.native import extension as _native
from jaxascend.native import ffi_call, host_callbacks
from jaxascend.offload.raw_bits import BitViewedStep

PROBE_SIZE = 2  # a gradient's statistics: [sum of squares of finite elements, count of non-finite elements]


def sink_gradient(g: jax.Array, layer: jax.Array, *, sink: int, tensor: int,
                  via_host: Optional[bool] = None) -> jax.Array:
    """Sends ``g`` to sink ``sink`` as layer ``layer`` of tensor ``tensor``; returns f32[2] stats,
    the way :func:`native_path` of ``via_host`` chooses (None: the
    environment's): :func:`sink_gradient_ffi` or :func:`sink_gradient_via_host`."""
    return native_path(via_host).send(g, layer, sink=sink, tensor=tensor)


def sink_gradient_ffi(g: jax.Array, layer: jax.Array, *, sink: int, tensor: int) -> jax.Array:
    """:func:`sink_gradient` through the FFI target, which reads the gradient where XLA computed
    it (the CPU backend)."""
    out_types = (jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32))
    sumsq, nonfinite = ffi_call("jaxascend_grad_sink", out_types, has_side_effect=True)(
        g, jnp.asarray(layer, jnp.int32), sink=np.int64(sink), tensor=np.int64(tensor))
    return jnp.stack([sumsq, nonfinite.astype(jnp.float32)])


def sink_gradient_via_host(g: jax.Array, layer: jax.Array, *, sink: int, tensor: int) -> jax.Array:
    """:func:`sink_gradient` through an ``io_callback``: it copies the gradient to host memory and
    its host side calls the same sink, the way of other backends (GPU)."""
    dtype_name = jnp.dtype(g.dtype).name

    def host(g_host, layer_host):
        sumsq, nonfinite = _native.consume_gradient(sink, tensor, int(layer_host),
                                                    np.ascontiguousarray(g_host).reshape(-1).view(np.uint8), dtype_name)
        return np.array([sumsq, float(nonfinite)], np.float32)

    return io_callback(host, jax.ShapeDtypeStruct((PROBE_SIZE,), jnp.float32), g, layer, ordered=False)


def fetch_layer(handle: int, layer: jax.Array, specs: Sequence[jax.ShapeDtypeStruct],
                via_host: Optional[bool] = None) -> list[jax.Array]:
    """Layer ``layer`` (an int32 scalar, may be traced) of every streamed leaf, from source
    ``handle``; ``specs`` are the leaves' layer shapes and dtypes (:attr:`ParamSource.specs`).
    The way :func:`native_path` of ``via_host`` chooses (None: the
    environment's): :func:`fetch_layer_ffi` or :func:`fetch_layer_via_host`."""
    return native_path(via_host).fetch(handle, layer, specs)


def fetch_layer_ffi(handle: int, layer: jax.Array, specs: Sequence[jax.ShapeDtypeStruct]) -> list[jax.Array]:
    """:func:`fetch_layer` through the FFI target (the CPU backend)."""
    return list(ffi_call("jaxascend_param_source", tuple(specs), has_side_effect=False)(
        jnp.asarray(layer, jnp.int32), source=np.int64(handle)))


def fetch_layer_via_host(handle: int, layer: jax.Array, specs: Sequence[jax.ShapeDtypeStruct]) -> list[jax.Array]:
    """:func:`fetch_layer` through a ``pure_callback`` (other backends, a GPU)."""
    return list(jax.pure_callback(_host_fetcher(handle, specs), tuple(specs), jnp.asarray(layer, jnp.int32)))


def _host_fetcher(handle: int, specs: Sequence[jax.ShapeDtypeStruct]):
    names = [jnp.dtype(s.dtype).name for s in specs]

    def host(layer):
        outs = [np.empty(s.shape, s.dtype) for s in specs]
        _native.fetch_params_to_host(handle, int(layer), [o.reshape(-1).view(np.uint8) for o in outs], names)
        return tuple(outs)

    return host


class NativePath(NamedTuple):
    """One way to the native side (see the module doc)."""

    via_host: bool  # through host callbacks
    send: Callable  # (g, layer, *, sink, tensor) -> f32[2]: a gradient to its sink, its statistics
    fetch: Callable  # (handle, layer, specs) -> list: layer ``layer`` of every served leaf
    called: Callable  # (jitted, routing) -> the step as it is called


def _as_jitted(jitted, routing):
    return jitted


FFI = NativePath(False, sink_gradient_ffi, fetch_layer_ffi, BitViewedStep)
VIA_HOST = NativePath(True, sink_gradient_via_host, fetch_layer_via_host, _as_jitted)
_PATHS = {False: FFI, True: VIA_HOST}


def native_path(via_host: Optional[bool] = None) -> NativePath:
    """The way ``via_host`` names (a step's plan's ``host_callbacks``); None: the environment's,
    :func:`jaxascend.native.host_callbacks` at this call (a step built without a plan)."""
    chosen = host_callbacks() if via_host is None else via_host
    return _PATHS[bool(chosen)]
