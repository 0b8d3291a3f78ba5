"""Restoring the ``offloaded`` checkpoint item into SSD regions, chunk by chunk, checked.

Restore reads the zarr chunks one at a time (one chunk of host memory,
:class:`~jaxascend.checkpoint.offloaded_item.ChunkReader`), checks each one's crc32c against the
manifest before using it, and writes whole SSD blocks back, merging blocks shared with
neighbouring data. Arrays described otherwise than the checkpoint's (names, shapes, dtypes, the
optimizer state's format) are refused before anything is written. A checkpoint saved by another
number of processes is re-partitioned as it streams (:mod:`jaxascend.checkpoint.repartition`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from jaxascend.checkpoint.array_specs import ArraySpec, SsdArrays, pass_geometry, regions_of, whole_blocks
from jaxascend.checkpoint.errors import IncompatibleCheckpointError
from jaxascend.checkpoint.offloaded_item import (chunk_reader, part_directory, read_manifest, saved_processes,
                                                 ts_context)
from jaxascend.checkpoint.repartition import SliceReader, check_tensors_match, saved_tensors
from jaxascend.optim import StateFormat
from jaxascend.ssd import Segment


def restore_arrays(directory: Path, arrays: SsdArrays) -> dict:
    """Streams every array of ``arrays`` from ``directory`` back into its store spans, one zarr
    chunk in memory at a time, each checked against its crc32c; returns the manifest. A
    checkpoint saved by another number of processes is re-partitioned as it streams: each array
    is this process's slice of its tensor (:class:`Piece`), read from the saved slices. On an
    error the regions hold a partial restore."""
    directory = Path(directory)
    saved = saved_processes(directory)
    index, count = arrays.process
    context = ts_context()
    if saved == count:  # each process reads back the arrays it wrote
        part = part_directory(directory, index, count)
        manifest = read_manifest(part)
        check_attributes_match(manifest, arrays.attributes, part)
        check_arrays_match(manifest, arrays.specs, part)
        entries = {e["name"]: e for e in manifest["arrays"]}

        def open_reader(spec):
            return chunk_reader(part, entries[spec.name], context)
    else:
        manifest = read_manifest(part_directory(directory, 0, saved))
        check_attributes_match(manifest, arrays.attributes, directory)
        tensors = saved_tensors(directory, context)
        check_tensors_match(tensors, arrays.specs, directory, saved, count)

        def open_reader(spec):
            for t in tensors.values():
                t.release()  # one array's chunks in memory at a time
            return SliceReader(tensors[spec.name], spec.piece, spec.dtype.itemsize)
    store = arrays.store
    slot_bytes, depth, block = pass_geometry(arrays)
    for spec in arrays.specs:
        regions = regions_of(store, spec)
        reader = open_reader(spec)
        for pieces in _restore_passes(spec, regions, block, slot_bytes):
            # A piece that covers only part of its first or last block reads it first (merge).
            segments = [[Segment(r, wl, wh - wl, read=(wl < lo or wh > hi), write=True)]
                        for r, lo, hi, wl, wh, _ in pieces]
            with store.stream(segments, arrays.slot_class, depth=depth) as stream:
                for chunk in stream:
                    _, lo, hi, write_lo, _, flat = pieces[chunk.index]
                    reader.copy_to(chunk.arrays[0][lo - write_lo:hi - write_lo], flat)
    return manifest


def _restore_passes(spec: ArraySpec, regions: dict, block: int, piece_bytes: int) -> list[list[tuple]]:
    """The spans cut at block-aligned ``piece_bytes`` boundaries: ``(region, lo, hi, write_lo,
    write_hi, flat)``, grouped into passes in which no two pieces touch the same block (a shared
    block is read, merged and written; the next piece must see that write)."""
    passes, current, touched, flat = [], [], set(), 0
    for span in spec.spans:
        lo, end = span.offset, span.offset + span.nbytes
        while lo < end:
            hi = min(end, lo // block * block + piece_bytes)
            write_lo, write_hi = whole_blocks(lo, hi, block, regions[span.region].nbytes)
            ends = {(span.region, write_lo // block), (span.region, (write_hi - 1) // block)}
            if ends & touched:
                passes.append(current)
                current, touched = [], set()
            current.append((span.region, lo, hi, write_lo, write_hi, flat))
            touched |= ends
            flat += hi - lo
            lo = hi
    return passes + [current] if current else passes


def check_attributes_match(manifest: dict, attributes: Optional[dict], where: Path) -> None:
    """Refuses to restore into arrays described otherwise than the checkpoint's (e.g. optimizer
    state of another dtype), naming both; a checkpoint without attributes holds float32 state."""
    saved = manifest.get("attributes") or {"state": StateFormat().describe()}
    for key, want in (attributes or {}).items():
        have = saved.get(key)
        if have is not None and have != want:
            if key == "state":
                raise IncompatibleCheckpointError(
                    f"checkpoint {where} holds {_describe_state(have)} optimizer state; this run keeps "
                    f"{_describe_state(want)} (optimizer.state_dtype, optimizer.master_dtype); resume with the "
                    "checkpoint's")
            raise IncompatibleCheckpointError(f"checkpoint {where}: {key} is {have!r}, this run has {want!r}")


def _describe_state(record: dict) -> str:
    dtype = record.get("state_dtype")
    text = f"{dtype} (blocks of {record['block']})" if dtype == "int8" and "block" in record else str(dtype)
    master = record.get("master_dtype", "float32")
    return text + (f" with a {master} master ({record.get('master_rounding')})" if master != "float32" else "")


def check_arrays_match(manifest: dict, specs: Sequence[ArraySpec], where: Path) -> None:
    """Refuses to restore arrays whose names, shapes or dtypes differ from the checkpoint's."""
    saved = {e["name"]: e for e in manifest["arrays"]}
    wanted = {s.name: s for s in specs}
    missing = sorted(set(wanted) - set(saved))
    extra = sorted(set(saved) - set(wanted))
    if missing or extra:
        raise IncompatibleCheckpointError(
            f"checkpoint {where} holds other optimizer-state arrays than this run: "
            f"not in the checkpoint: {missing[:5] or 'none'}; only in the checkpoint: {extra[:5] or 'none'}")
    for name, spec in wanted.items():
        e = saved[name]
        if tuple(e["shape"]) != spec.shape or e["dtype"] != spec.dtype.name:
            raise IncompatibleCheckpointError(
                f"checkpoint {where}: array {name!r} is {e['dtype']}{tuple(e['shape'])} in the checkpoint, "
                f"{spec.dtype.name}{spec.shape} in this run")
