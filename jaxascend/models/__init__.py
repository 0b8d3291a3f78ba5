"""Decoder-only causal LMs in Flax NNX: the Llama family (llama, qwen2, mistral, qwen3, phi3),
GPT-2 and Gemma 3 (text), and their next-token loss (over every target, or a weighted subset).

    model = build_model(cfg.model, vocab_size=259, rngs=nnx.Rngs(0))
    logits = model(input_ids)            # int32 [B, T] -> float32 [B, T, V]
    count_params(model)

    cache = model.init_cache(batch=1, length=64)          # cached decoding (models.decoding)
    logits, cache = model.decode(prompt, cache, 0)        # prefill, then one token at a time

Layers are stacked along a leading axis and run under ``lax.scan`` with the remat policy
``cfg.remat``; each model module documents its parameter tree against Hugging Face names.
Imports only :mod:`jaxascend.config`.
"""

from __future__ import annotations

import jax
from flax import nnx

from jaxascend.config import ModelConfig
from jaxascend.models.blocked_loss import CHUNK_ELEMENTS as LOSS_CHUNK_ELEMENTS
from jaxascend.models.blocked_loss import blocked_token_losses, chosen_loss, table_head
from jaxascend.models.blockwise_attention import scores_held
from jaxascend.models.decoding import KVCache, cache_positions, layer_decode
from jaxascend.models.gemma3 import GEMMA3_ARCHS, Gemma3ForCausalLM
from jaxascend.models.gpt2 import GPT2LMHeadModel
from jaxascend.models.vocab import is_large_table, table_blocks
from jaxascend.models.layers import DTYPES, REMAT_POLICIES, attention
from jaxascend.models.llama import LLAMA_ARCHS, LlamaForCausalLM
from jaxascend.models.losses import (TokenBatch, as_token_batch, batch_loss, forward, loss_sum_and_count,
                                     next_token_loss, token_batch, token_losses)
from jaxascend.models.rope import Rotary

ARCHS = LLAMA_ARCHS + ("gpt2",) + GEMMA3_ARCHS


def model_class(arch: str) -> type:
    """The model class of architecture ``arch``."""
    if arch in LLAMA_ARCHS:
        return LlamaForCausalLM
    if arch == "gpt2":
        return GPT2LMHeadModel
    if arch in GEMMA3_ARCHS:
        return Gemma3ForCausalLM
    raise ValueError(f"model.arch: {arch!r} is not supported (allowed: {', '.join(ARCHS)})")


def layer_stack_key(arch: str) -> str:
    """The attribute holding the scanned layer stack ('layers'; GPT-2: 'h')."""
    return model_class(arch).LAYER_STACK


def token_table_path(arch: str) -> tuple[str, ...]:
    """The path of the token embedding table in the parameter tree (also the head when tied)."""
    return model_class(arch).TOKEN_TABLE


def build_model(cfg: ModelConfig, vocab_size: int, *, rngs: nnx.Rngs) -> nnx.Module:
    """Builds the model ``cfg.arch`` names with freshly initialized parameters
    (normal(cfg.init_std) matrices and embeddings, ones for norm scales, zeros for biases and
    for Gemma 3's zero-centred norm scales)."""
    return model_class(cfg.arch)(cfg, vocab_size, rngs=rngs)


def norm_scale_init(arch: str) -> float:
    """The value norm scales start at (what ``build_model`` gives them): 1, or 0 for Gemma 3,
    whose norms multiply by ``1 + scale``. Lean and preset initialisers use it too."""
    return 0.0 if arch in GEMMA3_ARCHS else 1.0


def count_params(model: nnx.Module) -> int:
    """Number of scalar parameters (every ``nnx.Param`` leaf) in ``model``."""
    return sum(int(leaf.size) for leaf in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)))


__all__ = [
    "DTYPES", "KVCache", "LOSS_CHUNK_ELEMENTS", "REMAT_POLICIES", "Rotary", "TokenBatch", "as_token_batch", "attention", "batch_loss",
    "blocked_token_losses", "build_model", "chosen_loss",
    "cache_positions", "count_params", "forward", "is_large_table", "layer_decode", "layer_stack_key",
    "loss_sum_and_count", "next_token_loss", "norm_scale_init", "scores_held", "table_blocks",
    "table_head", "token_batch", "token_losses", "token_table_path",
]
