"""Where an update reads and writes each state record, and when what it wrote counts: one part,
chosen once for the state's owner (:class:`~jaxascend.offload.state.OffloadedAdamState`).

* :class:`InPlaceRecords` (the default): a record is rewritten where it is. A crash inside an
  update leaves some chunks updated and others not, and maybe one torn: the state is then only
  good for a restore from a checkpoint.
* :class:`DurableRecords` (durable steps): every record is written to a free slot of its ring
  (:mod:`~jaxascend.offload.slot_rings`), and the journal (:mod:`~jaxascend.offload.step_journal`)
  says which step the files hold and how far an update got, so the files are a resume point after
  every step. An update:

  1. ``begin``: the step's gradients are on disk (``fdatasync``); the journal records the update
     in flight (its kernel scalars, the updates applied before it) and the trainer's state once it
     is done.
  2. For each chunk, before its write is issued (``before_write``): if the chunk W places earlier
     in its ring is not committed yet, everything written so far is synced and committed (one
     journal write naming the step position committed through). A gradient region goes back to
     the sink, and a layer to the next forward, only once committed (``when_committed``): the
     gradients are the redo log of the chunks not yet committed.
  3. ``end``: the journal records the step complete, with the rings' new rotations.

  A resume (:meth:`DurableRecords.reopen`) reads the journal: with an update in flight, the chunks
  after the committed position are updated again from their old slots and the gradients, with the
  journal's scalars, and the files hold exactly what an uninterrupted update wrote.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Callable, Optional, Protocol, Sequence

from jaxascend.kill_points import kill_point
from jaxascend.offload.gradient_log import GradientLog, log_regions
from jaxascend.offload.layout import ChunkRef, OffloadLayout
from jaxascend.offload.slot_rings import PARAM_SPARES, ParamRings, SlotRings
from jaxascend.offload.step_journal import JournalRecord, StepJournal, UpdateInFlight
from jaxascend.ssd import Segment, SsdStore


class PassProgress(Protocol):
    """What a running pass tells the records about its write-back, in step positions."""

    def written_through(self) -> int: ...  # every position up to this one is on disk

    def wait_through(self, position: int) -> None: ...  # until every position up to this one is


class InPlaceRecords:
    """Records rewritten where they are (see the module docstring)."""

    durable = False
    step = 0
    staged: dict = {}
    gradient_log = None

    def __init__(self, chunks: list[ChunkRef], segments: list[list[Segment]]):
        self._chunks, self._segments = chunks, segments

    def placed(self) -> list[ChunkRef]:
        """Every chunk with its record where it is now."""
        return self._chunks

    def segments(self) -> list[list[Segment]]:
        """Per chunk, the segments of the next update."""
        return self._segments

    def position(self, chunk_index: int) -> int:
        return chunk_index

    def param_region(self, leaf, layer: int) -> str:
        """Where a streamed leaf's layer of weights is: its home."""
        return leaf.param_regions[layer]

    def watch(self, fn: Callable[[int, int, str], None]) -> None:
        pass  # layers never move

    def join(self, barrier: Callable[[str], None]) -> None:
        pass

    def skip(self, trainer: dict) -> None:
        pass

    def begin(self, scalars, updates_applied: int, trainer: Optional[dict]) -> None:
        pass

    def stage(self, trainer: dict) -> None:
        pass

    def before_write(self, position: int, progress: PassProgress) -> None:
        pass

    def when_committed(self, position: int, fn: Callable[[], None]) -> None:
        fn()

    def end_pass(self, last_position: int) -> None:
        pass

    def end(self) -> None:
        pass

    def invalidate(self) -> None:
        pass

    def record_step(self, step: int, trainer: dict, updates: Optional[int] = None) -> None:
        pass

    def figures(self) -> dict:
        return {}

    def close(self) -> None:
        pass


def layout_fingerprint(layout: OffloadLayout, rings: SlotRings, regions: Sequence[tuple[str, int]],
                       params: Optional[ParamRings] = None) -> str:
    """What the files were written under: the store's regions in order (names and sizes), the
    chunks and the rings. Files written under another are never read as this layout's."""
    described = {"regions": list(regions), "chunk_elements": layout.chunk_elements,
                 "state": layout.state.describe(), "order": list(rings.order),
                 "rings": [(r.nbytes, len(r.members), r.spares) for r in rings.rings]}
    if params is not None:
        described["params"] = [list(ring) for ring in params.slots]
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:32]


