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
raises exceptions naming the leaf, size or region at fault.

With ``offload.fp32_grad_buffer`` (an ablation switch: ZeRO-Infinity's full fp32 host gradient
copy) the gradients do not go to SSD: the owner allocates one float32 host buffer of 4 B/param
for the whole run, the sink widens every gradient into it, and the step reads the gradient of
each chunk from there (bit-identical results: the widening is exact and the kernel widens
16-bit gradients to fp32 anyway).
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional, Union

import jax
import numpy as np

from jaxascend.config import OffloadConfig
from jaxascend.kill_points import kill_point
from jaxascend.offload.layout import (PARAM_SLOT_CLASS, STATE_SLOT_CLASS, STATE_TENSORS, ChunkRef, LeafLayout, OffloadLayout,
                                     StackedSpec)
from jaxascend.offload.param_source import ParamSource
from jaxascend.offload.store_sink import (BufferTarget, Fp32BufferGradientSink, SinkTarget, StoreGradientSink,
                                          register_store_sink)
from jaxascend.optim import AdamHyperParams, StateFormat, fused_adamw_update_numpy
from jaxascend.optim import state_codes
from jaxascend.ssd import (ArenaError, ArenaPlan, HostArena, Segment, SlotRequest, SsdStore, format_bytes,
                           round_to_alignment)

log = logging.getLogger(__name__)

_owner_ids = itertools.count(1)

LeafRef = Union[int, str, LeafLayout]


@dataclass(frozen=True)
class StepStats:
    """What one streamed step cost, from the store's counters."""

    bytes_read: int
    bytes_written: int
    seconds: float  # wall time of the step (flush of pending gradient writes included)
    read_busy_seconds: float  # time with at least one read in flight
    write_busy_seconds: float
    chunks: int
    flush_seconds: float = 0.0  # waiting, before the first chunk, for the backward's gradient writes

    @property
    def ssd_gbps(self) -> float:
        """Bytes read plus written per second of the step."""
        return (self.bytes_read + self.bytes_written) / self.seconds / 1e9 if self.seconds > 0 else 0.0


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


