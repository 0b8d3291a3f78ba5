"""Writing the initial SSD-resident state: fp32 master weights and zero moments, chunk by chunk.

:meth:`~jaxascend.offload.state.OffloadedAdamState.init` (from arrays) and
:meth:`~jaxascend.offload.state.OffloadedAdamState.init_from` (from a reader of one layer at a
time) check their input here and run :func:`write_initial_state`: one write-only pass over every
chunk's record through the arena, a streamed leaf's compute weights written beside it, its
progress on the terminal and its bytes and seconds returned (:mod:`~jaxascend.offload.init_progress`).
"""

from __future__ import annotations

from typing import Callable, Optional

import ml_dtypes
import numpy as np

from jaxascend.offload.init_progress import InitialWrite, InitProgress
from jaxascend.offload.layout import STATE_SLOT_CLASS, ChunkRef, LeafLayout, OffloadLayout
from jaxascend.optim import StateFormat, master_codes
from jaxascend.ssd import Segment, SsdStore

Reader = Callable[[LeafLayout, Optional[int]], np.ndarray]


def initial_segments(chunks: list[ChunkRef], regions: dict) -> list[list[Segment]]:
    """The init pass's segments: every chunk's state record, written only."""
    return [[Segment(regions[c.region], c.state_offset, c.state_bytes, read=False, write=True)]
            for c in chunks]


def check_init_params(layout: OffloadLayout, leaves: list) -> None:
    """Refuses init params of a dtype other than float32 or the leaf's compute dtype."""
    for leaf, x in zip(layout.leaves, leaves):
        dtype = np.dtype(x.dtype)
        if dtype != np.float32 and dtype != leaf.dtype:
            raise ValueError(f"offloaded AdamW: init params leaf {leaf.path!r} has dtype {dtype}; "
                             f"expected float32 or the compute dtype {leaf.dtype}")


def checked_reader(read: Reader) -> Reader:
    """``read`` whose every layer is checked for its shape and dtype (float32 or the compute dtype)."""
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

    return checked


def initial_bytes(chunks: list[ChunkRef]) -> int:
    """What the init pass writes: every chunk's state record, every layer of a streamed leaf's
    compute weights."""
    streamed = {c.leaf.index: c.leaf for c in chunks if c.leaf.streamed}
    return sum(c.state_bytes for c in chunks) + sum(leaf.layers * leaf.grad_layer_bytes for leaf in streamed.values())


def write_initial_state(store: SsdStore, chunks: list[ChunkRef], segments: list[list[Segment]], source: Callable,
                        whole_leaves: bool, compute: Callable, report: bool = True) -> InitialWrite:
    """The init pass: every chunk's master weights from ``source(leaf, layer)`` (the whole leaf
    when ``whole_leaves``, else one layer), zero m and v; a streamed leaf's compute weights from
    ``compute(leaf, values)``, layer by layer. Returns once every write is on disk, with the bytes
    written and the seconds taken; ``report``: its progress on the terminal (:class:`InitProgress`)."""
    progress = InitProgress(initial_bytes(chunks), enabled=report)
    values = None
    with store.stream(segments, STATE_SLOT_CLASS) as stream:
        for chunk in stream:
            ref = chunks[chunk.index]
            fmt = ref.record.state
            if ref.first_of_leaf if whole_leaves else ref.start == 0:
                values = np.asarray(source(ref.leaf, ref.layer)).reshape(-1)
                if ref.leaf.streamed:  # a bfloat16 master there: its high half is the compute weights
                    weights = (lambda leaf, x: master_weights(x, fmt)) if fmt.master_elsewhere else compute
                    progress.add(_write_compute_params(store, ref.leaf, values, weights, whole_leaves, ref.layer))
            start = ref.flat_start if whole_leaves else ref.start
            n = ref.count
            raw = chunk.arrays[0]
            master, comp = master_parts(values[start:start + n], fmt)
            if not fmt.master_elsewhere:  # else the compute weights written above are the master
                ref.record.views(raw)[0][:] = master
            raw[ref.record.companion_offset:ref.state_bytes] = 0  # zero companion and moments (int8: code 0, scale 0)
            if comp is not None:
                ref.record.companion(raw)[:] = comp
            if ref.last_of_leaf:
                values = None
            progress.add(ref.state_bytes)  # the stream writes the record once the next is asked for
    store.flush()  # the compute weights' writes are on disk (or their error raises here)
    return progress.finish()


def master_parts(values: np.ndarray, fmt: StateFormat) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """``values`` (float32, or the compute dtype) as the master stores them, and a compensated
    master's companion (else None): float32 as they are; a compensated bfloat16 master and its
    low half, together ``values`` (exactly, but a tie that rounds down is held one float32 ulp
    toward zero: ``master_codes.split_master``; a bfloat16 value exactly); a stochastic one's
    bits rounded to nearest even once (exact from bfloat16)."""
    x = np.asarray(values, np.float32)
    if fmt.master == "float32":
        return x, None
    if fmt.master_rounding == "compensated":
        return master_codes.split_master(x)
    return x.astype(ml_dtypes.bfloat16).view(np.uint16), None


def master_weights(values, fmt: StateFormat, block: int = 1 << 22) -> np.ndarray:
    """A bfloat16 master's weights (the high half of :func:`master_parts`, as bfloat16) of
    ``values``, a block at a time: no companion, and temporaries of ``block`` elements, not of
    the whole leaf (a leaf of 10^8 parameters would otherwise take 1.2 GB of them)."""
    x = np.asarray(values)
    flat = x.reshape(-1)
    out = np.empty(flat.size, np.uint16)
    for i in range(0, flat.size, block):
        out[i:i + block] = master_parts(flat[i:i + block], fmt)[0]
    return out.view(ml_dtypes.bfloat16).reshape(x.shape)


def _write_compute_params(store: SsdStore, leaf: LeafLayout, values: np.ndarray, compute: Callable,
                          whole_leaf: bool, layer: int) -> int:
    """Writes a streamed leaf's compute weights: every layer of ``values`` (the whole leaf) or
    layer ``layer`` (one layer's values); returns the bytes written."""
    layers = range(leaf.layers) if whole_leaf else (layer,)
    written = 0
    for i in layers:
        part = values[i * leaf.layer_elements:(i + 1) * leaf.layer_elements] if whole_leaf else values
        weights = np.ascontiguousarray(compute(leaf, part.reshape(leaf.layer_shape)), dtype=leaf.dtype)
        store.write(leaf.param_regions[i], weights.reshape(-1), wait=False)
        written += weights.nbytes
    return written
