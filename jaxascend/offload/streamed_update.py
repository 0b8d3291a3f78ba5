"""The streamed AdamW update: a pipeline over the state's chunks, pass by pass.

The store reads chunk k+1 while the fused AdamW kernel updates chunk k in its arena slot and
chunk k-1 is written back. :class:`UpdatePlan` is computed once per layout (every chunk's store
segments, the passes in the forward's order); :class:`StreamedUpdate` runs one update of the
whole model over it with a :class:`ChunkKernel` (the kernel's settings for that update) and hands
the new compute weights to :class:`UpdateOutputs` leaf by leaf and layer by layer.
:class:`~jaxascend.offload.state.OffloadedAdamState` owns both and checks everything around them.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import time
from typing import Callable, Optional

import numpy as np

from jaxascend.kill_points import kill_point
from jaxascend.offload.layout import PARAM_SLOT_CLASS, ChunkRef, LeafLayout, OffloadLayout
from jaxascend.offload.param_source import ParamSource
from jaxascend.optim import AdamHyperParams, MasterFormat, StateFormat, chunk_seed, fused_adamw_update_numpy
from jaxascend.ssd import ArenaError, Segment, SsdStore, format_bytes, round_to_alignment


@dataclasses.dataclass(frozen=True)
class StepStats:
    """What one streamed step cost, from the store's counters."""

    bytes_read: int
    bytes_written: int
    seconds: float  # wall time of the step (flush of pending gradient writes included)
    read_busy_seconds: float  # time with at least one read in flight
    write_busy_seconds: float
    chunks: int
    flush_seconds: float = 0.0  # waiting, before the first chunk, for the backward's gradient writes

    @classmethod
    def between(cls, before: dict, after: dict, seconds: float, chunks: int, flushed: float) -> "StepStats":
        """The step's costs from the store's counters ``before`` and ``after`` it (``stats()``)."""
        return cls(bytes_read=after["bytes_read"] - before["bytes_read"],
                   bytes_written=after["bytes_written"] - before["bytes_written"], seconds=seconds,
                   read_busy_seconds=after["read_seconds"] - before["read_seconds"],
                   write_busy_seconds=after["write_seconds"] - before["write_seconds"], chunks=chunks,
                   flush_seconds=flushed)

    @property
    def ssd_gbps(self) -> float:
        """Bytes read plus written per second of the step."""
        return (self.bytes_read + self.bytes_written) / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class UpdatePlan:
    """What a streamed update walks, computed once from the layout and the store's regions."""

    chunks: list[ChunkRef]  # every chunk, in disk order (OffloadLayout.chunks)
    # Per chunk: its state record (read and written), its gradient (read; when on SSD) and, for a
    # streamed leaf, its new compute weights (written). Segments name Region records (not
    # names), so a step does no lookups per chunk.
    segments: list[list[Segment]]
    passes: list[list[int]]  # chunk indices in the forward's order, resident and streamed runs apart
    layer_done: dict[int, int]  # the chunk that completes a layer of the stack -> that layer
    source_position: dict[int, int]  # streamed leaf index -> its place in a parameter-source slot

    @classmethod
    def build(cls, layout: OffloadLayout, chunks: list[ChunkRef], regions: dict) -> "UpdatePlan":
        """The plan of ``layout``'s ``chunks``; ``regions``: the store's Region records by name."""
        grads_in_store, masters_read = layout.grads_in_store, layout.masters_in_params
        segments = [
            [Segment(regions[c.region], c.state_offset, c.state_bytes, read=True, write=True)] +
            ([Segment(regions[c.leaf.grad_regions[c.layer]], c.grad_offset, c.grad_bytes, read=True, write=False)]
             if grads_in_store else []) +
            # a streamed leaf's new compute weights go to SSD (same offsets as the gradient's); read
            # first where they are its bfloat16 master
            ([Segment(regions[c.leaf.param_regions[c.layer]], c.grad_offset, c.grad_bytes, read=masters_read,
                      write=True)]
             if c.leaf.streamed else [])
            for c in chunks]
        # A step updates in the forward's order (layout.step_order: the leaves outside the stack,
        # then the stack layer by layer). A pass needs one segment count for all its chunks: runs
        # of chunks of resident leaves and of streamed leaves are streamed one after the other.
        order = layout.step_order(chunks)
        passes = [list(g) for _, g in itertools.groupby(order, key=lambda i: chunks[i].leaf.streamed)]
        # The chunk that completes each layer of the stack (every stacked leaf of that layer).
        last_chunk = {chunks[i].layer: i for i in order if chunks[i].leaf.stacked}
        # A streamed leaf's place in a parameter-source slot (the source serves them in leaf order).
        source_position = {leaf.index: k for k, leaf in enumerate(layout.streamed_leaves)}
        return cls(chunks, segments, passes, {i: layer for layer, i in last_chunk.items()}, source_position)


