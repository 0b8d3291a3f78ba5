"""Building blocks shared by the decoder-only models: parameter-holding layers, RoPE,
causal attention (dense here; blockwise in :mod:`~jaxascend.models.blockwise_attention`),
activations, and the scanned layer stack with its remat policies.

Conventions:

- Parameters are stored in ``param_dtype`` and cast to the compute ``dtype`` at use.
- Linear kernels are ``[in, out]`` (Hugging Face ``nn.Linear.weight`` is ``[out, in]``).
- Norm statistics, attention scores and softmax are computed in float32.
- Einsum axes: B batch, T query time, S key time, D model width, N query heads, K key/value
  heads, G query heads per key/value head, H head width, V vocabulary, I/O linear in/out.
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from jaxascend.config import ModelConfig
from jaxascend.models import blockwise_attention as blockwise
from jaxascend.models import blocked_loss
from jaxascend.models import fused_attention as fused
from jaxascend.models import vocab
from jaxascend.models.micro_batches import micro_batched_layer

DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch", "offload")
HIDDEN_ACTS = ("silu", "gelu_new", "gelu_pytorch_tanh", "gelu")
ATTENTION_IMPLEMENTATIONS = blockwise.IMPLEMENTATIONS
LOSS_IMPLEMENTATIONS = blocked_loss.IMPLEMENTATIONS

# Per-layer activations tagged with ``checkpoint_name``: the outputs of every projection matmul
# plus the attention context. Remat "offload" keeps exactly these, in pinned host memory, and
# recomputes the rest (norms, RoPE, softmax, activations) in the backward pass.
OFFLOADED_ACTIVATIONS = (
    "query", "key", "value", "attn_context", "attn_out", "mlp_gate", "mlp_up", "mlp_out",
)


def compute_dtype(name: str, field: str = "model.dtype"):
    """Maps ``"bfloat16" | "float16" | "float32"`` to the jnp dtype; ValueError otherwise."""
    if name not in DTYPES:
        raise ValueError(f"{field}: {name!r} is not supported (allowed: {', '.join(DTYPES)})")
    return DTYPES[name]


def check_positive(name: str, value) -> None:
    """Raises ValueError unless ``value`` is an int >= 1 (``name`` is the config field)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")


def check_choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name}: {value!r} is not supported (allowed: {', '.join(map(str, allowed))})")


def check_common_fields(cfg: ModelConfig, default_act: str) -> None:
    """The checks every model makes of the fields it reads alike: ``hidden_act`` (None means
    ``default_act``), ``remat``, ``attention``, ``loss``, ``dtype``, ``param_dtype`` and ``init_std``."""
    check_choice("model.hidden_act", cfg.hidden_act or default_act, HIDDEN_ACTS)
    check_choice("model.remat", cfg.remat, REMAT_POLICIES)
    check_choice("model.attention", cfg.attention, ATTENTION_IMPLEMENTATIONS)
    check_choice("model.loss", cfg.loss, LOSS_IMPLEMENTATIONS)
    compute_dtype(cfg.dtype, "model.dtype")
    compute_dtype(cfg.param_dtype, "model.param_dtype")
    if not cfg.init_std > 0:
        raise ValueError(f"model.init_std: must be > 0, got {cfg.init_std!r}")


# The token table is used by the lookup and, when tied, by the head. ``hook(block, use, k)``, with
# use "lookup" or "head", lets a caller wrap each block of rows of each use on its own (the whole
# table is block 0 when it is not computed in blocks, see models.vocab): the offloaded step sends
# each one's gradient to the SSD as soon as it exists (the sink sums a tied table's two uses),
# instead of JAX building the whole table's gradient in memory.
TableHook = Callable[[jax.Array, str, int], jax.Array]


# ----------------------------------------------------------------------------- parameter layers

class Linear(nnx.Module):
    """``y = x @ kernel (+ bias)`` over the last axis; kernel ``[in, out]``."""

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool, init_std: float,
                 dtype, param_dtype, rngs: nnx.Rngs):
        check_positive("Linear.in_features", in_features)
        check_positive("Linear.out_features", out_features)
        init = jax.nn.initializers.normal(init_std)
        self.kernel = nnx.Param(init(rngs.params(), (in_features, out_features), param_dtype))
        self.bias = nnx.Param(jnp.zeros((out_features,), param_dtype)) if use_bias else None
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jnp.einsum("BTI,IO->BTO", x.astype(self.dtype), self.kernel[...].astype(self.dtype))
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


