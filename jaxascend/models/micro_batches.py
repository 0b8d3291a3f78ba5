"""Vertical micro-batches: inside one layer, the step's ``A`` micro-batches run one after another.

A step of ``A`` micro-batches of ``B`` rows is one forward/backward over ``A * B`` rows in which
every layer of the scan (:func:`~jaxascend.models.layers.scan_layers`) runs its micro-batches
in turn before the next layer starts (GreedySnake's vertical schedule)::

    hidden [A*B, T, D] --layer 0: mb 0, mb 1, ..., mb A-1--> [A*B, T, D] --layer 1: ...

So each layer's weights are fetched once per step (an SSD read does not grow with ``A``), and
each layer's weight gradient leaves once per step: the layer's micro-batches widen its 16-bit
weights to float32 once, take them back to the compute dtype for each micro-batch, and the
transpose of that widening is where the ``A`` gradients are summed, in float32, one layer at a
time (no whole-model accumulator), before the one cast to the compute dtype the sink receives.

The loss and the statistics are those of one batch of ``A * B`` rows (the per-token weights of
the whole step, :mod:`jaxascend.models.losses`). Under remat each micro-batch is its own
checkpoint: the scan keeps the layer-boundary activations of all micro-batches, and a layer's
backward recomputes (and holds the internals of) one micro-batch at a time.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

# apply(layer_params, hidden [B, T, D], rows) -> [B, T, D]; rows: the per-row arrays of one micro-batch
LayerApply = Callable[[Any, jax.Array, Any], jax.Array]


def split_rows(x: Optional[jax.Array], micro_batches: int) -> Optional[jax.Array]:
    """``[A*B, ...]`` as ``[A, B, ...]``: micro-batch ``a`` is rows ``a*B .. a*B+B-1``."""
    if x is None:
        return None
    if x.shape[0] % micro_batches:
        raise ValueError(f"micro-batches: {x.shape[0]} rows do not split into {micro_batches} micro-batches")
    return x.reshape((micro_batches, x.shape[0] // micro_batches) + x.shape[1:])


def join_rows(x: jax.Array) -> jax.Array:
    """``[A, B, ...]`` as ``[A*B, ...]`` (the inverse of :func:`split_rows`)."""
    return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def step_rows(x: Optional[jax.Array]) -> Optional[jax.Array]:
    """A step's per-row array ``[A, B, ...]`` as the ``[A*B, ...]`` rows of one batch."""
    return None if x is None else join_rows(x)


def _widened(x: jax.Array) -> jax.Array:
    if jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize < 4:
        return x.astype(jnp.float32)
    return x


def micro_batched_layer(apply: LayerApply, layer_params, hidden: jax.Array, rows, micro_batches: int,
                        use_checkpoint: bool, policy=None) -> jax.Array:
    """``apply`` over ``hidden [A*B, T, D]`` one micro-batch of ``B`` rows at a time.

    ``rows``: a pytree of per-row arrays ``[A*B, ...]`` (positions, segment ids; None leaves
    allowed), split with ``hidden``. ``use_checkpoint``/``policy``: the layer's remat
    (:func:`~jaxascend.models.layers.remat_policy`), applied to each micro-batch. The gradient of
    ``layer_params`` is the sum over the micro-batches, accumulated in float32 and returned in
    the parameters' dtype."""
    wide = jax.tree.map(_widened, layer_params)
    dtypes = [x.dtype for x in jax.tree.leaves(layer_params)]
    treedef = jax.tree.structure(layer_params)

    def one(carry, xs):
        h, micro_rows = xs
        params = treedef.unflatten([w.astype(d) for w, d in zip(jax.tree.leaves(wide), dtypes)])
        return carry, apply(params, h, micro_rows)

    if use_checkpoint:
        # prevent_cse=False: inside scan CSE cannot merge the recomputation with the forward.
        one = jax.checkpoint(one, policy=policy, prevent_cse=False)
    split = jax.tree.map(lambda x: split_rows(x, micro_batches), rows)
    _, out = jax.lax.scan(one, None, (split_rows(hidden, micro_batches), split))
    return join_rows(out)
