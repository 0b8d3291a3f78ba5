"""Gemma 3 (text): the scanned stack of mixed sliding/global layers against an unrolled numpy
reference, the remat policies, init, and the config checks.

The reference is written from Hugging Face's ``modeling_gemma3`` (float64, zero-centred
``(1 + w)`` norms, sandwich norms, q/k norms, ``query_pre_attn_scalar``, the local RoPE and the
sliding window on sliding layers, linear-scaled global RoPE, final logit softcapping) and loops
over the layers in Python, so it shares nothing with the scan. fp32 logits must match it within
float32 sums in any order (tests/_tolerances.py: 1.7e-4 with the softcap, 4.8e-4 without).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxascend.config import ConfigError, ModelConfig
from jaxascend.models import build_model
from tests._tolerances import assert_reordered_close, logits_atol
from tests.models.test_models import (VOCAB, assert_loss_and_grads_close, forward, jitted_loss_and_grads, layer_slice,
                                      np_rope, np_softmax, numpy_params, randomized_model, sample_ids)

SLIDING, FULL = "sliding_attention", "full_attention"
LAYER_TYPES = [SLIDING, SLIDING, FULL, SLIDING]


def gemma3_config(**overrides) -> ModelConfig:
    # head_dim 16 != hidden/heads, query_pre_attn_scalar 12 != head_dim, window 5 < T = 16,
    # linear x8 RoPE on the full layer only, softcap low enough to bend the logits.
    fields = dict(arch="gemma3", hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=5,
                  layer_types=LAYER_TYPES, rope_theta=1e6, rope_local_theta=1e4,
                  rope_scaling={"rope_type": "linear", "factor": 8.0}, query_pre_attn_scalar=12,
                  final_logit_softcapping=3.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                  dtype="float32", param_dtype="float32")
    fields.update(overrides)
    return ModelConfig(**fields)


def np_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * (1.0 + w)


def np_gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def gemma3_reference(p: dict, cfg: ModelConfig, ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
    n, kv, hd, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
    j = np.arange(0, hd, 2) / hd
    inv_freq = {FULL: 1.0 / cfg.rope_theta ** j / cfg.rope_scaling["factor"],
                SLIDING: 1.0 / cfg.rope_local_theta ** j}
    b, t = ids.shape
    h = p["embed_tokens"]["embedding"][ids] * math.sqrt(cfg.hidden_size)
    for i, kind in enumerate(cfg.layer_types):
        lp = layer_slice(p["layers"], i)
        at = lp["self_attn"]
        x = np_norm(h, lp["input_layernorm"]["scale"], eps)
        q = np_norm((x @ at["q_proj"]["kernel"]).reshape(b, t, n, hd), at["q_norm"]["scale"], eps)
        k = np_norm((x @ at["k_proj"]["kernel"]).reshape(b, t, kv, hd), at["k_norm"]["scale"], eps)
        v = (x @ at["v_proj"]["kernel"]).reshape(b, t, kv, hd)
        q, k = np_rope(q, positions, inv_freq[kind]), np_rope(k, positions, inv_freq[kind])
        k, v = np.repeat(k, n // kv, axis=2), np.repeat(v, n // kv, axis=2)
        scores = np.einsum("btnh,bsnh->bnts", q, k) * cfg.query_pre_attn_scalar ** -0.5
        qi, ki = np.arange(t)[:, None], np.arange(t)[None, :]
        allowed = (ki <= qi) & ((qi - ki < cfg.sliding_window) if kind == SLIDING else True)
        probs = np_softmax(np.where(allowed, scores, -np.inf))
        context = np.einsum("bnts,bsnh->btnh", probs, v).reshape(b, t, n * hd)
        h = h + np_norm(context @ at["o_proj"]["kernel"], lp["post_attention_layernorm"]["scale"], eps)
        x = np_norm(h, lp["pre_feedforward_layernorm"]["scale"], eps)
        mlp = lp["mlp"]
        up = np_gelu_tanh(x @ mlp["gate_proj"]["kernel"]) * (x @ mlp["up_proj"]["kernel"])
        h = h + np_norm(up @ mlp["down_proj"]["kernel"], lp["post_feedforward_layernorm"]["scale"], eps)
    h = np_norm(h, p["norm"]["scale"], eps)
    logits = h @ (p["embed_tokens"]["embedding"].T if cfg.tie_word_embeddings else p["lm_head"]["kernel"])
    cap = cfg.final_logit_softcapping
    return logits if cap is None else np.tanh(logits / cap) * cap


@pytest.mark.parametrize("overrides, derived", [
    ({}, {}),
    # untied head, no softcap, no layer_types: every layer sliding, with the default local base
    (dict(tie_word_embeddings=False, final_logit_softcapping=None, layer_types=None, rope_local_theta=None),
     dict(layer_types=[SLIDING] * 4, rope_local_theta=1e4)),
], ids=["mixed", "uniform"])
def test_scanned_mixed_stack_matches_unrolled_reference(overrides, derived):
    cfg = gemma3_config(**overrides)
    model = randomized_model(cfg)
    ids = sample_ids(2, 16)
    positions = jnp.stack([jnp.arange(16), jnp.arange(16) + 9]).astype(jnp.int32)
    logits = forward(model, ids, positions)
    reference = gemma3_reference(numpy_params(model), dataclasses.replace(cfg, **derived),
                                 np.asarray(ids), np.asarray(positions))
    assert np.abs(reference).max() > 1.0
    # float32 against float64: within float32 sums in any order (tests/_tolerances.py)
    assert_reordered_close(logits, reference, logits_atol(cfg, reference, 16), "gemma3 against numpy")


def test_each_layer_type_matters():
    """Flipping one layer's type changes the logits: the flag really selects mask and RoPE."""
    ids = sample_ids(2, 16)
    base = forward(randomized_model(gemma3_config()), ids)
    flipped = forward(randomized_model(gemma3_config(layer_types=[SLIDING, FULL, FULL, SLIDING])), ids)
    assert np.abs(base - flipped).max() > 1e-3


