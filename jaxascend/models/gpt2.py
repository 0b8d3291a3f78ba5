"""GPT-2 (arch ``gpt2``) as a Flax NNX causal LM.

Learned position embeddings, pre-norm LayerNorm blocks, fused q/k/v projection, GELU MLP
(``gelu_new``, the tanh approximation, unless ``hidden_act`` says otherwise), biases on every
projection and norm, output head tied to ``wte`` (or a separate ``lm_head`` when
``tie_word_embeddings`` is false, which stock GPT-2 checkpoints never are).

Config fields read: hidden_size (HF ``n_embd``), num_hidden_layers (``n_layer``),
num_attention_heads (``n_head``), intermediate_size (``n_inner``, HF's None means 4 * n_embd),
max_position_embeddings (``n_positions``), layer_norm_epsilon, hidden_act
(``activation_function``). num_key_value_heads must equal num_attention_heads, head_dim must be
None or hidden_size / num_attention_heads, rope_scaling and sliding_window must be None;
rope_theta, rms_norm_eps and attention_bias are not used.

Parameter tree and its Hugging Face names (``L`` layers, ``D`` hidden, ``F`` intermediate,
``P`` max positions, ``V`` vocab). HF's Conv1D stores weights ``[in, out]`` like our kernels,
so nothing is transposed. ``GPT2LMHeadModel`` checkpoints prefix every name with
``transformer.``; the original ``gpt2`` checkpoints have no prefix. Our layer parameters are
stacked: HF's ``h.{i}.X`` is slice ``[i]`` of our ``h.X``.

=============================================  ==================================
Hugging Face tensor                            our path (shape)
=============================================  ==================================
``wte.weight`` [V, D]                          ``wte.embedding`` [V, D]
``wpe.weight`` [P, D]                          ``wpe.embedding`` [P, D]
``h.{i}.ln_1.weight`` / ``.bias`` [D]          ``h.ln_1.scale`` / ``.bias`` [L, D]
``h.{i}.attn.c_attn.weight`` [D, 3D]           ``h.attn.c_attn.kernel`` [L, D, 3D]
``h.{i}.attn.c_attn.bias`` [3D]                ``h.attn.c_attn.bias`` [L, 3D]
``h.{i}.attn.c_proj.weight`` [D, D]            ``h.attn.c_proj.kernel`` [L, D, D]
``h.{i}.attn.c_proj.bias`` [D]                 ``h.attn.c_proj.bias`` [L, D]
``h.{i}.ln_2.weight`` / ``.bias`` [D]          ``h.ln_2.scale`` / ``.bias`` [L, D]
``h.{i}.mlp.c_fc.weight`` [D, F]               ``h.mlp.c_fc.kernel`` [L, D, F]
``h.{i}.mlp.c_fc.bias`` [F]                    ``h.mlp.c_fc.bias`` [L, F]
``h.{i}.mlp.c_proj.weight`` [F, D]             ``h.mlp.c_proj.kernel`` [L, F, D]
``h.{i}.mlp.c_proj.bias`` [D]                  ``h.mlp.c_proj.bias`` [L, D]
``ln_f.weight`` / ``.bias`` [D]                ``ln_f.scale`` / ``.bias`` [D]
``lm_head.weight`` [V, D] (tied to wte)        none when tied; else ``lm_head.kernel`` [D, V] (T)
=============================================  ==================================

``c_attn``'s output columns are ``[q | k | v]``, each head-major (``n * H + h``), as in HF.
Older checkpoints also hold ``h.{i}.attn.bias`` / ``attn.masked_bias`` (causal-mask buffers,
not parameters): skip them on import.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxascend.config import ModelConfig
from jaxascend.models import layers as L
from jaxascend.models.causal_lm import CausalLM
from jaxascend.models.decoding import LayerKV, cached_attention


def _check_gpt2_config(cfg: ModelConfig, vocab_size: int) -> None:
    L.check_choice("model.arch", cfg.arch, ("gpt2",))
    L.check_positive("vocab_size", vocab_size)
    for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "max_position_embeddings"):
        L.check_positive(f"model.{name}", getattr(cfg, name))
    if cfg.hidden_size % cfg.num_attention_heads:
        raise ValueError(f"model.hidden_size: {cfg.hidden_size} is not divisible by "
                         f"model.num_attention_heads={cfg.num_attention_heads}")
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    if cfg.head_dim is not None and cfg.head_dim != head_dim:
        raise ValueError(f"model.head_dim: gpt2 uses hidden_size / num_attention_heads = {head_dim}; "
                         f"set it to null, got {cfg.head_dim}")
    if cfg.num_key_value_heads != cfg.num_attention_heads:
        raise ValueError(f"model.num_key_value_heads: gpt2 has no grouped-query attention; must equal "
                         f"model.num_attention_heads={cfg.num_attention_heads}, got "
                         f"{cfg.num_key_value_heads}")
    if cfg.rope_scaling is not None:
        raise ValueError("model.rope_scaling: gpt2 uses learned position embeddings; must be null")
    if cfg.sliding_window is not None:
        raise ValueError("model.sliding_window: gpt2 has no sliding-window attention; must be null")
    L.check_common_fields(cfg, "gelu_new")


def _linear(cfg: ModelConfig, in_features: int, out_features: int, rngs: nnx.Rngs) -> L.Linear:
    return L.Linear(in_features, out_features, use_bias=True, init_std=cfg.init_std,
                    dtype=L.DTYPES[cfg.dtype], param_dtype=L.DTYPES[cfg.param_dtype], rngs=rngs)


def _layer_norm(cfg: ModelConfig) -> L.LayerNorm:
    return L.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_epsilon, dtype=L.DTYPES[cfg.dtype],
                       param_dtype=L.DTYPES[cfg.param_dtype])


class GPT2Attention(nnx.Module):
    """Multi-head causal self-attention with a fused ``c_attn`` q/k/v projection."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d = cfg.hidden_size
        self.c_attn = _linear(cfg, d, 3 * d, rngs)
        self.c_proj = _linear(cfg, d, d, rngs)
        self.num_heads = cfg.num_attention_heads
        self.implementation = cfg.attention  # dense or blockwise (L.attention)

    def project(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``q, k, v [B,T,N,H]`` of ``x`` (the fused ``c_attn``)."""
        batch, length, width = x.shape
        shape = (batch, length, self.num_heads, width // self.num_heads)
        q, k, v = jnp.split(self.c_attn(x), 3, axis=-1)
        q = checkpoint_name(q.reshape(shape), "query")
        k = checkpoint_name(k.reshape(shape), "key")
        return q, k, checkpoint_name(v.reshape(shape), "value")

    def __call__(self, x: jax.Array, segment_ids: Optional[jax.Array] = None) -> jax.Array:
        batch, length, width = x.shape
        q, k, v = self.project(x)
        context = L.attention(q, k, v, implementation=self.implementation, segment_ids=segment_ids)
        context = context.reshape(batch, length, width)
        context = checkpoint_name(context, "attn_context")
        return checkpoint_name(self.c_proj(context), "attn_out")

    def decode(self, x: jax.Array, kv: LayerKV, start: jax.Array) -> tuple[jax.Array, LayerKV]:
        """The cached call over ``x [B,t,D]`` at cache indices ``start ..`` (see
        :func:`jaxascend.models.decoding.cached_attention`)."""
        batch, length, width = x.shape
        q, k, v = self.project(x)
        context, kv = cached_attention(q, k, v, kv, start)
        return self.c_proj(context.reshape(batch, length, width)), kv


class GPT2MLP(nnx.Module):
    """``c_proj(act(c_fc(x)))``."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.c_fc = _linear(cfg, cfg.hidden_size, cfg.intermediate_size, rngs)
        self.c_proj = _linear(cfg, cfg.intermediate_size, cfg.hidden_size, rngs)
        self.hidden_act = cfg.hidden_act or "gelu_new"  # a name: module data must hash by value

    def __call__(self, x: jax.Array) -> jax.Array:
        up = checkpoint_name(self.c_fc(x), "mlp_up")
        return checkpoint_name(self.c_proj(L.activation(self.hidden_act)(up)), "mlp_out")


class GPT2Block(nnx.Module):
    """Pre-norm block: ``x += attn(ln_1(x)); x += mlp(ln_2(x))``."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.ln_1 = _layer_norm(cfg)
        self.attn = GPT2Attention(cfg, rngs=rngs)
        self.ln_2 = _layer_norm(cfg)
        self.mlp = GPT2MLP(cfg, rngs=rngs)

    def __call__(self, hidden: jax.Array, positions: jax.Array, *,
                 segment_ids: Optional[jax.Array] = None) -> jax.Array:
        del positions  # positions enter once, through wpe, before the first block
        hidden = hidden + self.attn(self.ln_1(hidden), segment_ids)
        return hidden + self.mlp(self.ln_2(hidden))

    def decode(self, hidden: jax.Array, positions: jax.Array, kv: LayerKV, start: jax.Array, *,
               rope_length: Optional[jax.Array] = None) -> tuple[jax.Array, LayerKV]:
        """The block over a cached call (positions entered through ``wpe``; no RoPE, so
        ``rope_length`` is unused)."""
        del positions, rope_length
        attn, kv = self.attn.decode(self.ln_1(hidden), kv, start)
        hidden = hidden + attn
        return hidden + self.mlp(self.ln_2(hidden)), kv


class GPT2LMHeadModel(nnx.Module, CausalLM):
    """GPT-2 LM: ``model(input_ids [B,T], positions [B,T] | None, segment_ids [B,T] | None)
    -> float32 [B,T,V]``; ``model.decode(input_ids [B,t], cache, start)`` is the cached path.

    Positions index ``wpe``; a position >= max_position_embeddings gives NaN logits (the table
    lookup fills out-of-range rows with NaN instead of clamping).
    """

    LAYER_STACK = "h"  # the stacked blocks
    TOKEN_TABLE = ("wte", "embedding")
    FINAL_NORM = "ln_f"

    def __init__(self, cfg: ModelConfig, vocab_size: int, *, rngs: nnx.Rngs):
        _check_gpt2_config(cfg, vocab_size)
        dtype, param_dtype = L.DTYPES[cfg.dtype], L.DTYPES[cfg.param_dtype]
        self.wte = L.Embed(vocab_size, cfg.hidden_size, init_std=cfg.init_std, dtype=dtype,
                           param_dtype=param_dtype, rngs=rngs)
        self.wpe = L.Embed(cfg.max_position_embeddings, cfg.hidden_size, init_std=cfg.init_std,
                           dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.h = L.stack_layers(lambda r: GPT2Block(cfg, rngs=r), cfg.num_hidden_layers, rngs)
        self.ln_f = _layer_norm(cfg)
        self.lm_head = L.output_head(cfg, vocab_size, rngs)
        self.max_positions = cfg.max_position_embeddings
        self.remat = cfg.remat
        self.loss = cfg.loss  # how the loss computes the head: L.LOSS_IMPLEMENTATIONS
        self.dtype = dtype
        heads = cfg.num_attention_heads
        self.kv_cache_dims = (cfg.num_hidden_layers, heads, cfg.hidden_size // heads)

    def embed_inputs(self, input_ids: jax.Array, positions: jax.Array,
                     table_hook: Optional[L.TableHook] = None) -> jax.Array:
        """The first block's input: token plus position embeddings."""
        return self.embed(input_ids, table_hook) + self.wpe(positions)

    def hidden_states(self, input_ids: jax.Array, positions: Optional[jax.Array] = None,
                      layer_hook: Optional[L.LayerHook] = None, table_hook: Optional[L.TableHook] = None,
                      segment_ids: Optional[jax.Array] = None, micro_batches: int = 1) -> jax.Array:
        """As :meth:`CausalLM.hidden_states`; without ``positions``, a row longer than ``wpe`` is refused."""
        if positions is None and input_ids.ndim == 2 and input_ids.shape[1] > self.max_positions:
            raise ValueError(f"input_ids: length {input_ids.shape[1]} exceeds "
                             f"model.max_position_embeddings={self.max_positions}")
        return super().hidden_states(input_ids, positions, layer_hook, table_hook, segment_ids, micro_batches)