def _is_bits(table: jax.Array) -> bool:
    """The offloaded step hands a large table over as raw bits (see models.vocab)."""
    return not jnp.issubdtype(table.dtype, jnp.floating)


def _in_blocks(table: jax.Array, blocks: int) -> bool:
    """A table the models compute block by block (models.vocab), not with the plain ops."""
    return blocks > 1 or vocab.is_large_table(table) or _is_bits(table)


class Embed(nnx.Module):
    """Token (or position) table ``embedding [V, D]``; ``attend`` is the tied output head."""

    def __init__(self, num_embeddings: int, features: int, *, init_std: float, dtype, param_dtype,
                 rngs: nnx.Rngs):
        check_positive("Embed.num_embeddings", num_embeddings)
        check_positive("Embed.features", features)
        init = jax.nn.initializers.normal(init_std)
        self.embedding = nnx.Param(init(rngs.params(), (num_embeddings, features), param_dtype))
        self.dtype = dtype

    @property
    def blocks(self) -> int:
        """Blocks of rows a large table is computed in (1: the plain ops); see models.vocab."""
        return vocab.table_blocks(*self.embedding.shape)

    def __call__(self, ids: jax.Array, hook: Optional[TableHook] = None) -> jax.Array:
        """Rows of ``ids``; ``hook(block, "lookup", k)`` may wrap each block of the table (the
        whole table, k=0, when it is not computed in blocks)."""
        table = self.embedding[...]
        blocks = self.blocks
        if _in_blocks(table, blocks):
            rows = vocab.lookup(table, ids, blocks, hook, dtype=self.dtype if _is_bits(table) else None)
            return rows.astype(self.dtype)
        if hook is not None:
            table = hook(table, "lookup", 0)
        # mode="fill": an out-of-range id gives NaN rows instead of silently clamping.
        return jnp.take(table, ids, axis=0, mode="fill").astype(self.dtype)

    def attend(self, x: jax.Array, hook: Optional[TableHook] = None) -> jax.Array:
        """float32 logits ``x @ embedding.T`` (matmul in the compute dtype, fp32 accumulation);
        ``hook(block, "head", k)`` may wrap each block of the table, as in ``__call__``."""
        table = self.embedding[...]
        table = table if _is_bits(table) else table.astype(self.dtype)
        blocks = self.blocks
        if _in_blocks(table, blocks):
            return vocab.head_logits(x.astype(self.dtype), table, blocks, hook)
        if hook is not None:
            table = hook(table, "head", 0)
        return jnp.einsum("BTD,VD->BTV", x.astype(self.dtype), table,
                          preferred_element_type=jnp.float32)


class RMSNorm(nnx.Module):
    """``x / sqrt(mean(x**2) + eps) * (offset + scale)``, computed in float32.

    ``offset=1`` is Gemma's zero-centred norm: ``scale`` holds Hugging Face's ``weight`` verbatim
    (so loading and export stay 1:1 and weight decay acts on it as in HF) and starts at 0, an
    effective scale of 1 like the ones of ``offset=0``.
    """

    def __init__(self, features: int, *, eps: float, dtype, param_dtype, offset: float = 0.0):
        check_positive("RMSNorm.features", features)
        if not eps > 0:
            raise ValueError(f"model.rms_norm_eps: must be > 0, got {eps!r}")
        self.scale = nnx.Param(jnp.full((features,), 1.0 - offset, param_dtype))
        self.eps = eps
        self.offset = offset
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * (self.offset + self.scale[...].astype(jnp.float32))).astype(self.dtype)


class LayerNorm(nnx.Module):
    """``(x - mean) / sqrt(var + eps) * scale + bias``, computed in float32."""

    def __init__(self, features: int, *, eps: float, dtype, param_dtype):
        check_positive("LayerNorm.features", features)
        if not eps > 0:
            raise ValueError(f"model.layer_norm_epsilon: must be > 0, got {eps!r}")
        self.scale = nnx.Param(jnp.ones((features,), param_dtype))
        self.bias = nnx.Param(jnp.zeros((features,), param_dtype))
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        centered = x32 - mean
        var = jnp.mean(centered * centered, axis=-1, keepdims=True)
        y = centered * jax.lax.rsqrt(var + self.eps)
        y = y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
        return y.astype(self.dtype)


