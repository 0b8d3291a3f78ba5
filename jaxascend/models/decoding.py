"""Cached decoding: a key/value cache per layer, the attention over it, and the layer stack run
one call (a prompt, then one token at a time) at a time.

    cache = model.init_cache(batch=1, length=64)                       # zeros, [L, B, S, K, H]
    logits, cache = model.decode(prompt, cache, 0)                      # prefill: t = prompt length
    logits, cache = model.decode(next_token[:, None], cache, prompt_len)  # then t = 1 per token

A call over ``t`` tokens starting at cache index ``start`` writes their keys and values at
``[start, start + t)`` and attends over the whole cache with the mask ``key <= query`` (and
``query - key < sliding_window`` where the layer has one); positions (RoPE, GPT-2's ``wpe``)
are the cache indices. Cache entries past ``start + t`` are masked, so whatever they hold
(zeros, or the padding of a longer prefill) is never seen before a later call overwrites it.

The training path (``model(input_ids, ...)``) is untouched: these functions are separate
entry points over the same modules and parameters. :func:`layer_decode` is one layer as a
pure function; :func:`decode_layers` scans it over the stacked layers, and a caller whose
weights do not fit in memory calls it layer by layer with each layer's weights read just before.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import nnx


class KVCache(NamedTuple):
    """Keys and values of every layer at every cache index (RoPE already applied to the keys)."""

    k: jax.Array  # [L, B, S, K, H], the compute dtype
    v: jax.Array  # [L, B, S, K, H], the compute dtype

    @classmethod
    def zeros(cls, num_layers: int, batch: int, length: int, num_kv_heads: int, head_dim: int,
              dtype) -> "KVCache":
        """An empty cache of ``length`` positions."""
        shape = (num_layers, batch, length, num_kv_heads, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    @property
    def length(self) -> int:
        """Positions the cache holds (``S``)."""
        return self.k.shape[2]


class LayerKV(NamedTuple):
    """One layer's slice of a :class:`KVCache`."""

    k: jax.Array  # [B, S, K, H]
    v: jax.Array  # [B, S, K, H]


def cache_positions(input_ids: jax.Array, start: jax.Array) -> jax.Array:
    """int32 ``[B, t]`` cache indices ``start .. start + t - 1`` of a call over ``input_ids [B, t]``."""
    if input_ids.ndim != 2 or not jnp.issubdtype(input_ids.dtype, jnp.integer):
        raise ValueError(f"input_ids: expected an integer array [batch, time], got "
                         f"{input_ids.dtype}{list(input_ids.shape)}")
    positions = jnp.asarray(start, jnp.int32) + jnp.arange(input_ids.shape[1], dtype=jnp.int32)
    return jnp.broadcast_to(positions, input_ids.shape)


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, cache: LayerKV, start: jax.Array, *,
                     sliding_window: Optional[int] = None, scale: Optional[float] = None,
                     is_sliding: Optional[jax.Array] = None) -> tuple[jax.Array, LayerKV]:
    """Grouped-query attention of this call's ``q [B,t,N,H]`` over a layer's cache, after
    writing this call's ``k, v [B,t,K,H]`` at cache indices ``[start, start + t)``. Returns the
    context ``[B,t,N,H]`` in q's dtype and the updated cache; scores and softmax in float32.

    Query ``i`` (cache index ``start + i``) sees cache index ``s`` iff ``s <= start + i`` and,
    with ``sliding_window`` (only where the traced bool ``is_sliding`` is true, if given),
    ``start + i - s < sliding_window``: the masks of :func:`jaxascend.models.layers.causal_attention`.
    """
    batch, length, num_heads, head_dim = q.shape
    num_kv = k.shape[2]
    cache = LayerKV(jax.lax.dynamic_update_slice(cache.k, k.astype(cache.k.dtype), (0, start, 0, 0)),
                    jax.lax.dynamic_update_slice(cache.v, v.astype(cache.v.dtype), (0, start, 0, 0)))
    q = q.reshape(batch, length, num_kv, num_heads // num_kv, head_dim)
    scores = jnp.einsum("BTKGH,BSKH->BKGTS", q, cache.k, preferred_element_type=jnp.float32)
    scores = scores * (head_dim ** -0.5 if scale is None else scale)
    query = start + jnp.arange(length)[:, None]  # [t, 1] cache indices
    key = jnp.arange(cache.k.shape[1])[None, :]  # [1, S]
    mask = key <= query
    if sliding_window is not None:
        windowed = mask & (query - key < sliding_window)
        mask = windowed if is_sliding is None else jnp.where(is_sliding, windowed, mask)
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(cache.v.dtype)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, cache.v)
    return out.reshape(batch, length, num_heads, head_dim).astype(q.dtype), cache