def _scalars_array(hparams) -> np.ndarray:
    """The kernel's float32[10] operand from an :class:`AdamHyperParams` or the array itself."""
    if isinstance(hparams, AdamHyperParams):
        hparams = hparams.scalars()
    scalars = np.ascontiguousarray(np.asarray(hparams), dtype=np.float32)
    if scalars.shape != (10,):
        raise ValueError(f"offloaded AdamW: hyperparameters must be an AdamHyperParams or its float32[10] "
                         f"scalars(), got shape {scalars.shape}")
    return scalars


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
                       state: StateFormat = StateFormat()) -> list[SlotRequest]:
        """The arena slots a step over ``params_spec`` needs (add them to the arena plan)."""
        return OffloadLayout.plan(params_spec, cfg, stacked, stream_params, row_blocks, state).arena_requests()

    @classmethod
    def create(cls, params_spec, cfg: OffloadConfig, *, stacked: StackedSpec = None, kernel_threads: int = 1,
               extra_requests: tuple[SlotRequest, ...] = (), stream_params: bool = False,
               row_blocks=None, state: StateFormat = StateFormat(), rounding_seed: int = 0,
               partition_index: int = 0) -> "OffloadedAdamState":
        """Builds the arena (store staging + step slots + ``extra_requests``), opens the store in
        ``cfg.dir`` and lays out the state; :meth:`close` then closes all three."""
        plan = (ArenaPlan().extend(SsdStore.arena_requests(cfg))
                .extend(OffloadLayout.plan(params_spec, cfg, stacked, stream_params, row_blocks,
                                           state).arena_requests())
                .extend(extra_requests))
        arena = HostArena(plan, cfg)
        store = None
        try:
            store = SsdStore(cfg, arena)
            owner = cls(store, params_spec, stacked=stacked, kernel_threads=kernel_threads,
                        stream_params=stream_params, row_blocks=row_blocks, state=state,
                        rounding_seed=rounding_seed, partition_index=partition_index)
        except BaseException:
            if store is not None:
                store.close()
            arena.close()
            raise
        owner._owned = (store, arena)
        return owner

    def __init__(self, store: SsdStore, params_spec, *, stacked: StackedSpec = None, kernel_threads: int = 1,
                 stream_params: bool = False, row_blocks=None, state: StateFormat = StateFormat(),
                 rounding_seed: int = 0, partition_index: int = 0):
        if int(kernel_threads) < 1:
            raise ValueError(f"offloaded AdamW: kernel_threads must be >= 1, got {kernel_threads}")
        self.store = store
        self.layout = OffloadLayout.plan(params_spec, store.cfg, stacked, stream_params, row_blocks, state)
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
        self._check_arena()
        grads_on_ssd = self.layout.grads_on_ssd
        for leaf in self.layout.leaves:
            for layer, (state_region, grad_region) in enumerate(zip(leaf.state_regions, leaf.grad_regions)):
                store.add_region(state_region, self.layout.state_layer_bytes(leaf))
                if grads_on_ssd:
                    store.add_region(grad_region, leaf.grad_layer_bytes)
                if leaf.streamed:
                    store.add_region(leaf.param_regions[layer], leaf.grad_layer_bytes)
        # The fp32_grad_buffer ablation: every gradient in one float32 host buffer for the whole
        # run. Filled with zeros now, so its 4 B/param are resident from the start, as a pinned
        # buffer would be.
        self.grad_buffer: Optional[np.ndarray] = None
        self._grad_offsets = np.cumsum([0] + [leaf.size for leaf in self.layout.leaves[:-1]]).tolist()
        if not grads_on_ssd:
            self.grad_buffer = np.empty(self.layout.num_parameters, np.float32)
            self.grad_buffer.fill(0.0)
        self._chunks = self.layout.chunks()
        # Segments name Region records (not names), so a step does no lookups per chunk.
        regions = {r.name: r for r in store.regions()}
        self._step_segments = [
            [Segment(regions[c.leaf.state_regions[c.layer]], c.state_offset, c.state_bytes, read=True, write=True)] +
            ([Segment(regions[c.leaf.grad_regions[c.layer]], c.grad_offset, c.grad_bytes, read=True, write=False)]
             if grads_on_ssd else []) +
            # a streamed leaf's new compute weights go to SSD (same offsets as the gradient's)
            ([Segment(regions[c.leaf.param_regions[c.layer]], c.grad_offset, c.grad_bytes, read=False, write=True)]
             if c.leaf.streamed else [])
            for c in self._chunks]
        # A step updates in the forward's order (layout.step_order: the leaves outside the stack,
        # then the stack layer by layer). A pass needs one segment count for all its chunks: runs
        # of chunks of resident leaves and of streamed leaves are streamed one after the other.
        order = self.layout.step_order(self._chunks)
        self._step_passes = [list(g) for _, g in itertools.groupby(order, key=lambda i: self._chunks[i].leaf.streamed)]
        # The chunk that completes each layer of the stack (every stacked leaf of that layer).
        last_chunk = {self._chunks[i].layer: i for i in order if self._chunks[i].leaf.stacked}
        self._layer_done = {i: layer for layer, i in last_chunk.items()}
        # A streamed leaf's place in a parameter-source slot (the source serves them in leaf order).
        self._source_position = {leaf.index: k for k, leaf in enumerate(self.layout.streamed_leaves)}
        self._init_segments = [[Segment(regions[c.leaf.state_regions[c.layer]], c.state_offset, c.state_bytes,
                                        read=False, write=True)] for c in self._chunks]
        self._initialized = False
        self._broken: Optional[str] = None  # why the SSD state can no longer be trusted
        self._grads_written = False  # write_grads() ran since the last step
        self._sink: Optional[Union[StoreGradientSink, Fp32BufferGradientSink]] = None
        self._source: Optional[ParamSource] = None
        self._arrivals: dict[int, int] = {}
        self._owned: tuple = ()  # (store, arena) when made by create()
        self._lock = threading.RLock()
        log.info("offloaded AdamW: %d leaves, %d parameters, %s of %s state on SSD, %d chunks of %d elements",
                 len(self.layout.leaves), self.layout.num_parameters, format_bytes(self.layout.state_bytes),
                 self.layout.state.dtype, len(self._chunks), self.layout.chunk_elements)

    def _check_arena(self) -> None:
        for request in self.layout.arena_requests():
            shape_class, nbytes, depth = request.shape_class, request.nbytes, request.count
            slots = self.store.arena.slots(shape_class)
            fitting = [s for s in slots if s.capacity >= round_to_alignment(nbytes)]
            if len(fitting) < depth:
                raise ArenaError(
                    f"offloaded AdamW: a step streams chunks of up to {self.layout.chunk_elements} elements "
                    f"(offload.chunk_bytes={self.store.cfg.chunk_bytes}) and needs {depth} arena slots of class "
                    f"{shape_class!r} of {format_bytes(nbytes)} each (offload.stream_depth={depth}); the arena "
                    f"has {len(fitting)} that large ({len(slots)} of that class). Add "
                    f"OffloadedAdamState.arena_requests(params, cfg) to the arena plan or lower offload.chunk_bytes")

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
        for leaf, x in zip(self.layout.leaves, leaves):
            dtype = np.dtype(x.dtype)
            if dtype != np.float32 and dtype != leaf.dtype:
                raise ValueError(f"offloaded AdamW: init params leaf {leaf.path!r} has dtype {dtype}; "
                                 f"expected float32 or the compute dtype {leaf.dtype}")
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
        def checked(leaf: LeafLayout, layer: Optional[int]) -> np.ndarray:
            x = np.asarray(read(leaf, layer if leaf.layers > 1 else None))
            where = f"{leaf.path!r}" + (f" layer {layer}" if leaf.layers > 1 else "")
            if tuple(x.shape) != tuple(leaf.layer_shape):
                raise ValueError(f"offloaded AdamW: init reader returned shape {list(x.shape)} for {where}; "
                                 f"expected {list(leaf.layer_shape)}")
            if x.dtype != np.float32 and x.dtype != leaf.dtype:
                raise ValueError(f"offloaded AdamW: init reader returned dtype {x.dtype} for {where}; "
                                 f"expected float32 or the compute dtype {leaf.dtype}")
            return x

        self._write_initial(checked, whole_leaves=False,
                            compute=compute or (lambda leaf, x: np.asarray(x).astype(leaf.dtype)))

    def _write_initial(self, source: Callable, whole_leaves: bool, compute: Callable) -> None:
        """The init pass: every chunk's master weights from ``source(leaf, layer)`` (the whole
        leaf when ``whole_leaves``, else one layer), zero m and v; a streamed leaf's compute
        weights from ``compute(leaf, values)``, layer by layer."""
        self._check_open(allow_broken=True)
        self._broken = "init() was interrupted; call init(params) again"
        values = None
        with self.store.stream(self._init_segments, STATE_SLOT_CLASS) as stream:
            for chunk in stream:
                ref = self._chunks[chunk.index]
                if ref.first_of_leaf if whole_leaves else ref.start == 0:
                    values = np.asarray(source(ref.leaf, ref.layer)).reshape(-1)
                    if ref.leaf.streamed:
                        self._write_compute_params(ref.leaf, values, compute, whole_leaves, ref.layer)
                start = ref.flat_start if whole_leaves else ref.start
                n = ref.count
                raw = chunk.arrays[0]
                raw[:4 * n].view(np.float32)[:] = values[start:start + n]
                raw[4 * n:ref.state_bytes] = 0  # zero moments in every format (int8: code 0, scale 0)
                if ref.last_of_leaf:
                    values = None
        self.store.flush()  # the compute weights' writes are on disk (or their error raises here)
        self._broken = None
        self._initialized = True
        self.updates_applied = 0

    def _write_compute_params(self, leaf: LeafLayout, values: np.ndarray, compute: Callable, whole_leaf: bool,
                              layer: int) -> None:
        """Writes a streamed leaf's compute weights: every layer of ``values`` (the whole leaf) or
        layer ``layer`` (one layer's values)."""
        layers = range(leaf.layers) if whole_leaf else (layer,)
        for i in layers:
            part = values[i * leaf.layer_elements:(i + 1) * leaf.layer_elements] if whole_leaf else values
            weights = np.ascontiguousarray(compute(leaf, part.reshape(leaf.layer_shape)), dtype=leaf.dtype)
            self.store.write(leaf.param_regions[i], weights.reshape(-1), wait=False)

    @_serialized
    def restored(self, updates_applied: int) -> None:
        """Declares that the state regions were filled by a checkpoint restore that had
        ``updates_applied`` updates (instead of :meth:`init`)."""
        self._check_open(allow_broken=True)
        self._initialized = True
        self._broken = None
        self.updates_applied = int(updates_applied)

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
            for layer, region in enumerate(leaf.grad_regions):
                self.store.write(region, np.ascontiguousarray(g[layer]), wait=False)
        self.store.flush()  # I/O errors surface here, naming the region
        self._grads_written = True

    @_serialized
    def mark_gradients_written(self) -> None:
        """Declares that the caller wrote every gradient region itself (``store.write`` to each
        ``leaf.grad_regions[layer]``, e.g. a benchmark), so the next step may read them."""
        self._check_open()
        self._grads_written = True

    @property
    def early_gradient_arrivals(self) -> int:
        """Gradients the sink held back because the optimizer had not yet read their region (an
        overlapped step's ordering), since the sink was made; 0 without a sink."""
        return self._sink.early_arrivals if self._sink is not None else 0

    @_serialized
    def gradient_sink(self, arrivals: Optional[dict[int, int]] = None) -> Union[StoreGradientSink,
                                                                                 Fp32BufferGradientSink]:
        """The gradient sink for this state (created and registered once): pass ``sink.handle``
        and :meth:`tensor_ids` to :func:`jaxascend.offload.grad_sink.offload_on_backward` (``layer=``
        the index within a stacked leaf). Store-backed, or the fp32 host buffer's with
        ``offload.fp32_grad_buffer``. ``arrivals``: tensor id -> gradients per layer the sink sums
        (2 for a tied table whose lookup and head send their gradients separately; default 1).
        Closed with this owner."""
        self._check_open()
        if self._sink is None or self._sink.closed:
            self._arrivals = dict(arrivals or {})
            n = self._arrivals.get
            if self.grad_buffer is not None:
                buffer_targets = [BufferTarget(leaf.index, offset, leaf.layers, leaf.layer_elements, leaf.dtype,
                                               n(leaf.index, 1))
                                  for leaf, offset in zip(self.layout.leaves, self._grad_offsets)]
                self._sink = Fp32BufferGradientSink(self.grad_buffer, buffer_targets)
            else:
                targets = [SinkTarget(leaf.index, leaf.grad_regions, leaf.grad_layer_bytes, leaf.dtype,
                                      n(leaf.index, 1)) for leaf in self.layout.leaves]
                self._sink = register_store_sink(self.store, targets)
        return self._sink

    @_serialized
    def param_source(self, host: Optional[dict[int, np.ndarray]] = None) -> ParamSource:
        """The parameter source over the layer stack (created once, closed with this owner): the
        layer scan reads its weights through it. Without ``host``, the streamed leaves' SSD
        regions (``offload.params: ssd``); with ``host`` (leaf index -> flat array of that
        stacked leaf's compute weights), those buffers, which :meth:`apply_update` fills in
        place when given them as ``outputs`` (the resident weights of an overlapped step)."""
        self._check_open()
        if self._source is None or self._source.closed:
            if host is None:
                self._source = ParamSource(self.store, self.layout.streamed_leaves, self.layout.param_prefetch)
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
        leaf = self.leaf(leaf)
        if not leaf.streamed or not 0 <= layer < leaf.layers:
            raise ValueError(f"offloaded AdamW: leaf {leaf.path!r} has no streamed layer {layer}")
        return self.store.read(leaf.param_regions[layer], dtype=leaf.dtype).reshape(leaf.layer_shape)

    def _grad_view(self, leaf: LeafLayout) -> np.ndarray:
        """The leaf's flat float32 gradient in the host buffer (fp32_grad_buffer only)."""
        start = self._grad_offsets[leaf.index]
        return self.grad_buffer[start:start + leaf.size]

    # ------------------------------------------------------------------ the streamed step
    @_serialized
    def step(self, hparams, *, skip: bool = False, put: Optional[Callable] = None, trace: Optional[list] = None):
        """One AdamW update of the whole model; returns the new compute parameters as a pytree.

        ``hparams``: :class:`~jaxascend.optim.fused_adam.AdamHyperParams` (``count`` = updates applied
        before this one; ``grad_scale`` = loss-scale unscale times clip factor) or its float32[10]
        ``scalars()``. Gradients must have arrived since the last step (sink or
        :meth:`write_grads`). ``put`` turns each filled host leaf into the returned array
        (default: ``jax.device_put`` to the default device; e.g. ``lambda x: jax.device_put(x,
        sharding)``); the host leaf is dropped right after. ``skip=True`` (an overflowed step) touches nothing, forgets the
        received gradients and returns None.
        """
        if skip:
            # The skipped step's gradient writes land before the next step's can be queued: two
            # writes of one block in flight at once could land in either order.
            self.store.flush()
            self._forget_gradients()
            return None
        put = to_default_device if put is None else put
        new_leaves: list = [None] * len(self.layout.leaves)

        def on_leaf(leaf: LeafLayout, host: np.ndarray) -> None:
            new_leaves[leaf.index] = put(host)

        self.apply_update(hparams, on_leaf, trace=trace)
        return self.layout.treedef.unflatten(new_leaves)

    @_serialized
    def apply_update(self, hparams, on_leaf: Callable[[LeafLayout, np.ndarray], None],
                     on_layer: Optional[Callable[[int], None]] = None,
                     outputs: Optional[dict[int, np.ndarray]] = None,
                     trace: Optional[list] = None, handover: Optional[ParamSource] = None) -> StepStats:
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
        in ``time.perf_counter`` seconds."""
        scalars = _scalars_array(hparams)
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
        outputs = outputs or {}
        hosts: dict[int, np.ndarray] = {}  # leaf index -> its new weights, being filled
        handed: dict[int, Optional[tuple]] = {}  # layer -> (slot, views) being filled for the handover
        try:
            for chunk_ids in self._step_passes:
                streamed = self._chunks[chunk_ids[0]].leaf.streamed
                classes = self.layout.slot_classes + ([PARAM_SLOT_CLASS] if streamed else [])
                durable: list[tuple[int, int]] = []  # (last chunk position, layer), until written back
                with self.store.stream([self._step_segments[i] for i in chunk_ids], classes) as stream:
                    asked = time.perf_counter()
                    for chunk in stream:
                        got = time.perf_counter()
                        kill_point("optimizer_chunk")
                        while durable and durable[0][0] <= stream.written_through:  # on disk now
                            on_layer(durable.pop(0)[1])
                        index = chunk_ids[chunk.index]
                        ref = self._chunks[index]
                        leaf, n = ref.leaf, ref.count
                        if not streamed and leaf.index not in hosts:
                            hosts[leaf.index] = outputs.get(leaf.index)
                            if hosts[leaf.index] is None:
                                hosts[leaf.index] = np.empty(leaf.size, leaf.dtype)
                        master, m, v, m_scale, v_scale = ref.record.views(chunk.arrays[0])
                        if self.grad_buffer is None:
                            grad = chunk.arrays[1].view(leaf.dtype)
                        else:
                            grad = self._grad_view(leaf)[ref.flat_start:ref.flat_start + n]
                        # The new compute weights: into the leaf's host array, or (streamed) into the
                        # chunk's parameter slot, written back to SSD behind the kernel.
                        out = chunk.arrays[-1].view(leaf.dtype)[:n] if streamed else \
                            hosts[leaf.index][ref.flat_start:ref.flat_start + n]
                        seed, first = self._rounding_key(ref)
                        fused_adamw_update_numpy(master, m, v, grad[:n], out, scalars, threads=self.kernel_threads,
                                                 state=self.layout.state, m_scale=m_scale, v_scale=v_scale,
                                                 seed=seed, index=first)
                        if handover is not None and streamed:
                            if ref.layer not in handed:
                                handed[ref.layer] = handover.acquire_handover(ref.layer)
                            if handed[ref.layer] is not None:  # the next forward's copy of this layer
                                view = handed[ref.layer][1][self._source_position[leaf.index]].view(leaf.dtype)
                                view[ref.start:ref.start + n] = out
                        if trace is not None:
                            asked_next = time.perf_counter()
                            trace.append(("io wait", asked, got, leaf.index, ref.layer))
                            trace.append(("kernel", got, asked_next, leaf.index, ref.layer))
                            asked = asked_next
                        if sink is not None and ref.start + n == leaf.layer_elements:
                            sink.release(leaf.index, ref.layer)  # this layer's gradient is read
                        if on_layer is not None and index in self._layer_done:
                            layer = self._layer_done[index]
                            if streamed:
                                durable.append((chunk.index, layer))
                                if handover is not None:
                                    taken = handed.pop(layer)
                                    if taken is None:
                                        handover.skip_handover(layer)
                                    else:
                                        handover.handover(layer, taken[0])
                            else:
                                on_layer(layer)
                        if ref.last_of_leaf and not streamed:
                            on_leaf(leaf, hosts.pop(leaf.index).reshape(leaf.shape))
                for _, layer in durable:  # the pass has finished: every write is on disk
                    on_layer(layer)
        finally:
            if sink is not None:
                sink.release_all()  # after a failure the state is broken anyway; no arrival is refused
            for taken in handed.values():  # a failure midway: slots filled for a handover never made
                if taken is not None:
                    self.store.arena.native.release(taken[0])
        self._broken = None
        seconds = time.perf_counter() - start
        after = self.store.stats()
        self.last_step = StepStats(
            bytes_read=after["bytes_read"] - before["bytes_read"],
            bytes_written=after["bytes_written"] - before["bytes_written"], seconds=seconds,
            read_busy_seconds=after["read_seconds"] - before["read_seconds"],
            write_busy_seconds=after["write_seconds"] - before["write_seconds"], chunks=len(self._chunks),
            flush_seconds=flushed)
        self.updates_applied += 1
        return self.last_step

    def _rounding_key(self, ref: ChunkRef) -> tuple[int, int]:
        """(chunk seed, index of its first element in the whole layer) of a chunk's stochastic
        rounding in this update; (0, 0) when v is rounded to nearest."""
        if not self.layout.state.stochastic:
            return 0, 0
        seed = state_codes.chunk_seed(self.rounding_seed, self.updates_applied, ref.leaf.index, ref.layer)
        return seed, self.partition_index * ref.leaf.layer_elements + ref.start

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
        problems = []
        for leaf in self.layout.leaves:
            counts = self._sink.received(leaf.index)
            want = self._arrivals.get(leaf.index, 1)
            missing = [layer for layer, c in enumerate(counts) if c < want]
            repeated = [layer for layer, c in enumerate(counts) if c > want]
            if missing:
                problems.append(f"{leaf.path!r} (tensor {leaf.index}) never arrived for layers {missing}" if want == 1
                                else f"{leaf.path!r} (tensor {leaf.index}) arrived fewer than {want} times (one per "
                                     f"use) for layers {missing}")
            if repeated:
                problems.append(f"{leaf.path!r} (tensor {leaf.index}) arrived more than {want}x for layers "
                                f"{repeated} (the sink overwrites; it does not accumulate)")
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
        layer of a stacked leaf (its layer shape), so a reader never holds a whole stack."""
        if which not in STATE_TENSORS:
            raise ValueError(f"offloaded AdamW: which must be one of {STATE_TENSORS}, got {which!r}")
        self._check_open()
        leaf = self.leaf(leaf)
        if layer is not None and not (leaf.stacked and 0 <= layer < leaf.layers):
            raise ValueError(f"offloaded AdamW: leaf {leaf.path!r} has no layer {layer} "
                             f"({leaf.layers if leaf.stacked else 'not'} stacked)")
        first = 0 if layer is None else layer * leaf.layer_elements
        out = np.empty(leaf.size if layer is None else leaf.layer_elements, np.float32)
        fmt = self.layout.state
        for ref in self._chunks:
            if ref.leaf.index != leaf.index or (layer is not None and ref.layer != layer):
                continue
            n = ref.count
            raw = self.store.read(leaf.state_regions[ref.layer], offset=ref.state_offset, nbytes=ref.state_bytes,
                                  dtype=np.uint8)
            master, m, v, m_scale, v_scale = ref.record.views(raw)
            if which == "master":
                values = master
            else:
                values = fmt.decode(which, m if which == "m" else v, m_scale if which == "m" else v_scale)
            out[ref.flat_start - first:ref.flat_start - first + n] = values
        return out.reshape(leaf.shape if layer is None else leaf.layer_shape)

    @_serialized
    def read_grad(self, leaf: LeafRef) -> np.ndarray:
        """One leaf's gradient as stored (compute dtype, leaf shape)."""
        self._check_open()
        leaf = self.leaf(leaf)
        if self.grad_buffer is not None:  # exact: the buffer holds widened compute-dtype values
            return self._grad_view(leaf).astype(leaf.dtype).reshape(leaf.shape)
        layers = [self.store.read(region, dtype=leaf.dtype) for region in leaf.grad_regions]
        return np.concatenate(layers).reshape(leaf.shape)

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
