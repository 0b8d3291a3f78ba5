"""Training with compressed optimizer state (optimizer.state_dtype): bit-exact resume in each
state dtype, the checkpoint's arrays, SSD traffic in the metrics, and a resume with another
state dtype refused with one line naming both."""

import json
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxascend.checkpoint import IncompatibleCheckpointError
from jaxascend.config import ConfigError, load_config
from jaxascend.trainer import run
from tests.test_resume import _assert_bitwise_equal, _final_state, _overrides, corpus  # noqa: F401


def _cfg(out, corpus, state_dtype, *extra):
    return load_config("configs/tiny.yaml", _overrides(out, corpus, "offload") +
                       [f"optimizer.state_dtype={state_dtype}", "optimizer.state_block=256", "optimizer.warmup_steps=1",
                        *extra])


@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
def test_stop_and_resume_is_bit_identical(tmp_path, corpus, state_dtype):  # noqa: F811
    straight = run(_cfg(tmp_path / "straight", corpus, state_dtype))
    run(_cfg(tmp_path / "halves", corpus, state_dtype, "train.stop_at_step=3"))
    second = run(_cfg(tmp_path / "halves", corpus, state_dtype))
    assert second.losses == straight.losses  # step by step, bitwise
    state = _final_state(tmp_path / "straight")
    offloaded = state["offloaded"]
    want = {"master", "m", "v"} | ({"m_scale", "v_scale"} if state_dtype == "int8" else set())
    assert set(offloaded) == want
    # plain Orbax reads the moments in their dtype
    assert {np.asarray(x).dtype.name for x in jax.tree.leaves(offloaded["m"])} == \
        {"bfloat16" if state_dtype == "bfloat16" else "uint8"}
    _assert_bitwise_equal(state, _final_state(tmp_path / "halves"))
    # The metrics report each step's SSD traffic and the run's writes (the endurance cost).
    records = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "ssd_written_bytes" in r]
    assert len(steps) == 6 and all(r["ssd_written_bytes"] > 0 and r["ssd_read_bytes"] > 0 for r in steps)
    assert steps[-1]["state_dtype"] == state_dtype
    assert steps[-1]["state_rounding"] == "stochastic"  # the default; resume drew the same bits
    assert steps[-1]["ssd_written_bytes_run"] >= sum(r["ssd_written_bytes"] for r in steps)
    assert straight.ssd_bytes_written_run == steps[-1]["ssd_written_bytes_run"]


def test_state_dtype_follows_into_smaller_ssd_traffic(tmp_path, corpus):  # noqa: F811
    """The same model with int8 moments moves fewer bytes per step than with float32 ones (the
    tiny model's small tensors are whole 4 KiB blocks, so not the large model's 28 -> 16 B/param;
    bench_optimizer_step.py measures that)."""
    results = {d: run(_cfg(tmp_path / d, corpus, d, "train.steps=2", "checkpoint.every_steps=0"))
               for d in ("float32", "int8")}
    per_step = {d: (r.ssd_bytes_read + r.ssd_bytes_written) / r.steps_this_run for d, r in results.items()}
    assert per_step["int8"] < 0.85 * per_step["float32"], per_step
    assert results["int8"].losses[0] == results["float32"].losses[0]  # the same first forward


def test_resume_with_another_state_dtype_is_refused(tmp_path, corpus):  # noqa: F811
    out = tmp_path / "run"
    run(_cfg(out, corpus, "bfloat16", "train.steps=2", "checkpoint.every_steps=2"))
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    metrics = (out / "metrics.jsonl").read_text()
    with pytest.raises(IncompatibleCheckpointError,
                       match=r"optimizer.state_dtype: checkpoint has 'bfloat16', this run has 'int8'"):
        run(_cfg(out, corpus, "int8", "train.steps=4"))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before
    assert (out / "metrics.jsonl").read_text() == metrics  # nothing written
    # The CLI says it in one line.
    args = [sys.executable, "-m", "jaxascend.train", "--config", "configs/tiny.yaml"]
    for o in _overrides(out, corpus, "offload") + ["optimizer.state_dtype=float32", "train.steps=4"]:
        args += ["--set", o]
    done = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "optimizer.state_dtype: checkpoint has 'bfloat16', this run has 'float32'" in lines[0]


def test_compressed_state_needs_the_offloaded_engine(tmp_path, corpus):  # noqa: F811
    with pytest.raises(ConfigError, match="optimizer.state_dtype: 'int8' needs offload.enabled: true"):
        load_config("configs/tiny.yaml", _overrides(tmp_path, corpus, "in-memory") + ["optimizer.state_dtype=int8"])
    with pytest.raises(ConfigError, match="optimizer.state_block: 1000 must be a power of two in \\[256, 2048\\]"):
        load_config("configs/tiny.yaml", _overrides(tmp_path, corpus, "offload") + ["optimizer.state_block=1000"])


def test_an_unknown_state_rounding_is_one_line_and_writes_nothing(tmp_path, corpus):  # noqa: F811
    with pytest.raises(ConfigError, match="optimizer.state_rounding: expected one of 'stochastic', 'nearest', got 'up'"):
        load_config("configs/tiny.yaml", _overrides(tmp_path, corpus, "offload") + ["optimizer.state_rounding=up"])
    out = tmp_path / "run"
    args = [sys.executable, "-m", "jaxascend.train", "--config", "configs/tiny.yaml"]
    for o in _overrides(out, corpus, "offload") + ["optimizer.state_dtype=int8", "optimizer.state_rounding=up"]:
        args += ["--set", o]
    done = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: optimizer.state_rounding:"), done.stderr
    assert not out.exists()
