"""Where each parameter's AdamW state and gradient live in the SSD store, and how a step walks it.

One :class:`LeafLayout` per parameter leaf (a leaf may be a stack of layers ``[L, ...]``). For
every (leaf, layer) there are two store regions:

* ``state``: fp32 master, m and v, interleaved by chunk. Chunk j of a layer covers elements
  ``[j*C, j*C + n)`` and is stored as one record ``master[n] | m[n] | v[n]`` at byte ``j*S``, so
  the step reads all three in **one** request per chunk and writes them back in one. m and v are
  in the state format (``optimizer.state_dtype``, :class:`~jaxascend.optim.StateFormat`):
  float32 (``S = 12*C``), bfloat16 (``S = 8*C``) or int8 codes, whose record adds the chunk's
  block scales, ``... | v[n] | pad to 4 | m_scale[n/block] | v_scale[n/block]`` (float32), and
  whose stride ``S`` is the full record rounded up to whole SSD blocks (``C`` is a multiple of
  the block, so no block straddles two chunks);
* ``grad``: the layer's gradient in the compute dtype, exactly one layer long. The backward pass
  produces a layer's gradient in one piece; writing it at offset 0 of its own region meets the
  store's rule (a write starts on a block boundary and is whole blocks or ends at the region's
  end) whatever the layer size. Chunk j reads bytes ``[j*C*g, (j*C + n)*g)``.

With ``offload.params: ssd`` every leaf of the layer stack has a third region per layer,
``param``: the layer's compute-dtype weights, laid out like ``grad``. The step writes chunk j's
new weights to bytes ``[j*C*g, (j*C + n)*g)`` of it (a third, write-only segment per chunk,
slot class ``adam_param``), and the parameter source reads whole layers of it during the next
forward/backward. Leaves outside the stack stay resident.

Regions are added leaf by leaf, layer by layer (state then grad), so a step reads the disk
front to back. ``C`` (``chunk_elements``) comes from ``offload.chunk_bytes`` (bytes of one fp32
state tensor per chunk), rounded so that a full chunk of every gradient dtype is whole blocks.
A chunk never spans two layers; the arena needs ``stream_depth`` slots of each class::

    adam_state: one record of min(C, largest layer)    adam_grad: g * min(C, largest layer) bytes

Two ablation switches (``offload.*``, see docs/architecture.md) change the slots, never the
arithmetic: ``single_pool`` makes a chunk a whole layer of the largest tensor and sizes every
step slot, state and gradient alike, for that tensor's state (one pool of uniform buffers, as
ZeRO-Infinity's swap buffers are); ``fp32_grad_buffer`` reads gradients from a host fp32 buffer
instead of the store, so no ``adam_grad`` slots are planned.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import jax
import numpy as np

from jaxascend.config import OffloadConfig
from jaxascend.optim import StateFormat, StateRecord
from jaxascend.ssd import SlotRequest, round_to_alignment

STATE_SLOT_CLASS = "adam_state"
GRAD_SLOT_CLASS = "adam_grad"
PARAM_SLOT_CLASS = "adam_param"  # the new compute weights of a streamed chunk, on their way to SSD
SOURCE_SLOT_CLASS = "param_source"  # one layer of every streamed leaf, read ahead of the layer scan
STATE_TENSORS = ("master", "m", "v")
FLOAT32_STATE = StateFormat()

SUPPORTED_COMPUTE_DTYPES = ("float32", "float16", "bfloat16")

# True/False for every leaf, a pytree of bools matching the parameters, or
# f(path, shape) -> bool; a stacked leaf's axis 0 is its layer axis.
StackedSpec = Union[None, bool, Any, Callable[[str, tuple], bool]]


@dataclass(frozen=True)
class LeafLayout:
    """One parameter leaf's place in the store. ``index`` (its position in the flattened
    parameter pytree) is also its tensor id for the gradient sink."""

    index: int
    path: str
    shape: tuple[int, ...]
    dtype: np.dtype  # compute dtype: of the emitted parameters and of the gradient regions
    stacked: bool  # axis 0 is a layer axis: one region pair per layer
    state_regions: tuple[str, ...]  # per layer: chunk-interleaved fp32 master | m | v
    grad_regions: tuple[str, ...]  # per layer: the gradient, layer_elements * itemsize bytes
    param_regions: tuple[str, ...] = ()  # per layer, when streamed: the compute weights, as grad
    # > 1: an unstacked table split into that many equal blocks of rows, each a "layer" of its
    # own (its regions, its gradient arrivals): a large vocabulary table (models.vocab)
    row_blocks: int = 1

    @property
    def streamed(self) -> bool:
        """The compute weights live on SSD (offload.params: ssd), not in memory."""
        return bool(self.param_regions)

    @property
    def layers(self) -> int:
        return len(self.state_regions)

    @property
    def layer_shape(self) -> tuple[int, ...]:
        if self.stacked:
            return self.shape[1:]
        if self.row_blocks > 1:
            return (self.shape[0] // self.row_blocks,) + self.shape[1:]
        return self.shape

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def layer_elements(self) -> int:
        return self.size // self.layers

    @property
    def grad_layer_bytes(self) -> int:
        return self.layer_elements * self.dtype.itemsize


@dataclass(frozen=True)
class ChunkRef:
    """Elements ``[start, start + count)`` of one layer of one leaf; its state ``record`` sits at
    byte ``state_offset`` of the layer's state region, and a step moves ``state_bytes`` there: the
    record padded to the next chunk's (whole SSD blocks), or to the region's end for the last.
    ``state_region``: the region the record is in when not its home (durable steps move records
    between slots, :mod:`~jaxascend.offload.slot_rings`)."""

    leaf: LeafLayout
    layer: int
    start: int
    count: int
    state_offset: int
    record: StateRecord
    state_bytes: int
    state_region: Optional[str] = None
    param_region: Optional[str] = None  # a streamed leaf's weights when not in their home region (durable steps)

    @property
    def region(self) -> str:
        """The store region the state record is in."""
        return self.state_region or self.leaf.state_regions[self.layer]

    @property
    def params_at(self) -> str:
        """The store region holding a streamed chunk's weights (at :attr:`grad_offset`)."""
        return self.param_region or self.leaf.param_regions[self.layer]

    @property
    def grad_offset(self) -> int:
        return self.start * self.leaf.dtype.itemsize

    @property
    def grad_bytes(self) -> int:
        return self.count * self.leaf.dtype.itemsize

    @property
    def flat_start(self) -> int:
        """Where the chunk begins in the leaf's flattened parameters."""
        return self.layer * self.leaf.layer_elements + self.start

    @property
    def first_of_leaf(self) -> bool:
        return self.layer == 0 and self.start == 0

    @property
    def last_of_leaf(self) -> bool:
        return self.layer == self.leaf.layers - 1 and self.start + self.count == self.leaf.layer_elements