def layer_decode(graphdef: nnx.GraphDef, layer_params: nnx.State, hidden: jax.Array, positions: jax.Array,
                 cache: KVCache, index: jax.Array, start: jax.Array, flag: Optional[jax.Array] = None,
                 rope_length: Optional[jax.Array] = None) -> tuple[jax.Array, KVCache]:
    """Layer ``index`` (an int32 scalar, may be traced) of a cached call, as a pure function of
    its parameters: reads its slice of ``cache``, runs the layer's ``decode`` and writes the
    slice back. ``flag`` is the layer's entry of the model's ``layer_flags`` (Gemma 3's
    ``is_sliding``), None for models without them. ``rope_length``: the sequence length that
    length-dependent RoPE (dynamic, longrope) chooses its frequencies from; None: ``start + t``.
    A prompt prefilled in blocks passes the prompt's length to every block, so that each block
    rotates its keys as the one call over the whole prompt would."""
    layer = nnx.merge(graphdef, layer_params)
    kv = LayerKV(cache.k[index], cache.v[index])
    if flag is None:
        hidden, kv = layer.decode(hidden, positions, kv, start, rope_length=rope_length)
    else:
        hidden, kv = layer.decode(hidden, positions, kv, start, flag, rope_length=rope_length)
    cache = KVCache(jax.lax.dynamic_update_index_in_dim(cache.k, kv.k, index, 0),
                    jax.lax.dynamic_update_index_in_dim(cache.v, kv.v, index, 0))
    return hidden, cache


def decode_layers(layers: nnx.Module, hidden: jax.Array, positions: jax.Array, cache: KVCache,
                  start: jax.Array, layer_flags: Optional[tuple[bool, ...]] = None,
                  rope_length: Optional[jax.Array] = None) -> tuple[jax.Array, KVCache]:
    """Runs ``hidden`` through the stacked ``layers`` with ``lax.scan``, each step
    :func:`layer_decode` on that layer's slice of the parameters, the cache in the carry."""
    graphdef, stacked = nnx.split(layers)
    num_layers = jax.tree.leaves(stacked)[0].shape[0]
    if cache.k.shape[0] != num_layers:
        raise ValueError(f"cache: {cache.k.shape[0]} layers for a model of {num_layers}")
    flags = None if layer_flags is None else jnp.asarray(layer_flags, dtype=bool)

    def step(carry, xs):
        hidden, cache = carry
        params, index, flag = xs  # flag is None without layer_flags (an empty pytree)
        return layer_decode(graphdef, params, hidden, positions, cache, index, start, flag, rope_length), None

    xs = (stacked, jnp.arange(num_layers, dtype=jnp.int32), flags)
    (hidden, cache), _ = jax.lax.scan(step, (hidden, cache), xs)
    return hidden, cache


class CachedDecoding:
    """What a model class mixes in for cached decoding. It provides :meth:`init_cache`,
    :meth:`decode` and :meth:`decode_hidden`; the model provides ``embed_inputs(input_ids,
    positions)``, ``logits(hidden)``, its stacked layers under the attribute ``LAYER_STACK``,
    ``kv_cache_dims = (layers, kv heads, head dim)`` and, if its layers differ by a switch,
    ``layer_flags``; each stacked layer has ``decode(hidden, positions, kv, start[, flag], *,
    rope_length)``."""

    LAYER_STACK = "layers"
    TOKEN_TABLE = ("embed_tokens", "embedding")  # the token table's path (also the head when tied)
    layer_flags: Optional[tuple[bool, ...]] = None

    def init_cache(self, batch: int, length: int, dtype=None) -> KVCache:
        """An empty :class:`KVCache` of ``length`` positions in the compute dtype (or ``dtype``)."""
        num_layers, num_kv, head_dim = self.kv_cache_dims
        return KVCache.zeros(num_layers, batch, length, num_kv, head_dim, dtype or self.dtype)

    def decode_hidden(self, input_ids: jax.Array, cache: KVCache, start: jax.Array,
                      rope_length: Optional[jax.Array] = None) -> tuple[jax.Array, KVCache]:
        """The final hidden states ``[B, t, D]`` (before the final norm) of a cached call over
        ``input_ids [B, t]`` at cache indices ``[start, start + t)``, and the updated cache.
        ``rope_length``: see :func:`layer_decode` (None: ``start + t``)."""
        positions = cache_positions(input_ids, start)
        hidden = self.embed_inputs(input_ids, positions)
        return decode_layers(getattr(self, self.LAYER_STACK), hidden, positions, cache, start, self.layer_flags,
                             rope_length)

    def decode(self, input_ids: jax.Array, cache: KVCache, start: jax.Array) -> tuple[jax.Array, KVCache]:
        """float32 logits ``[B, t, V]`` of a cached call over ``input_ids [B, t]`` at cache
        indices ``[start, start + t)``, and the updated cache: prefill is ``t`` = the prompt
        length at ``start = 0``, then one token at a time. Jit it in the caller (``start`` may
        be traced; ``t`` and the cache length are static)."""
        hidden, cache = self.decode_hidden(input_ids, cache, start)
        return self.logits(hidden), cache
