"""Every collective of a data-parallel step in one order, by data dependencies XLA must keep.

Why: on the CPU backend a job's collectives run over gloo, and XLA's gloo communicator gives
every collective the same tag. Two collectives in flight at once on one process pair mix their
messages: a reduce-scatter then takes a run of another's bytes (seen: a ~128 KiB run at the end
of one process's slice of a table block, off by up to 2e-4, in about half the runs of a tied
table under CPU load). XLA orders collectives of one computation only by a *scheduling* edge
(the next may start once the previous has started), and not at all between a loop's collectives
and those outside it; ``optimization_barrier`` is an HLO scheduling hint with no buffer of its
own, so the CPU runtime does not see it either. What it always respects is a buffer read: an op
that reads a buffer waits for the op that wrote it.

So each collective's input is made to read a *token* written by the previous one
(:func:`after`): the token is a float32 zero computed from the previous collective's output
(:func:`token_of`), which XLA cannot fold away (it does not know the value is finite), and
:func:`after` subtracts it from one element of the input (``x - 0`` is ``x`` for every float,
-0 and NaN included), in place when the input is not needed elsewhere.

In a step the order is: the head's blocks (a loop the layers' backward waits for, since it
needs the head's input gradient), the layers (one loop, each layer's leaves in a chain,
:func:`offload_leaves_on_backward`), the lookup's blocks, then every top-level leaf in a chain
that waits for a token the table's blocks pass back (see ``step._OrderedSinkHooks``), and last
the loss's sum over the processes.
"""

from __future__ import annotations

from functools import partial
from typing import Optional, Sequence

import jax
import jax.numpy as jnp

from jaxascend.offload.grad_sink import GradientScatter


def token_of(*values) -> jax.Array:
    """A float32 zero that can only be computed once every one of ``values`` is (each's first
    element, made finite, minus itself); what :func:`after` makes a later collective wait for."""
    token = jnp.zeros((), jnp.float32)
    for value in values:
        for leaf in jax.tree.leaves(value):
            if leaf is None or leaf.size == 0:
                continue
            first = leaf.reshape(-1)[0].astype(jnp.float32)
            first = jnp.where(jnp.isfinite(first), first, 0.0)
            token = token + (first - first)
    return token


def after(x: jax.Array, token: Optional[jax.Array]) -> jax.Array:
    """``x``, bit for bit, as an array XLA computes only once ``token`` (a :func:`token_of`
    zero) exists: its first element less the token."""
    if token is None or x.size == 0:
        return x
    flat = x.reshape(-1)
    first = flat[0] - token.astype(x.dtype)
    return flat.at[0].set(first).reshape(x.shape)


def after_each(values: Sequence[jax.Array], token: Optional[jax.Array], collective) -> list:
    """``collective(v)`` of each of ``values`` in turn, each one's input waiting for the
    previous one's output (the first's for ``token``)."""
    out = []
    for value in values:
        result = collective(after(value, token))
        token = token_of(result)
        out.append(result)
    return out


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _leaves_identity(xs, probes, layer, order, sink, tensors, scatter):
    del probes, layer
    return xs, order


def _leaves_fwd(xs, probes, layer, order, sink, tensors, scatter):
    # A scalar of each leaf: the backward's first collective waits for every leaf, e.g. for the
    # all-gathers that made a streamed layer whole (recomputed with it under remat).
    anchors = tuple(x.reshape(-1)[:1] for x in xs)
    return (xs, order), (layer, anchors)


def _leaves_bwd(sink, tensors, scatter, res, cotangents):
    layer, anchors = res
    gs, g_order = cotangents
    token = token_of(anchors, g_order)
    stats = []
    for g, tensor in zip(gs, tensors):
        s = scatter.send(after(g, token), layer, sink=sink, tensor=tensor)
        token = token_of(s)
        stats.append(s)
    return tuple(jnp.zeros_like(g) for g in gs), tuple(stats), None, token


_leaves_identity.defvjp(_leaves_fwd, _leaves_bwd)


def offload_leaves_on_backward(xs: Sequence[jax.Array], probes: Sequence[jax.Array], *, sink: int,
                               tensors: Sequence[int], layer=0, scatter: GradientScatter,
                               order: Optional[jax.Array] = None) -> tuple[list, jax.Array]:
    """:func:`~jaxascend.offload.grad_sink.offload_on_backward` of several leaves at once, for a
    data-parallel step: ``(xs, order)`` unchanged; in the backward, once every leaf's gradient
    exists *and* the cotangent of the returned ``order`` does (whatever used it sent its own
    gradients first), each leaf's gradient is reduce-scattered and sent in turn, each waiting for
    the previous one's statistics, and the cotangent of ``order`` (a zero) waits for the last."""
    order = jnp.zeros((), jnp.float32) if order is None else order
    out, order = _leaves_identity(tuple(xs), tuple(probes), jnp.asarray(layer, jnp.int32), order, int(sink),
                                  tuple(int(t) for t in tensors), scatter)
    return list(out), order