def layout_summary(layout: OffloadLayout, rings: SlotRings) -> dict:
    """The parts of the fingerprint's layout a person can name, by the config field that sets
    them; the journal keeps them beside it, so a resume under another layout says what differs."""
    state = layout.state
    return {"optimizer.state_dtype": state.dtype, "optimizer.state_block": state.block or None,
            "optimizer.master_dtype": state.master,
            "optimizer.master_rounding": state.master_rounding if state.master != "float32" else None,
            "offload.chunk_bytes": f"{layout.chunk_elements} elements a chunk",
            "offload.durable_spares": max(ring.spares for ring in rings.rings) if rings.rings else 0,
            "offload.gradients": layout.grad_store, "offload.params": "ssd" if layout.streamed_leaves else "resident",
            "offload.host_gradient_layers": (layout.host_grad_layers or "all") if layout.grad_store == "host" else None,
            "parameters (the model's shape; a job's process: its slice)": layout.num_parameters}


def differences(saved: Optional[dict], current: dict) -> list[str]:
    """``saved``'s fields that ``current`` has otherwise, as "field: the files have X, this run Y"
    (a field that one side does not have, None, is left out: an int8 block beside float32 moments)."""
    return [f"{name}: the files have {saved[name]!r}, this run {value!r}" for name, value in current.items()
            if saved is not None and saved.get(name) is not None and value is not None and saved[name] != value]


