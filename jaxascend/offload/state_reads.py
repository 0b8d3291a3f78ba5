"""Reading one leaf's optimizer state back from its records (checkpoints, exports, tests)."""

from __future__ import annotations

from typing import Optional

import numpy as np

from jaxascend.offload.layout import STATE_TENSORS, ChunkRef, LeafLayout
from jaxascend.optim import StateFormat
from jaxascend.ssd import SsdStore


def read_leaf_state(store: SsdStore, fmt: StateFormat, chunks: list[ChunkRef], leaf: LeafLayout, which: str,
                    layer: Optional[int]) -> np.ndarray:
    """``leaf``'s ``master``, ``m`` or ``v`` as float32 (leaf shape, or ``layer``'s shape), one
    chunk's record at a time from where ``chunks`` place them; compressed moments decoded."""
    if which not in STATE_TENSORS:
        raise ValueError(f"offloaded AdamW: which must be one of {STATE_TENSORS}, got {which!r}")
    if layer is not None and not (leaf.layers > 1 and 0 <= layer < leaf.layers):
        raise ValueError(f"offloaded AdamW: leaf {leaf.path!r} has no layer {layer} "
                         f"({leaf.layers if leaf.layers > 1 else 'not'} stacked or in blocks)")
    first = 0 if layer is None else layer * leaf.layer_elements
    out = np.empty(leaf.size if layer is None else leaf.layer_elements, np.float32)
    for ref in chunks:
        if ref.leaf.index != leaf.index or (layer is not None and ref.layer != layer):
            continue
        n = ref.count
        raw = store.read(ref.region, offset=ref.state_offset, nbytes=ref.state_bytes, dtype=np.uint8)
        master, m, v, m_scale, v_scale = ref.record.views(raw)
        if which == "master":  # a streamed leaf's bfloat16 master: in its params region
            if ref.record.state.master_elsewhere:
                master = store.read(ref.params_at, offset=ref.grad_offset, nbytes=ref.grad_bytes,
                                    dtype=np.uint16)
            values = fmt.master_values(master, ref.record.companion(raw))
        else:
            values = fmt.decode(which, m if which == "m" else v, m_scale if which == "m" else v_scale)
        out[ref.flat_start - first:ref.flat_start - first + n] = values
    return out.reshape(leaf.shape if layer is None else leaf.layer_shape)


def read_leaf_grad(store: SsdStore, leaf: LeafLayout) -> np.ndarray:
    """One leaf's gradient as its regions hold it (compute dtype, leaf shape)."""
    layers = [store.read(region, dtype=leaf.dtype) for region in leaf.grad_regions]
    return np.concatenate(layers).reshape(leaf.shape)


def read_leaf_params(store: SsdStore, leaf: LeafLayout, layer: int, where=None) -> np.ndarray:
    """Layer ``layer`` of a streamed leaf's compute weights, as the next step will read them;
    ``where(leaf, layer)``: the region holding them (default: their home)."""
    if not leaf.streamed or not 0 <= layer < leaf.layers:
        raise ValueError(f"offloaded AdamW: leaf {leaf.path!r} has no streamed layer {layer}")
    region = leaf.param_regions[layer] if where is None else where(leaf, layer)
    return store.read(region, dtype=leaf.dtype).reshape(leaf.layer_shape)
