"""Blockwise (FlashAttention-2 style) causal attention in pure JAX: memory linear in the length.

:func:`blockwise_attention` computes exactly what ``layers.causal_attention`` computes (same
arguments, shapes, masks and float32 softmax) without ever holding the ``[T, S]`` score matrix:

- forward: for each block of ``block_q`` queries, an online softmax over blocks of ``block_k``
  keys keeps a running max, sum and output in float32, and saves the per-row log-sum-exp;
- backward (a ``jax.custom_vjp``): saves only q, k, v, the output and the log-sum-exp, and
  recomputes each block's scores. For each key block it walks the query blocks that see it,
  accumulating ``dk`` and ``dv`` for the block and ``dq`` into one float32 buffer, with
  ``D = rowsum(dO * O)`` (Dao, "FlashAttention-2", 2023, Algorithm 2);
- key blocks wholly above the causal diagonal, and wholly outside the sliding window when it
  applies, are never visited: the loops over blocks have data-dependent bounds, because the
  window's use (``is_sliding``) is a traced per-layer flag inside the scanned layer stack.

Memory is ``O(B * T * (block + H))`` in both passes. A length that is not a multiple of the
blocks is padded internally; the padded keys lie after every real query, so the causal mask
already hides them, and the padded queries' rows are dropped.

Einsum axes as in :mod:`jaxascend.models.layers`: B batch, T query time, S key time, K key/value
heads, G query heads per key/value head, H head width.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

# Default block sizes: 512 query rows x 512 keys keep one block's float32 scores at
# 1 MiB per head (B=1), large enough for the matmuls to run at full speed on CPU and small
# enough to stay in cache-sized working sets; the loop overhead per block is then negligible.
BLOCK_Q = 512
BLOCK_K = 512

# ``model.attention: auto`` uses the blockwise path from this many tokens per row up, the dense
# one below it. Measured on an AMD EPYC (2 cores; scripts/bench_attention.py and whole tiny runs,
# remat full): at 1024 tokens blockwise takes 1.0x dense's forward/backward on the tiny shape and
# 0.60x on Qwen2.5-0.5B's attention, at 2048 0.72x and 0.51x, at 512 1.38x on the tiny shape; it
# holds a fixed block of scores where dense holds T x T (0.65 against 1.23 GiB peak at tiny
# 4 x 1024). The bundled tiny runs (128-256 tokens) stay dense.
BLOCKWISE_FROM = 1024

IMPLEMENTATIONS = ("auto", "blockwise", "dense")

_MASKED = float(jnp.finfo(jnp.float32).min)  # what the dense path writes into masked scores


def chosen_implementation(implementation: str, length: int) -> str:
    """``"blockwise"`` or ``"dense"`` for ``model.attention`` at a static row length ``length``:
    ``auto`` picks blockwise from :data:`BLOCKWISE_FROM` tokens up."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"model.attention: {implementation!r} is not supported (allowed: "
                         f"{', '.join(IMPLEMENTATIONS)})")
    if implementation == "auto":
        return "blockwise" if length >= BLOCKWISE_FROM else "dense"
    return implementation


