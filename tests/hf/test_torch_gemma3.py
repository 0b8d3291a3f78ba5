"""Gemma 3 (text) against transformers' own ``Gemma3ForCausalLM``, on checkpoints transformers
itself builds and saves: fp32 logits, a load -> export round trip that is bit-identical, and the
text model of a multimodal ``Gemma3ForConditionalGeneration``.

The tiny model has every Gemma 3 feature that changes numbers: 7 layers of which layer 5 is
full and the rest sliding, a window (5) shorter than the 12-token input, query_pre_attn_scalar
(12) != head_dim (16), linear x8 RoPE on the full layer only, final logit softcapping, tied
embeddings, and random zero-centred norm weights. Weights are scaled so logits reach a few
units and the softcap bends them.
"""

from __future__ import annotations

import json
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed; pip install torch==2.13.0 (CPU build)")
transformers = pytest.importorskip("transformers")

from jaxascend.config import ModelConfig  # noqa: E402
from jaxascend.hf import CheckpointFiles, export_hf, load_hf_model, load_hf_params, model_config_from_hf  # noqa: E402

FP32 = ModelConfig(dtype="float32", param_dtype="float32")
ATOL = RTOL = 1e-4
TEXT = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=7, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=5,
            query_pre_attn_scalar=12, rope_theta=1e6, rope_local_base_freq=1e4,
            rope_scaling={"rope_type": "linear", "factor": 8.0}, final_logit_softcapping=2.0)
# The architecture fields of config.json that an export must carry over unchanged.
FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window", "layer_types",
          "query_pre_attn_scalar", "final_logit_softcapping", "attn_logit_softcapping", "rope_parameters",
          "hidden_activation", "rms_norm_eps", "tie_word_embeddings", "attention_bias",
          "use_bidirectional_attention")


def sample_ids() -> np.ndarray:
    return np.random.default_rng(1).integers(0, 512, (2, 12))


def randomize(model) -> None:
    """Zero-centred random norms (HF's effective scale is 1 + w) and 6x the initial matrices."""
    torch.manual_seed(0)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.1 if p.ndim == 1 else p * 6.0)


def save(model, folder) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(folder)


def theirs(folder) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, local_files_only=True, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    with torch.no_grad():
        return model.eval()(torch.tensor(sample_ids())).logits.numpy()


def ours(folder) -> np.ndarray:
    model = load_hf_model(folder, model_config_from_hf(folder, FP32))
    return np.asarray(model(jnp.asarray(sample_ids(), jnp.int32)))


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3") / "hf"
    config = transformers.Gemma3TextConfig(**TEXT)
    config.architectures = ["Gemma3ForCausalLM"]
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    assert type(model).__name__ == "Gemma3ForCausalLM"
    randomize(model)
    save(model, folder)
    return folder


def test_logits_match_transformers(hf_folder):
    written = json.loads((hf_folder / "config.json").read_text())
    assert "rope_parameters" in written and "rope_scaling" not in written  # transformers 5's spelling
    assert written["layer_types"].count("full_attention") == 1
    reference, got = theirs(hf_folder), ours(hf_folder)
    assert np.abs(reference).max() > 1.0 and np.abs(reference).max() < TEXT["final_logit_softcapping"]
    print(f"gemma3 fp32 max |logit difference| vs transformers: {np.abs(got - reference).max():.3g}")
    np.testing.assert_allclose(got, reference, atol=ATOL, rtol=RTOL)


def test_load_export_round_trip_is_bit_identical(hf_folder, tmp_path):
    cfg = model_config_from_hf(hf_folder, FP32)
    out = export_hf(load_hf_params(hf_folder, cfg), cfg, tmp_path / "out", dtype="float32")
    with CheckpointFiles(hf_folder) as a, CheckpointFiles(out) as b:
        assert sorted(a.entries) == sorted(b.entries)
        for name, entry in a.entries.items():
            assert (entry.dtype, entry.shape) == (b.entries[name].dtype, b.entries[name].shape), name
            assert a.read(entry).tobytes() == b.read(b.entries[name]).tobytes(), name
    source, exported = (json.loads((f / "config.json").read_text()) for f in (hf_folder, out))
    assert {k: exported[k] for k in FIELDS} == {k: source[k] for k in FIELDS}
    assert exported["architectures"] == ["Gemma3ForCausalLM"] and exported["model_type"] == "gemma3_text"
    # transformers reads the export back to the same model.
    np.testing.assert_array_equal(theirs(out), theirs(hf_folder))


def test_text_model_of_a_multimodal_checkpoint(tmp_path):
    # No softcap: transformers 5.24's Gemma3ForConditionalGeneration never applies
    # final_logit_softcapping (its Gemma3ForCausalLM does); every released Gemma 3 has none.
    text = {**TEXT, "model_type": "gemma3_text", "final_logit_softcapping": None}
    config = transformers.Gemma3Config(
        text_config=text, mm_tokens_per_image=4,
        vision_config={"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 37,
                       "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 28, "patch_size": 14})
    model = transformers.Gemma3ForConditionalGeneration(config).to(torch.float32)
    randomize(model)
    save(model, tmp_path)
    with CheckpointFiles(tmp_path) as ckpt:
        assert any(name.startswith("vision_tower.") for name in ckpt.entries)
        assert "language_model.model.embed_tokens.weight" in ckpt.entries
    cfg = model_config_from_hf(tmp_path, FP32)
    assert cfg.arch == "gemma3" and cfg.layer_types.count("full_attention") == 1
    with torch.no_grad():  # text only: no pixel values, so no image tokens
        reference = model.eval()(input_ids=torch.tensor(sample_ids())).logits.numpy()
    np.testing.assert_allclose(ours(tmp_path), reference, atol=ATOL, rtol=RTOL)


def test_bf16_embedding_scale_is_rounded_as_transformers_rounds_it(tmp_path):
    """Gemma3TextScaledWordEmbedding multiplies by sqrt(hidden_size) cast to the weight dtype:
    with hidden_size 72 that is bf16(8.485) = 8.5. Our bf16 embedding must equal it bit for bit."""
    config = transformers.Gemma3TextConfig(**{**TEXT, "hidden_size": 72})
    model = transformers.Gemma3ForCausalLM(config)
    randomize(model)
    save(model, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, local_files_only=True)
    ids = torch.arange(512)[None]
    with torch.no_grad():
        reference = hf.model.embed_tokens(ids).float().numpy()
    bf16 = ModelConfig(dtype="bfloat16", param_dtype="bfloat16")
    ours_ = np.asarray(load_hf_model(tmp_path, model_config_from_hf(tmp_path, bf16)).embed(jnp.asarray(ids.numpy())))
    np.testing.assert_array_equal(ours_.astype(np.float32), reference)
