"""With ``model.path`` the architecture is config.json's: the context length, the vocabulary, RoPE,
the sliding window and the tied head are read from it before anything is checked against them,
so a section's own defaults (``max_position_embeddings: 2048``) never refuse a model's run."""

import json
from collections import namedtuple

import pytest

from jaxascend.config import ConfigError, load_config
from jaxascend.planning import disk_plan, machine_limits
from jaxascend.plan import main as plan_main
from jaxascend.preparation import resolve_model_config

# Qwen2.5-7B's config.json as published (context 131072, untied head, 152064 rows).
QWEN_7B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02,
    "intermediate_size": 18944, "max_position_embeddings": 131072, "max_window_layers": 28,
    "model_type": "qwen2", "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.43.1", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 152064,
}


@pytest.fixture
def qwen_7b(tmp_path):
    folder = tmp_path / "Qwen2.5-7B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN_7B))
    return folder


@pytest.fixture
def roomy(monkeypatch):
    """A machine with memory and disk to spare, whatever this one has."""
    monkeypatch.setenv(machine_limits.MEM_AVAILABLE_ENV, "1TiB")
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(disk_plan.shutil, "disk_usage", lambda path: usage(2**50, 0, 2**50))


def _plan(tmp_path, folder, *overrides) -> list[str]:
    args = ["--config", "configs/qwen2.5-7b.yaml", "--json", "--disk-gbps", "2"]
    for o in (f"model.path={folder}", f"train.out_dir={tmp_path / 'run'}", *overrides):
        args += ["--set", o]
    return args


def test_a_7b_model_plans_4096_tokens_from_config_json(tmp_path, qwen_7b, roomy, capsys):
    assert plan_main(_plan(tmp_path, qwen_7b, "data.seq_len=4096")) == 0
    out, err = capsys.readouterr()
    plan = json.loads(out)
    assert err == "" and plan["num_params"] == 7_615_616_512 and plan["problems"] == []
    assert not (tmp_path / "run").exists()


def test_a_row_longer_than_config_json_allows_is_refused_naming_it(tmp_path, qwen_7b, capsys):
    assert plan_main(_plan(tmp_path, qwen_7b, "data.seq_len=131073")) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (f"error: data.seq_len: 131073 exceeds the model's max_position_embeddings=131072 "
                   f"({qwen_7b}/config.json)\n")


def test_the_sections_own_shape_fields_do_not_decide_with_a_model_path(qwen_7b):
    # Each of these would be refused for a model from scratch (the default 4 layers, arch llama,
    # head_dim 32); with model.path config.json's values replace them before anything is checked.
    cfg = load_config("configs/qwen2.5-7b.yaml", [
        f"model.path={qwen_7b}", "data.seq_len=4096", "model.max_position_embeddings=512",
        "model.layer_types=[sliding_attention]", "model.partial_rotary_factor=0.1", "model.num_key_value_heads=3",
        "model.vocab_size=1000", "model.tie_word_embeddings=true"], inputs=False)
    model = resolve_model_config(cfg)
    assert (model.max_position_embeddings, model.vocab_size, model.tie_word_embeddings) == (131072, 152064, False)
    assert (model.layer_types, model.sliding_window, model.partial_rotary_factor) == (None, None, 1.0)
    assert (model.rope_theta, model.num_key_value_heads) == (1e6, 4)
    with pytest.raises(ConfigError, match=r"^model\.layer_types: only arch 'gemma3' uses it"):
        load_config("configs/tiny.yaml", ["model.layer_types=[sliding_attention]"])


@pytest.mark.parametrize("change, message", [
    ({"num_key_value_heads": 3}, r"model\.num_key_value_heads: 3 must divide model\.num_attention_heads=28"),
    ({"num_attention_heads": 27}, r"model\.hidden_size: 3584 is not divisible by model\.num_attention_heads=27"),
])
def test_a_config_json_whose_shape_does_not_fit_together_is_refused_naming_it(qwen_7b, change, message):
    (qwen_7b / "config.json").write_text(json.dumps({**QWEN_7B, **change}))
    cfg = load_config("configs/qwen2.5-7b.yaml", [f"model.path={qwen_7b}"], inputs=False)
    with pytest.raises(ConfigError, match=f"^{qwen_7b}/config.json: {message}") as err:
        resolve_model_config(cfg)
    assert "\n" not in str(err.value)


def test_a_model_field_that_config_json_replaces_is_one_note(tmp_path, qwen_7b, roomy, capsys):
    args = [a for a in _plan(tmp_path, qwen_7b) if a != "--json"]
    plan_main(args)  # the shipped config sets only the run's numerics: nothing replaced
    assert "decides the architecture" not in capsys.readouterr().out
    plan_main(args + ["--set", "model.hidden_size=1024", "--set", "model.max_position_embeddings=4096"])
    notes = [line for line in capsys.readouterr().out.splitlines() if "decides the architecture" in line]
    assert notes == [f"note: model: hidden_size 1024 -> 3584, max_position_embeddings 4096 -> 131072: {qwen_7b}/"
                     "config.json decides the architecture (with model.path, the model section sets only dtype, "
                     "param_dtype, remat, attention, loss, init_std and init)"]
