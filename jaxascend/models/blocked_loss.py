"""The next-token cross-entropy without the logits: the LM head and the loss in blocks.

The plain loss holds the float32 logits ``[B, T, V]`` and their gradient: at 16384 tokens and
Qwen's 151936-token vocabulary that is 10 GB each. :func:`blocked_token_losses` computes the same
per-token losses from the head's input ``x [B, T, D]`` and the head's weights, one block of the
vocabulary at a time, and within a block one chunk of tokens at a time:

- forward: for each vocabulary block ``k`` (a ``lax.scan``) and each chunk of tokens, the block's
  logits give a running maximum, the sum of ``exp(logit - max)`` and the target's logit; the
  blocks are merged with the online log-sum-exp (Milakov & Gimelshein, 2018), and the loss of
  each token is ``max + log(sum) - target logit``;
- backward (:func:`_block_stats`, a ``jax.custom_vjp``): each chunk's logits are recomputed and
  their gradient ``softmax * dloss - onehot * dloss`` gives the chunk's ``dx`` (summed over the
  blocks in float32) and the block's weight gradient, summed over the chunks in float32 and
  rounded to the weights' dtype once per block -- what the plain head computes, in another
  summation order;
- each vocabulary block goes through ``OutputHead.hook`` as :func:`models.vocab.head_logits`'s
  blocks do, so the offloaded step sends each block's gradient to the SSD as soon as it exists:
  the table's gradient is never whole in memory;
- the scan over blocks is checkpointed with only the per-token statistics saved
  (:data:`_STATS`), so the backward recomputes no logits beyond its own chunks.

Memory: ``x`` and its float32 gradient ``[B, T, D]``, a few ``[B, T]`` statistics, and one
chunk's logits ``[B, tokens, Vb]`` with their temporaries (:data:`CHUNK_ELEMENTS`), whatever T.
Gemma 3's final logit soft-capping (``c * tanh(logit / c)``) is applied to each chunk.

``model.loss: auto`` uses it from :data:`BLOCKED_FROM` logits elements per micro-batch up.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxascend.models import vocab

# Logits elements (``B * tokens * Vb``) one chunk computes at once: 32 MiB of float32, large
# enough for the matmuls to run at speed, small beside the step.
CHUNK_ELEMENTS = 1 << 23

# ``model.loss: auto`` blocks the loss from this many logits elements (B * T * V) per micro-batch:
# 256 MiB of float32 logits, 442 tokens of Qwen's vocabulary. Measured on an AMD EPYC (2 cores,
# scripts/bench_attention.py --part loss, docs/bench_loss.json) at Qwen2.5-0.5B's tied 151936 x 896
# bfloat16 table: the blocked head and loss take 1.15-1.17x the whole logits' forward/backward
# time from 256 to 1024 tokens and hold 0.57-0.68 GiB of temporaries against 1.19-2.22 GiB; the
# head is about a quarter of that model's step. The bundled tiny runs (259 tokens) stay dense.
BLOCKED_FROM = 1 << 26

IMPLEMENTATIONS = ("auto", "blocked", "dense")

_STATS = "vocab_block_stats"  # the names the checkpointed scan saves
_NEG = float(jnp.finfo(jnp.float32).min)


def chosen_loss(implementation: str, batch: int, length: int, vocab_size: int) -> str:
    """``"blocked"`` or ``"dense"`` for ``model.loss`` at a micro-batch of ``batch`` rows of
    ``length`` tokens: ``auto`` blocks from :data:`BLOCKED_FROM` logits elements up."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"model.loss: {implementation!r} is not supported (allowed: "
                         f"{', '.join(IMPLEMENTATIONS)})")
    if implementation == "auto":
        return "blocked" if batch * length * vocab_size >= BLOCKED_FROM else "dense"
    return implementation


class OutputHead(NamedTuple):
    """A model's output head as the blocked loss reads it (see the models' ``output_head``)."""

    weights: jax.Array  # tied: the token table [V, D] (floats, or raw bits with a hook); else the kernel [D, V]
    tied: bool
    blocks: int  # blocks of vocabulary rows (models.vocab.table_blocks); the hook sees each
    hook: Optional[Callable[[jax.Array, str, int], jax.Array]]  # models.layers.TableHook, tied tables only
    dtype: Any  # the compute dtype the weights are used in
    softcap: Optional[float] = None  # Gemma 3: logits = c * tanh(logits / c)

    @property
    def vocab_size(self) -> int:
        return int(self.weights.shape[0] if self.tied else self.weights.shape[1])

    def block_rows(self) -> int:
        return self.vocab_size // self.blocks