def check_step_slots(layout: OffloadLayout, store: SsdStore) -> None:
    """Refuses an arena without the slots a step over ``layout`` streams through (ArenaError
    naming the class, the size and the settings that decide them)."""
    for request in layout.arena_requests():
        shape_class, nbytes, depth = request.shape_class, request.nbytes, request.count
        slots = store.arena.slots(shape_class)
        fitting = [s for s in slots if s.capacity >= round_to_alignment(nbytes)]
        if len(fitting) < depth:
            raise ArenaError(
                f"offloaded AdamW: a step streams chunks of up to {layout.chunk_elements} elements "
                f"(offload.chunk_bytes={store.cfg.chunk_bytes}) and needs {depth} arena slots of class "
                f"{shape_class!r} of {format_bytes(nbytes)} each (offload.stream_depth={depth}); the arena "
                f"has {len(fitting)} that large ({len(slots)} of that class). Add "
                f"OffloadedAdamState.arena_requests(params, cfg) to the arena plan or lower offload.chunk_bytes")


def kernel_scalars(hparams, leaves: int) -> np.ndarray:
    """The kernel's float32[10] operand from an :class:`AdamHyperParams` or the array itself, or
    one row per leaf, float32[leaves, 10] (:meth:`AdamWSettings.scalars` with a decay mask)."""
    if isinstance(hparams, AdamHyperParams):
        hparams = hparams.scalars()
    scalars = np.ascontiguousarray(np.asarray(hparams), dtype=np.float32)
    if scalars.shape not in ((10,), (leaves, 10)):
        raise ValueError(f"offloaded AdamW: hyperparameters must be an AdamHyperParams, its float32[10] "
                         f"scalars() or one row per leaf ([{leaves}, 10]), got shape {scalars.shape}")
    return scalars


@dataclasses.dataclass(frozen=True)
class ChunkKernel:
    """The fused AdamW kernel as one update of the whole model runs it on each chunk."""

    scalars: np.ndarray  # float32[10], or [leaves, 10] (weight decay per leaf): kernel_scalars(hparams)
    state: StateFormat  # how m and v are stored
    threads: int  # kernel threads per chunk
    rounding_seed: int  # the run's seed of stochastic rounding
    updates_applied: int  # updates before this one: part of each chunk's rounding seed
    partition_index: int  # this process's slice of every layer starts at partition_index * layer_elements

    def update(self, ref: ChunkRef, raw: np.ndarray, grad: np.ndarray, out: np.ndarray) -> None:
        """Updates the chunk's record (its bytes ``raw``: master, m, v, m_scale, v_scale and a
        compensated master's companion) in place from ``grad``, writing the new compute weights
        into ``out``."""
        master, m, v, m_scale, v_scale = ref.record.views(raw)
        if ref.record.state.master_elsewhere:  # a streamed leaf's bfloat16 master: its weights, updated in place
            master = out.view(np.uint16)
        seed, first = self.rounding_key(ref)
        scalars = self.scalars if self.scalars.ndim == 1 else self.scalars[ref.leaf.index]
        comp = ref.record.companion(raw)
        if self.state.master_rounding == "nearest":  # (a float32 master's rounding reads "compensated")
            comp = np.zeros(ref.count, np.uint16)  # the ablation: to nearest, the low half dropped
        extra = {} if self.state.master == "float32" else {"master_format": MasterFormat.of_state(self.state),
                                                                   "comp": comp}
        fused_adamw_update_numpy(master, m, v, grad, out, scalars, threads=self.threads, state=self.state,
                                 m_scale=m_scale, v_scale=v_scale, seed=seed, index=first, **extra)

    def rounding_key(self, ref: ChunkRef) -> tuple[int, int]:
        """(chunk seed, index of its first element in the whole layer) of a chunk's stochastic
        rounding in this update; (0, 0) when neither v nor the master is rounded stochastically."""
        if not (self.state.stochastic or self.state.master_rounding == "stochastic"):
            return 0, 0
        seed = chunk_seed(self.rounding_seed, self.updates_applied, ref.leaf.index, ref.layer)
        return seed, self.partition_index * ref.leaf.layer_elements + ref.start


