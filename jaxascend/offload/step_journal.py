"""The durable steps' journal: which step the offload files hold, and how far an update got.

One small file beside the shard files (``<offload.dir>/journal``) with two fixed-size slots. Each
write goes to the slot the previous one did not use, as ``magic | seq | length | crc32 | payload``,
and is made durable (``fdatasync``) before the writer goes on; a read takes the valid slot with
the higher ``seq``. A write torn by a crash leaves the other slot, the last record written whole,
so the journal is always one of its records, never a mix.

A :class:`JournalRecord` says:

* ``step``: the last step whose update is complete (-1 while the files are being written from
  scratch or from a checkpoint: they hold no step), ``updates`` the AdamW updates it has had, ``rotations`` (one per slot ring,
  :mod:`jaxascend.offload.slot_rings`) where its records are, and ``trainer``: what the trainer
  needs to go on after it (data position, loss scale, losses: the checkpoint meta's fields, as
  JSON);
* ``update``: None between updates, else the update of step ``step + 1`` in flight
  (:class:`UpdateInFlight`): its kernel scalars bit for bit, the updates applied before it, the
  step position its records are committed through, and the trainer's state once it completes.
  The gradients of that step stay in their regions until its update has finished, so a resume
  redoes the chunks after ``committed_through`` from them (a redo log) and gets the update an
  uninterrupted run made.

``layout`` fingerprints the layout and the rings: files written under another one are not read.
"""

from __future__ import annotations

import base64
import json
import os
import struct
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from jaxascend.kill_points import kill_point

JOURNAL_NAME = "journal"
SLOT_BYTES = 1 << 20  # each of the two slots; a record is a few KiB
_MAGIC = b"JXJ1"
_HEADER = struct.Struct("<4sQII")  # magic, seq, payload length, crc32 of the payload


class JournalError(RuntimeError):
    """The journal cannot be read or written (names the file and why)."""


@dataclass(frozen=True)
class UpdateInFlight:
    """The update of step ``JournalRecord.step + 1``, started and not yet complete."""

    scalars: str  # the kernel's float32 scalars, base64 of their bytes (exact)
    scalars_shape: tuple[int, ...]
    updates_applied: int  # before this update: part of each chunk's rounding seed
    committed_through: int  # step positions 0 .. this (-1: none) hold their new records
    trainer: dict  # the trainer's state once this step is complete

    @staticmethod
    def of(scalars: np.ndarray, updates_applied: int, trainer: dict) -> "UpdateInFlight":
        a = np.ascontiguousarray(scalars, np.float32)
        return UpdateInFlight(base64.b64encode(a.tobytes()).decode(), tuple(a.shape), int(updates_applied), -1,
                              dict(trainer))

    def kernel_scalars(self) -> np.ndarray:
        return np.frombuffer(base64.b64decode(self.scalars), np.float32).reshape(self.scalars_shape).copy()


@dataclass(frozen=True)
class JournalRecord:
    """What the offload files hold (see the module docstring)."""

    layout: str  # fingerprint of the layout and slot rings the files were written under
    step: int  # the last complete step (0: only the initial state; -1: the files hold none, being written)
    rotations: tuple[int, ...]
    trainer: dict
    update: Optional[UpdateInFlight] = None
    updates: int = 0  # AdamW updates the files' state has had (a skipped step has none)
    # A skipped step leaves the state as the step before it: that step and the trainer's state
    # after it ({"step", "trainer"}), until an update commits; a job may resume there (reach).
    back: Optional[dict] = None
    gradients: str = "ssd"  # where the redo log's gradients are: ssd (their regions), host (their log)
    written_under: Optional[dict] = None  # the layout's parts a person can name (config field -> value)

    def held(self) -> tuple[int, dict]:
        """The step a resume goes on from and the trainer's state after it: an update in flight
        counts as done (the resume rolls it forward); (-1, {}) while the files hold no step."""
        return self.reach()[1], self.trainer_at(self.reach()[1])

    def reach(self) -> tuple[int, int]:
        """The earliest and the latest step the files can resume at: an update in flight rolls
        forward to ``step + 1``, or, while none of its records is committed, may be dropped; a
        skipped step's state is the step's before it too (``back``). (-1, -1): no step."""
        if self.step < 0:
            return -1, -1
        lo = self.back["step"] if self.back is not None else self.step
        if self.update is None:
            return lo, self.step
        return (lo if self.update.committed_through < 0 else self.step + 1), self.step + 1

    def trainer_at(self, step: int) -> dict:
        """The trainer's state after ``step``, one of :meth:`reach`'s."""
        if self.update is not None and step == self.step + 1:
            return self.update.trainer
        if self.back is not None and step == self.back["step"]:
            return self.back["trainer"]
        return self.trainer if step == self.step else {}

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    @staticmethod
    def from_json(raw: bytes) -> "JournalRecord":
        d = json.loads(raw)
        update = d.get("update")
        if update is not None:
            update = UpdateInFlight(**{**update, "scalars_shape": tuple(update["scalars_shape"])})
        return JournalRecord(d["layout"], int(d["step"]), tuple(d["rotations"]), d["trainer"], update,
                             int(d.get("updates", 0)), d.get("back"), d.get("gradients", "ssd"),
                             d.get("written_under"))


