"""Hugging Face checkpoints in and out: make -> load -> export -> load again, for every
architecture; sharded and single files; prefix-less and head-carrying variants; the run
parameter file and the export CLI; transformers' AutoConfig reading our config.json.

Round trips must be bit-identical (bf16 on disk, fp32 in memory, bf16 again) and so must the
logits computed from the two loads.
"""

from __future__ import annotations

import functools
import json
import math
import shutil
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxascend.config import ModelConfig
from jaxascend.export import main as export_main
from jaxascend.hf import (CheckpointFiles, PRESETS, ParamsFile, export_hf, load_hf_model, load_hf_params,
                          make_hf_checkpoint, model_config_from_hf, model_config_from_hf_dict, param_plan, save_params)
from jaxascend.hf.load import iter_hf_params
from jaxascend.hf.presets import PUBLISHED_PARAMS
from jaxascend.hf.safetensors_io import INDEX_FILE, SINGLE_FILE, TensorSpec, write_safetensors

ARCHS = ("llama", "qwen2", "mistral", "gpt2", "gemma3", "qwen3", "phi3")
FP32 = ModelConfig(dtype="float32", param_dtype="float32")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """One tiny bf16 checkpoint per architecture, sharded into several files, with random norm
    scales and biases so that a misplaced one changes the logits."""
    root = tmp_path_factory.mktemp("hf")
    return {arch: make_hf_checkpoint(arch, "tiny", root / arch, random_norms=True, shard_bytes=40_000)
            for arch in ARCHS}


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, ids):
    return nnx.merge(graphdef, state)(ids)


def logits(model) -> np.ndarray:
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 512, (2, 12)), jnp.int32)
    return np.asarray(_forward(*nnx.split(model), ids))


def bits(state) -> dict:
    """Every parameter as raw bytes, keyed by path (compares NaN payloads and -0.0 too)."""
    return {jax.tree_util.keystr(p): np.asarray(x).tobytes()
            for p, x in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(state))}


