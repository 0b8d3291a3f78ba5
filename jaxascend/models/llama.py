"""The Llama family (arch ``llama``, ``qwen2``, ``mistral``, ``qwen3``, ``phi3``) as one Flax NNX
causal LM.

RMSNorm pre-norm blocks, RoPE (``rope_theta``; every ``rope_scaling`` type of
:mod:`jaxascend.models.rope`, optionally partial), grouped-query attention, optional q/k/v bias
(Qwen2; Qwen3 adds o_proj), q/k RMSNorm over head_dim before RoPE (Qwen3), optional sliding window
on every layer (Mistral, Phi-3), SwiGLU MLP, tied or untied output head. Phi-3's checkpoints fuse
q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``: our tree is Llama's, and each of those
parameters is a block of rows of HF's fused tensor (:mod:`jaxascend.hf.names`), split on load
and fused on export.

Parameter tree and its Hugging Face names (``L`` layers, ``D`` hidden_size, ``N`` heads,
``K`` key/value heads, ``H`` head_dim, ``F`` intermediate_size, ``V`` vocab). Our layer
parameters are stacked along a leading layer axis; HF's ``model.layers.{i}.X`` is slice ``[i]``
of our ``layers.X``. "T" means HF's tensor is the transpose of our slice (HF ``nn.Linear.weight``
is ``[out, in]``; our kernels are ``[in, out]``).

=========================================================  ============================================  =====
Hugging Face tensor                                        our path (shape)                              T
=========================================================  ============================================  =====
``model.embed_tokens.weight`` [V, D]                       ``embed_tokens.embedding`` [V, D]
``model.layers.{i}.input_layernorm.weight`` [D]            ``layers.input_layernorm.scale`` [L, D]
``model.layers.{i}.self_attn.q_proj.weight`` [N*H, D]      ``layers.self_attn.q_proj.kernel`` [L, D, N*H]  T
``model.layers.{i}.self_attn.q_proj.bias`` [N*H]           ``layers.self_attn.q_proj.bias`` [L, N*H]       (attention_bias)
``model.layers.{i}.self_attn.k_proj.weight`` [K*H, D]      ``layers.self_attn.k_proj.kernel`` [L, D, K*H]  T
``model.layers.{i}.self_attn.k_proj.bias`` [K*H]           ``layers.self_attn.k_proj.bias`` [L, K*H]       (attention_bias)
``model.layers.{i}.self_attn.v_proj.weight`` [K*H, D]      ``layers.self_attn.v_proj.kernel`` [L, D, K*H]  T
``model.layers.{i}.self_attn.v_proj.bias`` [K*H]           ``layers.self_attn.v_proj.bias`` [L, K*H]       (attention_bias)
``model.layers.{i}.self_attn.o_proj.weight`` [D, N*H]      ``layers.self_attn.o_proj.kernel`` [L, N*H, D]  T
``model.layers.{i}.self_attn.q_norm.weight`` [H]           ``layers.self_attn.q_norm.scale`` [L, H]       (qwen3)
``model.layers.{i}.self_attn.k_norm.weight`` [H]           ``layers.self_attn.k_norm.scale`` [L, H]       (qwen3)
``model.layers.{i}.post_attention_layernorm.weight`` [D]   ``layers.post_attention_layernorm.scale`` [L, D]
``model.layers.{i}.mlp.gate_proj.weight`` [F, D]           ``layers.mlp.gate_proj.kernel`` [L, D, F]       T
``model.layers.{i}.mlp.up_proj.weight`` [F, D]             ``layers.mlp.up_proj.kernel`` [L, D, F]         T
``model.layers.{i}.mlp.down_proj.weight`` [D, F]           ``layers.mlp.down_proj.kernel`` [L, F, D]       T
``model.norm.weight`` [D]                                  ``norm.scale`` [D]
``lm_head.weight`` [V, D]                                  ``lm_head.kernel`` [D, V]                       T (absent when tied)
=========================================================  ============================================  =====

Head layout inside ``N*H`` is head-major (``n * H + h``), as in HF, so no permutation is needed.
phi3: ``self_attn.qkv_proj.weight`` [(N+2K)*H, D] is rows ``[q_proj | k_proj | v_proj]`` and
``mlp.gate_up_proj.weight`` [2F, D] is rows ``[gate_proj | up_proj]`` of the tensors above.
With ``tie_word_embeddings`` HF checkpoints may omit ``lm_head.weight`` (or store a copy of the
embedding); our tree has no ``lm_head`` then. HF's ``rotary_emb.inv_freq`` buffers are not
parameters (recomputed from the config).
"""

from __future__ import annotations

from typing import Optional

import jax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxascend.config import ModelConfig, validate_rope_scaling
from jaxascend.models import layers as L
from jaxascend.models.causal_lm import CausalLM
from jaxascend.models.decoding import LayerKV, cached_attention
from jaxascend.models.rope import Rotary, apply_rope

