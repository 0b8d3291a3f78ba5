"""Gemma 3 checkpoints without torch: config.json in transformers 4.5x's and 5's spellings (and
the sparse text_config of the multimodal model) map onto one ModelConfig, what we refuse says
which field, the text model of a multimodal checkpoint loads, and random init starts the
zero-centred norms at 0."""

from __future__ import annotations

import copy
import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import nnx

from jaxascend.config import ModelConfig
from jaxascend.hf import (CheckpointFiles, PRESETS, build_model_lean, load_hf_params, make_hf_checkpoint,
                          model_config_from_hf, model_config_from_hf_dict)
from jaxascend.hf.config_map import hf_config_dict
from jaxascend.hf.errors import HFCheckpointError, UnsupportedModelError
from jaxascend.hf.safetensors_io import SINGLE_FILE, TensorSpec, write_safetensors

FP32 = ModelConfig(dtype="float32", param_dtype="float32")
FULL, SLIDING = "full_attention", "sliding_attention"
# google/gemma-3-4b-pt's config.json: the text fields it lists; the rest are Gemma3TextConfig's defaults.
MULTIMODAL_4B = {
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "mm_tokens_per_image": 256,
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152}, "tie_word_embeddings": True,
}


def transformers5_spelling(legacy: dict) -> dict:
    """What transformers 5's save_pretrained writes for a 4.5x-era Gemma 3 config."""
    hf = {k: v for k, v in legacy.items()
          if k not in ("rope_theta", "rope_local_base_freq", "rope_scaling", "sliding_window_pattern")}
    pattern, layers = legacy["sliding_window_pattern"], legacy["num_hidden_layers"]
    hf["layer_types"] = [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
    hf["rope_parameters"] = {FULL: {"rope_type": "default", **(legacy["rope_scaling"] or {}),
                                    "rope_theta": legacy["rope_theta"]},
                             SLIDING: {"rope_type": "default", "rope_theta": legacy["rope_local_base_freq"]}}
    return hf


@pytest.mark.parametrize("size", ["1B", "4B"])
def test_both_rope_spellings_give_one_config(size):
    legacy = PRESETS["gemma3"][size]
    cfg = model_config_from_hf_dict(legacy)
    assert model_config_from_hf_dict(transformers5_spelling(legacy)) == cfg
    assert cfg.layer_types == [SLIDING] * 5 + [FULL] + [SLIDING] * 5 + [FULL] + cfg.layer_types[12:]
    assert cfg.layer_types.count(FULL) == {"1B": 4, "4B": 5}[size]
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.query_pre_attn_scalar) == (1e6, 1e4, 256)
    assert cfg.rope_scaling == (None if size == "1B" else {"rope_type": "linear", "factor": 8.0})
    assert cfg.tie_word_embeddings and cfg.hidden_act == "gelu_pytorch_tanh" and cfg.head_dim == 256


def test_multimodal_text_config_takes_the_text_defaults():
    assert model_config_from_hf_dict(MULTIMODAL_4B) == model_config_from_hf_dict(PRESETS["gemma3"]["4B"])


def test_export_writes_both_spellings_and_the_pattern():
    written = hf_config_dict(model_config_from_hf_dict(PRESETS["gemma3"]["4B"]), vocab_size=262208)
    assert written["architectures"] == ["Gemma3ForCausalLM"] and written["model_type"] == "gemma3_text"
    assert written["rope_parameters"] == {FULL: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                          SLIDING: {"rope_type": "default", "rope_theta": 1e4}}
    assert (written["rope_scaling"], written["rope_local_base_freq"]) == ({"rope_type": "linear", "factor": 8.0}, 1e4)
    assert written["sliding_window_pattern"] == 6 and len(written["layer_types"]) == 34
    irregular = model_config_from_hf_dict({**PRESETS["gemma3"]["tiny"], "layer_types": [FULL, SLIDING] * 3 + [FULL]})
    assert "sliding_window_pattern" not in hf_config_dict(irregular, vocab_size=512)


