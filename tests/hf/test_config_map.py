"""config.json <-> ModelConfig: every field of the four architectures, both RoPE spellings
(transformers 4's rope_theta/rope_scaling and 5's rope_parameters, the latter written by
transformers itself), Qwen2's sliding-window rules, run fields kept from the user's config,
and the ready configs in configs/ parsing with real paths."""

from __future__ import annotations

import copy
import dataclasses
import json
import warnings
from pathlib import Path

import pytest

from jaxascend.config import ModelConfig, load_config
from jaxascend.hf import PRESETS, make_hf_checkpoint, model_config_from_hf, model_config_from_hf_dict
from jaxascend.hf.config_map import detect_arch, hf_config_dict

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))
READY = {"qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b", "llama3.2-1b", "llama3.2-3b",
         "llama3.1-8b", "gpt2", "gemma3-1b", "gemma3-4b", "qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b",
         "phi3-mini-4k"}


def test_llama_3_2_1b_fields():
    cfg = model_config_from_hf_dict(PRESETS["llama"]["1B"])
    assert (cfg.arch, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == ("llama", 128256, 2048, 8192)
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (16, 32, 8)
    assert cfg.head_dim is None  # 64 == 2048 / 32: the default
    assert cfg.rope_theta == 500000.0 and cfg.rms_norm_eps == 1e-5 and cfg.tie_word_embeddings
    assert cfg.rope_scaling == {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert cfg.max_position_embeddings == 131072 and not cfg.attention_bias and cfg.sliding_window is None


def test_llama_3_2_3b_keeps_an_explicit_head_dim_only_when_it_differs():
    assert model_config_from_hf_dict(PRESETS["llama"]["3B"]).head_dim is None  # 3072 / 24 = 128
    assert model_config_from_hf_dict(PRESETS["llama"]["tiny"]).head_dim == 24


def test_rope_parameters_spelling_of_transformers_5(tmp_path):
    transformers = pytest.importorskip("transformers")
    v4 = copy.deepcopy(PRESETS["llama"]["8B"])  # transformers adds rope_theta to the dict it gets
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fields = {k: v for k, v in copy.deepcopy(v4).items() if k not in ("architectures", "model_type")}
        hf = transformers.LlamaConfig(**fields)
        hf.architectures = ["LlamaForCausalLM"]
        hf.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in written and "rope_scaling" not in written  # transformers 5's format
    assert model_config_from_hf(tmp_path) == dataclasses.replace(model_config_from_hf_dict(v4), path=str(tmp_path))


def test_qwen2_fields_and_bias():
    cfg = model_config_from_hf_dict(PRESETS["qwen2"]["7B"])
    assert (cfg.arch, cfg.vocab_size, cfg.hidden_size, cfg.num_key_value_heads) == ("qwen2", 152064, 3584, 4)
    assert cfg.attention_bias and not cfg.tie_word_embeddings and cfg.rope_theta == 1e6
    assert cfg.rms_norm_eps == 1e-6 and cfg.sliding_window is None  # use_sliding_window: false


@pytest.mark.parametrize("extra,window", [
    ({"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0}, 16),
    ({"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 2}, None),
    ({"layer_types": ["sliding_attention"] * 2, "sliding_window": 16}, 16),
    ({"layer_types": ["full_attention"] * 2, "sliding_window": 16}, None),
])
def test_qwen2_sliding_window(extra, window):
    assert model_config_from_hf_dict({**PRESETS["qwen2"]["tiny"], **extra}).sliding_window == window


def test_mistral_sliding_window():
    cfg = model_config_from_hf_dict(PRESETS["mistral"]["7B"])
    assert cfg.sliding_window == 4096 and cfg.num_key_value_heads == 8 and not cfg.attention_bias


def test_gpt2_fields():
    cfg = model_config_from_hf_dict(PRESETS["gpt2"]["124M"])
    assert (cfg.arch, cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == ("gpt2", 50257, 768, 12)
    assert cfg.intermediate_size == 4 * 768  # n_inner: null
    assert cfg.num_attention_heads == cfg.num_key_value_heads == 12
    assert cfg.max_position_embeddings == 1024 and cfg.layer_norm_epsilon == 1e-5
    assert cfg.hidden_act == "gelu_new" and cfg.tie_word_embeddings
    explicit = model_config_from_hf_dict({**PRESETS["gpt2"]["tiny"], "n_inner": 100,
                                          "activation_function": "gelu", "layer_norm_epsilon": 1e-6})
    assert (explicit.intermediate_size, explicit.hidden_act, explicit.layer_norm_epsilon) == (100, "gelu", 1e-6)


def test_architecture_from_model_type_when_architectures_is_absent():
    assert detect_arch({"model_type": "mistral"}) == "mistral"
    assert detect_arch({"architectures": ["Qwen2ForCausalLM"], "model_type": "whatever"}) == "qwen2"


def test_run_fields_come_from_the_users_config():
    base = ModelConfig(dtype="float16", param_dtype="bfloat16", remat="offload", init_std=0.01,
                       hidden_size=8, num_hidden_layers=1)
    cfg = model_config_from_hf_dict(PRESETS["qwen2"]["0.5B"], base, path="/x")
    assert (cfg.dtype, cfg.param_dtype, cfg.remat, cfg.init_std) == ("float16", "bfloat16", "offload", 0.01)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.path) == (896, 24, "/x")


@pytest.mark.parametrize("arch,size", [(a, s) for a in PRESETS for s in PRESETS[a]])
def test_hf_config_dict_round_trips_every_preset(arch, size):
    cfg = model_config_from_hf_dict(PRESETS[arch][size])
    written = hf_config_dict(cfg, dtype="bfloat16", token_ids={"eos_token_id": 7, "bos_token_id": None})
    assert written["eos_token_id"] == 7 and "bos_token_id" not in written
    assert written["architectures"] == PRESETS[arch][size]["architectures"]
    assert model_config_from_hf_dict(json.loads(json.dumps(written))) == cfg
    # Every architecture field of the preset is written with the same value.
    for key, value in PRESETS[arch][size].items():
        if key in written and key not in ("bos_token_id", "eos_token_id", "n_inner", "max_window_layers",
                                          "sliding_window"):
            assert written[key] == value, key


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    return make_hf_checkpoint("qwen2", "tiny", tmp_path_factory.mktemp("hf") / "qwen2")


def test_the_ready_configs_are_all_there():
    assert {p.stem for p in CONFIGS} >= READY


@pytest.mark.parametrize("path", [p for p in CONFIGS if p.stem in READY], ids=lambda p: p.stem)
def test_ready_config_parses_with_real_paths(path, tiny_qwen, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "hello"}\n')
    text = path.read_text()
    assert "/path/to/" in text and "model.path" in text  # placeholders and how to set them
    cfg = load_config(path, [f"model.path={tiny_qwen}", f"data.paths=[{data}]"])
    assert cfg.model.path == str(tiny_qwen) and cfg.data.tokenizer in ("model", "auto")  # auto: the model's, here
    # the arena exactly as its plan needs (a fixed size would be allocated and locked, the rest unused)
    assert cfg.offload.enabled and cfg.offload.arena_bytes is None and cfg.offload.chunk_bytes
    assert cfg.model.dtype == "bfloat16"
    # The architecture comes from the folder, run settings from the YAML.
    resolved = model_config_from_hf(cfg.model.path, cfg.model)
    assert resolved.arch == "qwen2" and resolved.remat == cfg.model.remat