def encode(record: JournalRecord, seq: int) -> bytes:
    """One slot's bytes: header and payload, zero-padded to whole 4 KiB pages (a write moves only
    those; the rest of the slot is never read, the header says how long the payload is)."""
    payload = record.to_json()
    if _HEADER.size + len(payload) > SLOT_BYTES:
        raise JournalError(f"journal: a record of {len(payload)} bytes does not fit its {SLOT_BYTES}-byte slot")
    head = _HEADER.pack(_MAGIC, seq, len(payload), zlib.crc32(payload))
    return (head + payload).ljust(-(-(_HEADER.size + len(payload)) // 4096) * 4096, b"\0")


def decode(raw: bytes) -> Optional[tuple[int, JournalRecord]]:
    """(seq, record) of one slot's bytes, or None where they are not a whole record."""
    if len(raw) < _HEADER.size:
        return None
    magic, seq, length, crc = _HEADER.unpack_from(raw)
    payload = raw[_HEADER.size:_HEADER.size + length]
    if magic != _MAGIC or len(payload) != length or zlib.crc32(payload) != crc:
        return None
    try:
        return seq, JournalRecord.from_json(payload)
    except (ValueError, KeyError, TypeError):
        return None


class StepJournal:
    """Owner of the journal file in ``directory``: :meth:`read` the newest record, :meth:`write`
    the next one durably."""

    def __init__(self, directory, create: bool):
        self.path = Path(directory) / JOURNAL_NAME
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        try:
            self._fd = os.open(self.path, flags, 0o644)
        except OSError as e:
            raise JournalError(f"journal: cannot open {self.path}: {e.strerror}") from None
        newest = self._newest()
        self._seq = newest[0] if newest else 0  # record seq s lives in slot s % 2
        self.writes = self.bytes_written = 0  # this opening's (benchmarks: the journal's share of a step's I/O)
        self.record: Optional[JournalRecord] = newest[1] if newest else None

    def _newest(self) -> Optional[tuple[int, JournalRecord]]:
        """The newest whole record; sets :attr:`damaged` from the same reads."""
        raw = [os.pread(self._fd, SLOT_BYTES, k * SLOT_BYTES) for k in (0, 1)]
        valid = [f for f in map(decode, raw) if f is not None]
        # No whole record, though a second one was written (the first goes to slot 1, the second
        # to slot 0): a write tears one slot at most, so both are damaged, not a first write cut.
        self.damaged = not valid and any(raw[0])
        return max(valid, key=lambda f: f[0]) if valid else None

    def write(self, record: JournalRecord) -> None:
        """Writes ``record`` over the older slot and makes it durable; until ``fdatasync``
        returns the newest whole record on disk is the previous one."""
        seq = self._seq + 1
        data = encode(record, seq)
        kill_point("journal_write")  # tests: a kill before the record is written
        try:
            written = os.pwrite(self._fd, data, (seq % 2) * SLOT_BYTES)
            if written != len(data):
                raise OSError(0, f"short write ({written} of {len(data)} bytes)")
            kill_point("journal_fsync")  # tests: written, maybe not durable yet
            os.fdatasync(self._fd)
        except OSError as e:
            raise JournalError(f"journal: cannot write {self.path}: {e.strerror}") from None
        self._seq, self.record = seq, record
        self.writes, self.bytes_written = self.writes + 1, self.bytes_written + len(data)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "StepJournal":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_journal(directory) -> Optional[JournalRecord]:
    """The newest whole record of the journal in ``directory``; None when there is no journal
    file or no whole record in it (raises ValueError where both slots are damaged:
    the files' step cannot be known, and starting afresh over them would lose it unasked)."""
    if not (Path(directory) / JOURNAL_NAME).exists():
        return None
    with StepJournal(directory, create=False) as opened:
        if opened.damaged:
            raise ValueError(f"durable steps: the journal {opened.path} holds no whole record (both of its slots "
                             f"are damaged), so the step the offload files hold is unknown; resume from a "
                             f"checkpoint (train.resume: <step>) or start afresh with train.resume: none")
        return opened.record