class DurableRecords:
    """Slot rings and the journal (see the module docstring). Made by the state's owner, which
    adds :attr:`SlotRings.spare_regions` to the store before building its update plan."""

    durable = True

    def __init__(self, store: SsdStore, chunks: list[ChunkRef], segments: list[list[Segment]],
                 rings: SlotRings, journal: StepJournal, fingerprint: str, params: Optional[ParamRings] = None,
                 gradient_log: Optional[GradientLog] = None, summary: Optional[dict] = None):
        self.store, self.rings, self.journal, self.fingerprint = store, rings, journal, fingerprint
        self.summary = summary or {}  # layout_summary's, recorded beside the fingerprint
        self.gradient_log = gradient_log  # gradients in RAM: their copy on SSD, the redo log
        self._chunks, self._segments = chunks, segments
        self._regions = {r.name: r for r in store.regions()}
        # a bfloat16 master of streamed weights: its layers' rings, the last position of each
        # (leaf, layer), and who reads the layers (the parameter source)
        self.params = params
        self._param_k = {i: k for k, i in enumerate(params.leaves)} if params else {}
        self._leaves = {c.leaf.index: c.leaf for c in chunks}
        self._param_last: dict[tuple[int, int], int] = {}
        for i, c in enumerate(chunks):
            if c.leaf.index in self._param_k:
                key = (c.leaf.index, c.layer)
                self._param_last[key] = max(self._param_last.get(key, -1), rings.position[i])
        self._watchers: list[Callable[[int, int, str], None]] = []
        self._needs = self._commit_needs()
        self.rotations = self._initial_rotations()
        self.step = -1  # the last step the files hold (-1: none yet)
        self.updates = 0  # AdamW updates it has had
        self.trainer: dict = {}  # the trainer's state after it
        self._update: Optional[UpdateInFlight] = None
        self.back: Optional[dict] = None  # a skipped step's: the step before it, whose state the files hold too
        self._barrier: Optional[Callable[[str], None]] = None  # a job's (join)
        self.staged: dict = {}  # the trainer's state once the next step is complete (stage)
        self._committed = -1
        self._pending: list[tuple[int, Callable[[], None]]] = []
        self.commits = 0  # journal commits of the last update (bench and tests)
        self._placed: Optional[tuple] = None  # (where records are, placed()'s chunks)

    # ------------------------------------------------------------------ where records are
    def _initial_rotations(self) -> tuple[int, ...]:
        """Every record and layer at home: the state rings' rotations, then the params rings' one."""
        return self.rings.initial_rotations() + ((0,) if self.params else ())

    def _advanced(self) -> tuple[int, ...]:
        params = (self.params.advanced(self.rotations[-1]),) if self.params else ()
        return self.rings.advanced(self.rotations[:len(self.rings.rings)]) + params

    def _commit_needs(self) -> list[int]:
        """:meth:`SlotRings.commit_needs`, and for a chunk of a rotating streamed layer ``l``, the
        last position of layer ``l - W`` of its leaf (whose old slot it writes)."""
        needs = self.rings.commit_needs()
        w = self.params.spares if self.params else 0
        for i, c in enumerate(self._chunks):
            if c.leaf.index in self._param_k and c.layer >= w:
                p, need = self.rings.position[i], self._param_last[(c.leaf.index, c.layer - w)]
                if need >= p:
                    raise ValueError(f"durable steps: layer {c.layer} of {c.leaf.path!r} is updated before layer "
                                     f"{c.layer - w}, whose slot it takes; the step's order must go up the stack")
                needs[p] = max(needs[p], need)
        return needs

    def _param_at(self, leaf_index: int, layer: int, new: bool) -> str:
        k, rotation = self._param_k[leaf_index], self.rotations[-1]
        return (self.params.write_region if new else self.params.read_region)(k, layer, rotation)

    def param_region(self, leaf, layer: int) -> str:
        """Where a streamed leaf's layer of weights is now (whole layers: between updates, or a
        layer whose chunks an interrupted update committed all or none of)."""
        if leaf.index not in self._param_k:
            return leaf.param_regions[layer]
        new = self._update is not None and self._param_last[(leaf.index, layer)] <= self._committed
        return self._param_at(leaf.index, layer, new)

    def watch(self, fn: Callable[[int, int, str], None]) -> None:
        """``fn(leaf index, layer, region)`` is told where every rotating layer is now, and again
        whenever one moves: once its update is committed, or the files are rewritten."""
        self._watchers.append(fn)
        self._announce(self._param_last)

    def _announce(self, keys) -> None:
        for leaf, layer in keys:
            where = self.param_region(self._leaves[leaf], layer)
            for fn in self._watchers:
                fn(leaf, layer, where)

    def placed(self) -> list[ChunkRef]:
        """Every chunk with its record (and a rotating streamed chunk its weights) where it is
        now: between updates, at the rings' rotations; inside an interrupted one, new up to the
        committed position and old after it (built once per placement: a checkpoint reads it per leaf)."""
        key = (tuple(self.rotations), self._update is None, self._committed)
        if self._placed is None or self._placed[0] != key:
            self._placed = (key, self._place())
        return self._placed[1]

    def _place(self) -> list[ChunkRef]:
        if self._update is None:
            slots = [read for read, _ in self.rings.locations(self.rotations)]
        else:
            slots = self.rings.current(self.rotations, self._committed)
        out = []
        for i, (c, s) in enumerate(zip(self._chunks, slots)):
            c = dataclasses.replace(c, state_region=s.region, state_offset=s.offset)
            if c.leaf.index in self._param_k:
                new = self._update is not None and self.rings.position[i] <= self._committed
                c = dataclasses.replace(c, param_region=self._param_at(c.leaf.index, c.layer, new))
            out.append(c)
        return out

    def segments(self) -> list[list[Segment]]:
        """Per chunk, the next update's segments: its record read from its slot and written to the
        slot the ring gives it; the gradient as always; the streamed weights likewise where a
        bfloat16 master is them (their layer's ring), else in place."""
        out = []
        for c, segs, (read, write) in zip(self._chunks, self._segments, self.rings.locations(self.rotations)):
            state = dataclasses.replace(segs[0], region=self._regions[read.region], offset=read.offset,
                                        write_region=self._regions[write.region], write_offset=write.offset)
            rest = list(segs[1:])
            if c.leaf.index in self._param_k:
                rest[-1] = dataclasses.replace(rest[-1], region=self._regions[self._param_at(c.leaf.index, c.layer, False)],
                                               write_region=self._regions[self._param_at(c.leaf.index, c.layer, True)],
                                               write_offset=rest[-1].offset)
            out.append([state] + rest)
        return out

    def position(self, chunk_index: int) -> int:
        return self.rings.position[chunk_index]

    # ------------------------------------------------------------------ the journal
    def invalidate(self) -> None:
        """The files are about to be written whole (an init, a restore): until :meth:`record_step`
        they hold no step. Every record goes back to its home slot."""
        self.rotations = self._initial_rotations()
        self.record_step(-1, {}, 0)
        self._announce(self._param_last)

    def record_step(self, step: int, trainer: dict, updates: Optional[int] = None,
                    back: Optional[dict] = None) -> None:
        """The files hold ``step`` as they are (the initial state, a restore, an update's end);
        ``updates``: the AdamW updates it has had (default: as before); ``back``: (a skipped
        step) the step before it, whose state the files hold too."""
        if step >= 0:
            kill_point("durable_sync")  # tests: a kill before what the step wrote is made durable
            self.store.sync()
        self.step, self.trainer, self._update, self._committed = int(step), dict(trainer), None, -1
        self.updates, self.back = self.updates if updates is None else int(updates), back
        self._write()

    def join(self, barrier: Callable[[str], None]) -> None:
        """In a job of processes: ``barrier(name)`` returns once every process has called it with
        ``name``. Each process's files then hold at most one step more than another's, and a
        resume finds a step all of them can reach (:meth:`JournalRecord.reach`): an update's
        records are written only once every process has journaled it (:meth:`begin`), and a
        skipped step is recorded only once every process has reached it (:meth:`skip`)."""
        self._barrier = barrier

    def _agree(self, step: int) -> None:
        if self._barrier is not None:
            kill_point("durable_barrier")  # tests: journaled, but another process may not be yet
            self._barrier(f"jaxascend durable step {step}")

    def skip(self, trainer: dict) -> None:
        """The next step was skipped (an overflow): the files hold it with the same state."""
        self._agree(self.step + 1)
        self.record_step(self.step + 1, trainer, back={"step": self.step, "trainer": self.trainer})

    def stage(self, trainer: dict) -> None:
        """The trainer's state once the next step is complete: what :meth:`begin` (or a skipped
        step's :meth:`record_step`) records when given none."""
        self.staged = dict(trainer)

    def begin(self, scalars, updates_applied: int, trainer: Optional[dict]) -> None:
        """The update of step ``self.step + 1`` starts; ``trainer``: the trainer's state once it is
        done (None: the staged one)."""
        kill_point("durable_sync")
        self.store.sync()  # the gradients, this update's redo log, are on disk (in RAM: their log, gradient_log)
        self._update = UpdateInFlight.of(scalars, updates_applied, self.staged if trainer is None else trainer)
        self._committed, self._pending, self.commits = -1, [], 0
        self._write()
        self._agree(self.step + 1)  # a job: every process has journaled the update before any record moves

    def resume_update(self, update: UpdateInFlight) -> None:
        """Takes up an interrupted update (:meth:`reopen`): positions after ``committed_through`` remain."""
        self._update, self._committed, self._pending = update, update.committed_through, []

    def before_write(self, position: int, progress: PassProgress) -> None:
        """Commits what is written before ``position``'s write may reuse a slot (module docstring)."""
        need = self._needs[position]
        if need > self._committed:
            progress.wait_through(need)
            self._commit(max(need, progress.written_through()))

    def when_committed(self, position: int, fn: Callable[[], None]) -> None:
        if position <= self._committed:
            fn()
        else:
            self._pending.append((position, fn))

    def end_pass(self, last_position: int) -> None:
        """A pass has finished: everything it wrote is on disk; commit it."""
        if last_position > self._committed:
            self._commit(last_position)

    def end(self) -> None:
        """The update is complete: the step is the files' and the rings have turned."""
        trainer = self._update.trainer
        self.rotations = self._advanced()
        self.record_step(self.step + 1, trainer, self.updates + 1)  # every layer was announced at its commit

    def _commit(self, through: int) -> None:
        kill_point("durable_sync")
        self.store.sync()
        before, self._committed = self._committed, through
        self._update = dataclasses.replace(self._update, committed_through=through)
        self._write()
        self.commits += 1
        if self._watchers:  # layers now whole in their new slots: read there from now on
            self._announce([key for key, last in self._param_last.items() if before < last <= through])
        due = [fn for p, fn in self._pending if p <= through]
        self._pending = [(p, fn) for p, fn in self._pending if p > through]
        for fn in due:
            fn()

    def _write(self) -> None:
        self.journal.write(JournalRecord(self.fingerprint, self.step, tuple(self.rotations), self.trainer,
                                         self._update, self.updates, self.back,
                                         "host" if self.gradient_log is not None else "ssd", self.summary))

    def figures(self) -> dict:
        """The journal's writes and bytes so far, the last update's commits and the spares' disk."""
        return {"journal_writes": self.journal.writes, "journal_bytes": self.journal.bytes_written,
                "commits_last_update": self.commits,
                "spare_bytes": self.rings.spare_bytes + (self.params.spare_bytes if self.params else 0),
                "gradient_log_bytes": self.gradient_log.nbytes if self.gradient_log is not None else 0}

    def close(self) -> None:
        self.journal.close()

    # ------------------------------------------------------------------ reopening
    def reopen(self, step: Optional[int] = None) -> Optional[UpdateInFlight]:
        """Takes the journal's record as the files' state: returns the update to roll forward
        (None when the files hold a whole step). ``step``: the one a job resumes at, where the
        record reaches another than its newest (an update none of whose records is committed,
        dropped; a skipped step's step before). Raises ValueError when the journal is missing,
        was written under another layout, or cannot reach ``step``."""
        record = self.journal.record
        if record is None:
            raise ValueError(f"durable steps: no journal in {self.journal.path.parent}")
        if record.layout != self.fingerprint:
            named = differences(record.written_under, self.summary) or \
                ["the model's shape, the state format, the offload sizes or the processes differ"]
            raise ValueError(f"durable steps: the offload files in {self.journal.path.parent} were written under "
                             f"another layout ({'; '.join(named)}); resume with the config they were written "
                             f"under, or start afresh with train.resume: none")
        if record.step < 0:
            raise ValueError(f"durable steps: the offload files in {self.journal.path.parent} were being written "
                             f"from scratch or from a checkpoint when the run stopped; they hold no step")
        self.step, self.trainer, self.rotations = record.step, dict(record.trainer), tuple(record.rotations)
        self.updates, self.back = record.updates, record.back
        lo, hi = record.reach()
        if step is not None and step != hi:
            if not lo <= step <= hi:
                raise ValueError(f"durable steps: the offload files in {self.journal.path.parent} hold steps {lo} to "
                                 f"{hi}, not step {step}")
            if step == record.step:  # an update in flight that no record of has moved yet
                self.record_step(step, self.trainer, back=self.back)
            else:  # a skipped step's state is the step's before it
                self.record_step(step, record.trainer_at(step), back=None)
            return None
        if record.update is not None:
            if self.gradient_log is not None:  # gradients in RAM: back from their log
                self.gradient_log.restore()
            self.resume_update(record.update)
        return record.update