LLAMA_ARCHS = ("llama", "qwen2", "mistral", "qwen3", "phi3")
QK_NORM_ARCHS = ("qwen3",)  # RMSNorm over head_dim on q and k, before RoPE


def check_llama_config(cfg: ModelConfig, vocab_size: int, archs: tuple[str, ...] = LLAMA_ARCHS) -> int:
    """Validates the fields this model reads; returns the head dimension. ``archs``: the arch
    names the caller builds (Gemma 3 shares these fields and checks)."""
    L.check_choice("model.arch", cfg.arch, archs)
    L.check_positive("vocab_size", vocab_size)
    for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads"):
        L.check_positive(f"model.{name}", getattr(cfg, name))
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ValueError(f"model.num_key_value_heads: {cfg.num_key_value_heads} must divide "
                         f"model.num_attention_heads={cfg.num_attention_heads}")
    if cfg.head_dim is None:
        if cfg.hidden_size % cfg.num_attention_heads:
            raise ValueError(f"model.hidden_size: {cfg.hidden_size} is not divisible by "
                             f"model.num_attention_heads={cfg.num_attention_heads}; set model.head_dim")
        head_dim = cfg.hidden_size // cfg.num_attention_heads
    else:
        L.check_positive("model.head_dim", cfg.head_dim)
        head_dim = cfg.head_dim
    validate_rope_scaling(cfg.rope_scaling)
    if head_dim % 2:
        raise ValueError(f"model.head_dim: RoPE needs an even head dimension, got {head_dim}")
    if cfg.sliding_window is not None:
        L.check_positive("model.sliding_window", cfg.sliding_window)
    L.check_common_fields(cfg, "silu")
    return head_dim