def scores_held(implementation: str, length: int) -> int:
    """Attention scores one head of one row holds at once for ``model.attention`` at a row of
    ``length`` tokens: all ``T x T`` dense; blockwise, one block of queries against one block of
    keys whatever the length (the blocks shrink for a short row; see :func:`_block_sizes`)."""
    if chosen_implementation(implementation, length) == "dense":
        return length * length
    rounded = -(-length // 8) * 8
    return min(BLOCK_Q, rounded) * min(BLOCK_K, rounded)


class BlockPlan(NamedTuple):
    """The static part of one call (hashable: it is the custom_vjp's non-differentiable argument)."""

    block_q: int  # query rows per block
    block_k: int  # keys per block
    window: Optional[int]  # sliding window, None: none on any layer
    scale: float  # multiplies the scores


def _block_sizes(length: int, block_q: int, block_k: int) -> tuple[int, int, int]:
    """``(block_q, block_k, padded_length)``: a short row shrinks the blocks (to ``length``
    rounded up to 8) instead of padding it to a whole default block; both blocks divide the
    padded length."""
    for name, value in (("block_q", block_q), ("block_k", block_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"blockwise_attention.{name}: must be an integer >= 1, got {value!r}")
    small, big = sorted((block_q, block_k))
    if big % small:
        raise ValueError(f"blockwise_attention: block_q {block_q} and block_k {block_k} must divide one another")
    small = min(small, -(-length // 8) * 8)
    big = min(big, -(-length // small) * small)
    bq, bk = (small, big) if block_q <= block_k else (big, small)
    return bq, bk, -(-length // big) * big


def _visible(plan: BlockPlan, sliding, q_start, k_start, seg_q, seg_k) -> jax.Array:
    """bool ``[B, bq, 1, 1, bk]``: which keys of the block at ``k_start`` the queries of the block at
    ``q_start`` see (the convention of ``layers.causal_mask``, plus segments)."""
    t = q_start + jnp.arange(plan.block_q)[:, None]
    s = k_start + jnp.arange(plan.block_k)[None, :]
    mask = s <= t
    if plan.window is not None:
        mask = mask & ((s > t - plan.window) | ~sliding)
    mask = mask[None] & (seg_q[:, :, None] == seg_k[:, None, :])
    return mask[:, :, None, None, :]


def key_block_range(plan: BlockPlan, sliding, q_start) -> tuple[jax.Array, jax.Array]:
    """``[lo, hi)``: the key blocks the query block at ``q_start`` can see."""
    hi = (q_start + plan.block_q - 1) // plan.block_k + 1
    if plan.window is None:
        return jnp.zeros_like(hi), hi
    lo = jnp.maximum(q_start - plan.window + 1, 0) // plan.block_k
    return jnp.where(sliding, lo, 0), hi


def query_block_range(plan: BlockPlan, sliding, k_start, num_q_blocks: int) -> tuple[jax.Array, jax.Array]:
    """``[lo, hi)``: the query blocks that can see the key block at ``k_start``."""
    lo = k_start // plan.block_q
    if plan.window is None:
        return lo, jnp.full_like(lo, num_q_blocks)
    hi = jnp.minimum((k_start + plan.block_k - 1 + plan.window - 1) // plan.block_q + 1, num_q_blocks)
    return lo, jnp.where(sliding, hi, num_q_blocks)


def _scores(plan: BlockPlan, q_blk, k_blk, mask) -> jax.Array:
    """float32 scaled and masked scores ``[B, bq, K, G, bk]``."""
    scores = jnp.einsum("BTKGH,BSKH->BTKGS", q_blk, k_blk, preferred_element_type=jnp.float32)
    return jnp.where(mask, scores * plan.scale, _MASKED)


def _slice(x: jax.Array, start, size: int) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=1)


def _forward(plan: BlockPlan, q, k, v, seg, sliding) -> tuple[jax.Array, jax.Array]:
    """``(out [B,P,K,G,H] in q's dtype, lse [B,P,K,G] float32)`` on padded inputs (q as
    ``[B,P,K,G,H]``): one query block at a time, online softmax over its visible key blocks."""
    batch, padded, num_kv, groups, head_dim = q.shape
    num_q_blocks = padded // plan.block_q

    def query_block(_, i):
        q_start = i * plan.block_q
        q_blk, seg_q = _slice(q, q_start, plan.block_q), _slice(seg, q_start, plan.block_q)

        def key_block(j, carry):
            row_max, row_sum, acc = carry
            k_start = j * plan.block_k
            mask = _visible(plan, sliding, q_start, k_start, seg_q, _slice(seg, k_start, plan.block_k))
            scores = _scores(plan, q_blk, _slice(k, k_start, plan.block_k), mask)
            new_max = jnp.maximum(row_max, scores.max(axis=-1))
            probs = jnp.exp(scores - new_max[..., None])
            rescale = jnp.exp(row_max - new_max)
            pv = jnp.einsum("BTKGS,BSKH->BTKGH", probs.astype(v.dtype), _slice(v, k_start, plan.block_k),
                            preferred_element_type=jnp.float32)
            return new_max, row_sum * rescale + probs.sum(axis=-1), acc * rescale[..., None] + pv

        stats = (batch, plan.block_q, num_kv, groups)
        init = (jnp.full(stats, _MASKED, jnp.float32), jnp.zeros(stats, jnp.float32),
                jnp.zeros(stats + (head_dim,), jnp.float32))
        lo, hi = key_block_range(plan, sliding, q_start)
        row_max, row_sum, acc = jax.lax.fori_loop(lo, hi, key_block, init)
        out = (acc / row_sum[..., None]).astype(q.dtype)
        return None, (out, row_max + jnp.log(row_sum))

    _, (out, lse) = jax.lax.scan(query_block, None, jnp.arange(num_q_blocks))
    # [nq, B, bq, ...] -> [B, P, ...]
    out = jnp.moveaxis(out, 0, 1).reshape(q.shape)
    return out, jnp.moveaxis(lse, 0, 1).reshape(q.shape[:-1])


def _backward(plan: BlockPlan, q, k, v, seg, sliding, out, lse, d_out) -> tuple[jax.Array, ...]:
    """``(dq, dk, dv)`` on padded inputs: for each key block, the query blocks that see it, with
    the block's probabilities recomputed from the saved log-sum-exp."""
    padded = q.shape[1]
    num_q_blocks, num_k_blocks = padded // plan.block_q, padded // plan.block_k
    # D = rowsum(dO * O): the softmax's Jacobian term, one number per query row and head.
    delta = jnp.einsum("BTKGH,BTKGH->BTKG", d_out.astype(jnp.float32), out.astype(jnp.float32))

    def key_block(dq, j):
        k_start = j * plan.block_k
        k_blk, v_blk = _slice(k, k_start, plan.block_k), _slice(v, k_start, plan.block_k)
        seg_k = _slice(seg, k_start, plan.block_k)

        def query_block(i, carry):
            dq, dk, dv = carry
            q_start = i * plan.block_q
            q_blk, do_blk = _slice(q, q_start, plan.block_q), _slice(d_out, q_start, plan.block_q)
            mask = _visible(plan, sliding, q_start, k_start, _slice(seg, q_start, plan.block_q), seg_k)
            probs = jnp.exp(_scores(plan, q_blk, k_blk, mask) - _slice(lse, q_start, plan.block_q)[..., None])
            dv = dv + jnp.einsum("BTKGS,BTKGH->BSKH", probs.astype(do_blk.dtype), do_blk,
                                 preferred_element_type=jnp.float32)
            d_probs = jnp.einsum("BTKGH,BSKH->BTKGS", do_blk, v_blk, preferred_element_type=jnp.float32)
            d_scores = (probs * (d_probs - _slice(delta, q_start, plan.block_q)[..., None]) * plan.scale)
            d_scores = d_scores.astype(q.dtype)
            dk = dk + jnp.einsum("BTKGS,BTKGH->BSKH", d_scores, q_blk, preferred_element_type=jnp.float32)
            dq_blk = jnp.einsum("BTKGS,BSKH->BTKGH", d_scores, k_blk, preferred_element_type=jnp.float32)
            dq = jax.lax.dynamic_update_slice_in_dim(dq, _slice(dq, q_start, plan.block_q) + dq_blk,
                                                     q_start, axis=1)
            return dq, dk, dv

        zeros = jnp.zeros(k_blk.shape, jnp.float32)
        lo, hi = query_block_range(plan, sliding, k_start, num_q_blocks)
        dq, dk, dv = jax.lax.fori_loop(lo, hi, query_block, (dq, zeros, zeros))
        return dq, (dk, dv)

    dq, (dk, dv) = jax.lax.scan(key_block, jnp.zeros(q.shape, jnp.float32), jnp.arange(num_k_blocks))
    dk, dv = (jnp.moveaxis(x, 0, 1).reshape(k.shape) for x in (dk, dv))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(plan: BlockPlan, q, k, v, seg, sliding) -> jax.Array:
    return _forward(plan, q, k, v, seg, sliding)[0]


def _attend_fwd(plan: BlockPlan, q, k, v, seg, sliding):
    out, lse = _forward(plan, q, k, v, seg, sliding)
    return out, (q, k, v, seg, sliding, out, lse)


def _attend_bwd(plan: BlockPlan, saved, d_out):
    q, k, v, seg, sliding, out, lse = saved
    dq, dk, dv = _backward(plan, q, k, v, seg, sliding, out, lse, d_out)
    return dq, dk, dv, None, None  # segment ids and the sliding flag are not differentiable


_attend.defvjp(_attend_fwd, _attend_bwd)


def blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                        sliding_window: Optional[int] = None, scale: Optional[float] = None,
                        is_sliding: Optional[jax.Array] = None, segment_ids: Optional[jax.Array] = None,
                        block_q: Optional[int] = None, block_k: Optional[int] = None) -> jax.Array:
    """Grouped-query causal attention, the result of ``layers.causal_attention`` (same arguments,
    ``q [B,T,N,H]``, ``k, v [B,T,K,H]``, output ``[B,T,N,H]`` in q's dtype), computed in blocks of
    ``block_q`` queries by ``block_k`` keys so that no ``[T, S]`` array exists, forward or backward.

    ``is_sliding`` (traced bool scalar; None: the window applies wherever ``sliding_window`` is
    set) chooses the window per layer; ``segment_ids [B, T]`` keep packed examples apart. The two
    block sizes (None: :data:`BLOCK_Q`, :data:`BLOCK_K`) must divide one another; a short row
    shrinks them.

    Example::

        out = blockwise_attention(q, k, v, sliding_window=4096, is_sliding=flag, block_q=256)
    """
    batch, length, num_heads, head_dim = q.shape
    num_kv = k.shape[2]
    bq, bk, padded = _block_sizes(length, BLOCK_Q if block_q is None else block_q,
                                  BLOCK_K if block_k is None else block_k)
    plan = BlockPlan(bq, bk, sliding_window, float(head_dim ** -0.5 if scale is None else scale))
    sliding = jnp.asarray(True if is_sliding is None else is_sliding, dtype=bool)
    seg = jnp.zeros((batch, length), jnp.int32) if segment_ids is None else segment_ids
    pad = padded - length
    # Padded keys come after every real query, so the causal mask hides them whatever their
    # segment; a padded query sees at least itself, so no row is empty (its output is dropped).
    seg = jnp.pad(seg.astype(jnp.int32), ((0, 0), (0, pad)))
    q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
    q = q.reshape(batch, padded, num_kv, num_heads // num_kv, head_dim)
    out = _attend(plan, q, k, v, seg, sliding)
    return out[:, :length].reshape(batch, length, num_heads, head_dim)
