"""Large vocabulary tables: the token lookup and the output head in blocks of rows.

A 151936 x 2048 table (Qwen2.5-3B) is 0.62 GB in bf16. Differentiated the plain way, XLA's CPU
backend holds three float32 copies of it at the step's peak (1.24 GB each): the table widened for
the head's matmul (kept from the forward to the backward), the head's weight gradient before
rounding, and the lookup's scatter-add, plus the bf16 gradients. For a table of at least
:data:`LARGE_TABLE_ELEMENTS` elements whose row count splits into equal blocks of at most
:data:`MAX_BLOCK_ROWS` rows (:func:`table_blocks`), the models compute both uses block by block:

* :func:`head_logits` -- the float32 logits ``x @ table.T`` one block of vocabulary per
  iteration of a ``lax.scan`` (recomputed in the backward): :func:`block_logits` widens the block
  on its own; the input's gradient is summed over the blocks in float32, each block's weight
  gradient is rounded to the table's dtype on its own;
* :func:`lookup` -- ``jnp.take(table, ids, mode="fill")`` block by block, the same way; each
  block's gradient is built in the table's dtype (duplicate ids summed in float32 in position
  order, rounded once), never as a float32 table.

The scan slices the table along its rows. XLA's CPU backend widens a scanned 16-bit array to
float32 whole, so the offloaded step hands the table over as raw ``uint16`` bits (as it does the
layer stack) and its hook turns each block back into floats.

A caller may wrap each block of each use (``hook(block, use, index)``, see
:data:`jaxascend.models.layers.TableHook`): the offloaded step sends every block's gradient to
the SSD as soon as it exists, so the table's gradient is never whole in memory. Without a hook
the same arithmetic runs on slices of the table, so ``jax.grad`` of the model is the reference
the offloaded step is checked against. Smaller tables keep the plain ops.
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp

LARGE_TABLE_ELEMENTS = 1 << 24  # 16.8M elements: e.g. 32000 x 512 and up
MAX_BLOCK_ROWS = 16384

BlockHook = Callable[[jax.Array, str, int], jax.Array]


def is_large_table(table: jax.Array) -> bool:
    """Large enough for the block-by-block ops (one block when its rows do not split evenly)."""
    return int(table.size) >= LARGE_TABLE_ELEMENTS


def table_blocks(rows: int, width: int) -> int:
    """How many equal blocks of rows a ``rows x width`` table is computed in: 1 for a small
    table (or one whose row count has no divisor that makes blocks of at most
    :data:`MAX_BLOCK_ROWS` rows and at least 64), else the fewest such blocks."""
    if rows * width < LARGE_TABLE_ELEMENTS:
        return 1
    for blocks in range(-(-rows // MAX_BLOCK_ROWS), rows // 64 + 1):
        if rows % blocks == 0:
            return blocks
    return 1


def _bits_dtype(dtype):
    return {2: jnp.uint16, 4: jnp.uint32}[jnp.dtype(dtype).itemsize]


def _bits(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, _bits_dtype(x.dtype))


# ----------------------------------------------------------------------------- the head

@jax.custom_vjp
def block_logits(x32: jax.Array, block: jax.Array) -> jax.Array:
    """float32 ``x32 [B, T, D] @ block[Vb, D].T``: the products of the 16-bit block widened
    exactly, summed in float32 (what a 16-bit matmul with float32 accumulation computes)."""
    return jnp.einsum("BTD,VD->BTV", x32, block.astype(jnp.float32))


def _block_logits_fwd(x32, block):
    return block_logits(x32, block), (x32, block)


def _block_logits_bwd(res, g):
    x32, block = res
    dx = jnp.einsum("BTV,VD->BTD", g, block.astype(jnp.float32))
    dblock = jnp.einsum("BTV,BTD->VD", g, x32).astype(block.dtype)
    return dx, dblock


block_logits.defvjp(_block_logits_fwd, _block_logits_bwd)


def _scan_blocks(table: jax.Array, blocks: int, body, carry):
    """``lax.scan`` of ``body(carry, block, k)`` over the table's ``blocks`` blocks of rows, each
    iteration recomputed in the backward (``jax.checkpoint``): one block's temporaries at a time,
    and no per-block residuals beyond the table itself."""
    rows = table.shape[0] // blocks
    xs = (table.reshape((blocks, rows) + table.shape[1:]), jnp.arange(blocks, dtype=jnp.int32))
    step = jax.checkpoint(lambda c, x: body(c, x[0], x[1]), prevent_cse=False)
    return jax.lax.scan(step, carry, xs)


def _block_of(raw: jax.Array, use: str, k, hook: Optional[BlockHook]) -> jax.Array:
    if hook is not None:
        return hook(raw, use, k)
    if not jnp.issubdtype(raw.dtype, jnp.floating):
        raise ValueError("vocab: a table passed as raw bits needs a hook that turns each block back")
    return raw


def head_logits(x: jax.Array, table: jax.Array, blocks: int, hook: Optional[BlockHook] = None) -> jax.Array:
    """float32 ``[B, T, V]`` logits of ``x`` against the tied ``table [V, D]``, in ``blocks``
    blocks of rows, one scan iteration each; ``hook(block, "head", k)`` may wrap block ``k``
    (and must, when the table is passed as raw bits: it returns the float block)."""
    x32 = x.astype(jnp.float32)  # the input's gradient is summed over the blocks in float32

    def body(carry, raw, k):
        return carry, block_logits(x32, _block_of(raw, "head", k, hook))

    _, logits = _scan_blocks(table, blocks, body, None)  # [K, B, T, Vb]
    return jnp.moveaxis(logits, 0, -2).reshape(x.shape[:-1] + (-1,))


# ----------------------------------------------------------------------------- the lookup

@jax.custom_vjp
def _take_rows(block: jax.Array, local: jax.Array) -> jax.Array:
    """``block[local]`` for ids inside the block; ``local == len(block)`` marks "not here"."""
    return jnp.take(block, local, axis=0, mode="fill")


def _take_rows_fwd(block, local):
    return _take_rows(block, local), (local, jax.ShapeDtypeStruct(block.shape, block.dtype))


def _take_rows_bwd(res, g):
    local, spec = res
    rows, width = spec.shape
    flat = local.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # duplicates stay in position order
    sorted_ids = flat[order]
    starts = jnp.concatenate([jnp.ones((1,), bool), sorted_ids[1:] != sorted_ids[:-1]])
    segment = jnp.cumsum(starts) - 1  # which distinct id each sorted position belongs to
    count = flat.shape[0]
    sums = jax.ops.segment_sum(g.reshape(-1, width).astype(jnp.float32)[order], segment, num_segments=count,
                               indices_are_sorted=True)
    uids = jnp.full((count,), rows, flat.dtype).at[segment].set(sorted_ids)  # unused segments: dropped
    # Written as raw bits: XLA's CPU backend would widen a 16-bit scatter's whole table to float32.
    grad = jnp.zeros(spec.shape, _bits_dtype(spec.dtype)).at[uids].set(
        _bits(sums.astype(spec.dtype)), mode="drop", unique_indices=True)
    return jax.lax.bitcast_convert_type(grad, spec.dtype), None


_take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


def lookup(table: jax.Array, ids: jax.Array, blocks: int, hook: Optional[BlockHook] = None,
           dtype=None) -> jax.Array:
    """Rows ``table[ids]`` (NaN rows for out-of-range ids, as ``jnp.take(mode="fill")``), block by
    block of ``blocks``; ``hook(block, "lookup", k)`` may wrap block ``k`` (and must turn raw bits
    back into floats; ``dtype`` is then the rows' float dtype)."""
    vocab = table.shape[0]
    rows = vocab // blocks
    dtype = dtype or table.dtype
    width = table.shape[1]

    def body(out, raw, k):
        block = _block_of(raw, "lookup", k, hook)
        local = ids - k * rows
        inside = (local >= 0) & (local < rows)
        part = _take_rows(block, jnp.where(inside, local, rows))
        return jnp.where(inside[..., None], part, out), None  # a selection: exact

    out, _ = _scan_blocks(table, blocks, body, jnp.zeros(ids.shape + (width,), dtype))
    valid = (ids >= 0) & (ids < vocab)
    return jnp.where(valid[..., None], out, jnp.asarray(jnp.nan, out.dtype))
