"""Durable steps in a job of processes, at the state's owner: every process journals an update
before any of its records moves (``DurableRecords.join``'s barrier), so the files of the
processes hold at most one step apart, and each reopens at the step the job agrees on
(``JournalRecord.reach``): an update journaled but not committed is dropped or rolled forward, a
skipped step's files are the step's before it too. Bit for bit against an uninterrupted run."""

import dataclasses
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from jaxascend.offload.step_journal import JournalRecord, StepJournal, UpdateInFlight
from tests.offload.test_durable_steps import STEPS, _make, _same, _snapshot, _step
from tests.offload.test_state import random_tree

_CHILD = """
import sys
from pathlib import Path
from tests.offload.test_durable_job_records import _job_run
_job_run(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1")
"""


def _job_run(path, steps, fmt="float32", streamed=False, skip_at=None, barriers=None):
    """As ``test_durable_steps._run`` with durable steps in a job (a barrier that lets every
    process through: the kill point before it is the test's); ``skip_at``: a step skipped."""
    state = _make(path, fmt=fmt, spares=2, streamed=streamed)
    state.records.join(lambda name: barriers.append(name) if barriers is not None else None)
    state.init(random_tree(1))
    for s in range(1, steps + 1):
        if s == skip_at:  # an overflow: the gradients arrive, nothing is updated
            state.write_grads(random_tree(100 + s, ml_dtypes.bfloat16, scale=0.1))
            state.step(None, skip=True, journal={"step": s, "data": [s * 7]})
        else:
            _step(state, s)
    return state


def _reference(tmp_path, fmt, streamed):
    """The uninterrupted run's state after each step."""
    state = _make(tmp_path / "reference", fmt=fmt, spares=2, streamed=streamed)
    state.init(random_tree(1))
    after = [_snapshot(state)]
    for s in range(1, STEPS + 1):
        _step(state, s)
        after.append(_snapshot(state))
    state.close()
    return after


def test_the_steps_a_record_reaches():
    update = UpdateInFlight.of(np.zeros(10, np.float32), 4, {"step": 5})
    back = {"step": 3, "trainer": {"step": 3}}
    record = JournalRecord("x", 4, (0,), {"step": 4})
    assert record.reach() == (4, 4) and record.held() == (4, {"step": 4})
    assert JournalRecord("x", 4, (0,), {"step": 4}, update).reach() == (4, 5)  # may drop or roll forward
    committed = JournalRecord("x", 4, (0,), {"step": 4}, dataclasses.replace(update, committed_through=0))
    assert committed.reach() == (5, 5) and committed.held() == (5, {"step": 5})  # a record moved: forward only
    skipped = JournalRecord("x", 4, (0,), {"step": 4}, None, 3, back)
    assert skipped.reach() == (3, 4) and skipped.trainer_at(3) == {"step": 3}
    assert JournalRecord("x", 4, (0,), {"step": 4}, update, 3, back).reach() == (3, 5)
    assert JournalRecord("x", -1, (0,), {}).reach() == (-1, -1)
    again = JournalRecord.from_json(JournalRecord("x", 4, (0,), {"step": 4}, update, 3, back).to_json())
    assert again.back == back and again.reach() == (3, 5)


@pytest.mark.parametrize("fmt, streamed", [("float32", False), ("int8+bf16-compensated", True)])
def test_an_update_journaled_before_the_barrier_is_dropped_or_rolled_forward(tmp_path, fmt, streamed):
    after = _reference(tmp_path, fmt, streamed)
    where = tmp_path / "killed"
    env = {**os.environ, "JAXASCEND_KILL_AT": "durable_barrier:2"}  # step 2's update journaled, nothing moved
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(where), str(STEPS), fmt, "1" if streamed else "0"],
                          env=env, capture_output=True, cwd=os.getcwd())
    assert proc.returncode == -9, proc.stderr.decode()[-3000:]
    with StepJournal(where / "offload", create=False) as journal:
        assert journal.record.step == 1 and journal.record.update.committed_through == -1
        assert journal.record.reach() == (1, 2)
    for at in (1, 2):  # where another process's files are: before the update, or after it
        copy = tmp_path / f"at{at}"
        subprocess.run(["cp", "-a", str(where), str(copy)], check=True)
        state = _make(copy, fmt=fmt, spares=2, streamed=streamed, reopen=True)
        try:
            assert state.recover(at) == at and state.records.trainer == {"step": at, "data": [at * 7]}
            _same(_snapshot(state), after[at])
            for s in range(at + 1, STEPS + 1):
                _step(state, s)
            _same(_snapshot(state), after[STEPS])
        finally:
            state.close()
    state = _make(where, fmt=fmt, spares=2, streamed=streamed, reopen=True)
    with pytest.raises(ValueError, match="hold steps 1 to 2, not step 0"):
        state.recover(0)
    state.close()


def test_a_skipped_step_reopens_at_the_step_before_it_too(tmp_path):
    barriers = []
    state = _job_run(tmp_path / "run", 2, skip_at=2, barriers=barriers)
    assert barriers == ["jaxascend durable step 1", "jaxascend durable step 2"]  # an update, then the skip
    one = _snapshot(state)
    state.close()
    with StepJournal(tmp_path / "run" / "offload", create=False) as journal:
        assert journal.record.reach() == (1, 2) and journal.record.updates == 1
    state = _make(tmp_path / "run", spares=2, reopen=True)
    try:
        assert state.recover(1) == 1 and state.records.trainer == {"step": 1, "data": [7]}
        _same(_snapshot(state), one)
        assert state.records.updates == 1
    finally:
        state.close()