def chunk_tokens(batch: int, length: int, block_rows: int, elements: int = CHUNK_ELEMENTS) -> int:
    """Tokens per chunk: the largest divisor of ``length`` whose chunk of logits
    (``batch * tokens * block_rows``) stays within ``elements``, else that many tokens rounded to
    8 (the last chunk is then padded); at least 8, at most ``length``."""
    target = max(8, elements // max(1, batch * block_rows))
    if target >= length:
        return length
    for tokens in range(target, max(8, target // 2) - 1, -1):
        if length % tokens == 0:
            return tokens
    return max(8, target // 8 * 8)


# ----------------------------------------------------------------------------- one block


def _chunk_logits(x32, w, tied: bool, softcap: Optional[float]):
    """float32 ``[B, t, Vb]`` logits of one chunk against one block (and the pre-cap values)."""
    w32 = w.astype(jnp.float32)
    raw = jnp.einsum("BTD,VD->BTV" if tied else "BTD,DV->BTV", x32, w32)
    if softcap is None:
        return raw, raw
    return raw, jnp.tanh(raw / softcap) * softcap


def _chunks(x32, local, tokens: int):
    """(chunk count, chunk ``i`` of ``x32``, chunk ``i`` of ``local``) along the token axis."""
    count = x32.shape[1] // tokens

    def take(i):
        start = i * tokens
        return (jax.lax.dynamic_slice_in_dim(x32, start, tokens, axis=1),
                jax.lax.dynamic_slice_in_dim(local, start, tokens, axis=1))

    return count, take


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _block_stats(x32, w, local, tied: bool, softcap: Optional[float], tokens: int):
    """Per token, over one vocabulary block: (the logits' maximum, the sum of ``exp(logit -
    max)``, the logit of the target ``local`` (0 where the target is not in the block)), each
    float32 ``[B, T]``. The maximum only shifts the sum; it carries no gradient."""
    return _stats_forward(x32, w, local, tied, softcap, tokens)


def _stats_forward(x32, w, local, tied, softcap, tokens):
    count, take = _chunks(x32, local, tokens)

    def one(_, i):
        xc, lc = take(i)
        _, logits = _chunk_logits(xc, w, tied, softcap)
        top = jnp.max(logits, axis=-1)
        total = jnp.sum(jnp.exp(logits - top[..., None]), axis=-1)
        target = jnp.take_along_axis(logits, jnp.clip(lc, 0, logits.shape[-1] - 1)[..., None], axis=-1)[..., 0]
        return None, (top, total, jnp.where(lc >= 0, target, 0.0))

    _, stats = jax.lax.scan(one, None, jnp.arange(count))
    return tuple(jnp.moveaxis(s, 0, 1).reshape(x32.shape[:2]) for s in stats)


def _stats_fwd(x32, w, local, tied, softcap, tokens):
    return _stats_forward(x32, w, local, tied, softcap, tokens), (x32, w, local)


def _stats_bwd(tied, softcap, tokens, residuals, cotangents):
    x32, w, local = residuals
    _, d_total, d_target = cotangents  # the maximum's cotangent is ignored (it only shifts)
    count, take = _chunks(x32, local, tokens)
    w32 = w.astype(jnp.float32)

    def one(dw, i):
        xc, lc = take(i)
        raw, logits = _chunk_logits(xc, w, tied, softcap)
        top = jnp.max(logits, axis=-1, keepdims=True)  # the forward's maximum, recomputed exactly
        start = i * tokens
        dt = jax.lax.dynamic_slice_in_dim(d_total, start, tokens, axis=1)[..., None]
        dg = jax.lax.dynamic_slice_in_dim(d_target, start, tokens, axis=1)[..., None]
        onehot = jnp.arange(logits.shape[-1]) == lc[..., None]
        dlogits = jnp.exp(logits - top) * dt + jnp.where(onehot, dg, 0.0)
        if softcap is not None:
            dlogits = dlogits * (1.0 - jnp.square(jnp.tanh(raw / softcap)))
        if tied:
            return dw + jnp.einsum("BTV,BTD->VD", dlogits, xc), jnp.einsum("BTV,VD->BTD", dlogits, w32)
        return dw + jnp.einsum("BTV,BTD->DV", dlogits, xc), jnp.einsum("BTV,DV->BTD", dlogits, w32)

    dw, dx = jax.lax.scan(one, jnp.zeros(w.shape, jnp.float32), jnp.arange(count))
    dx = jnp.moveaxis(dx, 0, 1).reshape(x32.shape)
    return dx, dw.astype(w.dtype), None


_block_stats.defvjp(_stats_fwd, _stats_bwd)


# ----------------------------------------------------------------------------- all blocks


def _head_block(head: OutputHead, xs, rows: int):
    """Block ``k`` of the head's weights in a float dtype (through the hook when there is one);
    ``xs``: ``(a tied table's block of rows, or None for a separate kernel, k)``."""
    raw, k = xs
    if head.tied:
        if head.hook is not None:
            return head.hook(raw, "head", k)
        if not jnp.issubdtype(raw.dtype, jnp.floating):
            raise ValueError("blocked loss: a table passed as raw bits needs a hook that turns each block back")
        return raw
    return jax.lax.dynamic_slice_in_dim(head.weights, k * rows, rows, axis=1).astype(head.dtype)


def _scanned_blocks(head: OutputHead):
    """What the scan over vocabulary blocks walks: a tied table's blocks of rows (as
    models.vocab does), or only the block indices of a separate kernel (sliced in the body)."""
    index = jnp.arange(head.blocks, dtype=jnp.int32)
    if head.tied:
        table = head.weights
        return table.reshape((head.blocks, head.block_rows()) + table.shape[1:]), index
    return None, index


def blocked_token_losses(x: jax.Array, head: OutputHead, targets: jax.Array,
                         chunk_elements: int = CHUNK_ELEMENTS) -> jax.Array:
    """float32 ``[B, T]`` cross-entropy of each target ``targets [B, T]`` given the head's input
    ``x [B, T, D]``, never holding more than one chunk of logits (see the module's doc)."""
    batch, length, _ = x.shape
    rows = head.block_rows()
    tokens = chunk_tokens(batch, length, rows, chunk_elements)
    padded = -(-length // tokens) * tokens
    x32 = x.astype(head.dtype).astype(jnp.float32)  # the compute dtype's values, summed in float32
    targets = targets.astype(jnp.int32)
    if padded != length:  # padded tokens have no target: their rows are dropped below
        x32 = jnp.pad(x32, ((0, 0), (0, padded - length), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, padded - length)), constant_values=-1)

    def body(carry, xs):
        top, total, target = carry
        k = xs[1]
        w = _head_block(head, xs, rows)
        local = jnp.where((targets >= k * rows) & (targets < (k + 1) * rows), targets - k * rows, -1)
        b_top, b_total, b_target = _block_stats(x32, w, local, head.tied, head.softcap, tokens)
        b_top, b_total, b_target = (checkpoint_name(s, _STATS) for s in (b_top, b_total, b_target))
        new_top = jax.lax.stop_gradient(jnp.maximum(top, b_top))
        total = total * jnp.exp(top - new_top) + b_total * jnp.exp(jax.lax.stop_gradient(b_top) - new_top)
        return (new_top, total, target + b_target), None

    policy = jax.checkpoint_policies.save_only_these_names(_STATS)
    step = jax.checkpoint(body, policy=policy, prevent_cse=False)
    start = (jnp.full((batch, padded), _NEG, jnp.float32), jnp.zeros((batch, padded), jnp.float32),
             jnp.zeros((batch, padded), jnp.float32))
    (top, total, target), _ = jax.lax.scan(step, start, _scanned_blocks(head))
    return (top + jnp.log(total) - target)[:, :length]


def table_head(table: jax.Array, dtype, hook=None, softcap: Optional[float] = None) -> OutputHead:
    """The :class:`OutputHead` of a tied token table ``[V, D]`` (floats or raw bits), in the
    blocks models.vocab computes it in (one block when it is not large)."""
    return OutputHead(table, True, vocab.table_blocks(*table.shape), hook, dtype, softcap)


def kernel_head(kernel: jax.Array, dtype, softcap: Optional[float] = None) -> OutputHead:
    """The :class:`OutputHead` of a separate ``lm_head`` kernel ``[D, V]``."""
    return OutputHead(kernel, False, vocab.table_blocks(kernel.shape[1], kernel.shape[0]), None, dtype, softcap)