def chunk_elements_for(cfg: OffloadConfig, itemsizes, state: StateFormat = FLOAT32_STATE) -> int:
    """Elements per chunk: ``chunk_bytes`` of fp32 state, rounded down (but at least one unit) to
    a multiple of the elements of one block in the narrowest gradient dtype (so a full chunk is
    whole blocks in every region) and of the int8 state's scale block."""
    unit = _chunk_unit(cfg, itemsizes, state)
    return max(unit, (cfg.chunk_bytes // 4) // unit * unit)


def _chunk_unit(cfg: OffloadConfig, itemsizes, state: StateFormat) -> int:
    """A chunk's elements are a multiple of this: one SSD block of the narrowest gradient dtype,
    and the int8 state's scale block."""
    return max(cfg.block_bytes // min(itemsizes, default=4), state.block)


def _is_stacked(stacked: StackedSpec, flags: list, index: int, path: str, shape: tuple) -> bool:
    if stacked is None or isinstance(stacked, bool):
        return bool(stacked)
    if callable(stacked):
        return bool(stacked(path, shape))
    return bool(flags[index])


def _compute_dtype(leaf, path: str) -> np.dtype:
    dtype = np.dtype(getattr(leaf, "dtype", None) or np.asarray(leaf).dtype)
    if dtype.name not in SUPPORTED_COMPUTE_DTYPES:
        raise ValueError(f"offloaded AdamW: parameter {path!r} has dtype {dtype}; the compute dtype must be "
                         f"one of {', '.join(SUPPORTED_COMPUTE_DTYPES)}")
    return dtype


@dataclass(frozen=True)
class OffloadLayout:
    """The whole model's layout: leaves in flattening order, and the chunk plan of a step."""

    leaves: tuple[LeafLayout, ...]
    treedef: Any
    chunk_elements: int
    stream_depth: int
    single_pool: bool = False  # every step slot sized for the largest tensor's state (ablation)
    grad_store: str = "ssd"  # the plan's: store regions on SSD (ssd) or in RAM (host), or host_fp32 (ablation)
    host_grad_layers: Optional[int] = None  # with grad_store host: only the stack's first N layers' in RAM
    param_prefetch: int = 2  # layers the parameter source reads ahead (streamed weights only)
    state: StateFormat = FLOAT32_STATE  # how m and v are stored
    state_stride: int = 0  # bytes between the records of consecutive chunks of a layer
    block_bytes: int = 4096  # the store's block: a stride is whole blocks

    @classmethod
    def plan(cls, params_spec, cfg: OffloadConfig, stacked: StackedSpec = None,
             stream_params: bool = False, row_blocks: Optional[Sequence[int]] = None,
             state: StateFormat = FLOAT32_STATE, grad_store: str = "ssd",
             host_grad_layers: Optional[int] = None) -> "OffloadLayout":
        """Lays out ``params_spec`` (a pytree of arrays or ``jax.ShapeDtypeStruct`` in the compute
        dtype). ``stacked`` says which leaves are layer stacks (see :data:`StackedSpec`);
        ``stream_params``: their compute weights get SSD regions too (``offload.params: ssd``);
        ``row_blocks``: per leaf (flattening order), blocks of rows of an unstacked table (1: none);
        ``state``: the format of m and v (``optimizer.state_dtype``); ``grad_store``: where the
        gradients wait (the plan's: ``ssd``, ``host`` regions in RAM, or the ``host_fp32`` buffer);
        ``host_grad_layers``: with ``host``, only the layer stack's first N layers' (the rest on SSD)."""
        path_leaves, treedef = jax.tree_util.tree_flatten_with_path(params_spec)
        flags = []
        if not (stacked is None or isinstance(stacked, bool) or callable(stacked)):
            flags = jax.tree.leaves(stacked)
            if len(flags) != len(path_leaves):
                raise ValueError(f"offloaded AdamW: `stacked` has {len(flags)} leaves but the parameters have "
                                 f"{len(path_leaves)}; give a pytree of bools with the parameters' structure")
        leaves = []
        for index, (key_path, leaf) in enumerate(path_leaves):
            path = jax.tree_util.keystr(key_path, simple=True, separator="/") or "param"
            shape = tuple(int(d) for d in np.shape(leaf))
            dtype = _compute_dtype(leaf, path)
            if int(np.prod(shape, dtype=np.int64)) == 0:
                raise ValueError(f"offloaded AdamW: parameter {path!r} has shape {shape} with no elements")
            is_stacked = _is_stacked(stacked, flags, index, path, shape)
            if is_stacked and len(shape) < 1:
                raise ValueError(f"offloaded AdamW: parameter {path!r} is marked stacked but is a scalar")
            blocks = 1 if row_blocks is None else int(row_blocks[index])
            if blocks > 1 and (is_stacked or len(shape) < 1 or shape[0] % blocks):
                raise ValueError(f"offloaded AdamW: parameter {path!r} of shape {shape} cannot be split into "
                                 f"{blocks} blocks of rows")
            layers = shape[0] if is_stacked else blocks
            prefix = f"adam/{index}/{path}"
            names = [f"{prefix}/L{layer}" if is_stacked else (f"{prefix}/B{layer}" if blocks > 1 else prefix)
                     for layer in range(layers)]
            params = tuple(n + "/param" for n in names) if stream_params and is_stacked else ()
            leaves.append(LeafLayout(index, path, shape, dtype, is_stacked,
                                     tuple(n + "/state" for n in names), tuple(n + "/grad" for n in names), params,
                                     blocks))
        itemsizes = [leaf.dtype.itemsize for leaf in leaves]
        chunk = chunk_elements_for(cfg, itemsizes, state)
        if cfg.single_pool:
            # ZeRO-Infinity sizes its buffers for the largest tensor: a chunk is then always one
            # whole layer of a leaf (rounded up to whole blocks, so any chunk size stays valid).
            unit = _chunk_unit(cfg, itemsizes, state)
            largest = max(leaf.layer_elements for leaf in leaves)
            chunk = -(-largest // unit) * unit
        stride = -(-StateRecord(state, chunk).nbytes // cfg.block_bytes) * cfg.block_bytes
        return cls(tuple(leaves), treedef, chunk, cfg.stream_depth, single_pool=cfg.single_pool,
                   grad_store=grad_store, host_grad_layers=host_grad_layers if grad_store == "host" else None,
                   param_prefetch=cfg.param_prefetch, state=state,
                   state_stride=stride, block_bytes=cfg.block_bytes)

    @property
    def num_parameters(self) -> int:
        return sum(leaf.size for leaf in self.leaves)

    def state_layer_bytes(self, leaf: LeafLayout) -> int:
        """Bytes of one layer's state region: its chunks' records at :attr:`state_stride`."""
        full, last = divmod(leaf.layer_elements, self.chunk_elements)
        if last == 0:
            full, last = full - 1, self.chunk_elements
        return full * self.stride_of(leaf) + StateRecord(self.record_format(leaf), last).nbytes

    def stride_of(self, leaf: LeafLayout) -> int:
        """Bytes between the records of consecutive chunks of ``leaf``'s layers: :attr:`state_stride`,
        or less where its records hold no master (:meth:`record_format`), whole blocks either way."""
        fmt = self.record_format(leaf)
        if fmt is self.state:
            return self.state_stride
        return -(-StateRecord(fmt, self.chunk_elements).nbytes // self.block_bytes) * self.block_bytes

    @property
    def state_bytes(self) -> int:
        """Bytes of master + m + v (+ scales) on SSD."""
        return sum(leaf.layers * self.state_layer_bytes(leaf) for leaf in self.leaves)

    @property
    def step_bytes(self) -> tuple[int, int]:
        """(bytes read, bytes written) of one step on SSD: every state record read and written,
        the gradients read (on SSD), a streamed leaf's new compute weights written (and read,
        when they are its bfloat16 master). The
        backward's gradient writes, and the parameter source's reads, come on top."""
        grads = self.ssd_grad_bytes
        params_read = self.streamed_param_bytes if self.masters_in_params else 0
        return self.state_bytes + grads + params_read, self.state_bytes + self.streamed_param_bytes

    @property
    def masters_in_params(self) -> bool:
        """A bfloat16 master of a streamed leaf lives in its params region (the weights the forward
        streams, read and written by the update), not in its state records."""
        return self.state.master == "bfloat16" and bool(self.streamed_leaves)

    def record_format(self, leaf: LeafLayout) -> StateFormat:
        """The format of ``leaf``'s state records: without the master where it lives in the
        params region (:attr:`masters_in_params`)."""
        if leaf.streamed and self.state.master == "bfloat16":
            return dataclasses.replace(self.state, master_elsewhere=True)
        return self.state

    @property
    def grad_bytes(self) -> int:
        return sum(leaf.size * leaf.dtype.itemsize for leaf in self.leaves)

    def grad_in_ram(self, leaf: LeafLayout, layer: int) -> bool:
        """Whether ``leaf``'s gradient of ``layer`` waits in RAM: every one with ``grad_store`` host,
        or with :attr:`host_grad_layers` N the layer stack's first N layers' only (the gradients
        the backward sends last and the update reads first)."""
        if self.grad_store != "host":
            return False
        return self.host_grad_layers is None or (leaf.stacked and layer < self.host_grad_layers)

    def grad_regions_in(self, ram: bool) -> list[tuple[str, int]]:
        """(name, bytes) of the gradients' store regions kept in RAM (``ram``) or on SSD (none
        with the ``host_fp32`` buffer, which has no regions)."""
        if not self.grads_in_store:
            return []
        return [(region, leaf.grad_layer_bytes) for leaf in self.leaves
                for layer, region in enumerate(leaf.grad_regions) if self.grad_in_ram(leaf, layer) == ram]

    @property
    def ram_grad_bytes(self) -> int:
        """The gradients' bytes in RAM (store regions kept in memory)."""
        return sum(nbytes for _, nbytes in self.grad_regions_in(ram=True))

    @property
    def ssd_grad_bytes(self) -> int:
        """The gradients' bytes in store regions on SSD (none with the ``host_fp32`` buffer)."""
        return self.grad_bytes - self.ram_grad_bytes if self.grads_in_store else 0

    def chunks(self) -> list[ChunkRef]:
        """Every chunk of a step, in disk order."""
        out = []
        for leaf in self.leaves:
            for layer in range(leaf.layers):
                for j, start in enumerate(range(0, leaf.layer_elements, self.chunk_elements)):
                    n = min(self.chunk_elements, leaf.layer_elements - start)
                    record = StateRecord(self.record_format(leaf), n)
                    last = start + n == leaf.layer_elements
                    out.append(ChunkRef(leaf, layer, start, n, j * self.stride_of(leaf), record,
                                        record.nbytes if last else self.stride_of(leaf)))
        return out

    def step_order(self, chunks: Optional[Sequence[ChunkRef]] = None) -> list[int]:
        """The order in which a step updates the chunks (indices into :meth:`chunks`): the
        forward's. Leaves outside the layer stack first (the embeddings, final norm and head:
        the next forward needs them whole, at once), then the stack layer by layer, every leaf
        of layer 0, then of layer 1, ...: so the next step's forward may start a layer as soon
        as its update is done (``offload.overlap``). The order does not change the arithmetic."""
        chunks = self.chunks() if chunks is None else chunks
        top = [i for i, c in enumerate(chunks) if not c.leaf.stacked]
        stack = sorted((i for i, c in enumerate(chunks) if c.leaf.stacked), key=lambda i: (chunks[i].layer, i))
        return top + stack

    @property
    def stack_layers(self) -> int:
        """Layers of the layer stack (0 without one)."""
        return max((leaf.layers for leaf in self.leaves if leaf.stacked), default=0)

    @property
    def largest_chunk(self) -> int:
        return min(self.chunk_elements, max(leaf.layer_elements for leaf in self.leaves))

    @property
    def state_slot_bytes(self) -> int:
        if self.largest_chunk == self.chunk_elements:  # a full chunk moves its padded record
            return self.state_stride
        return StateRecord(self.state, self.largest_chunk).nbytes

    @property
    def grad_slot_bytes(self) -> int:
        return max(min(self.chunk_elements, leaf.layer_elements) * leaf.dtype.itemsize for leaf in self.leaves)

    @property
    def streamed_leaves(self) -> tuple[LeafLayout, ...]:
        return tuple(leaf for leaf in self.leaves if leaf.streamed)

    @property
    def param_slot_bytes(self) -> int:
        """One chunk of a streamed leaf's new compute weights (0 when nothing is streamed)."""
        return max((min(self.chunk_elements, leaf.layer_elements) * leaf.dtype.itemsize
                    for leaf in self.streamed_leaves), default=0)

    @property
    def source_slot_bytes(self) -> int:
        """One slot of the parameter source: one layer of every streamed leaf, each 4096-aligned."""
        return sum(round_to_alignment(leaf.grad_layer_bytes) for leaf in self.streamed_leaves)

    @property
    def streamed_param_bytes(self) -> int:
        """Bytes of compute weights on SSD."""
        return sum(leaf.size * leaf.dtype.itemsize for leaf in self.streamed_leaves)

    @property
    def resident_param_bytes(self) -> int:
        """Bytes of compute weights that stay in memory."""
        return sum(leaf.size * leaf.dtype.itemsize for leaf in self.leaves if not leaf.streamed)

    @property
    def slot_classes(self) -> list[str]:
        """The slot class of each segment of a resident leaf's chunk (state, then gradient if in
        the store); a streamed leaf's chunk adds :data:`PARAM_SLOT_CLASS`."""
        return [STATE_SLOT_CLASS, GRAD_SLOT_CLASS] if self.grads_in_store else [STATE_SLOT_CLASS]

    @property
    def grads_in_store(self) -> bool:
        """Each layer's gradient is a store region (on SSD, or in RAM with ``grad_store`` host)."""
        return self.grad_store != "host_fp32"

    def arena_requests(self) -> list[SlotRequest]:
        """The arena slots a step needs: ``stream_depth`` of each class in :attr:`slot_classes`
        (with ``single_pool``, all of one size: the largest tensor's state), plus the streamed
        weights' slots when there are any."""
        sizes = {STATE_SLOT_CLASS: self.state_slot_bytes, GRAD_SLOT_CLASS: self.grad_slot_bytes}
        if self.single_pool:
            sizes = dict.fromkeys(sizes, max(sizes.values()))
        classes = list(self.slot_classes)
        if self.streamed_leaves:
            sizes[PARAM_SLOT_CLASS] = max(sizes.values()) if self.single_pool else self.param_slot_bytes
            classes.append(PARAM_SLOT_CLASS)
        requests = [SlotRequest(c, sizes[c], self.stream_depth) for c in classes]
        if self.streamed_leaves:
            requests.append(SlotRequest(SOURCE_SLOT_CLASS, self.source_slot_bytes, self.param_prefetch))
        return requests

    def flatten(self, tree, what: str) -> list:
        """The leaves of ``tree`` (any pytree with the parameters' leaves in the same order,
        e.g. a dict where the spec was an ``nnx.State``), checked against the layout's shapes."""
        leaves = jax.tree.leaves(tree)
        if len(leaves) != len(self.leaves):
            raise ValueError(f"offloaded AdamW: {what} has {len(leaves)} leaves but the optimizer state was laid "
                             f"out for {len(self.leaves)}")
        for leaf, x in zip(self.leaves, leaves):
            if tuple(np.shape(x)) != leaf.shape:
                raise ValueError(f"offloaded AdamW: {what} leaf {leaf.index} ({leaf.path!r}) has shape "
                                 f"{tuple(np.shape(x))}, expected {leaf.shape}")
        return leaves
