"""config.json <-> ModelConfig for Qwen3 and Phi-3 and for every RoPE type in both spellings
(transformers 4's rope_theta + rope_scaling with ``type`` or ``rope_type``, transformers 5's
rope_parameters), with transformers' defaults for absent keys, Phi-3's legacy ``su``/``yarn``
names, the one-line refusals of what our models do not implement, and lean random init of both
families. No torch needed."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from jaxascend.hf import PRESETS, model_config_from_hf_dict, param_plan
from jaxascend.hf.config_map import hf_config_dict
from jaxascend.hf.errors import UnsupportedModelError
from jaxascend.models import Rotary

SHAPE = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}
ROPE_TYPES = {
    "linear": {"factor": 4.0},
    "dynamic": {"factor": 2.0},
    "yarn": {"factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 16.0, "beta_slow": 2.0,
             "mscale": 0.8, "mscale_all_dim": 0.5, "truncate": False, "attention_factor": 1.1},
    "longrope": {"original_max_position_embeddings": 64, "factor": 4.0,
                 "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [2.0] * 8},
}


def config(arch_class: str, **fields) -> dict:
    return {"architectures": [arch_class], **SHAPE, **fields}


@pytest.mark.parametrize("arch_class", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
@pytest.mark.parametrize("rope_type", list(ROPE_TYPES))
def test_both_rope_spellings_give_the_same_config_and_survive_export(arch_class, rope_type):
    keys = ROPE_TYPES[rope_type]
    v4_type = config(arch_class, head_dim=16, rope_theta=5e5, rope_scaling={"type": rope_type, **keys})
    v4 = config(arch_class, head_dim=16, rope_theta=5e5, rope_scaling={"rope_type": rope_type, **keys})
    v5 = config(arch_class, head_dim=16, rope_parameters={"rope_type": rope_type, "rope_theta": 5e5, **keys})
    cfg = model_config_from_hf_dict(v5)
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling == {"rope_type": rope_type, **keys}
    assert model_config_from_hf_dict(v4) == cfg and model_config_from_hf_dict(v4_type) == cfg
    exported = hf_config_dict(cfg)
    assert exported["rope_scaling"] == {"rope_type": rope_type, **keys}
    assert exported["rope_parameters"] == {"rope_type": rope_type, **keys, "rope_theta": 5e5}
    assert model_config_from_hf_dict(exported) == cfg
    # transformers 5 reads only rope_parameters when rope_scaling is absent: the same model
    assert model_config_from_hf_dict({k: v for k, v in exported.items() if k != "rope_scaling"}) == cfg


@pytest.mark.parametrize("rope_type", ["llama3", "yarn", "longrope"])
def test_original_max_position_embeddings_defaults_to_max_position_embeddings(rope_type):
    keys = {k: v for k, v in {**ROPE_TYPES.get(rope_type, {}), "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0}.items() if k != "original_max_position_embeddings"}
    cfg = model_config_from_hf_dict(config("LlamaForCausalLM", rope_scaling={"rope_type": rope_type, **keys}))
    assert cfg.rope_scaling["original_max_position_embeddings"] == 256  # transformers' setdefault


def test_yarn_null_factor_is_max_positions_over_original():
    cfg = model_config_from_hf_dict(config("LlamaForCausalLM", rope_scaling={
        "rope_type": "yarn", "factor": None, "original_max_position_embeddings": 64}))
    assert cfg.rope_scaling["factor"] == 4.0


def test_qwen3_fields_and_defaults():
    cfg = model_config_from_hf_dict(PRESETS["qwen3"]["0.6B"])
    assert (cfg.arch, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == ("qwen3", 1024, 16, 8)
    assert cfg.head_dim == 128  # != 1024 / 16: kept explicit
    assert cfg.tie_word_embeddings and not cfg.attention_bias and cfg.sliding_window is None
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling is None and cfg.rms_norm_eps == 1e-6
    absent = {k: v for k, v in PRESETS["qwen3"]["8B"].items() if k != "head_dim"}
    assert model_config_from_hf_dict(absent).head_dim is None  # Qwen3Config's 128 = 4096 / 32
    bare = config("Qwen3ForCausalLM", hidden_size=256)
    bare.pop("max_position_embeddings")
    cfg = model_config_from_hf_dict(bare)
    assert cfg.head_dim == 128 and cfg.max_position_embeddings == 32768 and not cfg.tie_word_embeddings


def test_qwen3_attention_bias_adds_o_proj_bias_and_exports():
    cfg = model_config_from_hf_dict(config("Qwen3ForCausalLM", head_dim=16, attention_bias=True))
    biases = {m.hf_names[0] for m in param_plan(cfg) if m.path[-1] == "bias"}
    assert biases == {f"layers.0.self_attn.{p}_proj.bias" for p in "qkvo"}
    assert hf_config_dict(cfg)["attention_bias"] is True
    assert model_config_from_hf_dict(hf_config_dict(cfg)) == cfg


def test_qwen3_sliding_window_on_all_layers_only():
    cfg = model_config_from_hf_dict(config("Qwen3ForCausalLM", use_sliding_window=True, sliding_window=8,
                                           max_window_layers=0))
    assert cfg.sliding_window == 8 and model_config_from_hf_dict(hf_config_dict(cfg)) == cfg
    with pytest.raises(UnsupportedModelError, match=r"sliding-window attention on only some layers"):
        model_config_from_hf_dict(config("Qwen3ForCausalLM", use_sliding_window=True, sliding_window=8,
                                         max_window_layers=1))


@pytest.mark.parametrize("arch, size", [(a, s) for a in ("qwen3", "phi3") for s in PRESETS[a]])
def test_presets_round_trip_through_config_json(arch, size):
    cfg = model_config_from_hf_dict(PRESETS[arch][size])
    assert model_config_from_hf_dict(hf_config_dict(cfg)) == cfg


def test_phi3_mini_128k_longrope():
    cfg = model_config_from_hf_dict(PRESETS["phi3"]["mini-128k"])
    assert (cfg.arch, cfg.head_dim, cfg.sliding_window, cfg.rms_norm_eps) == ("phi3", None, 262144, 1e-5)
    assert cfg.rope_scaling["rope_type"] == "longrope"
    assert cfg.rope_scaling["original_max_position_embeddings"] == 4096  # from the top level
    rope = Rotary(96, cfg.rope_theta, Rotary.freeze(cfg.rope_scaling), cfg.max_position_embeddings)
    assert rope.attention_factor == pytest.approx(1.1902380714238083, rel=1e-12)
    exported = hf_config_dict(cfg)
    # transformers 4's Phi3Config wants exactly these three keys, the original length at the top
    assert exported["rope_scaling"] == {"type": "longrope", "short_factor": cfg.rope_scaling["short_factor"],
                                        "long_factor": cfg.rope_scaling["long_factor"]}
    assert exported["original_max_position_embeddings"] == 4096 and "head_dim" not in exported
    mini_4k = model_config_from_hf_dict(PRESETS["phi3"]["mini-4k"])
    assert mini_4k.rope_scaling is None and mini_4k.sliding_window == 2047


@pytest.mark.parametrize("legacy", ["su", "yarn"])
def test_phi3_legacy_rope_names_mean_longrope(legacy):
    hf = copy.deepcopy(PRESETS["phi3"]["tiny"])
    hf["rope_scaling"]["type"] = legacy
    assert model_config_from_hf_dict(hf) == model_config_from_hf_dict(PRESETS["phi3"]["tiny"])


def test_phi3_top_level_original_max_position_embeddings_wins():
    hf = copy.deepcopy(PRESETS["phi3"]["tiny"])
    hf["rope_parameters"] = {**hf.pop("rope_scaling"), "rope_type": "longrope", "rope_theta": 10000.0,
                             "original_max_position_embeddings": 99}
    assert model_config_from_hf_dict(hf).rope_scaling["original_max_position_embeddings"] == 8


def test_phi3_partial_rotary_factor_is_read_and_written():
    hf = config("Phi3ForCausalLM", partial_rotary_factor=0.5, original_max_position_embeddings=32,
                rope_scaling={"type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4})
    cfg = model_config_from_hf_dict(hf)
    assert cfg.partial_rotary_factor == 0.5
    exported = hf_config_dict(cfg)
    assert exported["partial_rotary_factor"] == 0.5 and exported["rope_parameters"]["partial_rotary_factor"] == 0.5
    assert model_config_from_hf_dict(exported) == cfg


def test_phi3_fused_tensors_are_row_blocks():
    plan = {m.dotted: m for m in param_plan(model_config_from_hf_dict(PRESETS["phi3"]["tiny"]))}
    q, k, v = (plan[f"layers.self_attn.{p}_proj.kernel"] for p in "qkv")
    assert {m.hf_names[1] for m in (q, k, v)} == {"layers.1.self_attn.qkv_proj.weight"}
    assert (q.hf_rows, k.hf_rows, v.hf_rows) == ((0, 64), (64, 96), (96, 128))
    assert q.hf_shape == (128, 64) and k.hf_part_shape == (32, 64)
    gate, up = plan["layers.mlp.gate_proj.kernel"], plan["layers.mlp.up_proj.kernel"]
    assert gate.hf_names[0] == up.hf_names[0] == "layers.0.mlp.gate_up_proj.weight"
    assert (gate.hf_rows, up.hf_rows, up.hf_shape) == ((0, 96), (96, 192), (192, 64))


@pytest.mark.parametrize("change, message", [
    ({"rope_scaling": {"type": "linear", "factor": 2.0}},
     r"rope type 'linear' is not supported for Phi3ForCausalLM \(supported: default, longrope\)"),
    ({"head_dim": 32}, r"head_dim 32 != hidden_size / num_attention_heads = 16; Phi3ForCausalLM derives it"),
    ({"resid_pdrop": 0.1}, r"resid_pdrop=0.1 is not supported \(no dropout; must be 0\)"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 7, "long_factor": [1.0] * 8}},
     r"model.rope_scaling.short_factor: needs 8 numbers \(rotary dims 16 / 2\), got 7"),
])
def test_phi3_refusals_name_the_field(change, message):
    hf = {**copy.deepcopy(PRESETS["phi3"]["tiny"]), **change}
    with pytest.raises(ValueError, match=message):
        model_config_from_hf_dict(hf, source="phi/config.json")


def test_unknown_rope_type_is_refused_with_the_allowed_ones():
    with pytest.raises(UnsupportedModelError, match=r"config.json: rope type 'ntk' is not supported "
                                                    r"\(supported: default, linear, dynamic, yarn, longrope, llama3\)"):
        model_config_from_hf_dict(config("LlamaForCausalLM", rope_scaling={"rope_type": "ntk"}))



@pytest.mark.parametrize("arch", ["qwen3", "phi3"])
def test_lean_random_init_builds_the_model_one_tensor_at_a_time(arch):
    import jax
    import numpy as np
    from flax import nnx

    from jaxascend.hf import build_model_lean

    cfg = model_config_from_hf_dict(PRESETS[arch]["tiny"])
    model = build_model_lean(dataclasses.replace(cfg, dtype="float32"), 512, seed=0)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name, x = jax.tree_util.keystr(path), np.asarray(leaf)
        if "scale" in name:  # q_norm/k_norm included
            np.testing.assert_array_equal(x, 1.0)
        else:
            assert abs(x.std() - cfg.init_std) < 0.005, name
    assert {m.dotted for m in param_plan(cfg)} == {
        jax.tree_util.keystr(p, simple=True, separator=".") for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]}
    logits = model(jax.numpy.zeros((1, 12), jax.numpy.int32))
    assert logits.shape == (1, 12, 512) and np.isfinite(np.asarray(logits)).all()