@pytest.mark.parametrize("change, error, message", [
    ({"rope_scaling": {"type": "linear", "factor": 8.0}}, UnsupportedModelError,
     r"gemma3 rope_scaling needs a 'rope_type' key \(transformers ignores a bare 'type'\)"),
    ({"attn_logit_softcapping": 50.0}, UnsupportedModelError,
     r"attn_logit_softcapping=50.0 is not supported \(transformers 5.24 does not apply it"),
    ({"use_bidirectional_attention": True}, UnsupportedModelError, r"use_bidirectional_attention=true"),
    ({"layer_types": [SLIDING] * 6 + ["chunked_attention"]}, UnsupportedModelError,
     r"layer_types\[6\] 'chunked_attention' is not supported"),
    ({"layer_types": [SLIDING] * 3}, HFCheckpointError,
     r"layer_types must be a list of num_hidden_layers=7 entries"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, UnsupportedModelError,
     r"gemma3 rope_parameters must be nested per layer type"),
    ({"rope_parameters": {SLIDING: {"rope_type": "linear", "factor": 2.0}}}, UnsupportedModelError,
     r"rope_parameters.sliding_attention: rope type 'linear' is not supported"),
    ({"hidden_activation": "relu"}, UnsupportedModelError, r"hidden_activation 'relu' is not supported"),
])
def test_unsupported_configs_are_refused_naming_the_field(change, error, message):
    with pytest.raises(error, match=r"^preset: " + message):
        model_config_from_hf_dict({**PRESETS["gemma3"]["tiny"], **change}, source="preset")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_hf_checkpoint("gemma3", "tiny", tmp_path_factory.mktemp("hf") / "gemma3", random_norms=True)


@pytest.mark.parametrize("prefix", ["language_model.model.", "model.language_model."])
def test_text_model_of_a_multimodal_checkpoint_loads(tiny, tmp_path, prefix):
    """Hub files (and transformers 5's save_pretrained) name the text model language_model.model.*,
    transformers 5 in memory model.language_model.*; the vision tower and projector are skipped."""
    folder = tmp_path / "mm"
    folder.mkdir()
    text = {k: v for k, v in PRESETS["gemma3"]["tiny"].items() if k not in ("architectures", "model_type")}
    (folder / "config.json").write_text(json.dumps(
        {**copy.deepcopy(MULTIMODAL_4B), "text_config": {**text, "model_type": "gemma3_text"}}))
    vision = "vision_tower.vision_model.embeddings.patch_embedding.weight"
    extra = [vision, "multi_modal_projector.mm_input_projection_weight"]
    if prefix.startswith("model."):
        extra = ["model." + name for name in extra]
    with CheckpointFiles(tiny) as ckpt:
        by_name = {prefix + n.removeprefix("model."): e for n, e in ckpt.entries.items()}
        specs = [TensorSpec(n, e.dtype, e.shape) for n, e in by_name.items()]
        specs += [TensorSpec(name, "F32", (4, 3)) for name in extra]
        write_safetensors(folder / SINGLE_FILE, specs, lambda s: ckpt.read(by_name[s.name]) if s.name in by_name
                          else np.ones(s.shape, np.float32))
    cfg, text_cfg = model_config_from_hf(folder, FP32), model_config_from_hf(tiny, FP32)
    assert cfg == dataclasses.replace(text_cfg, path=str(folder))
    mine, text_only = load_hf_params(folder, cfg), load_hf_params(tiny, text_cfg)
    assert jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(a, b), nnx.to_pure_dict(mine),
                                     nnx.to_pure_dict(text_only)))


def test_random_norms_are_zero_centred(tiny):
    with CheckpointFiles(tiny) as ckpt:
        norm = ckpt.read(ckpt.entries["model.layers.3.pre_feedforward_layernorm.weight"]).astype(np.float32)
        q_norm = ckpt.read(ckpt.entries["model.layers.5.self_attn.q_norm.weight"]).astype(np.float32)
    assert abs(norm.mean()) < 0.05 and 0.05 < norm.std() < 0.15 and q_norm.shape == (16,)


def test_lean_init_starts_norms_at_zero_like_build_model():
    cfg = model_config_from_hf_dict(PRESETS["gemma3"]["tiny"], FP32)
    params = nnx.to_pure_dict(nnx.state(build_model_lean(cfg, 512, seed=0), nnx.Param))
    scales = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
              if "scale" in jax.tree_util.keystr(p)}
    assert len(scales) == 7 and all(np.all(x == 0) for x in scales.values())
    assert params["layers"]["self_attn"]["q_norm"]["scale"].shape == (7, 16)
