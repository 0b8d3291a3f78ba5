"""The trainer end to end: the real CLI has a pulse, runs are reproducible, bad input is one line."""

import json
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxascend.config import load_config
from jaxascend.trainer import run
from tests._corpus import write_word_corpus

SMALL = [
    "model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=2",
    "model.num_attention_heads=4", "model.num_key_value_heads=2", "data.seq_len=32", "data.batch_size=4",
    "train.progress=false", "optimizer.warmup_steps=1",
]


@pytest.fixture
def corpus(tmp_path):
    d = write_word_corpus(tmp_path / "corpus", docs=6, words_per_doc=400)
    (d / "more.jsonl").write_text("\n".join(json.dumps({"text": f"record {i} " * 30}) for i in range(20)))
    return d


def _cfg(tmp_path, corpus, *extra):
    return load_config("configs/tiny.yaml", SMALL + [f"data.paths=[{corpus}]", "data.include=['*.txt','*.jsonl']",
                                                     f"train.out_dir={tmp_path / 'run'}", *extra])


def test_cli_has_a_pulse(tmp_path, corpus):
    out = tmp_path / "cli"
    proc = subprocess.run(
        [sys.executable, "-m", "jaxascend.train", "--config", "configs/tiny.yaml", *sum([["--set", s] for s in SMALL], []),
         "--set", f"data.paths=[{corpus}]", "--set", "data.include=['*.txt']", "--set", "train.steps=2",
         "--set", "train.log_every=1", "--set", f"train.out_dir={out}"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2]
    for r in lines:
        assert np.isfinite(r["loss"]) and r["tokens_per_s"] > 0 and r["peak_rss_bytes"] > 0
        assert "device_mem_bytes" not in r  # the CPU backend's device memory is host RAM: not reported
    # The run's first line names the backend and the devices (tests/test_devices.py: with their memory).
    assert proc.stdout.splitlines()[0] == "backend: cpu, 1 device: cpu (memory: host RAM)"
    assert "loss first -> last" in proc.stdout
    # The summary's tokens/s leaves out the first step, which compiled, and says so.
    assert any(line.startswith("tokens/s ") and line.endswith("(step 2; step 1 compiled)")
               for line in proc.stdout.splitlines()), proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tokens_per_s"] > 0 and summary["tokens_per_s_steps"] == [2, 2]
    assert (out / "summary.json").exists() and (out / "config.yaml").exists()
    # Every choice the user did not ask for is one note line on stderr, and the plan records it.
    notes = proc.stderr.strip().splitlines()
    assert notes and all(line.startswith("note: ") for line in notes), proc.stderr
    assert "note: offload.params: auto chose resident" in notes
    assert sum("offload.overlap is off" in line and "model.remat: none" in line for line in notes) == 1
    step = json.loads((out / "plan.json").read_text())["step"]
    assert step["overlap"] is False and "model.remat: none" in step["overlap_refused"]


def test_same_seed_same_losses_bitwise(tmp_path, corpus):
    a = run(_cfg(tmp_path / "a", corpus, "train.steps=4", "train.log_every=2"))
    b = run(_cfg(tmp_path / "b", corpus, "train.steps=4", "train.log_every=2"))
    assert len(a.losses) == 4
    assert a.losses == b.losses  # bitwise: float equality of every step's loss
    c = run(_cfg(tmp_path / "c", corpus, "train.steps=4", "train.seed=1"))
    assert c.losses != a.losses


def test_loss_falls(tmp_path, corpus):
    r = run(_cfg(tmp_path, corpus, "train.steps=30", "train.log_every=10", "optimizer.learning_rate=3e-3",
                 "optimizer.warmup_steps=0"))
    assert np.mean(r.losses[-5:]) < np.mean(r.losses[:5]) - 0.5


def test_grad_accum_runs(tmp_path, corpus):
    r = run(_cfg(tmp_path, corpus, "train.steps=2", "train.grad_accum=2"))
    assert len(r.losses) == 2 and all(np.isfinite(r.losses))


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.dtype=float8", "error: model.dtype: expected one of 'bfloat16', 'float16', 'float32', got 'float8'"),
        ("data.paths=[/no/such/dir]", "error: data.paths: '/no/such/dir' does not exist"),
        ("train.stepz=3", "error: train.stepz: unknown key"),
    ],
)
def test_cli_bad_input_is_one_line(override, message):
    proc = subprocess.run([sys.executable, "-m", "jaxascend.train", "--config", "configs/tiny.yaml", "--set", override],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith(message)
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "Traceback" not in proc.stderr


def test_fine_tune_hf_checkpoint_and_export(tmp_path, corpus):
    from jaxascend.hf import load_hf_params, make_hf_checkpoint

    src = tmp_path / "hf-in"
    make_hf_checkpoint("qwen2", "tiny", src, dtype="float32", seed=0)
    r = run(load_config("configs/tiny.yaml", [
        f"model.path={src}", "data.tokenizer=model", f"data.paths=[{corpus}]", "data.include=['*.txt']",
        "data.seq_len=32", "data.batch_size=2", "train.steps=2", "train.progress=false", "export.enabled=true",
        "export.dtype=float32", "optimizer.warmup_steps=0",
        f"train.out_dir={tmp_path / 'run'}"]))
    assert len(r.losses) == 2 and all(np.isfinite(r.losses))
    out = tmp_path / "run" / "hf"
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
    assert (tmp_path / "run" / "params.safetensors").exists()
    before, after = load_hf_params(src), load_hf_params(out)
    # Two AdamW steps moved every weight matrix away from the checkpoint it started from.
    changed = [not np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
               for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)) if np.ndim(a) >= 2]
    assert all(changed)


def test_a_config_with_no_offload_section_offloads(tmp_path, corpus):
    """The headline path is the default: a config that names no offload section trains with the
    AdamW state and the gradients on SSD, under <train.out_dir>/offload."""
    config = tmp_path / "no_offload.yaml"
    config.write_text("model:\n  arch: llama\n  dtype: bfloat16\ntrain:\n  steps: 2\n  log_every: 1\n")
    out = tmp_path / "plain"
    cfg = load_config(str(config), SMALL + [f"data.paths=[{corpus}]", "data.include=['*.txt']",
                                           f"train.out_dir={out}", "offload.keep_files=true"])
    assert cfg.offload.enabled
    result = run(cfg)
    assert result.engine == "offload"
    assert sorted(p.name for p in (out / "offload").iterdir() if p.suffix == ".bin"), "no offload shard files"
    assert json.loads((out / "summary.json").read_text())["engine"] == "offload"
