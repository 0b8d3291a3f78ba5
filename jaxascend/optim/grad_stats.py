"""Gradient statistics in one fused pass: sum of squares of the finite elements and the
number of non-finite (inf/NaN) elements, for fp16, bf16 and fp32 arrays.

The overflow check and global-norm clipping both derive from these two numbers::

    sumsq, nonfinite = grad_stats(g)
    overflow = nonfinite > 0
    norm = jnp.sqrt(sumsq)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxascend.native import ffi_call

SUPPORTED_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)


def grad_stats(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Returns ``(sumsq: f32[], nonfinite: i32[])`` for ``x`` of any shape.

    ``sumsq`` sums ``x**2`` over the finite elements, accumulated in float64 and
    rounded to float32; ``nonfinite`` counts inf and NaN elements (saturating at 2**31-1).
    """
    x = jnp.asarray(x)
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"grad_stats: dtype {x.dtype} is not supported (float16, bfloat16, float32)")
    out_types = (
        jax.ShapeDtypeStruct((), jnp.float32),
        jax.ShapeDtypeStruct((), jnp.int32),
    )
    return ffi_call("jaxascend_grad_stats", out_types, vmap_method="sequential")(x)


def grad_stats_reference(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Pure-``jnp`` reference for :func:`grad_stats` (fp32 accumulation)."""
    x32 = jnp.asarray(x).astype(jnp.float32)
    finite = jnp.isfinite(x32)
    sumsq = jnp.sum(jnp.where(finite, x32 * x32, 0.0))
    nonfinite = jnp.sum(~finite).astype(jnp.int32)
    return sumsq, nonfinite


def tree_grad_stats(tree) -> tuple[jax.Array, jax.Array]:
    """Sums :func:`grad_stats` over every leaf of a pytree."""
    leaves = jax.tree_util.tree_leaves(tree)
    sumsq = jnp.zeros((), jnp.float32)
    nonfinite = jnp.zeros((), jnp.int32)
    for leaf in leaves:
        s, n = grad_stats(leaf)
        sumsq = sumsq + s
        nonfinite = nonfinite + n
    return sumsq, nonfinite
