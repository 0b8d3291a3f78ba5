"""Tests for jaxascend.models: logits against plain-numpy references of each architecture,
causality, sliding windows, remat policies, low-precision compute, init and argument checks.

The numpy references below are written from the Hugging Face architectures (float64, HF's
``rotate_half`` RoPE, ``repeat_kv`` for grouped-query attention, an explicit -inf mask) and read
the same weights as the model. fp32 logits must match them within float32 sums in any order
(tests/_tolerances.py: ~1e-4 on these models).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxascend.config import ConfigError, ModelConfig
from jaxascend.models import build_model, count_params
from jaxascend.models.rope import rope_inverse_frequencies
from jaxascend.models.rope import rope_attention_factor
from tests._tolerances import assert_reordered_close, logits_atol, model_depth, model_reduction, reordering_atol, \
    reordering_rtol

VOCAB = 97
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}

ARCH_CASES = {
    # GQA (4 query heads over 2 kv heads), head_dim != hidden/heads, llama3 rope, untied head.
    "llama": dict(arch="llama", num_key_value_heads=2, head_dim=24, rope_scaling=LLAMA3_ROPE,
                  tie_word_embeddings=False),
    # q/k/v bias, tied embeddings, a large rope_theta.
    "qwen2": dict(arch="qwen2", num_key_value_heads=2, attention_bias=True,
                  tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6),
    # multi-query attention and a sliding window shorter than the sequence.
    "mistral": dict(arch="mistral", num_key_value_heads=1, sliding_window=5,
                    tie_word_embeddings=False),
    "gpt2": dict(arch="gpt2", num_key_value_heads=4, max_position_embeddings=64),
    # q/k norms, head_dim != hidden/heads, yarn RoPE (attention factor 1.14) on a tied model.
    "qwen3": dict(arch="qwen3", num_key_value_heads=2, head_dim=24, tie_word_embeddings=True, rope_theta=1e6,
                  rms_norm_eps=1e-6, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": 8}),
    # longrope past its original length (16 > 8 tokens: the long factors), half the head rotated,
    # a sliding window on every layer.
    "phi3": dict(arch="phi3", num_key_value_heads=2, sliding_window=5, partial_rotary_factor=0.5,
                 tie_word_embeddings=False, rope_scaling={"rope_type": "longrope", "original_max_position_embeddings": 8,
                                                          "short_factor": [1.0, 1.2, 1.4, 1.6],
                                                          "long_factor": [2.0, 3.0, 4.0, 5.0]}),
}


def tiny_config(arch: str = "llama", **overrides) -> ModelConfig:
    fields = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, dtype="float32", param_dtype="float32")
    fields.update(ARCH_CASES[arch])
    fields.update(overrides)
    return ModelConfig(**fields)


def randomized_model(cfg: ModelConfig, seed: int = 0) -> nnx.Module:
    """The model with every parameter (norm scales and biases included) drawn at random, so that
    a missing bias or scale in either implementation shows up in the logits. Shapes come from
    ``nnx.eval_shape`` and values from numpy: building eagerly would dominate the test time."""
    abstract = nnx.eval_shape(lambda: build_model(cfg, VOCAB, rngs=nnx.Rngs(seed)))
    graphdef, state = nnx.split(abstract)
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        name = jax.tree_util.keystr(path)
        noise = rng.standard_normal(leaf.shape)
        value = 1.0 + 0.1 * noise if "scale" in name else (0.1 if "bias" in name else 0.15) * noise
        return jnp.asarray(value, jnp.float32).astype(leaf.dtype)

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(draw, state))


@functools.partial(jax.jit, static_argnums=0)
def _jitted_forward(graphdef, state, ids, positions):
    return nnx.merge(graphdef, state)(ids, positions)


def forward(model, ids, positions=None) -> np.ndarray:
    """Logits of a jitted forward (eager dispatch of every op would dominate the test time)."""
    return np.asarray(_jitted_forward(*nnx.split(model), ids, positions))


def numpy_params(model) -> dict:
    return jax.tree.map(lambda x: np.asarray(x, np.float64), nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def layer_slice(tree: dict, i: int) -> dict:
    return jax.tree.map(lambda x: x[i], tree)


def sample_ids(batch: int = 2, length: int = 16, seed: int = 0) -> jnp.ndarray:
    return jnp.asarray(np.random.default_rng(seed).integers(0, VOCAB, (batch, length)), jnp.int32)


# ----------------------------------------------------------------------------- numpy references

def np_softmax(x):
    x = x - x.max(-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(-1, keepdims=True)


def np_attention(q, k, v, sliding_window=None):
    """q [B,T,N,H], k/v [B,T,N,H] (already repeated)."""
    length, head_dim = q.shape[1], q.shape[3]
    scores = np.einsum("btnh,bsnh->bnts", q, k) / math.sqrt(head_dim)
    t, s = np.arange(length)[:, None], np.arange(length)[None, :]
    allowed = s <= t
    if sliding_window is not None:
        allowed &= (t - s) < sliding_window
    scores = np.where(allowed, scores, -np.inf)
    return np.einsum("bnts,bsnh->btnh", np_softmax(scores), v)


def np_llama3_inv_freq(head_dim, theta, scaling):
    """Hugging Face's _compute_llama3_parameters, transcribed to numpy."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    if scaling is None or scaling.get("rope_type", "default") == "default":
        return inv_freq
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    llama = np.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * llama / factor + smooth * llama
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return np.where(medium, smoothed, llama)