def output_head(cfg: ModelConfig, vocab_size: int, rngs: nnx.Rngs) -> Optional[Linear]:
    """The separate ``lm_head`` (``[D, V]``, no bias), or None when ``tie_word_embeddings``."""
    if cfg.tie_word_embeddings:
        return None
    return Linear(cfg.hidden_size, vocab_size, use_bias=False, init_std=cfg.init_std,
                  dtype=DTYPES[cfg.dtype], param_dtype=DTYPES[cfg.param_dtype], rngs=rngs)


def head_weights(embed: Embed, lm_head: Optional[Linear], table_hook: Optional[TableHook] = None,
                 softcap: Optional[float] = None) -> blocked_loss.OutputHead:
    """The output head as the blocked loss reads it: the tied table (``lm_head`` None; in the
    compute dtype unless handed over as raw bits, ``table_hook`` on each block as in
    :meth:`Embed.attend`) or the separate head's kernel; ``softcap`` as the model applies it."""
    if lm_head is None:
        table = embed.embedding[...]
        table = table if _is_bits(table) else table.astype(embed.dtype)
        return blocked_loss.table_head(table, embed.dtype, table_hook, softcap)
    return blocked_loss.kernel_head(lm_head.kernel[...], lm_head.dtype, softcap)


def lm_logits(hidden: jax.Array, embed: Embed, lm_head: Optional[Linear],
              table_hook: Optional[TableHook] = None) -> jax.Array:
    """float32 logits ``[B, T, V]`` from the tied table (``lm_head`` None) or the separate head;
    the matmul runs in the compute dtype with float32 accumulation either way (a large tied
    table in blocks of rows, see :mod:`jaxascend.models.vocab`; a separate head is one matmul).
    ``table_hook``: passed to the tied table's head use (see :data:`TableHook`)."""
    if lm_head is None:
        return embed.attend(hidden, table_hook)
    return jnp.einsum("BTD,DV->BTV", hidden, lm_head.kernel[...].astype(lm_head.dtype),
                      preferred_element_type=jnp.float32)


def activation(name: str) -> Callable[[jax.Array], jax.Array]:
    """The Hugging Face ``hidden_act`` / ``activation_function`` of that name, evaluated in fp32."""
    check_choice("model.hidden_act", name, HIDDEN_ACTS)
    fn = {
        "silu": jax.nn.silu,
        "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),  # tanh approximation
        "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
        "gelu": lambda x: jax.nn.gelu(x, approximate=False),  # exact (erf)
    }[name]
    return lambda x: fn(x.astype(jnp.float32)).astype(x.dtype)


# ----------------------------------------------------------------------------- attention

def causal_mask(length: int, sliding_window: Optional[int] = None) -> jax.Array:
    """bool ``[T, S]``: query ``t`` sees key ``s`` iff ``s <= t`` (and ``t - s < sliding_window``)."""
    t = jnp.arange(length)[:, None]
    s = jnp.arange(length)[None, :]
    mask = s <= t
    if sliding_window is not None:
        mask = mask & (s > t - sliding_window)
    return mask


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                     sliding_window: Optional[int] = None, scale: Optional[float] = None,
                     is_sliding: Optional[jax.Array] = None,
                     segment_ids: Optional[jax.Array] = None) -> jax.Array:
    """Grouped-query causal attention. ``q [B,T,N,H]``, ``k, v [B,T,K,H]`` with ``N % K == 0``
    (query head ``n`` uses key/value head ``n // (N // K)``). Returns ``[B,T,N,H]`` in q's dtype;
    scores and softmax in float32.

    ``scale`` multiplies the scores (default ``H ** -0.5``; Gemma 3 uses
    ``query_pre_attn_scalar ** -0.5``). ``is_sliding``, a traced bool scalar, applies
    ``sliding_window`` only where it is true: the layers of one scanned stack share a program,
    so a per-layer choice of mask must be data, not Python.

    ``segment_ids`` (int ``[B, T]``): several examples packed into one row; a query sees only
    keys of its own segment (padding is a segment of its own), so each example is attended to
    as if it were alone.
    """
    batch, length, num_heads, head_dim = q.shape
    num_kv = k.shape[2]
    q = q.reshape(batch, length, num_kv, num_heads // num_kv, head_dim)
    scores = jnp.einsum("BTKGH,BSKH->BKGTS", q, k, preferred_element_type=jnp.float32)
    scores = scores * (head_dim ** -0.5 if scale is None else scale)
    mask = causal_mask(length, sliding_window)
    if is_sliding is not None:
        mask = jnp.where(is_sliding, mask, causal_mask(length))
    if segment_ids is not None:
        same = segment_ids[:, :, None] == segment_ids[:, None, :]  # [B, T, S]
        mask = mask & same[:, None, None]  # [B, 1, 1, T, S]: per row, shared by the heads
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v)
    return out.reshape(batch, length, num_heads, head_dim)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, implementation: str,
              sliding_window: Optional[int] = None, scale: Optional[float] = None,
              is_sliding: Optional[jax.Array] = None, segment_ids: Optional[jax.Array] = None) -> jax.Array:
    """The models' training attention: :func:`causal_attention` or, by ``implementation``
    (``ModelConfig.attention``: auto, blockwise, dense) and the row length,
    :func:`~jaxascend.models.blockwise_attention.blockwise_attention`, which computes the same
    result with memory linear in the length. Same arguments and result as :func:`causal_attention`.
    auto and blockwise take cuDNN's fused attention on a GPU where it covers the call
    (:mod:`~jaxascend.models.fused_attention`)."""
    chosen = blockwise.chosen_implementation(implementation, q.shape[1])
    if implementation != "dense":
        out = fused.fused_attention(q, k, v, sliding_window=sliding_window, scale=scale, is_sliding=is_sliding,
                                    segment_ids=segment_ids)
        if out is not None:
            return out
    if chosen == "blockwise":
        return blockwise.blockwise_attention(q, k, v, sliding_window=sliding_window, scale=scale,
                                             is_sliding=is_sliding, segment_ids=segment_ids)
    return causal_attention(q, k, v, sliding_window=sliding_window, scale=scale, is_sliding=is_sliding,
                            segment_ids=segment_ids)