def test_stack_is_one_scan_not_unrolled():
    model = randomized_model(gemma3_config())
    graphdef, state = nnx.split(model)
    jaxpr = jax.make_jaxpr(lambda s, i: nnx.merge(graphdef, s)(i))(state, sample_ids(1, 8))
    scans = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    assert len(scans) == 1 and scans[0].params["length"] == 4


@pytest.mark.parametrize("remat", ["full", "dots", "dots_no_batch", "offload"])
def test_remat_policies_give_the_same_logits_and_gradients(remat):
    ids = sample_ids(2, 17)
    (ref_loss, ref_grads), _, _ = jitted_loss_and_grads(randomized_model(gemma3_config()), ids)
    model = randomized_model(gemma3_config(remat=remat))
    np.testing.assert_array_equal(forward(model, ids), forward(randomized_model(gemma3_config()), ids))
    assert_loss_and_grads_close(gemma3_config(), 16, jitted_loss_and_grads(model, ids)[0], (ref_loss, ref_grads),
                                f"gemma3 {remat}")


def test_norm_scales_start_at_zero_and_the_embedding_scale_is_rounded_like_hf():
    # sqrt(72) = 8.485 is not a bf16 number; HF multiplies by bf16(8.485) = 8.5.
    cfg = gemma3_config(hidden_size=72, dtype="bfloat16", param_dtype="bfloat16")
    model = build_model(cfg, VOCAB, rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    scales = [x for path, x in jax.tree_util.tree_flatten_with_path(params)[0]
              if "scale" in jax.tree_util.keystr(path)]
    assert len(scales) == 7 and all(np.all(np.asarray(x) == 0) for x in scales)
    ids = jnp.arange(VOCAB, dtype=jnp.int32)[None]
    table = model.embed_tokens.embedding[...]
    assert float(jnp.asarray(math.sqrt(72), jnp.bfloat16)) == 8.5
    np.testing.assert_array_equal(np.asarray(model.embed(ids)[0]), np.asarray(table * jnp.bfloat16(8.5)))
    assert not np.array_equal(np.asarray(model.embed(ids)[0]),
                              np.asarray((table.astype(jnp.float32) * math.sqrt(72)).astype(jnp.bfloat16)))


@pytest.mark.parametrize("fields, message", [
    (dict(layer_types=[SLIDING, "global", FULL, SLIDING]),
     r"model.layer_types\[1\]: 'global' is not supported \(allowed: 'sliding_attention', 'full_attention'\)"),
    (dict(layer_types=[SLIDING, FULL]), r"model.layer_types: 2 entries, but model.num_hidden_layers=4"),
    (dict(sliding_window=None), r"model.sliding_window: must be set when model.layer_types has"),
    (dict(query_pre_attn_scalar=0), r"model.query_pre_attn_scalar: must be > 0, got 0"),
    (dict(final_logit_softcapping=-1.0), r"model.final_logit_softcapping: must be > 0"),
    (dict(rope_local_theta=0.0), r"model.rope_local_theta: must be > 0"),
    (dict(arch="llama"), r"model.layer_types: only arch 'gemma3' uses it; must be null for arch 'llama'"),
])
def test_config_rejects(fields, message):
    with pytest.raises(ConfigError, match=message):
        gemma3_config(**fields)


def test_build_model_rejects_attention_bias():
    with pytest.raises(ValueError, match=r"model.attention_bias: gemma3 has no q/k/v bias; must be false"):
        build_model(gemma3_config(attention_bias=True), VOCAB, rngs=nnx.Rngs(0))