def np_rope(x, positions, inv_freq, attention_factor=1.0):
    """HF's rotate_half RoPE on the first ``2 * len(inv_freq)`` dims (partial rotary), cos and
    sin scaled by the attention factor."""
    freqs = positions[..., None] * inv_freq  # [B,T,R/2]
    emb = np.concatenate([freqs, freqs], -1)[:, :, None, :]
    rot, rest = x[..., :emb.shape[-1]], x[..., emb.shape[-1]:]
    half = rot.shape[-1] // 2
    rotated = np.concatenate([-rot[..., half:], rot[..., :half]], -1)
    out = rot * np.cos(emb) * attention_factor + rotated * np.sin(emb) * attention_factor
    return np.concatenate([out, rest], -1)


def np_rms_norm(x, weight, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * weight


def llama_reference(p: dict, cfg: ModelConfig, ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
    n, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = cfg.head_dim or cfg.hidden_size // n
    b, t = ids.shape
    scaling = cfg.rope_scaling
    if cfg.partial_rotary_factor == 1 and (scaling is None or scaling["rope_type"] == "llama3"):
        inv_freq = np_llama3_inv_freq(head_dim, cfg.rope_theta, scaling)
    else:  # the other types are checked against numpy formulas in test_rope.py
        inv_freq = rope_inverse_frequencies(head_dim, cfg.rope_theta, scaling, seq_len=t,
                                            max_position_embeddings=cfg.max_position_embeddings,
                                            partial_rotary_factor=cfg.partial_rotary_factor)
    factor = rope_attention_factor(scaling, cfg.max_position_embeddings)
    h = p["embed_tokens"]["embedding"][ids]
    for i in range(cfg.num_hidden_layers):
        lp = layer_slice(p["layers"], i)
        at = lp["self_attn"]
        x = np_rms_norm(h, lp["input_layernorm"]["scale"], cfg.rms_norm_eps)

        def proj(name, heads):
            y = x @ at[name]["kernel"]
            if cfg.attention_bias:
                y = y + at[name]["bias"]
            return y.reshape(b, t, heads, head_dim)

        q, k = proj("q_proj", n), proj("k_proj", kv)
        if "q_norm" in at:  # Qwen3: RMSNorm over head_dim before RoPE
            q = np_rms_norm(q, at["q_norm"]["scale"], cfg.rms_norm_eps)
            k = np_rms_norm(k, at["k_norm"]["scale"], cfg.rms_norm_eps)
        q = np_rope(q, positions, inv_freq, factor)
        k = np.repeat(np_rope(k, positions, inv_freq, factor), n // kv, axis=2)
        v = np.repeat(proj("v_proj", kv), n // kv, axis=2)
        context = np_attention(q, k, v, cfg.sliding_window).reshape(b, t, n * head_dim)
        h = h + context @ at["o_proj"]["kernel"] + (at["o_proj"]["bias"] if "bias" in at["o_proj"] else 0)
        x = np_rms_norm(h, lp["post_attention_layernorm"]["scale"], cfg.rms_norm_eps)
        mlp = lp["mlp"]
        gate = x @ mlp["gate_proj"]["kernel"]
        h = h + (gate / (1 + np.exp(-gate)) * (x @ mlp["up_proj"]["kernel"])) @ mlp["down_proj"]["kernel"]
    h = np_rms_norm(h, p["norm"]["scale"], cfg.rms_norm_eps)
    head = p["embed_tokens"]["embedding"].T if cfg.tie_word_embeddings else p["lm_head"]["kernel"]
    return h @ head


def np_layer_norm(x, weight, bias, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * weight + bias


def gpt2_reference(p: dict, cfg: ModelConfig, ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
    n, d = cfg.num_attention_heads, cfg.hidden_size
    b, t = ids.shape
    eps = cfg.layer_norm_epsilon
    h = p["wte"]["embedding"][ids] + p["wpe"]["embedding"][positions]
    for i in range(cfg.num_hidden_layers):
        lp = layer_slice(p["h"], i)
        x = np_layer_norm(h, lp["ln_1"]["scale"], lp["ln_1"]["bias"], eps)
        qkv = x @ lp["attn"]["c_attn"]["kernel"] + lp["attn"]["c_attn"]["bias"]
        q, k, v = (qkv[..., j * d:(j + 1) * d].reshape(b, t, n, d // n) for j in range(3))
        context = np_attention(q, k, v).reshape(b, t, d)
        h = h + context @ lp["attn"]["c_proj"]["kernel"] + lp["attn"]["c_proj"]["bias"]
        x = np_layer_norm(h, lp["ln_2"]["scale"], lp["ln_2"]["bias"], eps)
        u = x @ lp["mlp"]["c_fc"]["kernel"] + lp["mlp"]["c_fc"]["bias"]
        gelu = 0.5 * u * (1 + np.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u ** 3)))
        h = h + gelu @ lp["mlp"]["c_proj"]["kernel"] + lp["mlp"]["c_proj"]["bias"]
    h = np_layer_norm(h, p["ln_f"]["scale"], p["ln_f"]["bias"], eps)
    return h @ p["wte"]["embedding"].T


# ----------------------------------------------------------------------------- logits vs reference

@pytest.mark.parametrize("arch", list(ARCH_CASES))
def test_logits_match_numpy_reference(arch):
    cfg = tiny_config(arch)
    model = randomized_model(cfg)
    ids = sample_ids(2, 16)
    # Row 1 starts at position 9, so RoPE/wpe see positions past the llama3 band edges.
    positions = jnp.stack([jnp.arange(16), jnp.arange(16) + 9]).astype(jnp.int32)
    logits = forward(model, ids, positions)
    assert logits.dtype == np.float32 and logits.shape == (2, 16, VOCAB)
    reference = (gpt2_reference if arch == "gpt2" else llama_reference)(
        numpy_params(model), cfg, np.asarray(ids), np.asarray(positions))
    assert np.abs(reference).max() > 1.0  # the comparison is not between near-zero numbers
    # float32 against float64: within float32 sums in any order (tests/_tolerances.py)
    assert_reordered_close(logits, reference, logits_atol(cfg, reference, 16), f"{arch} against numpy")


def test_default_positions_are_arange():
    model = randomized_model(tiny_config("llama"))
    ids = sample_ids(2, 12)
    explicit = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), ids.shape)
    np.testing.assert_array_equal(forward(model, ids), forward(model, ids, explicit))


def test_llama3_rope_scaling_changes_each_band():
    scaled = rope_inverse_frequencies(16, 10000.0, LLAMA3_ROPE)
    plain = rope_inverse_frequencies(16, 10000.0, None)
    np.testing.assert_allclose(plain, np_llama3_inv_freq(16, 10000.0, None), rtol=1e-6)
    np.testing.assert_allclose(scaled, np_llama3_inv_freq(16, 10000.0, LLAMA3_ROPE), rtol=1e-6)
    # wavelengths 2*pi*10000**(j/8): j=0 (6.3) < 32/4 is kept, j=1 (19.9) is interpolated,
    # j>=2 (> 32/1) are divided by the factor.
    assert scaled[0] == plain[0]
    assert plain[1] / 8 < scaled[1] < plain[1]
    np.testing.assert_allclose(scaled[2:], plain[2:] / 8, rtol=1e-6)


# ----------------------------------------------------------------------------- causality

@pytest.mark.parametrize("arch", list(ARCH_CASES))
def test_future_tokens_do_not_change_earlier_logits(arch):
    model = randomized_model(tiny_config(arch))
    ids = sample_ids(2, 16)
    changed = ids.at[:, 9].set((ids[:, 9] + 1) % VOCAB)
    before, after = forward(model, ids), forward(model, changed)
    np.testing.assert_allclose(after[:, :9], before[:, :9], atol=1e-6, rtol=0)
    assert np.abs(after[:, 9:] - before[:, 9:]).max() > 1e-3


def test_sliding_window_bounds_the_receptive_field():
    # Window 4, two layers: token 0 reaches positions 0..3 after one layer and 0..6 after two.
    model = randomized_model(tiny_config("mistral", sliding_window=4))
    ids = sample_ids(1, 16)
    changed = ids.at[:, 0].set((ids[:, 0] + 1) % VOCAB)
    delta = np.abs(forward(model, changed) - forward(model, ids)).max(axis=-1)[0]
    assert delta[6] > 1e-4
    np.testing.assert_array_equal(delta[7:], 0.0)


# ----------------------------------------------------------------------------- remat policies

def mean_cross_entropy(model, ids):
    logits = model(ids[:, :-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1))


def assert_loss_and_grads_close(cfg: ModelConfig, length: int, got, want, label: str) -> None:
    """(loss, grads) of the model computed another way (another remat policy: other fusions)
    against ``want``, within float32 sums in another order through the layers, forward for the
    loss and forward and backward for each gradient (tests/_tolerances.py)."""
    (loss, grads), (ref_loss, ref_grads) = got, want
    reduction = model_reduction(cfg, length)
    rtol = reordering_rtol(reduction=reduction, depth=model_depth(cfg))
    error = abs(float(loss) - float(ref_loss)) / abs(float(ref_loss))
    print(f"{label} loss: relative difference {error:.2e}, derived rtol {rtol:.2e}")
    assert error <= rtol, (label, error, rtol)
    depth = model_depth(cfg, backward=True)
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
        assert_reordered_close(g, r, reordering_atol(r, reduction=reduction, depth=depth),
                               f"{label} {jax.tree_util.keystr(path)}")


def jitted_loss_and_grads(model, ids):
    graphdef, state = nnx.split(model)
    fn = jax.jit(jax.value_and_grad(lambda s, i: mean_cross_entropy(nnx.merge(graphdef, s), i)))
    return fn(state, ids), fn, state


@pytest.fixture(scope="module")
def no_remat_loss_and_grads():
    results = {}
    for arch in ("llama", "gpt2", "qwen3", "phi3"):
        (loss, grads), _, _ = jitted_loss_and_grads(randomized_model(tiny_config(arch)), sample_ids(2, 17))
        results[arch] = (loss, grads)
    return results


@pytest.mark.parametrize("arch, remat", [
    ("llama", "full"), ("llama", "dots"), ("llama", "dots_no_batch"), ("llama", "offload"),
    # The scan and policies are shared; gpt2 only tags its activations differently.
    ("gpt2", "offload"),
    # q/k norms and partial rotary sit inside the same checkpointed layer
    ("qwen3", "offload"), ("phi3", "dots"),
])
def test_remat_policy_matches_no_remat(remat, arch, no_remat_loss_and_grads):
    model = randomized_model(tiny_config(arch, remat=remat))
    (loss, grads), fn, state = jitted_loss_and_grads(model, sample_ids(2, 17))
    assert_loss_and_grads_close(tiny_config(arch), 16, (loss, grads), no_remat_loss_and_grads[arch], f"{arch} {remat}")
    if remat == "offload":
        # The saved activations are moved to host memory in the differentiated program.
        jaxpr = str(jax.make_jaxpr(fn)(state, sample_ids(2, 17)))
        assert "<host>" in jaxpr and "device_put" in jaxpr


# ----------------------------------------------------------------------------- dtypes

@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_low_precision_compute_is_close_to_fp32(dtype, arch):
    ids = sample_ids(2, 17)
    fp32 = randomized_model(tiny_config(arch))
    low = randomized_model(tiny_config(arch, dtype=dtype))  # same seed: same fp32 parameters
    want, got = forward(fp32, ids), forward(low, ids)
    assert got.dtype == np.float32
    # bf16 keeps 8 mantissa bits, fp16 11: errors relative to the logit scale.
    tolerance = {"bfloat16": 0.05, "float16": 0.01}[dtype] * np.abs(want).max()
    assert np.abs(got - want).max() < tolerance
    if arch == "gpt2":
        return  # the backward pass in low precision is exercised once, on llama
    (loss, grads), _, _ = jitted_loss_and_grads(low, ids)
    assert np.isfinite(loss) and all(np.isfinite(g).all() for g in jax.tree.leaves(grads))


def test_bfloat16_param_storage():
    model = build_model(tiny_config("llama", dtype="bfloat16", param_dtype="bfloat16"), VOCAB,
                        rngs=nnx.Rngs(0))
    assert {x.dtype for x in jax.tree.leaves(nnx.state(model, nnx.Param))} == {jnp.dtype(jnp.bfloat16)}
    logits = forward(model, sample_ids(2, 8))
    assert logits.dtype == np.float32 and np.isfinite(logits).all()


# ----------------------------------------------------------------------------- init and counts

@pytest.mark.parametrize("arch", list(ARCH_CASES))
def test_initialization(arch):
    cfg = tiny_config(arch, init_std=0.05)
    params = nnx.to_pure_dict(nnx.state(build_model(cfg, VOCAB, rngs=nnx.Rngs(0)), nnx.Param))
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name, x = jax.tree_util.keystr(path), np.asarray(leaf)
        if "scale" in name:
            np.testing.assert_array_equal(x, 1.0)
        elif "bias" in name:
            np.testing.assert_array_equal(x, 0.0)
        else:
            assert abs(x.std() - 0.05) < 0.01 and abs(x.mean()) < 0.01, (path, x.std(), x.mean())
    first = params["layers" if arch != "gpt2" else "h"]
    kernel = first["mlp"]["c_fc" if arch == "gpt2" else "up_proj"]["kernel"]
    assert not np.array_equal(kernel[0], kernel[1])  # layers are initialized independently


def test_count_params_llama_formula():
    cfg = tiny_config("llama")  # head_dim 24, GQA 4/2, untied
    d, f, hd, layers = 64, 96, 24, 2
    per_layer = d * 4 * hd + 2 * d * 2 * hd + 4 * hd * d + 3 * d * f + 2 * d
    expected = VOCAB * d + layers * per_layer + d + d * VOCAB
    assert count_params(build_model(cfg, VOCAB, rngs=nnx.Rngs(0))) == expected


def test_count_params_gpt2_formula():
    cfg = tiny_config("gpt2")
    d, f, layers = 64, 96, 2
    per_layer = 4 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
    expected = VOCAB * d + 64 * d + layers * per_layer + 2 * d
    assert count_params(build_model(cfg, VOCAB, rngs=nnx.Rngs(0))) == expected


# ----------------------------------------------------------------------------- argument checks

@pytest.mark.parametrize("fields, message", [
    (dict(num_key_value_heads=3), r"model.num_key_value_heads: 3 must divide model.num_attention_heads=4"),
    (dict(rope_scaling={"rope_type": "ntk", "factor": 4.0}),
     r"model.rope_scaling.rope_type: 'ntk' is not supported \(allowed: null, 'default', 'linear', "
     r"'dynamic', 'yarn', 'longrope', 'llama3'\)"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}),
     r"model.rope_scaling.original_max_position_embeddings: rope_type 'yarn' needs a number > 0, got None"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}),
     r"model.rope_scaling.low_freq_factor: rope_type 'llama3' needs a number > 0"),
    (dict(sliding_window=0), r"model.sliding_window: must be >= 1, got 0"),
    (dict(layer_norm_epsilon=0.0), r"model.layer_norm_epsilon: must be > 0"),
])
def test_config_rejects(fields, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config("llama", **fields)


@pytest.mark.parametrize("arch, mutation, message", [
    # ModelConfig checks these too; mutating after construction reaches the module's own checks.
    ("llama", dict(num_key_value_heads=3), r"model.num_key_value_heads: 3 must divide model.num_attention_heads=4"),
    ("llama", dict(rope_scaling={"rope_type": "dynamic"}),
     r"model.rope_scaling.factor: rope_type 'dynamic' needs a number > 0, got None"),
    ("llama", dict(head_dim=7), r"model.head_dim: RoPE needs an even head dimension, got 7"),
    ("llama", dict(head_dim=None, hidden_size=66), r"model.hidden_size: 66 is not divisible by model.num_attention_heads=4"),
    ("llama", dict(remat="selective"), r"model.remat: 'selective' is not supported \(allowed: none, full, dots"),
    ("llama", dict(dtype="float64"), r"model.dtype: 'float64' is not supported"),
    ("llama", dict(hidden_act="relu"), r"model.hidden_act: 'relu' is not supported"),
    ("llama", dict(arch="t5"), r"model.arch: 't5' is not supported \(allowed: llama, qwen2, mistral, qwen3, phi3, gpt2"),
    ("gpt2", dict(num_key_value_heads=2), r"model.num_key_value_heads: gpt2 has no grouped-query attention"),
    ("gpt2", dict(sliding_window=8), r"model.sliding_window: gpt2 has no sliding-window attention"),
    ("gpt2", dict(rope_scaling=LLAMA3_ROPE), r"model.rope_scaling: gpt2 uses learned position embeddings"),
    ("gpt2", dict(head_dim=32), r"model.head_dim: gpt2 uses hidden_size / num_attention_heads = 16"),
])
def test_build_model_rejects(arch, mutation, message):
    cfg = tiny_config(arch)
    for name, value in mutation.items():
        setattr(cfg, name, value)
    with pytest.raises(ValueError, match=message):
        build_model(cfg, VOCAB, rngs=nnx.Rngs(0))


def test_build_model_rejects_empty_vocab():
    with pytest.raises(ValueError, match=r"vocab_size: must be an integer >= 1, got 0"):
        build_model(tiny_config("llama"), 0, rngs=nnx.Rngs(0))


def test_forward_rejects_bad_inputs():
    model = build_model(tiny_config("gpt2", max_position_embeddings=8), VOCAB, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"input_ids: expected an integer array \[batch, time\]"):
        model(jnp.zeros((2, 4), jnp.float32))
    with pytest.raises(ValueError, match=r"positions: expected an integer array shaped like input_ids"):
        model(jnp.zeros((2, 4), jnp.int32), jnp.zeros((2, 5), jnp.int32))
    with pytest.raises(ValueError, match=r"input_ids: length 9 exceeds model.max_position_embeddings=8"):
        model(jnp.zeros((1, 9), jnp.int32))
