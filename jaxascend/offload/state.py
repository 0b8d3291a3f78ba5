"""The owner of SSD-resident AdamW state: fp32 master weights, m and v, and the gradients.

m and v are kept in the owner's state format (``state=``, ``optimizer.state_dtype``): float32,
bfloat16, or block-wise int8 codes with their scales (:class:`~jaxascend.optim.StateFormat`); the
fused kernel decodes and re-encodes them chunk by chunk, so nothing else changes.

:class:`OffloadedAdamState` lays out every parameter leaf in an :class:`~jaxascend.ssd.store.SsdStore`
(see :mod:`jaxascend.offload.layout`), writes the initial state, takes gradients (copied by
:meth:`~OffloadedAdamState.write_grads`, or written by the backward pass itself through
:meth:`~OffloadedAdamState.gradient_sink`), and runs the streamed optimizer step: a pipeline over
fixed-size chunks in which the store reads chunk k+1 while the fused AdamW kernel updates chunk k
in its arena slot and chunk k-1 is written back. The step emits the new compute-dtype
parameters leaf by leaf; host memory stays at the arena plus one leaf being filled, whatever the
model size. Construction order (the trainer's fast path)::

    plan = ArenaPlan().extend(SsdStore.arena_requests(cfg.offload))
    plan.extend(OffloadedAdamState.arena_requests(params, cfg.offload, stacked=is_layer_stack))
    arena = HostArena(plan, cfg.offload)
    store = SsdStore(cfg.offload, arena)
    state = OffloadedAdamState(store, params, stacked=is_layer_stack)   # adds the regions
    state.init(params)                                # fp32 master + zero moments, leaf by leaf
    sink = state.gradient_sink()                      # sink.handle -> offload_on_backward
    ids = state.tensor_ids()                          # tensor= for each parameter leaf
    ...                                               # jitted step; jax.block_until_ready(...)
    del params                                        # the step does not need the old ones
    params = state.step(AdamHyperParams(lr=..., grad_scale=..., count=n))

(:meth:`OffloadedAdamState.create` does the first four lines for you.) Every public method
raises exceptions naming the leaf, size or region at fault. The owner checks and keeps the
bookkeeping; the passes themselves are :mod:`jaxascend.offload.streamed_update` (the step) and
:mod:`jaxascend.offload.initial_state` (init).

With ``offload.fp32_grad_buffer`` (an ablation switch: ZeRO-Infinity's full fp32 host gradient
copy) the gradients do not go to SSD: the owner allocates one float32 host buffer of 4 B/param
for the whole run, the sink widens every gradient into it, and the step reads the gradient of
each chunk from there (bit-identical results: the widening is exact and the kernel widens
16-bit gradients to fp32 anyway). With ``offload.gradients: host`` the gradient regions are the
store's in-memory regions: the same sink, receipts and passes, no SSD round trip.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from typing import Callable, Optional, Union

import jax
import numpy as np

from jaxascend.config import OffloadConfig
from jaxascend.offload.gradient_intake import GradientSink, arrival_problems, make_gradient_sink
from jaxascend.offload.initial_state import (InitialWrite, check_init_params, checked_reader, initial_segments,
                                             write_initial_state)
from jaxascend.offload.durable_records import make_records, roll_forward
from jaxascend.offload.layout import LeafLayout, OffloadLayout, StackedSpec
from jaxascend.offload.param_source import ParamSource
from jaxascend.offload.state_reads import read_leaf_grad, read_leaf_params, read_leaf_state
from jaxascend.offload.streamed_update import (ChunkKernel, StepStats, StreamedUpdate, UpdateOutputs, UpdatePlan,
                                               check_step_slots, kernel_scalars)
from jaxascend.optim import StateFormat
from jaxascend.ssd import ArenaPlan, HostArena, SlotRequest, SsdStore, format_bytes

log = logging.getLogger(__name__)

_owner_ids = itertools.count(1)

LeafRef = Union[int, str, LeafLayout]


def to_default_device(host: np.ndarray) -> jax.Array:
    # device_put, unlike jnp.asarray, makes no intermediate host copy (measured: one leaf less
    # at the peak); the host buffer is never reused, so the array may alias it.
    return jax.device_put(host, may_alias=True)


def _serialized(method):
    """Runs ``method`` under the owner's lock. A jitted optax update runs the step in an XLA
    host-callback thread while Python goes on (async dispatch): without the lock, a direct call
    such as read_state() could share the store's staging slots with a running step."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return locked