@pytest.mark.parametrize("arch", ARCHS)
def test_round_trip_is_bit_identical(arch, checkpoints, tmp_path):
    folder = checkpoints[arch]
    cfg = model_config_from_hf(folder, FP32)
    first = load_hf_model(folder, cfg)
    out = export_hf(nnx.state(first, nnx.Param), cfg, tmp_path / "out", tokenizer_src=folder,
                    shard_bytes=30_000)
    second = load_hf_model(out, model_config_from_hf(out, FP32))
    assert bits(nnx.state(first)) == bits(nnx.state(second))
    np.testing.assert_array_equal(logits(first), logits(second))
    # The export's files are byte-identical tensors too (same names, dtypes and shapes).
    with CheckpointFiles(folder) as a, CheckpointFiles(out) as b:
        assert sorted(a.entries) == sorted(b.entries)
        for name, entry in a.entries.items():
            assert (entry.dtype, entry.shape) == (b.entries[name].dtype, b.entries[name].shape)
            assert a.read(entry).tobytes() == b.read(b.entries[name]).tobytes(), name
    assert json.loads((out / "config.json").read_text()) == json.loads((folder / "config.json").read_text())
    assert (out / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()


def test_checkpoint_files_are_sharded_with_an_index(checkpoints):
    folder = checkpoints["llama"]
    index = json.loads((folder / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    with CheckpointFiles(folder) as ckpt:
        assert index["metadata"]["total_size"] == sum(e.nbytes for e in ckpt.entries.values())
        for name, shard in index["weight_map"].items():
            assert ckpt.entries[name].file.endswith(shard)
        assert all(f.metadata == {"format": "pt"} for f in ckpt.files.values())


def test_single_file_export_and_fp32_dtype(checkpoints, tmp_path):
    folder = checkpoints["qwen2"]
    cfg = model_config_from_hf(folder, FP32)
    state = load_hf_params(folder, cfg)
    out = export_hf(state, cfg, tmp_path / "single", tokenizer_src=folder, dtype="float32")
    assert (out / SINGLE_FILE).is_file() and not (out / INDEX_FILE).exists()
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    assert bits(load_hf_params(out, cfg)) == bits(state)


def test_loading_casts_to_the_parameter_dtype_and_keeps_the_layout(checkpoints):
    folder = checkpoints["llama"]
    cfg = model_config_from_hf(folder, ModelConfig(dtype="bfloat16", param_dtype="bfloat16"))
    items = dict((m.dotted, array) for m, array in iter_hf_params(folder, cfg))
    assert {str(a.dtype) for a in items.values()} == {"bfloat16"}
    assert all(a.ctypes.data % 64 == 0 for a in items.values())
    with CheckpointFiles(folder) as ckpt:
        hf_q1 = ckpt.read(ckpt.entries["model.layers.1.self_attn.q_proj.weight"])
        hf_norm0 = ckpt.read(ckpt.entries["model.layers.0.input_layernorm.weight"])
    # HF Linear weights are [out, in]; ours are [in, out], stacked over layers.
    np.testing.assert_array_equal(items["layers.self_attn.q_proj.kernel"][1], hf_q1.T)
    np.testing.assert_array_equal(items["layers.input_layernorm.scale"][0], hf_norm0)
    state = load_hf_params(folder, cfg)
    assert state["layers"]["self_attn"]["q_proj"]["kernel"][...].dtype == jnp.bfloat16


def test_gpt2_checkpoint_without_prefix_and_with_mask_buffers_loads(checkpoints, tmp_path):
    """The original ``gpt2`` files name tensors without ``transformer.`` and carry the causal-mask
    buffers ``h.{i}.attn.bias``; both must load to the same model."""
    folder = checkpoints["gpt2"]
    plain = tmp_path / "gpt2-plain"
    plain.mkdir()
    (plain / "config.json").write_text((folder / "config.json").read_text())
    with CheckpointFiles(folder) as ckpt:
        specs = [TensorSpec(n.removeprefix("transformer."), e.dtype, e.shape) for n, e in ckpt.entries.items()]
        specs += [TensorSpec(f"h.{i}.attn.bias", "F32", (1, 1, 8, 8)) for i in range(2)]
        by_name = {n.removeprefix("transformer."): e for n, e in ckpt.entries.items()}
        write_safetensors(plain / SINGLE_FILE, specs,
                          lambda s: ckpt.read(by_name[s.name]) if s.name in by_name
                          else np.ones(s.shape, np.float32))
    cfg = model_config_from_hf(folder, FP32)
    assert bits(load_hf_params(plain, cfg)) == bits(load_hf_params(folder, cfg))


def test_tied_checkpoint_that_also_stores_lm_head_loads(checkpoints, tmp_path):
    folder = checkpoints["qwen2"]  # tied
    copy = tmp_path / "qwen2-with-head"
    copy.mkdir()
    (copy / "config.json").write_text((folder / "config.json").read_text())
    with CheckpointFiles(folder) as ckpt:
        entries = dict(ckpt.entries)
        embed = entries["model.embed_tokens.weight"]
        specs = [TensorSpec(n, e.dtype, e.shape) for n, e in entries.items()]
        specs.append(TensorSpec("lm_head.weight", embed.dtype, embed.shape))
        write_safetensors(copy / SINGLE_FILE, specs,
                          lambda s: ckpt.read(entries.get(s.name, embed)))
    cfg = model_config_from_hf(folder, FP32)
    assert bits(load_hf_params(copy, cfg)) == bits(load_hf_params(folder, cfg))


def test_params_file_and_export_cli(checkpoints, tmp_path, capsys):
    folder = checkpoints["mistral"]
    cfg = model_config_from_hf(folder, FP32)
    state = load_hf_params(folder, cfg)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    save_params(run_dir / "params.safetensors", state, cfg, tokenizer=str(folder))
    with ParamsFile(run_dir / "params.safetensors") as f:
        assert f.model_config == cfg and f.tokenizer == str(folder)
        np.testing.assert_array_equal(f.read(("layers", "mlp", "up_proj", "kernel"), 1),
                                      np.asarray(state["layers"]["mlp"]["up_proj"]["kernel"][...])[1])
    assert export_main(["--checkpoint", str(run_dir), "--out", str(tmp_path / "hf"),
                        "--shard-size", "50KB"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert bits(load_hf_params(tmp_path / "hf", cfg)) == bits(state)
    assert (tmp_path / "hf" / "tokenizer.json").is_file()


def test_export_without_tokenizer_is_quiet_and_keeps_the_sources_metadata(checkpoints, tmp_path):
    # No raw Python warning: the CLIs print one note line (tests/test_workflow.py). The model
    # folder it was fine-tuned from still gives the special-token ids and generation config.
    folder = Path(shutil.copytree(checkpoints["gpt2"], tmp_path / "source"))
    (folder / "generation_config.json").write_text(json.dumps({"max_new_tokens": 17}))
    cfg = model_config_from_hf(folder, FP32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = export_hf(load_hf_params(folder, cfg), cfg, tmp_path / "hf", model_src=folder)
    assert not (out / "tokenizer.json").exists() and (out / "config.json").is_file()
    assert json.loads((out / "generation_config.json").read_text()) == {"max_new_tokens": 17}
    source, exported = (json.loads((d / "config.json").read_text()) for d in (folder, out))
    assert all(exported.get(k) == source.get(k) for k in ("bos_token_id", "eos_token_id"))


def test_export_reads_one_layer_at_a_time_from_a_callable(checkpoints, tmp_path):
    """The SSD path: export from a reader that hands out fp32 layer slices on request."""
    folder = checkpoints["llama"]
    cfg = model_config_from_hf(folder, FP32)
    state = nnx.to_pure_dict(load_hf_params(folder, cfg))
    requests = []

    def read(path, layer):
        requests.append((path, layer))
        value = np.asarray(functools.reduce(lambda d, k: d[k], path, state), np.float32)
        return value if layer is None else value[layer]

    out = export_hf(read, cfg, tmp_path / "hf", tokenizer_src=folder)
    assert bits(load_hf_params(out, cfg)) == bits(nnx.State(state))
    stacked = [r for r in requests if r[1] is not None]
    assert stacked and {layer for _, layer in stacked} == {0, 1}


def test_exported_config_is_read_by_transformers(checkpoints, tmp_path):
    transformers = pytest.importorskip("transformers")
    for arch in ARCHS:
        cfg = model_config_from_hf(checkpoints[arch], FP32)
        out = export_hf(load_hf_params(checkpoints[arch], cfg), cfg, tmp_path / arch,
                        tokenizer_src=checkpoints[arch])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hf = transformers.AutoConfig.from_pretrained(out, local_files_only=True)
        assert type(hf).__name__.lower().startswith(arch.replace("gpt2", "gpt2"))
        assert hf.architectures == [PRESETS[arch]["tiny"]["architectures"][0]]
        assert hf.vocab_size == 512 and hf.tie_word_embeddings == cfg.tie_word_embeddings
        if arch == "gemma3":  # transformers 5 nests the RoPE settings per layer type
            assert hf.rope_parameters["full_attention"] == {"rope_theta": cfg.rope_theta, **cfg.rope_scaling}
            assert hf.rope_parameters["sliding_attention"] == {"rope_type": "default",
                                                               "rope_theta": cfg.rope_local_theta}
            assert hf.layer_types == cfg.layer_types and hf.sliding_window == cfg.sliding_window
            assert hf.query_pre_attn_scalar == cfg.query_pre_attn_scalar
            assert hf.final_logit_softcapping == cfg.final_logit_softcapping
        elif arch != "gpt2":
            assert hf.rope_parameters["rope_theta"] == cfg.rope_theta
            if arch != "phi3":  # Phi3Config has no head_dim: hidden_size / num_attention_heads
                assert hf.head_dim == (cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads)
            assert hf.num_key_value_heads == cfg.num_key_value_heads
        if arch == "llama":
            assert hf.rope_parameters["rope_type"] == "llama3"
            assert hf.rope_parameters["factor"] == cfg.rope_scaling["factor"]
        if arch in ("mistral", "phi3"):
            assert hf.sliding_window == cfg.sliding_window
        if arch == "phi3":  # our rope_scaling {type: longrope, ...} wins over rope_parameters, as in 5.x
            assert hf.rope_parameters["rope_type"] == "longrope"
            assert hf.rope_parameters["original_max_position_embeddings"] == 8
            assert hf.rope_parameters["short_factor"] == cfg.rope_scaling["short_factor"]
            assert hf.rope_parameters["long_factor"] == cfg.rope_scaling["long_factor"]
        if arch == "qwen3":
            assert hf.head_dim == 24 and not hf.attention_bias and hf.layer_types == ["full_attention"] * 2
        if arch == "gpt2":
            assert hf.n_inner == cfg.intermediate_size and hf.activation_function == "gelu_new"


@pytest.mark.parametrize("arch,size", sorted(PUBLISHED_PARAMS))
def test_presets_match_published_parameter_counts(arch, size):
    cfg = model_config_from_hf_dict(PRESETS[arch][size])
    assert sum(math.prod(m.shape) for m in param_plan(cfg)) == PUBLISHED_PARAMS[(arch, size)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float16"])
def test_tiled_transpose_matches_numpy(dtype):
    from jaxascend.hf.load import transpose_into
    from jaxascend.models import DTYPES

    src = np.random.default_rng(0).standard_normal((300, 700)).astype(DTYPES[dtype])
    dst = np.empty((700, 300), src.dtype)
    transpose_into(dst, src)
    assert dst.tobytes() == np.ascontiguousarray(src.T).tobytes()


def test_make_hf_checkpoint_script(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "make_hf_checkpoint.py"
    proc = subprocess.run([sys.executable, str(script), "--arch", "gpt2", "--size", "tiny", "--out",
                           str(tmp_path / "g"), "--dtype", "fp16"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["params"] == sum(math.prod(m.shape) for m in param_plan(model_config_from_hf(tmp_path / "g")))
    assert "tokenizer.json" in report["files"] and "model.safetensors" in report["files"]
    with CheckpointFiles(tmp_path / "g") as ckpt:
        assert {e.dtype for e in ckpt.entries.values()} == {"F16"}
    bad = subprocess.run([sys.executable, str(script), "--arch", "gpt2", "--size", "9B", "--out",
                          str(tmp_path / "x")], capture_output=True, text=True)
    assert bad.returncode == 2 and "not a preset for gpt2 (allowed: tiny, 124M)" in bad.stderr
