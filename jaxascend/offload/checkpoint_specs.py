"""The offloaded state's regions as checkpoint arrays: what :mod:`jaxascend.checkpoint` streams.

:func:`specs_for_offload_layout` reads an :class:`~jaxascend.offload.layout.OffloadLayout`'s chunk
records and names every tensor of the SSD-resident state as one
:class:`~jaxascend.checkpoint.ArraySpec` (spans of its regions), so the checkpoint package needs
to know nothing of the layout.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from jaxascend.checkpoint import SCALE_ARRAYS, ArraySpec, Piece, Span
from jaxascend.offload.layout import STATE_TENSORS, ChunkRef, LeafLayout, OffloadLayout
from jaxascend.optim import StateFormat


def specs_for_offload_layout(layout: OffloadLayout, pieces: Optional[Sequence[Piece]] = None,
                             placed: Optional[Sequence[ChunkRef]] = None) -> list[ArraySpec]:
    """Array specs for ``layout``'s state regions: per leaf ``"master/<leaf path>"`` (float32, or
    bfloat16 with ``optimizer.master_dtype``, whose compensated rounding adds ``"master_comp/..."``)
    and ``"m/..."``, ``"v/..."`` in the layout's state format (float32, bfloat16, or uint8
    codes), each of the leaf's shape, gathered from every layer's chunk records
    ``master[n] (| comp[n] | pad) | m[n] | v[n] (| pad | m_scale | v_scale)``; int8 state adds ``"m_scale/..."``
    and ``"v_scale/..."``, float32 ``[layers, blocks per layer]`` (``[blocks]`` for a leaf of one
    layer). A leaf whose compute weights are streamed from SSD adds ``"params/<leaf path>"`` in
    its dtype. ``pieces`` (one per leaf): where each leaf sits in the whole tensor (a
    data-parallel process's slices), so that a restore can re-partition; the scales of int8
    state belong to their process's slices and record none. ``placed``: the layout's chunks with their
    records where they are now (durable steps move them, ``OffloadedAdamState.records.placed()``)."""
    pieces = list(pieces) if pieces is not None else [None] * len(layout.leaves)
    chunks: dict[int, list[ChunkRef]] = {leaf.index: [] for leaf in layout.leaves}
    for ref in (layout.chunks() if placed is None else placed):  # leaf by leaf, layer by layer, in order
        chunks[ref.leaf.index].append(ref)
    specs = []
    for leaf, piece in zip(layout.leaves, pieces):
        specs += _leaf_specs(layout.record_format(leaf), leaf, chunks[leaf.index], piece)
    return specs


def _leaf_specs(fmt: StateFormat, leaf: LeafLayout, chunks: Sequence[ChunkRef],
                piece: Optional[Piece]) -> list[ArraySpec]:
    """One leaf's arrays (see :func:`specs_for_offload_layout`) from its ``chunks`` in order."""
    spans: dict[str, list] = {name: [] for name in STATE_TENSORS + SCALE_ARRAYS}
    for ref in chunks:
        region, base, record = ref.region, ref.state_offset, ref.record
        moment_bytes = fmt.moment_itemsize * record.count
        if fmt.master_elsewhere:  # a streamed leaf's bfloat16 master: its params region
            spans["master"].append(Span(ref.params_at, ref.grad_offset, ref.grad_bytes))
        else:
            spans["master"].append(Span(region, base, fmt.master_itemsize * record.count))
        if fmt.companion_itemsize:
            spans.setdefault("master_comp", []).append(Span(region, base + record.companion_offset,
                                                            fmt.companion_itemsize * record.count))
        spans["m"].append(Span(region, base + record.m_offset, moment_bytes))
        spans["v"].append(Span(region, base + record.v_offset, moment_bytes))
        if record.blocks:
            scales = base + record.scales_offset
            spans["m_scale"].append(Span(region, scales, 4 * record.blocks))
            spans["v_scale"].append(Span(region, scales + 4 * record.blocks, 4 * record.blocks))
    specs = []
    for name in STATE_TENSORS + (("master_comp",) if fmt.companion_itemsize else ()):
        specs.append(ArraySpec(f"{name}/{leaf.path}", leaf.shape, fmt.moment_dtype(name), tuple(spans[name]), piece))
    if fmt.block:  # a chunk is whole blocks (but the last of a layer): the layer's blocks in order
        blocks = fmt.blocks(leaf.layer_elements)
        shape = (leaf.layers, blocks) if leaf.layers > 1 else (blocks,)
        for name in SCALE_ARRAYS:
            specs.append(ArraySpec(f"{name}/{leaf.path}", shape, np.float32, tuple(spans[name])))
    if leaf.streamed and not fmt.master_elsewhere:  # offload.params: ssd: the compute weights live on SSD too
        param_spans = tuple(Span(ref.params_at, ref.grad_offset, ref.grad_bytes) for ref in chunks)
        specs.append(ArraySpec(f"params/{leaf.path}", leaf.shape, leaf.dtype, param_spans, piece))
    return specs
