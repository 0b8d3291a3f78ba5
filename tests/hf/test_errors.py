"""Every way a Hugging Face folder can be wrong gives a one-line ValueError naming the file,
the tensor and both shapes: unsupported architectures, missing/unexpected tensors, shape and
dtype surprises, truncated and corrupt files, broken indexes, and bad export targets. The
trainer's CLI stops on a bad weight file with that one line, before any note and before it
writes anything."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxascend.config import ModelConfig
from jaxascend.export import main as export_main
from jaxascend.hf import CheckpointFiles, export_hf, load_hf_params, make_hf_checkpoint, model_config_from_hf
from jaxascend.hf.errors import (CorruptFileError, DTypeMismatchError, HFCheckpointError, MissingTensorError,
                                 ShapeMismatchError, UnexpectedTensorError, UnsupportedModelError)
from jaxascend.hf.safetensors_io import INDEX_FILE, SINGLE_FILE, TensorSpec, write_safetensors

FP32 = ModelConfig(dtype="float32", param_dtype="float32")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_hf_checkpoint("llama", "tiny", tmp_path_factory.mktemp("hf") / "llama")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    return make_hf_checkpoint("qwen2", "tiny", tmp_path_factory.mktemp("hf") / "qwen2", shard_bytes=40_000)


def rewrite(src, dest, edit=None, config_edit=None):
    """Copies checkpoint ``src`` into a single-file checkpoint ``dest``; ``edit(dict name->array)``
    may add, drop or replace tensors and ``config_edit(dict)`` may change config.json."""
    dest.mkdir()
    config = json.loads((src / "config.json").read_text())
    if config_edit:
        config_edit(config)
    (dest / "config.json").write_text(json.dumps(config))
    with CheckpointFiles(src) as ckpt:
        tensors = {name: ckpt.read(entry) for name, entry in ckpt.entries.items()}
    if edit:
        edit(tensors)
    dtype_names = {np.dtype(np.int32): "I32", np.dtype(np.float32): "F32"}
    specs = [TensorSpec(n, dtype_names.get(a.dtype, "BF16"), a.shape) for n, a in tensors.items()]
    write_safetensors(dest / SINGLE_FILE, specs, lambda s: tensors[s.name])
    return dest


def load(folder):
    return load_hf_params(folder, model_config_from_hf(folder, FP32))


def check_one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert isinstance(err.value, ValueError) and "\n" not in message
    return message


def test_unsupported_architecture_lists_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["PhiForCausalLM"],
                                                     "model_type": "phi"}))
    with pytest.raises(UnsupportedModelError) as err:
        model_config_from_hf(tmp_path)
    message = check_one_line(err)
    assert "PhiForCausalLM" in message
    for name in ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "GPT2LMHeadModel"):
        assert name in message


def test_missing_or_broken_config_json(tmp_path):
    with pytest.raises(HFCheckpointError, match="config.json: not found") as err:
        model_config_from_hf(tmp_path)
    check_one_line(err)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(HFCheckpointError, match="cannot be read as JSON") as err:
        model_config_from_hf(tmp_path)
    check_one_line(err)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(HFCheckpointError, match="required field 'num_attention_heads' is missing"):
        model_config_from_hf(tmp_path)


def train_cli(folder, tokenizer, tmp_path) -> str:
    """``python -m jaxascend.train`` fine-tuning ``folder``: the one line it prints, once checked
    that nothing else was printed (no ``note:`` first), that it exited with status 2 and that it
    wrote nothing (no out_dir, so no offload files or checkpoints either)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a few words to fine-tune on\n" * 20)
    out = tmp_path / "run"
    args = [f"model.path={folder}", f"data.tokenizer={tokenizer}", f"data.paths=[{corpus}]", "data.seq_len=32",
            f"train.out_dir={out}"]
    proc = subprocess.run([sys.executable, "-m", "jaxascend.train", "--config", "configs/tiny.yaml",
                           *[a for o in args for a in ("--set", o)]],
                          capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2])
    lines = (proc.stdout + proc.stderr).splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stdout + proc.stderr
    assert not out.exists()
    return lines[0]