# ----------------------------------------------------------------------------- layer stack

def stack_layers(make_layer: Callable[[nnx.Rngs], nnx.Module], num_layers: int,
                 rngs: nnx.Rngs) -> nnx.Module:
    """Builds ``num_layers`` independently initialized layers as one module whose parameters
    have a leading layer axis ``[L, ...]`` (what :func:`scan_layers` iterates over)."""
    check_positive("model.num_hidden_layers", num_layers)

    @nnx.split_rngs(splits=num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, axis_size=num_layers)
    def make(layer_rngs: nnx.Rngs) -> nnx.Module:
        return make_layer(layer_rngs)

    return make(rngs)


def remat_policy(name: str):
    """``(use_checkpoint, policy)`` for a ``ModelConfig.remat`` name."""
    check_choice("model.remat", name, REMAT_POLICIES)
    policies = jax.checkpoint_policies
    return {
        "none": (False, None),
        "full": (True, None),  # save nothing but the layer input; recompute the whole layer
        "dots": (True, policies.checkpoint_dots),
        "dots_no_batch": (True, policies.dots_with_no_batch_dims_saveable),
        "offload": (True, policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=list(OFFLOADED_ACTIVATIONS),
            offload_src="device", offload_dst="pinned_host")),
    }[name]


def layer_forward(graphdef: nnx.GraphDef, layer_params: nnx.State, hidden: jax.Array,
                  positions: jax.Array, flag: Optional[jax.Array] = None,
                  segment_ids: Optional[jax.Array] = None) -> jax.Array:
    """One layer as a pure function of (its parameters, the hidden carry, positions), plus that
    layer's entry of ``scan_layers``' ``layer_flags`` when the model has them, and the packed
    rows' ``segment_ids`` (None: one sequence per row)."""
    layer = nnx.merge(graphdef, layer_params)
    if flag is None:
        return layer(hidden, positions, segment_ids=segment_ids)
    return layer(hidden, positions, flag, segment_ids=segment_ids)


LayerHook = Callable[[nnx.State, jax.Array], nnx.State]


