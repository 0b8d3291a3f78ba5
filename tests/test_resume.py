"""Bit-exact resume: stop-and-resume and SIGKILL at any moment end where a straight run ends."""

import os
import subprocess
import sys

import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxascend.config import load_config
from jaxascend.trainer import run
from tests._corpus import write_word_corpus

SMALL = [
    "model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=2",
    "model.num_attention_heads=4", "model.num_key_value_heads=2", "data.seq_len=32", "data.batch_size=2",
    "train.progress=false", "train.log_every=1", "train.steps=6", "checkpoint.every_steps=2",
    "optimizer.warmup_steps=2", "export.save_params=false", "offload.chunk_bytes=1MiB", "offload.staging_bytes=1MiB",
    "checkpoint.async_save=false",
]
ENGINES = {
    "in-memory": ["offload.enabled=false", "model.dtype=float32"],
    "offload": ["offload.enabled=true", "model.dtype=bfloat16"],
}


@pytest.fixture
def corpus(tmp_path_factory):
    return write_word_corpus(tmp_path_factory.mktemp("corpus"), docs=4, words_per_doc=300)


def _overrides(out, corpus, engine):
    return SMALL + ENGINES[engine] + [f"data.paths=[{corpus}]", "data.include=['*.txt']", f"train.out_dir={out}",
                                      f"offload.dir={out}/offload"]


def _final_state(out):
    """Every array of the final checkpoint, read with plain Orbax (no jaxascend)."""
    step = out / "checkpoints" / "6"
    arrays = {"params": ocp.StandardCheckpointer().restore(step / "params")}
    for item in ("opt_state", "offloaded"):
        if (step / item).exists():
            arrays[item] = ocp.StandardCheckpointer().restore(step / item)
    return arrays


def _assert_bitwise_equal(a, b):
    import jax

    la, lb = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)
    assert [p for p, _ in la] == [p for p, _ in lb]
    assert len(la) > 0
    for (path, x), (_, y) in zip(la, lb):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, path
        assert x.tobytes() == y.tobytes(), f"{jax.tree_util.keystr(path)} differs"


@pytest.mark.parametrize("engine", list(ENGINES))
def test_stop_and_resume_is_bit_identical(tmp_path, corpus, engine):
    straight = run(load_config("configs/tiny.yaml", _overrides(tmp_path / "straight", corpus, engine)))
    first = run(load_config("configs/tiny.yaml", _overrides(tmp_path / "halves", corpus, engine) +
                            ["train.stop_at_step=3"]))
    assert len(first.losses) == 3
    second = run(load_config("configs/tiny.yaml", _overrides(tmp_path / "halves", corpus, engine)))
    assert second.losses == straight.losses  # step by step, bitwise (floats compared exactly)
    state = _final_state(tmp_path / "straight")
    if engine == "offload":
        assert set(state["offloaded"]) == {"master", "m", "v"}  # fp32 master and both moments
    _assert_bitwise_equal(state, _final_state(tmp_path / "halves"))


def _cli(out, corpus, engine, kill_at=None):
    env = {k: v for k, v in os.environ.items() if k != "JAXASCEND_KILL_AT"}
    if kill_at:
        env["JAXASCEND_KILL_AT"] = kill_at
    args = [sys.executable, "-m", "jaxascend.train", "--config", "configs/tiny.yaml"]
    for o in _overrides(out, corpus, engine):
        args += ["--set", o]
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)


def test_sigkill_at_any_moment_then_resume_is_bit_identical(tmp_path, corpus):
    straight = _cli(tmp_path / "straight", corpus, "offload")
    assert straight.returncode == 0, straight.stderr
    out = tmp_path / "killed"
    # Each run is killed with SIGKILL at one moment, then the next run resumes from whatever
    # complete checkpoint is there (the offload shards are rebuilt from it).
    for kill_at in ("backward:3", "optimizer_chunk:20", "checkpoint_chunk:4", "backward:2"):
        proc = _cli(out, corpus, "offload", kill_at)
        assert proc.returncode == -9, f"{kill_at}: expected SIGKILL, got {proc.returncode}: {proc.stderr[-2000:]}"
    final = _cli(out, corpus, "offload")
    assert final.returncode == 0, final.stderr
    _assert_bitwise_equal(_final_state(tmp_path / "straight"), _final_state(out))
    import json

    losses = json.loads((out / "summary.json").read_text())["losses"]
    assert losses == json.loads((tmp_path / "straight" / "summary.json").read_text())["losses"]
