"""Saving SSD-resident arrays into the ``offloaded`` checkpoint item, chunk by chunk.

The fp32 master weights and Adam moments live in :class:`~jaxascend.ssd.SsdStore` regions and
are far larger than RAM, so they are never assembled on the host: every array
(:class:`~jaxascend.checkpoint.array_specs.ArraySpec`) is copied chunk by chunk from its region
into a tensorstore zarr array (layout: :mod:`jaxascend.checkpoint.offloaded_item`), through the
arena slots of one shape class (``"checkpoint"`` by default;
:func:`~jaxascend.checkpoint.array_specs.checkpoint_arena_requests` plans them, or pass the class
of slots that are idle while saving). Reads from the SSD run ahead of the zarr writes
(:meth:`SsdStore.stream`); tensorstore writes each chunk file straight from its slot
(``can_reference_source_data_indefinitely``), so a save adds next to nothing to host memory.
Chunk files go to the page cache and are fsync'ed together at the end of the item (one fsync per
file while writing halves the rate here), before Orbax renames the step directory into place.

Chunks hold at most ``offload.chunk_bytes`` and at most one slot minus two SSD blocks, because
the SSD is read in whole blocks around each chunk (a chunk that crosses a span boundary is
assembled in one chunk-sized buffer).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import tensorstore as ts

from jaxascend.native import extension as _native
from jaxascend.checkpoint.array_specs import ArraySpec, SsdArrays, pass_geometry, regions_of, whole_blocks
from jaxascend.checkpoint.offloaded_item import FORMAT, MANIFEST_FILE, PROCESSES_FILE, part_directory, ts_context
from jaxascend.checkpoint.zarr_layout import chunk_grid, orbax_tree_metadata, zarr_chunk_shape, zarr_dtype, zarr_spec
from jaxascend.kill_points import kill_point
from jaxascend.ssd import Segment

COMPRESSORS = {"none": None, "zstd": {"id": "zstd", "level": 1}}  # zstd level 1: Orbax's own choice


def save_item(directory: Path, arrays: SsdArrays, compression: str = "none") -> dict:
    """Saves this process's arrays into the ``offloaded`` item ``directory``: the plain layout for
    one process, ``process<i>/`` of a data-parallel job (process 0 also records how many)."""
    index, count = arrays.process
    manifest = save_arrays(part_directory(directory, index, count), arrays, compression)
    if count > 1 and index == 0:
        path = Path(directory) / PROCESSES_FILE
        with open(path, "w") as f:
            f.write(json.dumps({"format": FORMAT, "processes": count}))
            f.flush()
            os.fsync(f.fileno())
    return manifest


def save_arrays(directory: Path, arrays: SsdArrays, compression: str = "none") -> dict:
    """Streams every array of ``arrays`` into ``directory`` (layout in the module docstring);
    returns the manifest it wrote."""
    if compression not in COMPRESSORS:
        raise ValueError(f"checkpoint.compression: expected one of {', '.join(COMPRESSORS)}, got {compression!r}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    store = arrays.store
    slot_bytes, depth, block = pass_geometry(arrays)
    # A chunk plus the partial blocks around it fits a slot; the cap bounds the memory of a restore
    # (one chunk) and of a chunk assembled across spans, whatever the slots' size.
    cap = store.cfg.chunk_bytes if arrays.max_chunk_bytes is None else int(arrays.max_chunk_bytes)
    max_chunk_bytes = max(1, min(slot_bytes - 2 * block, cap))
    context = ts_context()
    carry = None  # assembles a zarr chunk that spans several store spans (allocated on first use)
    entries = []
    for spec in arrays.specs:
        regions = regions_of(store, spec)
        isz = spec.dtype.itemsize
        chunks = zarr_chunk_shape(spec.shape, isz, max_chunk_bytes)
        dst = ts.open({**zarr_spec(directory / spec.dirname),
                       "metadata": {"shape": list(spec.shape), "chunks": list(chunks), "order": "C",
                                    "dtype": zarr_dtype(spec.dtype),
                                    "compressor": COMPRESSORS[compression], "fill_value": None}},
                      create=True, context=context).result()
        grid = chunk_grid(spec.shape, chunks)
        pieces = _save_pieces(spec, grid, regions, block)
        crcs = []
        if pieces:
            segments = [[Segment(p[1], p[4], p[5] - p[4], read=True, write=False)] for p in pieces]
            with store.stream(segments, arrays.slot_class, depth=depth) as stream:
                for chunk in stream:
                    kill_point("checkpoint_chunk")
                    ci, _, lo, hi, read_lo, _, flat = pieces[chunk.index]
                    _, box, fs, fe = grid[ci]
                    data = chunk.arrays[0][lo - read_lo:hi - read_lo]
                    cs, ce = fs * isz, fe * isz
                    if flat == cs and flat + data.size == ce:
                        values = data  # the whole chunk is in this slot
                    else:
                        if carry is None:
                            carry = np.empty(max_chunk_bytes, np.uint8)
                        carry[flat - cs:flat - cs + data.size] = data
                        if flat + data.size < ce:
                            continue
                        values = carry[:ce - cs]
                    crcs.append(_native.crc32c(values))
                    # Written straight from the slot (no copy); the slot is reused after the commit.
                    dst[box].write(values.view(spec.dtype).reshape([b.stop - b.start for b in box]),
                                   can_reference_source_data_indefinitely=True).result()
        entries.append({"name": spec.name, "shape": list(spec.shape), "dtype": spec.dtype.name,
                        "chunks": list(chunks), "crc32c": crcs,
                        "spans": [[x.region, x.offset, x.nbytes] for x in spec.spans],
                        **({"piece": spec.piece.to_dict()} if spec.piece is not None else {})})
    _fsync_tree(directory)
    manifest = {"format": FORMAT, "compression": compression, "arrays": entries,
                **({"attributes": arrays.attributes} if arrays.attributes else {})}
    (directory / "_METADATA").write_text(json.dumps(orbax_tree_metadata([s.keys for s in arrays.specs])))
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1))
    return manifest


def _save_pieces(spec: ArraySpec, grid: list, regions: dict, block: int) -> list[tuple]:
    """The zarr chunks cut where spans end: ``(chunk index, region, lo, hi, read_lo, read_hi,
    flat)`` with ``[lo, hi)`` the bytes in the region and ``flat`` their byte offset in the array."""
    starts = [0]
    for span in spec.spans:
        starts.append(starts[-1] + span.nbytes)
    out, si, isz = [], 0, spec.dtype.itemsize
    for ci, (_, _, fs, fe) in enumerate(grid):
        a, b = fs * isz, fe * isz
        while a < b:
            while starts[si + 1] <= a:
                si += 1
            span = spec.spans[si]
            lo = span.offset + a - starts[si]
            hi = lo + min(b, starts[si + 1]) - a
            out.append((ci, span.region, lo, hi, *whole_blocks(lo, hi, block, regions[span.region].nbytes), a))
            a += hi - lo
    return out


def _fsync_tree(directory: Path) -> None:
    """fsync every file under ``directory`` (the kernel has been writing them back meanwhile)."""
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
