"""The durable steps' journal (``offload/step_journal.py``): two slots, the newest whole record
wins, a torn or killed write leaves the one before it."""

import os
import subprocess
import sys

import numpy as np
import pytest

from jaxascend.offload.step_journal import (JOURNAL_NAME, SLOT_BYTES, JournalError, JournalRecord, StepJournal,
                                            UpdateInFlight, decode, encode)


def _record(step, update=False):
    scalars = np.arange(30, dtype=np.float32).reshape(3, 10) / 7  # values that need every bit
    inflight = UpdateInFlight.of(scalars, updates_applied=step, trainer={"data": [step + 1]}) if update else None
    return JournalRecord("layout-1", step, (step % 5, 3), {"data": [step], "loss_scale": 1.0}, inflight)


def test_a_record_round_trips_exactly():
    rec = _record(7, update=True)
    seq, back = decode(encode(rec, 12))
    assert seq == 12 and back == rec
    np.testing.assert_array_equal(back.update.kernel_scalars().view(np.uint32),
                                  (np.arange(30, dtype=np.float32).reshape(3, 10) / 7).view(np.uint32))
    raw = bytearray(encode(rec, 12))
    assert len(raw) == 4096  # whole pages, not the slot
    raw[40] ^= 1
    assert decode(bytes(raw)) is None  # a flipped payload bit: not a record
    assert decode(b"\0" * SLOT_BYTES) is None


def test_the_newest_whole_record_wins_and_a_torn_one_leaves_the_last(tmp_path):
    with StepJournal(tmp_path, create=True) as j:
        assert j.record is None
        for step in range(1, 4):
            j.write(_record(step))
    with StepJournal(tmp_path, create=False) as j:
        assert j.record.step == 3
    # a write of step 4 torn halfway: its slot holds a mix; the journal still reads step 3
    path = tmp_path / JOURNAL_NAME
    data = encode(_record(4, update=True), 4)
    with open(path, "r+b") as f:
        f.seek(0)  # seq 4 goes to slot 0
        f.write(data[:60])  # the header and the payload's first bytes
    with StepJournal(tmp_path, create=False) as j:
        assert j.record == _record(3)
        j.write(_record(4))  # and writing goes on from there
    with StepJournal(tmp_path, create=False) as j:
        assert j.record == _record(4)
    with pytest.raises(JournalError, match=f"journal: cannot open {tmp_path / 'nowhere' / JOURNAL_NAME}"):
        StepJournal(tmp_path / "nowhere", create=True)


def test_a_record_too_large_for_its_slot_is_refused():
    with pytest.raises(JournalError, match="does not fit its 1048576-byte slot"):
        encode(JournalRecord("x", 1, (), {"big": "y" * SLOT_BYTES}), 1)


@pytest.mark.parametrize("point", ["journal_write", "journal_fsync"])
def test_a_kill_at_a_journal_write_leaves_a_whole_record(tmp_path, point):
    script = (
        "import sys; from tests.offload.test_step_journal import _record;"
        "from jaxascend.offload.step_journal import StepJournal;"
        "j = StepJournal(sys.argv[1], create=True)\n"
        "for s in range(1, 6): j.write(_record(s, update=s % 2 == 0))")
    env = {**os.environ, "JAXASCEND_KILL_AT": f"{point}:3"}
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env, capture_output=True)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    with StepJournal(tmp_path, create=False) as j:
        # killed before step 3's write (or after it, before its fdatasync: then the page cache has it)
        assert j.record == (_record(2, update=True) if point == "journal_write" else _record(3))


def _damage(path, slot):
    with open(path, "r+b") as f:
        f.seek(slot * SLOT_BYTES + 60)
        f.write(b"x" * 60)


def test_a_journal_with_both_slots_damaged_is_refused_not_read_as_a_fresh_start(tmp_path):
    from jaxascend.offload.step_journal import read_journal

    first = tmp_path / "first"  # a first write cut: slot 1 torn, slot 0 never written: nothing held yet
    first.mkdir()
    with StepJournal(first, create=True) as j:
        j.write(_record(0))
    _damage(first / JOURNAL_NAME, 1)
    assert read_journal(first) is None
    both = tmp_path / "both"
    both.mkdir()
    with StepJournal(both, create=True) as j:
        for step in range(1, 4):
            j.write(_record(step))
    _damage(both / JOURNAL_NAME, 1)  # one slot damaged: the other's record
    assert read_journal(both).step == 2
    _damage(both / JOURNAL_NAME, 0)
    with pytest.raises(ValueError, match=r"^durable steps: the journal .* holds no whole record \(both of its slots are "
                                         r"damaged\), so the step the offload files hold is unknown; resume from a "
                                         r"checkpoint \(train.resume: <step>\) or start afresh with train.resume: none$"):
        read_journal(both)