@dataclasses.dataclass(frozen=True)
class UpdateOutputs:
    """Where an update's results go (see :meth:`OffloadedAdamState.apply_update`)."""

    on_leaf: Callable[[LeafLayout, np.ndarray], None]  # a resident leaf's new weights, leaf shape
    on_layer: Optional[Callable[[int], None]] = None  # a layer of the stack holds its new weights
    outputs: dict = dataclasses.field(default_factory=dict)  # leaf index -> flat array to fill in place
    trace: Optional[list] = None  # ("io wait" | "kernel", begin, end, leaf index, layer) per chunk
    handover: Optional[ParamSource] = None  # takes each streamed layer in memory before it is on disk


class StreamedUpdate:
    """One update of the whole model over an :class:`UpdatePlan` (use once: :meth:`run`).

    ``grad_view(leaf)``: the leaf's flat float32 gradient in the host buffer (``offload.
    fp32_grad_buffer``), or None when each chunk's gradient is streamed from SSD beside its
    state. ``sink``: the gradient sink to release each layer's gradient region to once the
    kernel has read it (None: none is open)."""

    def __init__(self, plan: UpdatePlan, store: SsdStore, layout: OffloadLayout, kernel: ChunkKernel,
                 grad_view: Optional[Callable[[LeafLayout], np.ndarray]], sink, outputs: UpdateOutputs,
                 records, passes: Optional[list[list[int]]] = None):
        self.plan, self.store, self.layout, self.kernel = plan, store, layout, kernel
        self.grad_view, self.sink, self.out = grad_view, sink, outputs
        # Where each record is read and written, and when a write counts (durable_records: in
        # place, or slot rings). ``passes``: the plan's, or fewer chunks (a durable roll-forward).
        self.records = records
        self.segments = records.segments()
        self.passes = plan.passes if passes is None else passes
        self.hosts: dict[int, np.ndarray] = {}  # leaf index -> its new weights, being filled
        self.handed: dict[int, Optional[tuple]] = {}  # layer -> (slot, views) being filled for the handover
        self.durable: list[tuple[int, int]] = []  # the pass's (last chunk position, layer), until written back

    def run(self) -> None:
        """Every pass of the plan; on a failure, the sink and the handover slots are released."""
        try:
            for chunk_ids in self.passes:
                if chunk_ids:
                    self._run_pass(chunk_ids)
        finally:
            if self.sink is not None:
                self.sink.release_all()  # after a failure the state is broken anyway; no arrival is refused
            for taken in self.handed.values():  # a failure midway: slots filled for a handover never made
                if taken is not None:
                    self.store.arena.native.release(taken[0])

    def _run_pass(self, chunk_ids: list[int]) -> None:
        """One stream over ``chunk_ids`` (all of resident leaves, or all of streamed ones)."""
        streamed = self.plan.chunks[chunk_ids[0]].leaf.streamed
        classes = self.layout.slot_classes + ([PARAM_SLOT_CLASS] if streamed else [])
        durable = self.durable = []
        trace = self.out.trace
        progress = _PassProgress(chunk_ids, self.records)
        with self.store.stream([self.segments[i] for i in chunk_ids], classes) as stream:
            progress.stream = stream
            asked = time.perf_counter()
            for chunk in stream:
                got = time.perf_counter()
                kill_point("optimizer_chunk")
                while durable and durable[0][0] <= stream.written_through:  # on disk now
                    self.out.on_layer(durable.pop(0)[1])
                index = chunk_ids[chunk.index]
                ref = self.plan.chunks[index]
                out = self._update_chunk(ref, chunk.arrays, streamed)
                if self.out.handover is not None and streamed:
                    self._copy_to_handover(ref, out)
                if trace is not None:
                    asked_next = time.perf_counter()
                    trace.append(("io wait", asked, got, ref.leaf.index, ref.layer))
                    trace.append(("kernel", got, asked_next, ref.leaf.index, ref.layer))
                    asked = asked_next
                self._chunk_done(index, ref, streamed, chunk.index)
                self.records.before_write(progress.positions[chunk.index], progress)  # before its write-back
        for _, layer in durable:  # the pass has finished: every write is on disk
            self.out.on_layer(layer)
        self.records.end_pass(progress.positions[-1])

    def _update_chunk(self, ref: ChunkRef, arrays: list, streamed: bool) -> np.ndarray:
        """Runs the kernel on the chunk in its slots; returns where its new weights went."""
        leaf, n = ref.leaf, ref.count
        if not streamed and leaf.index not in self.hosts:
            self.hosts[leaf.index] = self.out.outputs.get(leaf.index)
            if self.hosts[leaf.index] is None:
                self.hosts[leaf.index] = np.empty(leaf.size, leaf.dtype)
        if self.grad_view is None:
            grad = arrays[1].view(leaf.dtype)
        else:
            grad = self.grad_view(leaf)[ref.flat_start:ref.flat_start + n]
        # The new compute weights: into the leaf's host array, or (streamed) into the chunk's
        # parameter slot, written back to SSD behind the kernel.
        out = arrays[-1].view(leaf.dtype)[:n] if streamed else \
            self.hosts[leaf.index][ref.flat_start:ref.flat_start + n]
        self.kernel.update(ref, arrays[0], grad[:n], out)
        return out

    def _copy_to_handover(self, ref: ChunkRef, out: np.ndarray) -> None:
        """Copies a streamed chunk's new weights into the next forward's copy of its layer."""
        if ref.layer not in self.handed:
            self.handed[ref.layer] = self.out.handover.acquire_handover(ref.layer)
        if self.handed[ref.layer] is not None:
            view = self.handed[ref.layer][1][self.plan.source_position[ref.leaf.index]].view(ref.leaf.dtype)
            view[ref.start:ref.start + ref.count] = out

    def _chunk_done(self, index: int, ref: ChunkRef, streamed: bool, position: int) -> None:
        """After the kernel: the layer's gradient is read, a layer or a leaf may be complete
        (``position``: the chunk's in its pass)."""
        leaf = ref.leaf
        if self.sink is not None and ref.start + ref.count == leaf.layer_elements:
            # this layer's gradient is read (durable: and no longer needed to redo an update)
            self._once_committed(index, functools.partial(self.sink.release, leaf.index, ref.layer))
        if self.out.on_layer is not None and index in self.plan.layer_done:
            layer = self.plan.layer_done[index]
            if self.records.durable:  # committed, so written
                self._once_committed(index, functools.partial(self.out.on_layer, layer))
                if streamed and self.out.handover is not None:
                    self._hand_over(layer)
            elif streamed:
                self.durable.append((position, layer))
                if self.out.handover is not None:
                    self._hand_over(layer)
            else:
                self.out.on_layer(layer)
        if ref.last_of_leaf and not streamed:
            self.out.on_leaf(leaf, self.hosts.pop(leaf.index).reshape(leaf.shape))

    def _once_committed(self, index: int, fn: Callable[[], None]) -> None:
        self.records.when_committed(self.records.position(index), fn)

    def _hand_over(self, layer: int) -> None:
        """Gives the next forward its in-memory copy of ``layer`` (or lets it read the layer from SSD)."""
        taken = self.handed.pop(layer)
        if taken is None:
            self.out.handover.skip_handover(layer)
        else:
            self.out.handover.handover(layer, taken[0])


class _PassProgress:
    """A pass's write-back in step positions, for the records' commits (durable_records.PassProgress)."""

    def __init__(self, chunk_ids: list[int], records):
        self.positions = [records.position(i) for i in chunk_ids]
        self.stream = None

    def written_through(self) -> int:
        k = self.stream.written_through
        return self.positions[k] if k >= 0 else self.positions[0] - 1  # earlier passes: all written

    def wait_through(self, position: int) -> None:
        local = bisect.bisect_right(self.positions, position) - 1
        if local > self.stream.written_through:
            self.stream.wait_written_through(local)
