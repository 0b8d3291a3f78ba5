"""RoPE types against small numpy references written from transformers' modeling_rope_utils
formulas (float64): inverse frequencies and attention factor of default, linear, dynamic, yarn,
longrope and llama3; the sequence-length choice of dynamic and longrope on both sides of their
switch; partial rotary; and the one-line errors of validate_rope_scaling."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from jaxascend.config import ConfigError, ModelConfig, validate_rope_scaling
from jaxascend.models.rope import Rotary, apply_rope, rope_attention_factor, rope_inverse_frequencies

HEAD_DIM, THETA = 32, 10000.0


def np_default(dim, theta):
    return 1.0 / theta ** (np.arange(0, dim, 2) / dim)


def np_dynamic(dim, theta, factor, seq_len, mpe):
    seq_len = max(seq_len, mpe)
    return np_default(dim, theta * (factor * seq_len / mpe - (factor - 1)) ** (dim / (dim - 2)))


def np_yarn(dim, theta, factor, original, beta_fast=32, beta_slow=1, truncate=True):
    def corr(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = corr(beta_fast), corr(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)  # 1: interpolate, 0: keep
    base = np_default(dim, theta)
    return base / factor * ramp + base * (1 - ramp)


def yarn_mscale(scale, m=1.0):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def np_longrope(dim, theta, ext):
    return 1.0 / (np.asarray(ext) * theta ** (np.arange(0, dim, 2) / dim))


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
SHORT, LONG = [1.0 + 0.1 * i for i in range(16)], [1.0 + 0.5 * i for i in range(16)]
LONGROPE = {"rope_type": "longrope", "original_max_position_embeddings": 16, "short_factor": SHORT,
            "long_factor": LONG}


@pytest.mark.parametrize("scaling, seq_len, expected", [
    (None, None, np_default(HEAD_DIM, THETA)),
    ({"rope_type": "default"}, 12, np_default(HEAD_DIM, THETA)),
    ({"rope_type": "linear", "factor": 8.0}, None, np_default(HEAD_DIM, THETA) / 8),
    ({"type": "linear", "factor": 2.5}, None, np_default(HEAD_DIM, THETA) / 2.5),  # transformers 4 spelling
    # dynamic: the default frequencies up to max_position_embeddings (64), a larger base beyond
    ({"rope_type": "dynamic", "factor": 4.0}, None, np_default(HEAD_DIM, THETA)),
    ({"rope_type": "dynamic", "factor": 4.0}, 64, np_default(HEAD_DIM, THETA)),
    ({"rope_type": "dynamic", "factor": 4.0}, 65, np_dynamic(HEAD_DIM, THETA, 4.0, 65, 64)),
    ({"rope_type": "dynamic", "factor": 4.0}, 300, np_dynamic(HEAD_DIM, THETA, 4.0, 300, 64)),
    (YARN, None, np_yarn(HEAD_DIM, THETA, 4.0, 64)),
    ({**YARN, "beta_fast": 8, "beta_slow": 2}, None, np_yarn(HEAD_DIM, THETA, 4.0, 64, 8, 2)),
    ({**YARN, "beta_fast": 0, "beta_slow": None}, None, np_yarn(HEAD_DIM, THETA, 4.0, 64)),  # 0 = unset
    ({**YARN, "truncate": False}, None, np_yarn(HEAD_DIM, THETA, 4.0, 64, truncate=False)),
    # longrope: short factors up to original_max_position_embeddings (16), long ones beyond
    (LONGROPE, None, np_longrope(HEAD_DIM, THETA, SHORT)),
    (LONGROPE, 16, np_longrope(HEAD_DIM, THETA, SHORT)),
    (LONGROPE, 17, np_longrope(HEAD_DIM, THETA, LONG)),
])
def test_inverse_frequencies_match_numpy(scaling, seq_len, expected):
    got = rope_inverse_frequencies(HEAD_DIM, THETA, scaling, seq_len=seq_len, max_position_embeddings=64)
    assert got.dtype == np.float32 and got.shape == (HEAD_DIM // 2,)
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_yarn_ramp_spans_kept_and_interpolated_dimensions():
    got = rope_inverse_frequencies(HEAD_DIM, THETA, YARN)
    plain = np_default(HEAD_DIM, THETA)
    assert got[0] == np.float32(plain[0])  # fastest dimension: extrapolated (kept)
    np.testing.assert_allclose(got[-1], plain[-1] / 4, rtol=1e-6)  # slowest: interpolated
    assert np.any((got < plain * 0.99) & (got > plain / 4 * 1.01))  # a ramp between


@pytest.mark.parametrize("scaling, expected", [
    (None, 1.0),
    ({"rope_type": "linear", "factor": 8.0}, 1.0),
    ({"rope_type": "dynamic", "factor": 8.0}, 1.0),
    (YARN, 0.1 * math.log(4.0) + 1),
    ({**YARN, "factor": 4.0, "original_max_position_embeddings": 32768}, 1.1386294361119891),  # Qwen3's YaRN
    ({**YARN, "mscale": 0.8, "mscale_all_dim": 0.5}, yarn_mscale(4.0, 0.8) / yarn_mscale(4.0, 0.5)),
    ({**YARN, "mscale": 1.0, "mscale_all_dim": 1.0}, 1.0),  # DeepSeek style
    ({**YARN, "mscale": 0.8, "mscale_all_dim": 0}, yarn_mscale(4.0)),  # 0 means unset
    ({**YARN, "attention_factor": 1.25}, 1.25),
    (LONGROPE, math.sqrt(1 + math.log(64 / 16) / math.log(16))),  # factor = max_positions / original
    ({**LONGROPE, "factor": 32.0, "original_max_position_embeddings": 4096}, 1.1902380714238083),  # Phi-3 128k
    ({**LONGROPE, "factor": 1.0}, 1.0),
    ({**LONGROPE, "attention_factor": 0.9}, 0.9),
])
def test_attention_factor_matches_numpy(scaling, expected):
    assert rope_attention_factor(scaling, max_position_embeddings=64) == pytest.approx(expected, rel=1e-12)


def test_rotary_scales_sin_and_cos_and_picks_the_longrope_factors_from_the_length():
    rope = Rotary(HEAD_DIM, THETA, Rotary.freeze(LONGROPE), 64)
    factor = math.sqrt(1 + math.log(4) / math.log(16))
    for length, ext in ((16, SHORT), (17, LONG)):
        positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (2, length))
        sin, cos = rope.angles(positions)
        angles = np.arange(length)[:, None] * np_longrope(HEAD_DIM, THETA, ext)
        np.testing.assert_allclose(np.asarray(cos[1]), np.cos(angles) * factor, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(sin[0]), np.sin(angles) * factor, rtol=1e-5, atol=1e-6)
    assert hash(rope) == hash(Rotary(HEAD_DIM, THETA, Rotary.freeze(LONGROPE), 64))  # static module data


def test_partial_rotary_rotates_only_the_leading_dimensions():
    rope = Rotary(HEAD_DIM, THETA, None, 64, partial_rotary_factor=0.25)
    positions = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (1, 5))
    sin, cos = rope.angles(positions)
    assert sin.shape == (1, 5, 4)  # int(32 * 0.25) = 8 rotated dims, 4 frequencies
    x = np.random.default_rng(0).standard_normal((1, 5, 3, HEAD_DIM)).astype(np.float32)
    out = np.asarray(apply_rope(jnp.asarray(x), sin, cos))
    np.testing.assert_array_equal(out[..., 8:], x[..., 8:])
    freqs = np.arange(5)[:, None] * np_default(8, THETA)
    emb = np.concatenate([freqs, freqs], -1)[None, :, None, :]
    rotated = np.concatenate([-x[..., 4:8], x[..., :4]], -1)
    np.testing.assert_allclose(out[..., :8], x[..., :8] * np.cos(emb) + rotated * np.sin(emb), atol=1e-5)


@pytest.mark.parametrize("scaling, message", [
    ({"rope_type": "ntk"}, r"model.rope_scaling.rope_type: 'ntk' is not supported \(allowed: null, 'default', "
                           r"'linear', 'dynamic', 'yarn', 'longrope', 'llama3'\)"),
    ({"rope_type": "linear"}, r"model.rope_scaling.factor: rope_type 'linear' needs a number > 0, got None"),
    ({"rope_type": "dynamic", "factor": -2}, r"model.rope_scaling.factor: rope_type 'dynamic' needs a number > 0, got -2"),
    ({"rope_type": "yarn", "factor": 4.0},
     r"model.rope_scaling.original_max_position_embeddings: rope_type 'yarn' needs a number > 0, got None"),
    ({**YARN, "factor": True}, r"model.rope_scaling.factor: rope_type 'yarn' needs a number > 0, got True"),
    ({**YARN, "beta_fast": -1}, r"model.rope_scaling.beta_fast: rope_type 'yarn' needs a number >= 0 or null, got -1"),
    ({**YARN, "attention_factor": "big"},
     r"model.rope_scaling.attention_factor: rope_type 'yarn' needs a number > 0 or null, got 'big'"),
    ({**YARN, "mscale": -0.5}, r"model.rope_scaling.mscale: rope_type 'yarn' needs a number >= 0 or null, got -0.5"),
    ({**YARN, "truncate": "yes"}, r"model.rope_scaling.truncate: rope_type 'yarn' needs true or false, got 'yes'"),
    ({**LONGROPE, "short_factor": None},
     r"model.rope_scaling.short_factor: rope_type 'longrope' needs a non-empty list of numbers > 0, got None"),
    ({**LONGROPE, "long_factor": [1.0, 0.0]},
     r"model.rope_scaling.long_factor: rope_type 'longrope' needs a non-empty list of numbers > 0"),
    ({**LONGROPE, "factor": 0}, r"model.rope_scaling.factor: rope_type 'longrope' needs a number > 0 or null, got 0"),
])
def test_validation_names_the_field_and_the_allowed_values(scaling, message):
    with pytest.raises(ConfigError, match=message):
        validate_rope_scaling(scaling)


def test_model_config_checks_longrope_lengths_and_partial_rotary():
    fields = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=2)  # head_dim 32
    ModelConfig(**fields, rope_scaling=LONGROPE)
    with pytest.raises(ConfigError, match=r"model.rope_scaling.short_factor: needs 4 numbers \(rotary dims 8 / 2\), "
                                          r"got 16"):
        ModelConfig(**fields, rope_scaling=LONGROPE, partial_rotary_factor=0.25)
    with pytest.raises(ConfigError, match=r"model.partial_rotary_factor: must be > 0 and <= 1, got 1.5"):
        ModelConfig(**fields, partial_rotary_factor=1.5)
    with pytest.raises(ConfigError, match=r"model.partial_rotary_factor: head_dim 32 x 0.1 = 3 rotary dims; "
                                          r"RoPE needs an even number >= 2"):
        ModelConfig(**fields, partial_rotary_factor=0.1)
