"""Gemma 3, text only (arch ``gemma3``; Hugging Face ``Gemma3ForCausalLM``), as a Flax NNX causal LM.

What differs from the Llama family (``llama.py``, whose MLP and checks it reuses):

- zero-centred RMSNorm, ``x / rms(x) * (1 + w)`` in float32 (``RMSNorm(offset=1)``); the stored
  scale is HF's ``w`` verbatim and starts at 0;
- the embedding is multiplied by ``sqrt(hidden_size)``, the scalar rounded to the compute dtype
  first as HF rounds it to the weight dtype (bf16: ``sqrt(1152) = 33.94 -> 34.0``); a tied
  head reads the unscaled table;
- GeGLU MLP (``hidden_activation``, default ``gelu_pytorch_tanh``);
- four norms per block (``input_layernorm``, ``post_attention_layernorm`` on the attention
  output, ``pre_feedforward_layernorm``, ``post_feedforward_layernorm`` on the MLP output) and
  per-head ``q_norm``/``k_norm`` before RoPE;
- ``layer_types``: sliding layers see ``sliding_window`` keys and use RoPE base
  ``rope_local_theta`` without scaling; full layers see every earlier key and use
  ``rope_theta`` with ``rope_scaling`` (Gemma 3 4B: linear x8);
- scores scaled by ``query_pre_attn_scalar ** -0.5``; optional ``final_logit_softcapping``.
  ``attn_logit_softcapping`` is not applied: transformers 5.24's ``Gemma3Attention`` stores it
  but never passes it to the attention function, so we match transformers (and the config
  reader accepts only null).

Sliding and full layers have the same parameters, so the stack stays one ``lax.scan``: a bool
per layer travels beside the stacked weights (``scan_layers(layer_flags=...)``) and selects the
mask and the RoPE table inside the scanned body.

Parameter tree: Llama's (see ``llama.py``; no biases) plus, per layer,

=============================================================  ==========================================
Hugging Face tensor                                            our path (shape)
=============================================================  ==========================================
``model.layers.{i}.self_attn.q_norm.weight`` [H]               ``layers.self_attn.q_norm.scale`` [L, H]
``model.layers.{i}.self_attn.k_norm.weight`` [H]               ``layers.self_attn.k_norm.scale`` [L, H]
``model.layers.{i}.pre_feedforward_layernorm.weight`` [D]      ``layers.pre_feedforward_layernorm.scale`` [L, D]
``model.layers.{i}.post_feedforward_layernorm.weight`` [D]     ``layers.post_feedforward_layernorm.scale`` [L, D]
=============================================================  ==========================================
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from jaxascend.config import ModelConfig
from jaxascend.models import layers as L
from jaxascend.models.causal_lm import CausalLM
from jaxascend.models.decoding import LayerKV
from jaxascend.models.llama import LlamaAttention, LlamaMLP, check_llama_config
from jaxascend.models.rope import Rotary

GEMMA3_ARCHS = ("gemma3",)
DEFAULT_HIDDEN_ACT = "gelu_pytorch_tanh"  # HF Gemma3TextConfig.hidden_activation
DEFAULT_LOCAL_THETA = 10000.0  # HF rope_local_base_freq


def layer_types(cfg: ModelConfig) -> tuple[str, ...]:
    """``cfg.layer_types``, or every layer alike: sliding when ``sliding_window`` is set."""
    if cfg.layer_types is not None:
        return tuple(cfg.layer_types)
    kind = "full_attention" if cfg.sliding_window is None else "sliding_attention"
    return (kind,) * cfg.num_hidden_layers


def _norm(cfg: ModelConfig, features: int) -> L.RMSNorm:
    return L.RMSNorm(features, eps=cfg.rms_norm_eps, dtype=L.DTYPES[cfg.dtype],
                     param_dtype=L.DTYPES[cfg.param_dtype], offset=1.0)


class Gemma3Attention(LlamaAttention):
    """Llama's grouped-query attention with zero-centred per-head q/k norms, the
    ``query_pre_attn_scalar`` scale, and two RoPEs: the layer's ``is_sliding`` flag picks the
    local one (``rope_local_theta``, no scaling) and the sliding-window mask, or the global one
    (``rope_theta`` + ``rope_scaling``, built by LlamaAttention) and the causal mask."""

    def __init__(self, cfg: ModelConfig, head_dim: int, *, rngs: nnx.Rngs):
        super().__init__(cfg, head_dim, rngs=rngs)
        self.q_norm = _norm(cfg, head_dim)
        self.k_norm = _norm(cfg, head_dim)
        self.qk_norm = True
        self.local_rope = Rotary(head_dim, cfg.rope_local_theta or DEFAULT_LOCAL_THETA, None,
                                   cfg.max_position_embeddings)
        self.scale = (cfg.query_pre_attn_scalar or head_dim) ** -0.5

    def rope_angles(self, positions: jax.Array, is_sliding: jax.Array,
                    length: Optional[jax.Array] = None) -> tuple[jax.Array, jax.Array]:
        # Both tables are [B, T, H/2]: computing the unused one costs nothing next to attention.
        local, full = self.local_rope.angles(positions, length), self.rope.angles(positions, length)
        return jnp.where(is_sliding, local[0], full[0]), jnp.where(is_sliding, local[1], full[1])


class Gemma3DecoderLayer(nnx.Module):
    """Sandwich-norm block: ``x += post_attn_norm(attn(norm(x)))``, then
    ``x += post_ff_norm(mlp(pre_ff_norm(x)))``."""

    def __init__(self, cfg: ModelConfig, head_dim: int, *, rngs: nnx.Rngs):
        self.input_layernorm = _norm(cfg, cfg.hidden_size)
        self.self_attn = Gemma3Attention(cfg, head_dim, rngs=rngs)
        self.post_attention_layernorm = _norm(cfg, cfg.hidden_size)
        self.pre_feedforward_layernorm = _norm(cfg, cfg.hidden_size)
        self.mlp = LlamaMLP(cfg, rngs=rngs)
        self.post_feedforward_layernorm = _norm(cfg, cfg.hidden_size)

    def __call__(self, hidden: jax.Array, positions: jax.Array, is_sliding: jax.Array, *,
                 segment_ids: Optional[jax.Array] = None) -> jax.Array:
        attn = self.self_attn(self.input_layernorm(hidden), positions, is_sliding, segment_ids=segment_ids)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)

    def decode(self, hidden: jax.Array, positions: jax.Array, kv: LayerKV, start: jax.Array,
               is_sliding: jax.Array, *, rope_length: Optional[jax.Array] = None) -> tuple[jax.Array, LayerKV]:
        """The block over a cached call (see ``LlamaAttention.decode``)."""
        attn, kv = self.self_attn.decode(self.input_layernorm(hidden), positions, kv, start, is_sliding,
                                         rope_length)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp), kv


class Gemma3ForCausalLM(nnx.Module, CausalLM):
    """Gemma 3 LM: ``model(input_ids [B,T], positions [B,T] | None, segment_ids [B,T] | None)
    -> float32 [B,T,V]``; ``model.decode(input_ids [B,t], cache, start)`` is the cached path."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, *, rngs: nnx.Rngs):
        cfg = dataclasses.replace(cfg, hidden_act=cfg.hidden_act or DEFAULT_HIDDEN_ACT)
        head_dim = check_llama_config(cfg, vocab_size, GEMMA3_ARCHS)
        if cfg.attention_bias:
            raise ValueError("model.attention_bias: gemma3 has no q/k/v bias; must be false")
        dtype, param_dtype = L.DTYPES[cfg.dtype], L.DTYPES[cfg.param_dtype]
        self.embed_tokens = L.Embed(vocab_size, cfg.hidden_size, init_std=cfg.init_std,
                                    dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.layers = L.stack_layers(lambda r: Gemma3DecoderLayer(cfg, head_dim, rngs=r),
                                     cfg.num_hidden_layers, rngs)
        self.norm = _norm(cfg, cfg.hidden_size)
        self.lm_head = L.output_head(cfg, vocab_size, rngs)
        self.layer_flags = tuple(kind == "sliding_attention" for kind in layer_types(cfg))
        self.embed_scale = math.sqrt(cfg.hidden_size)
        self.final_logit_softcapping = cfg.final_logit_softcapping
        self.remat = cfg.remat
        self.loss = cfg.loss  # how the loss computes the head: L.LOSS_IMPLEMENTATIONS
        self.dtype = dtype
        self.kv_cache_dims = (cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim)
