"""Runs that survive the real world, through the CLI, each run in its own process: a stop signal
at a step boundary, during an overlapped update or during a checkpoint save ends the run with a
checkpoint of one step, one line and exit 128 + the signal, and the same command resumes to an
uninterrupted run's losses and weights bit for bit; a second SIGINT abandons the step in flight;
a resumed run keeps its schedule, and a finished one does nothing."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests._corpus import write_word_corpus

REPO = Path(__file__).resolve().parents[1]
BASE = [
    "model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=2", "model.num_attention_heads=4",
    "model.num_key_value_heads=2", "data.seq_len=32", "data.batch_size=4", "train.progress=false",
    "train.steps=6", "train.log_every=1", "optimizer.warmup_steps=1", "checkpoint.every_steps=2",
    "checkpoint.async_save=false", "model.remat=full", "data.include=['*.txt']",
]
OVERLAP, SEQUENTIAL = ["offload.overlap=true"], ["offload.overlap=false"]


def train(out: Path, corpus: Path, *extra: str, signal_at: str | None = None,
          kill_at: str | None = None) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "jaxascend.train", "--config", "configs/tiny.yaml"]
    for s in BASE + [f"data.paths=[{corpus}]", f"train.out_dir={out}", *extra]:
        args += ["--set", s]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAXASCEND_KILL", "JAXASCEND_SIGNAL"))}
    if signal_at:
        env["JAXASCEND_SIGNAL_AT"] = signal_at
    if kill_at:
        env["JAXASCEND_KILL_AT"] = kill_at
    return subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=REPO, env=env)


def finished(out: Path) -> tuple[list[float], str]:
    """The run's losses and the sha256 of its params.safetensors."""
    summary = json.loads((out / "summary.json").read_text())
    return summary["losses"], hashlib.sha256((out / "params.safetensors").read_bytes()).hexdigest()


def checkpoints(out: Path) -> list[int]:
    return sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_word_corpus(tmp_path_factory.mktemp("corpus"), docs=4, words_per_doc=400)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus):
    """Uninterrupted runs, overlapped and sequential."""
    root = tmp_path_factory.mktemp("reference")
    refs = {}
    for name, mode in (("overlap", OVERLAP), ("sequential", SEQUENTIAL)):
        done = train(root / name, corpus, *mode)
        assert done.returncode == 0, done.stderr[-3000:]
        refs[name] = finished(root / name)
    return refs


@pytest.mark.parametrize("signame, point, step", [
    ("SIGTERM", "step_end:3", 3),  # at a step boundary
    ("SIGINT", "optimizer_chunk:40", None),  # during an overlapped update (the step it ends in stops)
    ("SIGUSR1", "checkpoint_chunk:1", 2),  # during the checkpoint save of step 2: the save completes
], ids=["sigterm-boundary", "sigint-overlapped-update", "sigusr1-checkpoint-save"])
def test_a_stop_signal_checkpoints_one_step_and_the_same_command_resumes_bit_identically(
        tmp_path, corpus, reference, signame, point, step):
    import signal

    out = tmp_path / "run"
    stopped = train(out, corpus, *OVERLAP, signal_at=f"{point}:{signame}")
    signum = signal.Signals[signame]
    assert stopped.returncode == 128 + signum, stopped.stderr[-3000:]
    last = stopped.stderr.strip().splitlines()[-1]
    assert last.startswith(f"stopped by {signame} at step ") and "the same command resumes" in last, stopped.stderr
    at = int(last.split(" at step ")[1].split(":")[0])
    assert step is None or at == step
    assert at < 6 and checkpoints(out)[-1] == at and f"checkpoint {at} saved in {out / 'checkpoints'}" in last
    assert "Traceback" not in stopped.stderr + stopped.stdout
    assert not (out / "summary.json").exists()  # the run did not finish
    resumed = train(out, corpus, *OVERLAP)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"note: resuming from checkpoint step {at} in {out / 'checkpoints'} (saved " in resumed.stderr
    assert "Traceback" not in resumed.stderr
    assert finished(out) == reference["overlap"]


def test_a_second_sigint_abandons_the_step_in_flight_and_the_newest_checkpoint_resumes(tmp_path, corpus, reference):
    out = tmp_path / "run"
    # The first SIGINT in step 3's backward pass, the second during step 3's update.
    stopped = train(out, corpus, *SEQUENTIAL, signal_at="backward:3:SIGINT,optimizer_chunk:+1:SIGINT")
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    assert stopped.stderr.strip().splitlines()[-1] == (
        f"stopped by a second SIGINT: the step in flight was abandoned; checkpoint 2 in {out / 'checkpoints'} is "
        "intact and the same command resumes from it")
    assert "Traceback" not in stopped.stderr and checkpoints(out) == [2]
    resumed = train(out, corpus, *SEQUENTIAL)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert finished(out) == reference["sequential"]


def test_an_extended_run_keeps_its_schedule_and_a_finished_one_does_nothing(tmp_path, corpus):
    out = tmp_path / "run"
    first = train(out, corpus, *SEQUENTIAL, "train.steps=4")
    assert first.returncode == 0, first.stderr[-3000:]
    extended = train(out, corpus, *SEQUENTIAL, "train.steps=6")
    assert extended.returncode == 0, extended.stderr[-3000:]
    assert ("note: train.steps is 6, but the learning-rate schedule keeps its recorded length of 4 steps (set "
            "optimizer.decay_steps to change it)") in extended.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rates = {r["step"]: r["learning_rate"] for r in records}
    # cosine over 4 steps (warmup 1) ends at learning_rate * min_lr_ratio and stays there
    assert rates[5] == rates[6] == pytest.approx(2e-3 * 0.1, rel=1e-6) and rates[2] > rates[3] > rates[4]
    assert yaml.safe_load((out / "config.yaml").read_text())["optimizer"]["decay_steps"] == 4  # recorded
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    for steps in (6, 3):  # at and past train.steps: one line, exit 0, nothing touched
        again = train(out, corpus, *SEQUENTIAL, f"train.steps={steps}")
        assert again.returncode == 0 and again.stderr.strip() == (
            f"{out / 'checkpoints'}: the run is already at step 6, at or past train.steps {steps}; nothing to do "
            "(raise train.steps to train further)"), again.stderr
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before
    longer = train(out, corpus, *SEQUENTIAL, "train.steps=8", "optimizer.decay_steps=8")
    assert longer.returncode == 0, longer.stderr[-3000:]
    assert "note: optimizer.decay_steps: 8 replaces the learning-rate schedule's recorded length of 4" in longer.stderr
