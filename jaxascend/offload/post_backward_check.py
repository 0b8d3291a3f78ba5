"""The ``offload.post_backward_overflow_check`` ablation: gradients first, then a scan over them.

This is how ZeRO-Infinity (and PyTorch's ``GradScaler``) find an overflow: the backward pass
leaves the whole gradient tree in memory (2 B/param in the compute dtype), then a separate pass
over every leaf materializes temporaries (a bool ``isfinite`` mask, an fp32 copy, its squares)
to count non-finite values and the squared norm, and only then are the gradients handed to the
optimizer (here: copied into the SSD store by ``OffloadedAdamState.write_grads``). jaxascend
does the same check on the fly inside the gradient sink, with no tree and no temporaries;
this module brings the old way back so the difference can be measured.

    step = make_full_gradient_step(graphdef, rest, loss_fn)
    loss, grads = step(params, tokens, loss_scale)        # the full tree, compute dtype
    sumsq, nonfinite = post_backward_stats(grads)         # eager ops, one leaf at a time
    state.write_grads(grads); del grads

The gradients are those the sink would have received, bit for bit (the same differentiation;
a step of ``A`` micro-batches runs them vertically, :mod:`jaxascend.models.micro_batches`).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx


def make_full_gradient_step(graphdef: nnx.GraphDef, rest: nnx.State, loss_fn: Callable) -> Any:
    """A jitted ``step(params, tokens, loss_scale) -> (loss, grads)``: ``grads`` is the gradient
    of ``loss * loss_scale`` in the parameters' (compute) dtype; ``loss`` is unscaled.

    ``tokens``: the step's batch ``[A, B, ...]`` (each layer runs the ``A`` micro-batches in
    turn, their gradient summed in float32: :mod:`jaxascend.models.micro_batches`).
    ``loss_fn(model, tokens, layer_hook)`` is called with ``layer_hook=None``.
    """

    def scaled_loss(params, tokens, loss_scale):
        loss = loss_fn(nnx.merge(graphdef, params, rest), tokens, None)
        return loss * loss_scale.astype(loss.dtype), loss

    grad_fn = jax.value_and_grad(scaled_loss, has_aux=True)

    @jax.jit
    def step(params, tokens, loss_scale):
        (_, loss), grads = grad_fn(params, tokens, loss_scale)
        return loss, grads

    return step


def post_backward_stats(grads) -> tuple[float, int]:
    """``(sum of squares of the finite elements, non-finite count)`` over every leaf of
    ``grads``, computed op by op (no ``jit``), so each temporary is materialized as in eager
    frameworks: per leaf a bool mask (1 B/element) and two fp32 arrays (4 B/element each).
    This is a host sync: the values come back as Python numbers."""
    sumsq = 0.0
    nonfinite = 0
    for g in jax.tree.leaves(grads):
        finite = jnp.isfinite(g)
        nonfinite += int(g.size - int(jnp.count_nonzero(finite)))
        wide = jnp.where(finite, g.astype(jnp.float32), 0.0)
        squares = jnp.square(wide)
        sumsq += float(jnp.sum(squares))
        del finite, wide, squares
    return sumsq, nonfinite


class PostBackwardCheckedStep:
    """The offloaded engine's backward step under the ablation, with the sinked step's
    signature: ``step(params, tokens, loss_scale) -> (loss, stats)``.

    Runs ``full_step`` (:func:`make_full_gradient_step`), scans the gradient tree with
    :func:`post_backward_stats`, copies it into ``state`` (``OffloadedAdamState.write_grads``:
    SSD, or the fp32 host buffer) and drops it; ``stats`` is ``{"all": f32[2]}``
    ``[sum of squares, non-finite count]``, as :func:`jaxascend.offload.step.total_stats` reads.
    """

    def __init__(self, full_step: Callable, state):
        self._full_step = full_step
        self._state = state

    def __call__(self, params, tokens, loss_scale):
        loss, grads = self._full_step(params, tokens, loss_scale)
        sumsq, nonfinite = post_backward_stats(grads)  # SYNC: waits for the backward pass
        self._state.write_grads(grads)
        del grads  # the tree is gone before the optimizer emits new parameters
        return loss, {"all": jnp.asarray([sumsq, nonfinite], jnp.float32)}
