"""Durable steps in a job of two processes, through the launcher (``offload.durable``, no
checkpoint but the final one): each process keeps its own journal, an update's records move only
once every process has journaled it, and after a SIGKILL of either process, anywhere, the same
command resumes the job from the latest step every process's files reach (one process may drop
an update it had journaled, or roll one forward), ending bit-identical to a straight job."""

import json

import numpy as np
import pytest

from jaxascend.offload import StepJournal
from tests.test_train_distributed import EVAL_TEXT, losses, train, weights

DURABLE = ("offload.durable=true", "checkpoint.every_steps=0", "offload.durable_spares=2")
# the gradients in RAM with their log on SSD (offload.gradients auto's choice), and on SSD
MODES = {"resident-sequential": (), "ssd-overlap": ("offload.params=ssd", "model.remat=dots", "offload.gradients=ssd")}


def _job(out, mode, kill=None):
    env = {"JAXASCEND_KILL_AT": kill[0], "JAXASCEND_KILL_PROCESS": str(kill[1])} if kill else None
    return train(out, 2, *DURABLE, *MODES[mode], env=env)


def _reaches(out) -> list:
    """(earliest, latest) step each process's files can resume at."""
    found = []
    for i in (0, 1):
        with StepJournal(out / "offload" / f"process{i}", create=False) as journal:
            found.append(journal.record.reach() if journal.record is not None else None)
    return found


def _resumed_from_files(done) -> bool:
    return any("resuming from step" in line and "held by the offload files" in line
               for line in (done.stdout + done.stderr).splitlines())


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("durable-job")
    (root / "eval.py").write_text(EVAL_TEXT)
    return root


@pytest.mark.parametrize("mode, kills", [
    # (point, process): before the barrier (that process journaled the update, the other maybe not),
    # inside an update, at a store sync, in a backward
    ("resident-sequential", [("durable_barrier:3", 1), ("optimizer_chunk:5", 0), ("durable_sync:8", 1)]),
    ("ssd-overlap", [("durable_barrier:2", 0), ("optimizer_chunk:9", 1)]),
])
def test_a_killed_process_resumes_the_job_from_the_files_bit_identically(root, mode, kills):
    _straight(root, mode)
    out, resumed, held = root / f"{mode}-killed", [], []
    for kill in kills:
        done = _job(out, mode, kill)
        assert done.returncode != 0 and f"process {kill[1]} was killed by SIGKILL" in done.stderr, done.stderr[-3000:]
        resumed.append(_resumed_from_files(done))
        held.append(_reaches(out))
    final = _job(out, mode)
    assert final.returncode == 0, final.stderr[-3000:]
    resumed.append(_resumed_from_files(final))
    print(f"{mode}: " + ", ".join(f"{k[0]} in process {k[1]} -> files reach {r}" for k, r in zip(kills, held)))
    assert resumed == [False] + [True] * len(kills), resumed  # every run after the first kill
    assert all(r is not None and r[0] is not None for r in held)
    assert not (out / "checkpoints").exists() or [p.name for p in (out / "checkpoints").iterdir()
                                                   if p.name.isdigit()] in ([], ["6"])
    # every step's record: those a kill cut before the update rolled forward come from the journal
    steps = [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert steps == list(range(1, 7)), steps
    assert losses(out) == losses(root / f"{mode}-straight")
    w, ref = weights(out), weights(root / f"{mode}-straight")
    for name in ref:
        np.testing.assert_array_equal(w[name], ref[name], err_msg=name)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 6


def test_a_stop_signal_stops_the_job_with_nothing_to_save_and_the_same_command_goes_on(root):
    out = root / "stopped"
    # SIGTERM to the launcher after step 3 (process 0 sends it to its parent), which forwards it
    done = train(out, 2, *DURABLE, env={"JAXASCEND_SIGNAL_AT": "step_end:3:SIGTERM@parent",
                                        "JAXASCEND_SIGNAL_PROCESS": "0"})
    assert done.returncode == 143, done.stderr[-3000:]
    stop = [line for line in done.stderr.splitlines() if line.startswith("stopped by SIGTERM at step ")]
    assert len(stop) == 1, done.stderr[-3000:]  # process 0 speaks for the job; the signal lands at a boundary
    step = int(stop[0].split(" at step ")[1].split(":")[0])
    assert stop[0].endswith(f"the offload files in {out}/offload/process0 hold step {step}; the same command resumes")
    assert not (out / "checkpoints").exists() or not any(p.name.isdigit() for p in (out / "checkpoints").iterdir())
    assert 3 <= step < 6 and _reaches(out) == [(step, step), (step, step)]  # both processes' files hold it
    final = train(out, 2, *DURABLE)
    assert final.returncode == 0 and _resumed_from_files(final), final.stderr[-3000:]
    ref = _straight(root, "resident-sequential")
    assert losses(out) == losses(ref)
    w, want = weights(out), weights(ref)
    for name in want:
        np.testing.assert_array_equal(w[name], want[name], err_msg=name)


def _straight(root, mode):
    """The uninterrupted job of ``mode`` (run once per worker)."""
    out = root / f"{mode}-straight"
    if not (out / "summary.json").exists():
        done = _job(out, mode)
        assert done.returncode == 0, done.stderr[-3000:]
    return out