class LlamaAttention(nnx.Module):
    """Grouped-query self-attention with RoPE and an optional sliding window; q/k RMSNorm over
    head_dim before RoPE for Qwen3."""

    def __init__(self, cfg: ModelConfig, head_dim: int, *, rngs: nnx.Rngs):
        dtype, param_dtype = L.DTYPES[cfg.dtype], L.DTYPES[cfg.param_dtype]
        n, k, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size

        def linear(i, o, bias):
            return L.Linear(i, o, use_bias=bias, init_std=cfg.init_std, dtype=dtype,
                            param_dtype=param_dtype, rngs=rngs)

        self.q_proj = linear(d, n * head_dim, cfg.attention_bias)
        self.k_proj = linear(d, k * head_dim, cfg.attention_bias)
        self.v_proj = linear(d, k * head_dim, cfg.attention_bias)
        # Qwen3's attention_bias puts a bias on o_proj too; Qwen2's is q/k/v only.
        self.o_proj = linear(n * head_dim, d, cfg.attention_bias and cfg.arch == "qwen3")
        if cfg.arch in QK_NORM_ARCHS:
            self.q_norm = L.RMSNorm(head_dim, eps=cfg.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
            self.k_norm = L.RMSNorm(head_dim, eps=cfg.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
        self.qk_norm = cfg.arch in QK_NORM_ARCHS
        self.num_heads, self.num_kv_heads, self.head_dim = n, k, head_dim
        # Frozen and hashable: static module data is part of the graphdef.
        self.rope = Rotary(head_dim, cfg.rope_theta, Rotary.freeze(cfg.rope_scaling),
                             cfg.max_position_embeddings, cfg.partial_rotary_factor)
        self.sliding_window = cfg.sliding_window
        self.scale = None  # head_dim ** -0.5 (Gemma 3 sets its own)
        self.implementation = cfg.attention  # dense or blockwise (L.attention)

    def rope_angles(self, positions: jax.Array, is_sliding: Optional[jax.Array],
                    length: Optional[jax.Array] = None) -> tuple[jax.Array, jax.Array]:
        """``(sin, cos)`` of this layer; every Llama-family layer has the same RoPE (Gemma 3's
        sliding layers have their own, chosen by ``is_sliding``). ``length``: see ``Rotary.angles``."""
        return self.rope.angles(positions, length)

    def project(self, x: jax.Array, positions: jax.Array, is_sliding: Optional[jax.Array],
                rope_length: Optional[jax.Array] = None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``q [B,T,N,H]`` and ``k, v [B,T,K,H]`` of ``x``: projections, q/k norms, RoPE."""
        batch, length, _ = x.shape
        q = self.q_proj(x).reshape(batch, length, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(batch, length, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(batch, length, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        sin, cos = self.rope_angles(positions, is_sliding, rope_length)
        q = checkpoint_name(apply_rope(q, sin, cos), "query")
        k = checkpoint_name(apply_rope(k, sin, cos), "key")
        return q, k, checkpoint_name(v, "value")

    def __call__(self, x: jax.Array, positions: jax.Array, is_sliding: Optional[jax.Array] = None, *,
                 segment_ids: Optional[jax.Array] = None) -> jax.Array:
        """``is_sliding`` (a traced bool; None: ``sliding_window`` on every layer) is the layer's
        entry of ``scan_layers``' ``layer_flags``; ``segment_ids`` keep packed examples apart."""
        batch, length, _ = x.shape
        q, k, v = self.project(x, positions, is_sliding)
        context = L.attention(q, k, v, implementation=self.implementation, sliding_window=self.sliding_window,
                              scale=self.scale, is_sliding=is_sliding, segment_ids=segment_ids)
        context = checkpoint_name(context.reshape(batch, length, -1), "attn_context")
        return checkpoint_name(self.o_proj(context), "attn_out")

    def decode(self, x: jax.Array, positions: jax.Array, kv: LayerKV, start: jax.Array,
               is_sliding: Optional[jax.Array] = None,
               rope_length: Optional[jax.Array] = None) -> tuple[jax.Array, LayerKV]:
        """The cached call over ``x [B,t,D]`` at cache indices ``positions`` (``start`` ..):
        this call's keys and values go into ``kv``, the queries attend over all of it.
        ``rope_length``: what RoPE chooses its frequencies from (None: ``start + t``)."""
        batch, length, _ = x.shape
        rope_length = start + length if rope_length is None else rope_length
        q, k, v = self.project(x, positions, is_sliding, rope_length=rope_length)
        context, kv = cached_attention(q, k, v, kv, start, sliding_window=self.sliding_window, scale=self.scale,
                                       is_sliding=is_sliding)
        return self.o_proj(context.reshape(batch, length, -1)), kv


class LlamaMLP(nnx.Module):
    """SwiGLU: ``down_proj(act(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        dtype, param_dtype = L.DTYPES[cfg.dtype], L.DTYPES[cfg.param_dtype]
        d, f = cfg.hidden_size, cfg.intermediate_size

        def linear(i, o):
            return L.Linear(i, o, use_bias=False, init_std=cfg.init_std, dtype=dtype,
                            param_dtype=param_dtype, rngs=rngs)

        self.gate_proj = linear(d, f)
        self.up_proj = linear(d, f)
        self.down_proj = linear(f, d)
        self.hidden_act = cfg.hidden_act or "silu"  # a name: module data must hash by value

    def __call__(self, x: jax.Array) -> jax.Array:
        gate = checkpoint_name(self.gate_proj(x), "mlp_gate")
        up = checkpoint_name(self.up_proj(x), "mlp_up")
        return checkpoint_name(self.down_proj(L.activation(self.hidden_act)(gate) * up), "mlp_out")


class LlamaDecoderLayer(nnx.Module):
    """Pre-norm block: ``x += attn(norm(x)); x += mlp(norm(x))``."""

    def __init__(self, cfg: ModelConfig, head_dim: int, *, rngs: nnx.Rngs):
        dtype, param_dtype = L.DTYPES[cfg.dtype], L.DTYPES[cfg.param_dtype]
        self.input_layernorm = L.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype,
                                         param_dtype=param_dtype)
        self.self_attn = LlamaAttention(cfg, head_dim, rngs=rngs)
        self.post_attention_layernorm = L.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps,
                                                  dtype=dtype, param_dtype=param_dtype)
        self.mlp = LlamaMLP(cfg, rngs=rngs)

    def __call__(self, hidden: jax.Array, positions: jax.Array, *,
                 segment_ids: Optional[jax.Array] = None) -> jax.Array:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), positions, segment_ids=segment_ids)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def decode(self, hidden: jax.Array, positions: jax.Array, kv: LayerKV, start: jax.Array, *,
               rope_length: Optional[jax.Array] = None) -> tuple[jax.Array, LayerKV]:
        """The block over a cached call (see ``LlamaAttention.decode``)."""
        attn, kv = self.self_attn.decode(self.input_layernorm(hidden), positions, kv, start,
                                         rope_length=rope_length)
        hidden = hidden + attn
        return hidden + self.mlp(self.post_attention_layernorm(hidden)), kv


class LlamaForCausalLM(nnx.Module, CausalLM):
    """Decoder-only LM: ``model(input_ids [B,T], positions [B,T] | None) -> float32 [B,T,V]``;
    ``segment_ids [B,T]`` keep the attention of examples packed into one row apart.
    ``model.decode(input_ids [B,t], cache, start) -> (logits, cache)`` is the cached path
    (:mod:`jaxascend.models.decoding`)."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, *, rngs: nnx.Rngs):
        head_dim = check_llama_config(cfg, vocab_size)
        dtype, param_dtype = L.DTYPES[cfg.dtype], L.DTYPES[cfg.param_dtype]
        self.embed_tokens = L.Embed(vocab_size, cfg.hidden_size, init_std=cfg.init_std,
                                    dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.layers = L.stack_layers(lambda r: LlamaDecoderLayer(cfg, head_dim, rngs=r),
                                     cfg.num_hidden_layers, rngs)
        self.norm = L.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype,
                              param_dtype=param_dtype)
        self.lm_head = L.output_head(cfg, vocab_size, rngs)
        self.remat = cfg.remat
        self.loss = cfg.loss  # how the loss computes the head: L.LOSS_IMPLEMENTATIONS
        self.dtype = dtype
        self.kv_cache_dims = (cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim)