def test_missing_tensor_names_it_and_its_shape(llama, tmp_path):
    folder = rewrite(llama, tmp_path / "c",
                     lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(MissingTensorError) as err:
        load(folder)
    message = check_one_line(err)
    assert "'model.layers.1.mlp.up_proj.weight' (expected shape [96, 64]) is missing" in message
    assert str(folder) in message
    assert train_cli(folder, llama, tmp_path) == f"error: {message}"


def test_untied_model_without_lm_head_is_missing_a_tensor(llama, tmp_path):
    folder = rewrite(llama, tmp_path / "c", lambda t: t.pop("lm_head.weight"))
    with pytest.raises(MissingTensorError, match=r"'lm_head.weight' \(expected shape \[512, 64\]\)"):
        load(folder)


def test_unexpected_tensor_names_it_and_the_file(llama, tmp_path):
    def add(t):
        t["model.layers.0.mlp.extra_proj.weight"] = np.zeros((3, 5), np.float32)

    folder = rewrite(llama, tmp_path / "c", add)
    with pytest.raises(UnexpectedTensorError) as err:
        load(folder)
    message = check_one_line(err)
    assert "unexpected tensor 'model.layers.0.mlp.extra_proj.weight' [3, 5]" in message
    assert str(folder / SINGLE_FILE) in message


def test_shape_mismatch_names_both_shapes(llama, tmp_path):
    def widen(config):
        config["intermediate_size"] = 128

    folder = rewrite(llama, tmp_path / "c", config_edit=widen)
    with pytest.raises(ShapeMismatchError) as err:
        load(folder)
    message = check_one_line(err)
    assert ("'model.layers.0.mlp.down_proj.weight' has shape [64, 96] but config.json implies "
            "[64, 128]") in message


def test_integer_tensor_is_a_dtype_error(llama, tmp_path):
    def to_int(t):
        t["model.norm.weight"] = np.ones(t["model.norm.weight"].shape, np.int32)

    folder = rewrite(llama, tmp_path / "c", to_int)
    with pytest.raises(DTypeMismatchError) as err:
        load(folder)
    message = check_one_line(err)
    assert "'model.norm.weight' [64] has dtype I32" in message and "F32, F16, BF16" in message


def test_truncated_shard_is_named(sharded, tmp_path):
    folder = tmp_path / "c"
    shutil.copytree(sharded, folder)
    shard = sorted(folder.glob("model-*.safetensors"))[1]
    os.truncate(shard, shard.stat().st_size - 10)
    with pytest.raises(CorruptFileError) as err:
        load(folder)
    message = check_one_line(err)
    assert str(shard) in message and "truncated" in message
    assert train_cli(folder, folder, tmp_path) == f"error: {message}"


def test_corrupt_header_is_named(sharded, tmp_path):
    folder = tmp_path / "c"
    shutil.copytree(sharded, folder)
    shard = sorted(folder.glob("model-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[8:16] = b"\x00garbage"
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptFileError) as err:
        load(folder)
    message = check_one_line(err)
    assert str(shard) in message and "not valid JSON" in message
    shard.write_bytes(b"\xff" * 8 + bytes(data[8:]))  # an absurd header length
    with pytest.raises(CorruptFileError, match="header length .* exceeds the file size"):
        load(folder)
    shard.write_bytes(b"abc")
    with pytest.raises(CorruptFileError, match="too short for a safetensors file"):
        load(folder)


def test_index_listing_a_missing_shard(sharded, tmp_path):
    folder = tmp_path / "c"
    shutil.copytree(sharded, folder)
    shard = sorted(folder.glob("model-*.safetensors"))[2]
    shard.unlink()
    with pytest.raises(CorruptFileError) as err:
        load(folder)
    message = check_one_line(err)
    assert INDEX_FILE in message and f"lists shard {shard.name!r} which does not exist" in message


def test_index_disagreeing_with_a_shard(sharded, tmp_path):
    folder = tmp_path / "c"
    shutil.copytree(sharded, folder)
    index = json.loads((folder / INDEX_FILE).read_text())
    name = "model.norm.weight"
    other = next(s for s in sorted(set(index["weight_map"].values())) if s != index["weight_map"][name])
    index["weight_map"][name] = other
    (folder / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CorruptFileError, match=f"says '{name}' is in '{other}'"):
        load(folder)


def test_folder_without_safetensors(llama, tmp_path):
    folder = tmp_path / "c"
    folder.mkdir()
    shutil.copy(llama / "config.json", folder)
    (folder / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(HFCheckpointError) as err:
        load(folder)
    message = check_one_line(err)
    assert "no model.safetensors or model.safetensors.index.json" in message
    assert "pytorch_model.bin: only safetensors weights are read" in message


@pytest.mark.parametrize("edit,match", [
    (lambda c: c.update(attention_bias=True), "attention_bias=true"),
    (lambda c: c.update(mlp_bias=True), "mlp_bias=true"),
    (lambda c: c.update(rope_scaling={"rope_type": "ntk", "factor": 4.0}), "rope type 'ntk' is not supported"),
    (lambda c: c.update(hidden_act="relu"), "hidden_act 'relu'"),
])
def test_unsupported_llama_features(llama, tmp_path, edit, match):
    config = json.loads((llama / "config.json").read_text())
    edit(config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=match) as err:
        model_config_from_hf(tmp_path)
    check_one_line(err)


def test_qwen2_with_sliding_window_on_some_layers_is_refused(sharded, tmp_path):
    config = json.loads((sharded / "config.json").read_text())
    config.update(use_sliding_window=True, sliding_window=16, max_window_layers=1)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="sliding-window attention on only some layers"):
        model_config_from_hf(tmp_path)


def test_export_refuses_a_non_empty_folder_and_bad_dtype(llama, tmp_path):
    cfg = model_config_from_hf(llama, FP32)
    state = load_hf_params(llama, cfg)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(HFCheckpointError, match="already exists and is not empty") as err:
        export_hf(state, cfg, tmp_path / "out", tokenizer_src=llama)
    check_one_line(err)
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
    with pytest.raises(ValueError, match="export dtype: 'int8' is not supported"):
        export_hf(state, cfg, tmp_path / "new", dtype="int8")
    assert not (tmp_path / "new").exists()


def test_export_with_a_wrong_parameter_shape_leaves_nothing(llama, tmp_path):
    cfg = model_config_from_hf(llama, FP32)
    state = load_hf_params(llama, cfg)
    state["norm"]["scale"].set_value(np.ones(7, np.float32))
    with pytest.raises(ShapeMismatchError, match=r"norm.scale has shape \[7\]; 'model.norm.weight' needs \[64\]"):
        export_hf(state, cfg, tmp_path / "out", tokenizer_src=llama)
    assert list(tmp_path.iterdir()) == []  # the partial folder is removed


def test_export_cli_errors_are_one_line_with_status_2(tmp_path, capsys):
    assert export_main(["--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not exist" in err
    assert export_main(["--checkpoint", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "has no params.safetensors" in capsys.readouterr().err
    (tmp_path / "params.safetensors").write_bytes(b"\x00" * 4)
    assert export_main(["--checkpoint", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "too short for a safetensors file" in capsys.readouterr().err