def make_records(store: SsdStore, layout: OffloadLayout, chunks: list[ChunkRef], segments: list[list[Segment]],
                 durable_spares: Optional[int]):
    """The records part of a state: :class:`InPlaceRecords`, or with ``durable_spares`` (W, spare
    records per ring) :class:`DurableRecords`, whose spare regions this adds to ``store`` (after
    every other region, so a reopened store finds them where they were) and whose journal it opens."""
    if not durable_spares:
        return InPlaceRecords(chunks, segments)
    if layout.grad_store not in ("ssd", "host"):
        raise ValueError(f"durable steps: the gradients are the redo log of an interrupted update and must be store "
                         f"regions (offload.gradients: ssd or host), not {layout.grad_store}")
    rings = SlotRings.plan(chunks, layout.step_order(chunks), durable_spares, layout.block_bytes)
    # a bfloat16 master of streamed weights is those weights: their layers rotate too
    params = ParamRings.plan(layout.streamed_leaves, PARAM_SPARES) if layout.masters_in_params else None
    # gradients in RAM: their redo log's twin regions on SSD (gradient_log)
    for name, nbytes in list(rings.spare_regions + (params.spare_regions if params else ())) + log_regions(layout):
        store.add_region(name, nbytes)
    fingerprint = layout_fingerprint(layout, rings, [(r.name, r.nbytes) for r in store.regions()], params)
    return DurableRecords(store, chunks, segments, rings, StepJournal(store.cfg.dir, create=True), fingerprint,
                          params, GradientLog(store, layout) if layout.grad_store == "host" else None,
                          layout_summary(layout, rings))


def roll_forward(records, plan, store: SsdStore, layout: OffloadLayout, kernel: Callable,
                 step: Optional[int] = None) -> int:
    """Takes a reopened store's journal (:meth:`DurableRecords.reopen`, at ``step``: a job's) and,
    for an update it names in flight, updates the chunks after its committed position again: from their old slots
    and the gradients, with the journal's scalars (``kernel(scalars=, updates_applied=)`` makes
    the :class:`ChunkKernel`), committing as any update does. Returns the AdamW updates the files
    then hold."""
    from jaxascend.offload.streamed_update import StreamedUpdate, UpdateOutputs

    if not records.durable:
        raise ValueError("durable steps: this state was not made with durable_spares; nothing to recover")
    update = records.reopen(step)
    if update is not None:
        left = [[i for i in chunk_ids if records.position(i) > update.committed_through] for chunk_ids in plan.passes]
        chunk_kernel = kernel(scalars=update.kernel_scalars(), updates_applied=update.updates_applied)
        StreamedUpdate(plan, store, layout, chunk_kernel, None, None,
                       UpdateOutputs(lambda leaf, params: None), records, left).run()
        records.end()
    return records.updates
