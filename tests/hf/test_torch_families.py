"""Qwen3, Phi-3 and every RoPE type against transformers, on tiny random models that
transformers itself builds and saves (its config class, its model class, ``save_pretrained``).

For each case: our fp32 logits match transformers' within 1e-4, and load -> export gives back
every tensor of the source file bit for bit (same names, dtypes, shapes) with a config.json that
transformers reads back to the same configuration.

Skipped when torch is not installed (``pip install torch==2.13.0`` installs a CPU build).
"""

from __future__ import annotations

import dataclasses
import json
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed; pip install torch==2.13.0 (CPU build)")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from jaxascend.config import ModelConfig  # noqa: E402
from jaxascend.hf import CheckpointFiles, export_hf, load_hf_model, load_hf_params, model_config_from_hf  # noqa: E402

FP32 = ModelConfig(dtype="float32", param_dtype="float32")
ATOL = RTOL = 1e-4
SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0)
# Phi-3 with original_max_position_embeddings 8: 12 tokens take the long factors, 6 the short ones.
LONGROPE = {"short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [1.0 + 0.5 * i for i in range(8)]}


def qwen3(**kw):
    return transformers.Qwen3Config(**{**SHAPE, "head_dim": 24, "max_position_embeddings": 256,
                                       "rope_theta": 1e6, **kw})


def llama(rope_scaling, max_position_embeddings=256, **kw):
    return transformers.LlamaConfig(**{**SHAPE, "head_dim": 24, "max_position_embeddings": max_position_embeddings,
                                       "rope_theta": 10000.0, "rope_scaling": rope_scaling, **kw})


def phi3(**kw):
    return transformers.Phi3Config(**{**SHAPE, "max_position_embeddings": 256,
                                      "original_max_position_embeddings": 8, "sliding_window": 5, **kw})


# name -> (config factory, sequence length). 12 tokens are past Phi-3's sliding window (5).
CASES = {
    "qwen3-tied": (lambda: qwen3(tie_word_embeddings=True), 12),
    "qwen3-untied": (lambda: qwen3(tie_word_embeddings=False), 12),
    "qwen3-dynamic-beyond-max-positions": (
        lambda: qwen3(max_position_embeddings=8, rope_scaling={"rope_type": "dynamic", "factor": 4.0}), 12),
    "phi3-default": (lambda: phi3(), 12),
    "phi3-longrope-long": (lambda: phi3(rope_scaling={"type": "longrope", **LONGROPE}), 12),
    "phi3-longrope-short": (lambda: phi3(rope_scaling={"type": "longrope", **LONGROPE}), 6),
    "phi3-longrope-at-original": (lambda: phi3(rope_scaling={"type": "longrope", **LONGROPE}), 8),
    "phi3-partial-rotary": (lambda: phi3(partial_rotary_factor=0.5, rope_scaling={
        "type": "longrope", "short_factor": LONGROPE["short_factor"][:4],
        "long_factor": LONGROPE["long_factor"][:4]}), 12),
    "llama-linear": (lambda: llama({"rope_type": "linear", "factor": 4.0}), 12),
    "llama-dynamic-within-max-positions": (lambda: llama({"rope_type": "dynamic", "factor": 4.0}), 12),
    "llama-dynamic-beyond-max-positions": (lambda: llama({"rope_type": "dynamic", "factor": 2.0}, 8), 12),
    "llama-yarn": (lambda: llama({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}), 12),
    "llama-yarn-all-fields": (lambda: llama({
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 16,
        "beta_slow": 2, "mscale": 0.8, "mscale_all_dim": 0.5, "truncate": False}), 12),
    "llama-yarn-attention-factor": (lambda: llama({
        "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128,
        "attention_factor": 1.3}), 12),
    "llama-longrope-long": (lambda: llama({"rope_type": "longrope", "original_max_position_embeddings": 8,
                                           "short_factor": [1.0 + 0.2 * i for i in range(12)],
                                           "long_factor": [1.0 + 0.7 * i for i in range(12)]}), 12),
    "llama-longrope-short": (lambda: llama({"rope_type": "longrope", "original_max_position_embeddings": 16,
                                            "factor": 3.0, "short_factor": [1.0 + 0.2 * i for i in range(12)],
                                            "long_factor": [1.0 + 0.7 * i for i in range(12)]}), 12),
}


def save_random_model(hf_config, folder) -> None:
    """transformers' own random model of ``hf_config``, norms randomised too (so a misplaced
    one shows), saved with ``save_pretrained`` in its own format."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
        with torch.no_grad():
            for _, p in model.named_parameters():
                if p.ndim == 1:
                    p.copy_(torch.randn_like(p) * 0.1 + 1.0)
        model.save_pretrained(folder)


def reference_logits(folder, ids: np.ndarray) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, local_files_only=True, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    with torch.no_grad():  # no position_ids / attention_mask: plain causal positions 0..T-1
        return model.eval()(torch.tensor(ids)).logits.numpy()


def our_logits(folder, ids: np.ndarray) -> np.ndarray:
    model = load_hf_model(folder, model_config_from_hf(folder, FP32))
    return np.asarray(model(jnp.asarray(ids, jnp.int32)))


def hf_config_of(folder) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoConfig.from_pretrained(folder, local_files_only=True).to_dict()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each case's model folder, saved once and shared by the tests below."""
    root = tmp_path_factory.mktemp("families")
    folders = {}
    for name, (make_config, _) in CASES.items():
        folders[name] = root / name
        save_random_model(make_config(), folders[name])
    return folders


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, saved):
    length = CASES[case][1]
    ids = np.random.default_rng(1).integers(0, 512, (2, length))
    reference = reference_logits(saved[case], ids)
    assert np.abs(reference).max() > 1.0  # the comparison is not between near-zero numbers
    ours = our_logits(saved[case], ids)
    print(f"{case}: max |logit difference| {np.abs(ours - reference).max():.2e}")
    np.testing.assert_allclose(ours, reference, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("case", list(CASES))
def test_load_export_round_trip_is_bit_identical(case, saved, tmp_path):
    folder = saved[case]
    cfg = model_config_from_hf(folder, FP32)
    written = json.loads((folder / "config.json").read_text())
    out = export_hf(load_hf_params(folder, cfg), cfg, tmp_path / "out", dtype="float32",
                    token_ids={k: written.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")})
    with CheckpointFiles(folder) as a, CheckpointFiles(out) as b:
        assert sorted(a.entries) == sorted(b.entries)
        for name, entry in a.entries.items():
            assert (entry.dtype, entry.shape) == (b.entries[name].dtype, b.entries[name].shape), name
            assert a.read(entry).tobytes() == b.read(b.entries[name]).tobytes(), name
    # Every field transformers wrote comes back with the same value when it reads our config.json,
    # except those that do not shape the model and ModelConfig does not keep: initializer_range
    # (ours is the run's init_std), Qwen3's max_window_layers without a sliding window and Phi-3's
    # original_max_position_embeddings without longrope.
    source, exported = hf_config_of(folder), hf_config_of(out)
    ignored = {"transformers_version", "initializer_range"}
    if not source.get("use_sliding_window", True):
        ignored.add("max_window_layers")
    if (source.get("rope_parameters") or {}).get("rope_type") == "default":
        ignored.add("original_max_position_embeddings")
    for key in sorted(set(written) - ignored):
        assert exported.get(key) == source[key], key
    assert model_config_from_hf(out, FP32) == dataclasses.replace(cfg, path=str(out))
