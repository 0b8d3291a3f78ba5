"""The 16-bit float weights a step takes as raw ``uint16`` bits: the layer stack's and a large
token table's (see :func:`stacked_as_bits` for why). Which leaves (:func:`bit_leaves`) is the
routing's; how they reach the step is the placement's
(:mod:`~jaxascend.offload.placement`): on one device each call views the arrays as bits
(:class:`BitViewedStep`); over several devices the replicated inputs are held as bits from the
start, a bitcast of a global array being a copy each step.

    params, bit_dtypes = stacked_as_bits(params, routing)   # uint16 views sharing the buffers
    step = BitViewedStep(jax.jit(fn, static_argnames="bit_dtypes"), routing)   # does the same per call

``routing`` is a :class:`~jaxascend.offload.step.LeafRoutes`: its ``routes`` (each a leaf's
``key``, ``tensor`` and ``layers``), ``table_key`` and ``table_as_bits``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def bit_leaves(routing, dtypes) -> dict[int, Any]:
    """Leaf index -> float dtype of the leaves the step takes as raw bits (see
    :func:`stacked_as_bits`): the layer stack's 16-bit float leaves and a large token table whose
    uses send their blocks; ``dtypes``: each leaf's compute dtype, in leaf order."""
    out = {}
    for route, dtype in zip(routing.routes, dtypes):
        dtype = jnp.dtype(dtype)
        as_bits = route.layers or (route.key == routing.table_key and routing.table_as_bits)
        if as_bits and dtype.itemsize == 2 and jnp.issubdtype(dtype, jnp.floating):
            out[route.tensor] = dtype
    return out


def bit_dtypes_of(routing, bits: dict[int, Any]) -> tuple[tuple[str, str], ...]:
    """:func:`bit_leaves` as the step's static ``bit_dtypes``: ``((leaf key, dtype name), ...)``."""
    return tuple((r.key, jnp.dtype(bits[r.tensor]).name) for r in routing.routes if r.tensor in bits)


def stacked_as_bits(params, routing) -> tuple[Any, tuple[tuple[str, str], ...]]:
    """The layer stack's 16-bit float leaves (and a large token table, see models.vocab) as
    uint16 arrays sharing their buffers, and ``((key, dtype name), ...)`` to turn each layer's
    (block's) slice back inside the scan.

    Why: XLA's CPU backend computes in fp32 whatever it cannot do in bf16/fp16, and its
    float-normalization pass treats the layer scan's ``dynamic-slice`` of a stacked bf16 weight
    that way: it converts the *whole stack* to fp32 once per step (4 B/param of temporaries;
    1.75 GB for a 0.5B model) just to slice one layer out of it. Sliced as integers, the stack
    stays as it is and only the current layer is ever widened. The bitcast is done here, outside
    XLA, where it is free for a CPU array (``np.asarray`` shares the buffer and ``device_put``
    with ``may_alias`` keeps sharing it); inside XLA it would be a copy of the stack. The
    parameters are not differentiated by the step (the probes are), so the integer detour
    costs no gradient.
    """
    leaves, treedef = jax.tree.flatten(params, is_leaf=lambda x: x is None)
    if len(leaves) != len(routing.routes):
        raise ValueError(f"offload step: params have {len(leaves)} leaves, the routing has {len(routing.routes)}")
    out, bit_dtypes = [], []
    for x, route in zip(leaves, routing.routes):
        if x is None:  # a streamed leaf (offload.params: ssd): not an input
            out.append(x)
            continue
        dtype = jnp.dtype(x.dtype)
        as_bits = route.layers or (route.key == routing.table_key and routing.table_as_bits)
        if as_bits and dtype.itemsize == 2 and jnp.issubdtype(dtype, jnp.floating):
            out.append(_uint16_view(x))
            bit_dtypes.append((route.key, dtype.name))
        else:
            out.append(x)
    return treedef.unflatten(out), tuple(bit_dtypes)


def _uint16_view(x):
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, jnp.uint16)
    if isinstance(x, np.ndarray):
        return x.view(np.uint16)
    devices = x.devices() if isinstance(x, jax.Array) else ()
    if len(devices) == 1 and next(iter(devices)).platform == "cpu":
        device = next(iter(devices))
        return jax.device_put(np.asarray(x).view(np.uint16), device, may_alias=True)
    return jax.lax.bitcast_convert_type(x, jnp.uint16)  # elsewhere: a copy, still correct


class BitViewedStep:
    """A jitted ``fn(params, *args, bit_dtypes=...)`` called (or lowered) with the layer stack's
    16-bit leaves as raw bits (:func:`stacked_as_bits`), viewed anew at each call."""

    def __init__(self, jitted, routing):
        self._jitted = jitted
        self._routing = routing

    def __call__(self, params, *args):
        params, bit_dtypes = stacked_as_bits(params, self._routing)
        return self._jitted(params, *args, bit_dtypes=bit_dtypes)

    def lower(self, params, *args):
        params, bit_dtypes = stacked_as_bits(params, self._routing)
        return self._jitted.lower(params, *args, bit_dtypes=bit_dtypes)