class OffloadedAdamState:
    """AdamW state on SSD for one parameter pytree; see the module docstring for the lifecycle.

    ``params_spec``: a pytree of arrays or ``jax.ShapeDtypeStruct`` giving each leaf's shape and
    **compute dtype** (float32, float16 or bfloat16: the dtype of the gradients the step reads
    and of the parameters it emits). ``stacked``: which leaves are layer stacks ``[L, ...]``
    (True/False for all, a pytree of bools, or ``f(path, shape) -> bool``); each layer then gets
    its own gradient region, so the backward pass can write layer by layer (``row_blocks``: per
    leaf, blocks of rows of a large table, handled the same way). ``kernel_threads``:
    threads of the fused kernel per chunk (the step is I/O bound; 1 leaves the other cores to
    the I/O workers). ``state``: how m and v are stored (:class:`~jaxascend.optim.StateFormat`;
    default float32).
    """

    @staticmethod
    def arena_requests(params_spec, cfg: OffloadConfig, stacked: StackedSpec = None,
                       stream_params: bool = False, row_blocks=None,
                       state: StateFormat = StateFormat(), grad_store: str = "ssd") -> list[SlotRequest]:
        """The arena slots a step over ``params_spec`` needs (add them to the arena plan)."""
        return OffloadLayout.plan(params_spec, cfg, stacked, stream_params, row_blocks, state,
                                  grad_store).arena_requests()

    @classmethod
    def create(cls, params_spec, cfg: OffloadConfig, *, stacked: StackedSpec = None, kernel_threads: int = 1,
               extra_requests: tuple[SlotRequest, ...] = (), stream_params: bool = False,
               row_blocks=None, state: StateFormat = StateFormat(), rounding_seed: int = 0,
               partition_index: int = 0, grad_store: str = "ssd", durable_spares: Optional[int] = None,
               reopen: bool = False, host_grad_layers: Optional[int] = None) -> "OffloadedAdamState":
        """Builds the arena (store staging + step slots + ``extra_requests``), opens the store in ``cfg.dir``
        (``reopen``: with a durable run's files, then :meth:`recover`) and lays out the state; :meth:`close` closes all three."""
        plan = (ArenaPlan().extend(SsdStore.arena_requests(cfg))
                .extend(OffloadLayout.plan(params_spec, cfg, stacked, stream_params, row_blocks,
                                           state, grad_store).arena_requests())
                .extend(extra_requests))
        arena = HostArena(plan, cfg)
        store = None
        try:
            store = SsdStore(cfg, arena, keep_files=reopen)
            owner = cls(store, params_spec, stacked=stacked, kernel_threads=kernel_threads,
                        stream_params=stream_params, row_blocks=row_blocks, state=state,
                        rounding_seed=rounding_seed, partition_index=partition_index, grad_store=grad_store,
                        durable_spares=durable_spares, host_grad_layers=host_grad_layers)
        except BaseException:
            if store is not None:
                store.close()
            arena.close()
            raise
        owner._owned = (store, arena)
        return owner

    def __init__(self, store: SsdStore, params_spec, *, stacked: StackedSpec = None, kernel_threads: int = 1,
                 stream_params: bool = False, row_blocks=None, state: StateFormat = StateFormat(),
                 rounding_seed: int = 0, partition_index: int = 0, grad_store: str = "ssd",
                 durable_spares: Optional[int] = None, host_grad_layers: Optional[int] = None):
        if int(kernel_threads) < 1:
            raise ValueError(f"offloaded AdamW: kernel_threads must be >= 1, got {kernel_threads}")
        self.store = store
        self.layout = OffloadLayout.plan(params_spec, store.cfg, stacked, stream_params, row_blocks, state,
                                         grad_store, host_grad_layers)
        self.kernel_threads = int(kernel_threads)
        # Stochastic rounding (state.rounding): element j of layer l of leaf k in the update
        # after `updates_applied` draws its bits from chunk_seed(rounding_seed, updates_applied,
        # k, l) and its index in the whole layer (this process's slice starts at
        # partition_index * layer_elements), so a run draws the same bits however it was split
        # into chunks and wherever it resumed.
        self.rounding_seed = int(rounding_seed)
        self.partition_index = int(partition_index)
        self.state_id = next(_owner_ids)  # what an optax state names to find this owner
        self.updates_applied = 0  # AdamW updates the SSD state has had since init (or restore)
        self.last_step: Optional[StepStats] = None
        self.initial_write: Optional[InitialWrite] = None  # the last init pass's bytes and seconds
        check_step_slots(self.layout, store)
        grads_in_store, in_ram = self.layout.grads_in_store, self.layout.grad_in_ram
        for leaf in self.layout.leaves:
            for layer, (state_region, grad_region) in enumerate(zip(leaf.state_regions, leaf.grad_regions)):
                store.add_region(state_region, self.layout.state_layer_bytes(leaf))
                if grads_in_store:  # offload.gradients: host keeps these regions in RAM
                    store.add_region(grad_region, leaf.grad_layer_bytes, in_memory=in_ram(leaf, layer))
                if leaf.streamed:
                    store.add_region(leaf.param_regions[layer], leaf.grad_layer_bytes)
        # The fp32_grad_buffer ablation: every gradient in one float32 host buffer for the whole
        # run. Filled with zeros now, so its 4 B/param are resident from the start, as a pinned
        # buffer would be.
        self.grad_buffer: Optional[np.ndarray] = None
        self._grad_offsets = np.cumsum([0] + [leaf.size for leaf in self.layout.leaves[:-1]]).tolist()
        if not grads_in_store:
            self.grad_buffer = np.empty(self.layout.num_parameters, np.float32)
            self.grad_buffer.fill(0.0)
        regions = {r.name: r for r in store.regions()}
        self._plan = UpdatePlan.build(self.layout, self.layout.chunks(), regions)  # the step's chunks and passes
        self._init_segments = initial_segments(self._plan.chunks, regions)
        # Records rewritten in place, or (durable steps) in slot rings with a journal: durable_records.
        self.records = make_records(store, self.layout, self._plan.chunks, self._plan.segments, durable_spares)
        self._mirrors = dict(self.records.gradient_log.pairs) if self.records.gradient_log else {}  # region -> log
        self._initialized = False
        self._broken: Optional[str] = None  # why the SSD state can no longer be trusted
        self._grads_written = False  # write_grads() ran since the last step
        self._sink: Optional[GradientSink] = None
        self._source: Optional[ParamSource] = None
        self._arrivals: dict[int, int] = {}
        self._owned: tuple = ()  # (store, arena) when made by create()
        self._lock = threading.RLock()
        log.info("offloaded AdamW: %d leaves, %d parameters, %s of %s state on SSD, %d chunks of %d elements",
                 len(self.layout.leaves), self.layout.num_parameters, format_bytes(self.layout.state_bytes),
                 self.layout.state.dtype, len(self._plan.chunks), self.layout.chunk_elements)

    # ------------------------------------------------------------------ identity
    @property
    def leaves(self) -> tuple[LeafLayout, ...]:
        return self.layout.leaves

    def leaf(self, ref: LeafRef) -> LeafLayout:
        """A leaf's record by index, path or record."""
        if isinstance(ref, LeafLayout):
            return ref
        for leaf in self.layout.leaves:
            if leaf.index == ref or leaf.path == ref:
                return leaf
        raise ValueError(f"offloaded AdamW: no parameter leaf {ref!r} (paths: "
                         f"{', '.join(repr(leaf.path) for leaf in self.layout.leaves[:8])}...)")

    def tensor_ids(self):
        """A pytree like the parameters holding each leaf's gradient-sink tensor id."""
        return self.layout.treedef.unflatten([leaf.index for leaf in self.layout.leaves])

    # ------------------------------------------------------------------ writing state and gradients
    @_serialized
    def init(self, params) -> None:
        """Writes fp32 master weights from ``params`` (float32, or the compute dtype upcast) and
        zero moments, one chunk at a time through the arena; resets :attr:`updates_applied`."""
        leaves = self.layout.flatten(params, "init params")
        check_init_params(self.layout, leaves)
        # One leaf on the host at a time (a copy only if it is on a device). A streamed leaf's
        # compute weights are the leaf in the compute dtype.
        self._write_initial(lambda leaf, layer: leaves[leaf.index], whole_leaves=True,
                            compute=lambda leaf, x: x.astype(leaf.dtype))

    @_serialized
    def init_from(self, read: Callable[[LeafLayout, Optional[int]], np.ndarray],
                  compute: Optional[Callable[[LeafLayout, np.ndarray], np.ndarray]] = None) -> None:
        """:meth:`init` from a reader instead of arrays: ``read(leaf, layer)`` returns one layer of
        a stacked leaf, or block ``layer`` of rows of a table stored in blocks (``layer`` None:
        the whole leaf) in the layer's shape, in float32
        or the compute dtype. The master weights then start from the reader's values (e.g. an fp32
        checkpoint's own, not a rounded compute copy), and only one layer is on the host at a time.
        ``compute(leaf, values)``: a streamed leaf's initial compute weights from the same values
        (default: cast to the compute dtype), written to its parameter regions in the same pass."""
        self._write_initial(checked_reader(read), whole_leaves=False,
                            compute=compute or (lambda leaf, x: np.asarray(x).astype(leaf.dtype)))

    def _write_initial(self, source: Callable, whole_leaves: bool, compute: Callable) -> None:
        """The init pass: every chunk's master weights from ``source(leaf, layer)`` (the whole
        leaf when ``whole_leaves``, else one layer), zero m and v; a streamed leaf's compute
        weights from ``compute(leaf, values)``, layer by layer."""
        self._check_open(allow_broken=True)
        self._broken = "init() was interrupted; call init(params) again"
        self.records.invalidate()  # every record at home, as the init pass writes them
        self.initial_write = write_initial_state(self.store, self._plan.chunks, self._init_segments, source,
                                                 whole_leaves, compute, report=self.partition_index == 0)
        self.records.record_step(0, {}, 0)
        self._broken = None
        self._initialized = True
        self.updates_applied = 0

    @_serialized
    def restored(self, updates_applied: int) -> None:
        """Declares that the state regions were filled by a checkpoint restore that had
        ``updates_applied`` updates (instead of :meth:`init`)."""
        self._check_open(allow_broken=True)
        self._initialized = True
        self._broken = None
        self.updates_applied = int(updates_applied)

    @_serialized
    def recover(self, step: Optional[int] = None) -> int:
        """Durable steps over a reopened store (``create(..., reopen=True)``): takes the journal's step
        (``step``: a job's, DurableRecords.reopen); rolls an interrupted update forward; returns the step."""
        self._check_open(allow_broken=True)
        kernel = functools.partial(ChunkKernel, state=self.layout.state, threads=self.kernel_threads,
                                   rounding_seed=self.rounding_seed, partition_index=self.partition_index)
        self.updates_applied = roll_forward(self.records, self._plan, self.store, self.layout, kernel, step)
        self._initialized, self._broken = True, None
        return self.records.step

    @_serialized
    def write_grads(self, grads) -> None:
        """Copies a gradient pytree (jax or numpy arrays, converted to each leaf's compute dtype)
        into the gradient regions (or the fp32 host buffer); the generic path, where the
        backward pass is not sinked."""
        self._check_open()
        leaves = self.layout.flatten(grads, "gradients")
        for leaf, g in zip(self.layout.leaves, leaves):
            g = np.asarray(g)
            if g.dtype != leaf.dtype:
                g = g.astype(leaf.dtype)
            if self.grad_buffer is not None:
                np.copyto(self._grad_view(leaf), g.reshape(-1))  # widened exactly, no temporary
                continue
            g = g.reshape(leaf.layers, leaf.layer_elements)
            for layer, region in enumerate(leaf.grad_regions):  # durable steps' log too, gradients in RAM
                for target in (region, self._mirrors[region]) if region in self._mirrors else (region,):
                    self.store.write(target, np.ascontiguousarray(g[layer]), wait=False)
        self.store.flush()  # I/O errors surface here, naming the region
        self._grads_written = True

    @_serialized
    def mark_gradients_written(self) -> None:
        """The caller wrote every gradient region itself (e.g. a benchmark): the next step may read them."""
        self._check_open()
        self._grads_written = True

    @_serialized
    def gradient_sink(self, arrivals: Optional[dict[int, int]] = None) -> GradientSink:
        """The gradient sink for this state (created and registered once): pass ``sink.handle``
        and :meth:`tensor_ids` to :func:`jaxascend.offload.grad_sink.offload_on_backward` (``layer=``
        the index within a stacked leaf). Store-backed, or the fp32 host buffer's with
        ``offload.fp32_grad_buffer``. ``arrivals``: tensor id -> gradients per layer the sink sums
        (2 for a tied table whose lookup and head send their gradients separately; default 1).
        Closed with this owner."""
        self._check_open()
        if self._sink is None or self._sink.closed:
            self._arrivals = dict(arrivals or {})
            self._sink = make_gradient_sink(self.store, self.layout, self.grad_buffer, self._grad_offsets,
                                            self._arrivals, self._mirrors)
        return self._sink

    @property
    def early_gradient_arrivals(self) -> int:
        """Gradients the sink refused because the optimizer had not read their region yet (0
        without a sink, and unless the overlapped step's ordering broke)."""
        return self._sink.early_arrivals if self._sink is not None else 0

    @_serialized
    def param_source(self, host: Optional[dict[int, np.ndarray]] = None) -> ParamSource:
        """The parameter source over the layer stack (created once, closed with this owner): the
        layer scan reads its weights through it. Without ``host``, the streamed leaves' SSD
        regions (``offload.params: ssd``; where the records part places them); with ``host`` (leaf
        index -> flat array of that stacked leaf's compute weights), those buffers, which
        :meth:`apply_update` fills in place as ``outputs`` (an overlapped step's resident weights)."""
        self._check_open()
        if self._source is None or self._source.closed:
            if host is None:
                self._source = ParamSource(self.store, self.layout.streamed_leaves, self.layout.param_prefetch, self.records)
            else:
                stacked = [leaf for leaf in self.layout.leaves if leaf.stacked]
                missing = [leaf.path for leaf in stacked if leaf.index not in host]
                if missing:
                    raise ValueError(f"offloaded AdamW: no host buffer for the stacked leaves {missing}")
                self._source = ParamSource(self.store, stacked, self.layout.param_prefetch,
                                           host=[host[leaf.index] for leaf in stacked])
        return self._source

    @_serialized
    def read_params(self, leaf: LeafRef, layer: int) -> np.ndarray:
        """Layer ``layer`` of a streamed leaf's compute weights, as the next step will read them."""
        self._check_open()
        return read_leaf_params(self.store, self.leaf(leaf), layer, self.records.param_region)

    def _grad_view(self, leaf: LeafLayout) -> np.ndarray:
        """The leaf's flat float32 gradient in the host buffer (fp32_grad_buffer only)."""
        start = self._grad_offsets[leaf.index]
        return self.grad_buffer[start:start + leaf.size]

    # ------------------------------------------------------------------ the streamed step
    @_serialized
    def step(self, hparams, *, skip: bool = False, put: Optional[Callable] = None, trace: Optional[list] = None,
             journal: Optional[dict] = None):
        """One AdamW update of the whole model; returns the new compute parameters as a pytree.

        ``hparams``: :class:`~jaxascend.optim.fused_adam.AdamHyperParams` (``count`` = updates applied
        before this one; ``grad_scale`` = loss-scale unscale times clip factor), its float32[10]
        ``scalars()``, or one row of them per leaf (``[leaves, 10]``: a leaf's own weight decay,
        :meth:`~jaxascend.optim.AdamWSettings.scalars` with a decay mask). Gradients must have arrived
        since the last step (sink or :meth:`write_grads`). ``put`` turns each filled host leaf into the
        returned array (default: ``jax.device_put`` to the default device), dropped right after.
        ``skip=True`` (an overflowed step) touches nothing, forgets the received gradients and
        returns None. ``journal``: as :meth:`apply_update`'s."""
        if skip:
            # The skipped step's gradient writes land before the next step's can be queued: two
            # writes of one block in flight at once could land in either order.
            self.store.flush()
            self._forget_gradients()
            self.records.skip(self.records.staged if journal is None else journal)
            return None
        put = to_default_device if put is None else put
        new_leaves: list = [None] * len(self.layout.leaves)

        def on_leaf(leaf: LeafLayout, host: np.ndarray) -> None:
            new_leaves[leaf.index] = put(host)

        self.apply_update(hparams, on_leaf, trace=trace, journal=journal)
        return self.layout.treedef.unflatten(new_leaves)

    @_serialized
    def apply_update(self, hparams, on_leaf: Callable[[LeafLayout, np.ndarray], None],
                     on_layer: Optional[Callable[[int], None]] = None,
                     outputs: Optional[dict[int, np.ndarray]] = None,
                     trace: Optional[list] = None, handover: Optional[ParamSource] = None,
                     journal: Optional[dict] = None) -> StepStats:
        """The streamed step with numpy output: ``on_leaf(leaf, params)`` receives each leaf's new
        compute parameters (a fresh host array, leaf shape) as soon as its last chunk is done.

        Chunks are updated in the forward's order (:meth:`OffloadLayout.step_order`), so that an
        overlapped step can hand layer after layer to the next forward: ``on_layer(layer)`` is
        called once every stacked leaf of ``layer`` holds its new weights (for streamed leaves:
        written to SSD). ``outputs``: leaf index -> flat array the kernel writes that leaf's new
        weights into (the resident weights an overlapped step serves from host memory) instead
        of a fresh one. Gradient receipts are checked and reset at the start; the sink refuses
        an arrival for a region until the kernel has read it (see :meth:`gradient_sink`).
        ``handover``: the parameter source to hand each layer of streamed weights to in memory as
        soon as the kernel has emitted it (:meth:`ParamSource.acquire_handover`), before it is on
        disk; it was gated with ``handover=True``.
        ``trace``: a list to append ``(what, begin, end, leaf index, layer)`` to for every chunk
        (``what``: "io wait", the pipeline handing out the chunk; "kernel", the fused update),
        in ``time.perf_counter`` seconds. ``journal``: with durable steps, the trainer's state once
        this step is complete (what a resume goes on from)."""
        scalars = kernel_scalars(hparams, len(self.layout.leaves))
        self._check_open()
        if not self._initialized:
            raise ValueError("offloaded AdamW: the state has no master weights yet; call init(params) first")
        self._check_gradients_arrived()
        before = self.store.stats()
        start = time.perf_counter()
        self.store.flush()  # every gradient write (sink or write_grads) is on disk; raises its error
        flushed = time.perf_counter() - start
        # The gradients are this step's from here on: the next step's may arrive as soon as the
        # kernel has read each region (the sink refuses them before).
        sink = self._sink if self._sink is not None and not self._sink.closed else None
        self._forget_gradients()
        if sink is not None:
            sink.hold()
        self._broken = "a step failed midway, so some chunks are updated and others are not; restore a checkpoint"
        kernel = ChunkKernel(scalars, self.layout.state, self.kernel_threads, self.rounding_seed,
                             self.updates_applied, self.partition_index)
        grad_view = self._grad_view if self.grad_buffer is not None else None
        self.records.begin(scalars, self.updates_applied, journal)
        StreamedUpdate(self._plan, self.store, self.layout, kernel, grad_view, sink,
                       UpdateOutputs(on_leaf, on_layer, outputs or {}, trace, handover), self.records).run()
        self.records.end()
        self._broken = None
        seconds = time.perf_counter() - start
        self.last_step = StepStats.between(before, self.store.stats(), seconds, len(self._plan.chunks), flushed)
        self.updates_applied += 1
        return self.last_step

    def _forget_gradients(self) -> None:
        self._grads_written = False
        if self._sink is not None and not self._sink.closed:
            self._sink.reset()

    def _check_gradients_arrived(self) -> None:
        if self._grads_written:
            return
        if self._sink is None or self._sink.closed:
            raise ValueError("offloaded AdamW: no gradients since the last step; call write_grads(grads) or run "
                             "the backward pass with offload_on_backward(sink=state.gradient_sink().handle, ...)")
        problems = arrival_problems(self._sink, self.layout.leaves, self._arrivals)
        if problems:
            raise ValueError("offloaded AdamW: the gradient sink did not receive exactly one gradient per "
                             "tensor and layer since the last step: " + "; ".join(problems[:6]) +
                             ("; ..." if len(problems) > 6 else "") +
                             ". Call jax.block_until_ready on the backward step's outputs before step()")

    # ------------------------------------------------------------------ reading back
    @_serialized
    def read_state(self, leaf: LeafRef, which: str = "master", layer: Optional[int] = None) -> np.ndarray:
        """One leaf's ``master``, ``m`` or ``v`` read back from SSD as float32 (leaf shape; for
        checkpoints, exports and tests: one chunk of staging at a time); compressed moments are
        decoded (bfloat16 widened, int8 codes times their block's scale). ``layer``: only that
        layer of a stacked leaf, or one block of rows of a table in blocks (its layer shape), so a
        reader never holds a whole stack."""
        self._check_open()
        return read_leaf_state(self.store, self.layout.state, self.records.placed(), self.leaf(leaf), which, layer)

    @_serialized
    def read_grad(self, leaf: LeafRef) -> np.ndarray:
        """One leaf's gradient as stored (compute dtype, leaf shape)."""
        self._check_open()
        leaf = self.leaf(leaf)
        if self.grad_buffer is not None:  # exact: the buffer holds widened compute-dtype values
            return self._grad_view(leaf).astype(leaf.dtype).reshape(leaf.shape)
        return read_leaf_grad(self.store, leaf)

    # ------------------------------------------------------------------ lifetime
    def _check_open(self, allow_broken: bool = False) -> None:
        if self.store.closed:
            raise ValueError(f"offloaded AdamW: the SSD store in {self.store.cfg.dir} is closed")
        if self._broken is not None and not allow_broken:
            raise RuntimeError(f"offloaded AdamW: the SSD state is inconsistent: {self._broken}")

    @_serialized
    def close(self) -> None:
        """Unregisters the gradient sink; closes the store and arena if :meth:`create` made them."""
        if self._sink is not None:
            self._sink.close()
        if self._source is not None:
            self._source.close()
        self.records.close()
        for owned in self._owned:
            owned.close()
        self._owned = ()

    def __enter__(self) -> "OffloadedAdamState":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"OffloadedAdamState(leaves={len(self.layout.leaves)}, parameters={self.layout.num_parameters}, "
                f"updates_applied={self.updates_applied}, dir={self.store.cfg.dir!r})")