def scan_layers(layers: nnx.Module, hidden: jax.Array, positions: jax.Array, remat: str,
                layer_hook: Optional[LayerHook] = None,
                layer_flags: Optional[tuple[bool, ...]] = None,
                segment_ids: Optional[jax.Array] = None, micro_batches: int = 1) -> jax.Array:
    """Runs ``hidden`` through the stacked ``layers`` with ``lax.scan``, one layer per step.

    Each step applies :func:`layer_forward` to that layer's slice of the stacked parameters,
    wrapped in ``jax.checkpoint`` with the ``remat`` policy (see :func:`remat_policy`). The
    parameters enter the scan as ``xs``, so a per-layer transform of them (e.g. a custom_vjp
    identity that ships the layer's gradient out) can be applied at the top of ``step``:
    ``layer_hook(layer_params, layer_index)`` does exactly that when given.

    ``layer_flags`` (one bool per layer, e.g. Gemma 3's sliding-window layers) travel through the
    scan beside the parameters and reach each layer as a traced bool scalar: layers that differ
    only in such a switch still share one scanned body instead of being unrolled.

    ``segment_ids`` (int ``[B, T]``, None: one sequence per row) keep the attention of packed
    examples inside each example (see :func:`causal_attention`).

    Streamed weights: when every stacked parameter is a ``jax.ShapeDtypeStruct`` (the weights
    are not in memory), nothing is scanned over but the layer index; ``layer_hook`` then receives
    the layer's *abstract* parameters (layer shapes) and must return real ones, e.g. read from
    SSD by :func:`jaxascend.offload.param_source.fetch_layer`. Under remat the hook's work is
    recomputed in the backward, so the weights are fetched again there, last layer first.

    ``micro_batches`` (``A``): the rows are a step's ``A`` micro-batches, and each layer runs
    them one after another (:mod:`~jaxascend.models.micro_batches`): the layer's weights are
    taken (``layer_hook``) once, and its gradient leaves once, summed over the micro-batches.
    """
    use_checkpoint, policy = remat_policy(remat)
    graphdef, stacked_params = nnx.split(layers)

    leaves = jax.tree.leaves(stacked_params)
    num_layers = leaves[0].shape[0]
    abstract = all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    if abstract:
        if layer_hook is None:
            raise ValueError("scan_layers: the stacked parameters are abstract (streamed weights) and no "
                             "layer_hook provides them")
        layer_spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), stacked_params)
    flags = None
    if layer_flags is not None:
        if len(layer_flags) != num_layers:
            raise ValueError(f"layer_flags: {len(layer_flags)} entries for {num_layers} layers")
        flags = jnp.asarray(layer_flags, dtype=bool)

    def step(carry, xs):
        layer_params, index, flag = xs  # flag is None without layer_flags (an empty pytree)
        if abstract:
            layer_params = layer_spec
        if layer_hook is not None:
            layer_params = layer_hook(layer_params, index)
        if micro_batches == 1:
            return layer_forward(graphdef, layer_params, carry, positions, flag, segment_ids), None

        def apply(params, hidden, rows):
            return layer_forward(graphdef, params, hidden, rows[0], flag, rows[1])

        return micro_batched_layer(apply, layer_params, carry, (positions, segment_ids), micro_batches,
                                   use_checkpoint, policy), None

    if use_checkpoint:
        # prevent_cse=False: inside scan CSE cannot merge the recomputation with the forward.
        step = jax.checkpoint(step, policy=policy, prevent_cse=False)
    xs = (None if abstract else stacked_params, jnp.arange(num_layers, dtype=jnp.int32), flags)
    hidden, _ = jax.lax.scan(step, hidden, xs)
    return hidden


def check_segment_ids(input_ids: jax.Array, segment_ids: Optional[jax.Array]) -> None:
    """Raises ValueError unless ``segment_ids`` is None or an integer array shaped like ``input_ids``."""
    if segment_ids is not None and (segment_ids.shape != input_ids.shape
                                    or not jnp.issubdtype(segment_ids.dtype, jnp.integer)):
        raise ValueError(f"segment_ids: expected an integer array shaped like input_ids {list(input_ids.shape)}, "
                         f"got {segment_ids.dtype}{list(segment_ids.shape)}")


def default_positions(input_ids: jax.Array, positions: Optional[jax.Array]) -> jax.Array:
    """Checks ``input_ids [B, T]`` (integer) and returns ``positions`` or ``arange(T)`` per row."""
    if input_ids.ndim != 2 or not jnp.issubdtype(input_ids.dtype, jnp.integer):
        raise ValueError(f"input_ids: expected an integer array [batch, time], got "
                         f"{input_ids.dtype}{list(input_ids.shape)}")
    if positions is None:
        return jnp.broadcast_to(jnp.arange(input_ids.shape[1], dtype=jnp.int32), input_ids.shape)
    if positions.shape != input_ids.shape or not jnp.issubdtype(positions.dtype, jnp.integer):
        raise ValueError(f"positions: expected an integer array shaped like input_ids "
                         f"{list(input_ids.shape)}, got {positions.dtype}{list(positions.shape)}")
    return positions
