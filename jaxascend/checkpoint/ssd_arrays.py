"""Streaming SSD-resident optimizer state into an Orbax checkpoint item, and back.

The fp32 master weights and Adam moments live in :class:`~jaxascend.ssd.store.SsdStore`
regions and are far larger than RAM, so they are never assembled on the host: every array is
copied chunk by chunk between its region and a tensorstore zarr array, through the arena slots of
one shape class (``"checkpoint"`` by default; :func:`checkpoint_arena_requests` plans them, or
pass the class of slots that are idle while saving). Reads from the SSD run ahead of the zarr
writes (:meth:`SsdStore.stream`); tensorstore writes each chunk file straight from its slot
(``can_reference_source_data_indefinitely``), so a save adds next to nothing to host memory. Chunk
files go to the page cache and are fsync'ed together at the end of the item (one fsync per file
while writing halves the rate here), before Orbax renames the step directory into place.

Layout of the item directory (the ``offloaded`` item of a step), chosen so that plain Orbax and
plain tensorstore read it without jaxascend -- it is exactly what Orbax's
``StandardCheckpointHandler(use_ocdbt=False)`` writes for a pytree of numpy arrays::

    offloaded/
      _METADATA                  Orbax tree metadata: one np.ndarray leaf per array
      jaxascend_arrays.json      which region/offset each array came from, chunk crc32c values
      master.layers.mlp.w/       zarr v2 array ("/"-separated name -> "."-joined directory)
        .zarray                  shape, dtype, chunks, compressor (none or zstd)
        0.0  1.0  ...            one file per chunk, C order

An array named ``"master/layers/mlp/w"`` is the leaf ``tree["master"]["layers"]["mlp"]["w"]``
of ``ocp.StandardCheckpointer().restore(".../offloaded")``, or
``ts.open({"driver": "zarr", "kvstore": {"driver": "file", "path": ".../offloaded/master.layers.mlp.w"}})``.
A zarr chunk is a run of whole rows (shape ``(1, .., 1, k, *trailing)``), i.e. one contiguous
byte range of the array; chunks hold at most ``offload.chunk_bytes`` and at most one slot minus
two SSD blocks, because the SSD is read in whole blocks around each chunk (a chunk that crosses a
span boundary is assembled in one chunk-sized buffer). Restore reads the zarr chunks one at a
time (one chunk of host memory), checks each one's crc32c against the manifest before using it --
a garbled or truncated file is reported by its path instead of being trained on -- and writes
whole SSD blocks back, merging blocks shared with neighbouring data.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

from jaxascend import _native
from jaxascend.checkpoint.errors import CorruptCheckpointError, IncompatibleCheckpointError
from jaxascend.checkpoint.zarr_layout import (chunk_grid, numpy_dtype, orbax_tree_metadata, zarr_chunk_shape,
                                              zarr_dtype, zarr_spec)
from jaxascend.config import OffloadConfig
from jaxascend.kill_points import kill_point
from jaxascend.ssd import Segment, SlotRequest

CHECKPOINT_SHAPE_CLASS = "checkpoint"
MANIFEST_FILE = "jaxascend_arrays.json"
FORMAT = "jaxascend-offloaded/1"
COMPRESSORS = {"none": None, "zstd": {"id": "zstd", "level": 1}}  # zstd level 1: Orbax's own choice


@dataclasses.dataclass(frozen=True)
class Span:
    """``nbytes`` at byte ``offset`` of store region ``region``: one contiguous piece of an array."""

    region: str
    offset: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class ArraySpec:
    """One checkpointed array of ``shape``/``dtype`` whose C-order bytes are the concatenation of
    ``spans`` (contiguous byte ranges of store regions, e.g. one per layer and chunk).

    ``name`` is a ``"/"``-separated path (``"master/layers/mlp/w"``): the keys of the leaf in the
    restored pytree; the zarr directory is the keys joined with ``"."``, as Orbax names leaves.
    """

    name: str
    shape: tuple
    dtype: Any
    spans: tuple

    def __post_init__(self):
        keys = tuple(self.name.split("/")) if isinstance(self.name, str) else ()
        if not keys or not all(keys):
            raise ValueError(f"ArraySpec.name: expected a '/'-separated path like 'master/w', got {self.name!r}")
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "dtype", numpy_dtype(self.dtype))
        spans = tuple(Span(str(r), int(o), int(n)) for r, o, n in
                      (dataclasses.astuple(x) if isinstance(x, Span) else x for x in self.spans))
        object.__setattr__(self, "spans", spans)
        if any(d < 0 for d in self.shape):
            raise ValueError(f"ArraySpec.shape of {self.name!r}: dimensions must be >= 0, got {self.shape}")
        if any(x.offset < 0 or x.nbytes < 0 for x in spans):
            raise ValueError(f"ArraySpec.spans of {self.name!r}: offsets and sizes must be >= 0, got {spans}")
        if any(x.nbytes % self.dtype.itemsize for x in spans):
            raise ValueError(f"ArraySpec.spans of {self.name!r}: every span must hold whole {self.dtype} elements")
        if sum(x.nbytes for x in spans) != self.nbytes:
            raise ValueError(f"ArraySpec.spans of {self.name!r} hold {sum(x.nbytes for x in spans)} bytes; "
                             f"{self.dtype}{self.shape} is {self.nbytes} bytes")

    @classmethod
    def contiguous(cls, name: str, region: str, offset: int, shape, dtype) -> "ArraySpec":
        """An array stored as one byte range: ``shape``/``dtype`` at ``offset`` of ``region``."""
        dtype = numpy_dtype(dtype)
        return cls(name, shape, dtype, (Span(region, offset, math.prod(shape) * dtype.itemsize),))

    @property
    def keys(self) -> tuple:
        return tuple(self.name.split("/"))

    @property
    def dirname(self) -> str:
        return ".".join(self.keys)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class SsdArrays:
    """The store regions a checkpoint streams: ``specs`` in ``store``, staged in ``slot_class`` slots.

    ``specs``: :class:`ArraySpec` records, or ``(name, region, offset, shape, dtype)`` tuples for
    contiguous arrays. ``depth`` (default ``offload.stream_depth``, at most the number of such
    slots) is how many slots one pass uses: one being copied, the others read ahead/written behind.
    """

    store: Any  # jaxascend.ssd.store.SsdStore
    specs: tuple
    slot_class: str = CHECKPOINT_SHAPE_CLASS
    depth: Optional[int] = None
    max_chunk_bytes: Optional[int] = None  # zarr chunk size cap; default offload.chunk_bytes

    def __post_init__(self):
        specs = tuple(s if isinstance(s, ArraySpec) else ArraySpec.contiguous(*s) for s in self.specs)
        object.__setattr__(self, "specs", specs)
        seen: dict[str, str] = {}
        for s in specs:
            if s.dirname in seen:
                raise ValueError(f"SsdArrays: arrays {seen[s.dirname]!r} and {s.name!r} map to the same "
                                 f"directory {s.dirname!r}")
            seen[s.dirname] = s.name
        names = {s.keys for s in specs}
        for s in specs:  # a leaf cannot also be a node of the tree ("m" and "m/w")
            for i in range(1, len(s.keys)):
                if s.keys[:i] in names:
                    raise ValueError(f"SsdArrays: array {'/'.join(s.keys[:i])!r} is a prefix of {s.name!r}")

    @classmethod
    def of(cls, value) -> "SsdArrays":
        """Accepts an :class:`SsdArrays`, ``(store, arena, specs)`` or ``(store, specs)``."""
        if isinstance(value, SsdArrays):
            return value
        if isinstance(value, tuple) and len(value) in (2, 3):
            return cls(value[0], tuple(value[-1]))
        raise TypeError(f"ssd: expected SsdArrays or (store, arena, specs), got {type(value).__name__}")


def checkpoint_arena_requests(cfg: OffloadConfig, chunk_bytes: Optional[int] = None) -> list[SlotRequest]:
    """The arena slots a checkpoint pass uses: ``stream_depth`` slots of ``chunk_bytes``
    (default ``offload.chunk_bytes``) plus two SSD blocks, of class ``"checkpoint"``."""
    chunk = int(chunk_bytes if chunk_bytes is not None else cfg.chunk_bytes)
    return [SlotRequest(CHECKPOINT_SHAPE_CLASS, chunk + 2 * cfg.block_bytes, cfg.stream_depth)]


def specs_for_offload_layout(layout, tensors: Sequence[str] = ("master", "m", "v")) -> list[ArraySpec]:
    """Array specs for :class:`jaxascend.offload.layout.OffloadLayout`'s state regions: per leaf
    and tensor an fp32 array ``"<tensor>/<leaf path>"`` of the leaf's shape, gathered from the
    chunk-interleaved ``master[n] | m[n] | v[n]`` pieces of every layer's state region; a leaf
    whose compute weights are streamed from SSD adds ``"params/<leaf path>"`` in its dtype."""
    specs = []
    chunk = layout.chunk_elements
    for leaf in layout.leaves:
        per_layer = leaf.layer_elements
        for k, tensor in enumerate(tensors):
            spans = []
            for region in leaf.state_regions:
                for start in range(0, per_layer, chunk):
                    n = min(chunk, per_layer - start)
                    spans.append(Span(region, 4 * len(tensors) * start + 4 * k * n, 4 * n))
            specs.append(ArraySpec(f"{tensor}/{leaf.path}", leaf.shape, np.float32, tuple(spans)))
        if getattr(leaf, "param_regions", ()):  # offload.params: ssd: the compute weights live on SSD too
            size = leaf.dtype.itemsize
            spans = [Span(region, size * start, size * min(chunk, per_layer - start))
                     for region in leaf.param_regions for start in range(0, per_layer, chunk)]
            specs.append(ArraySpec(f"params/{leaf.path}", leaf.shape, leaf.dtype, tuple(spans)))
    return specs


def _ts_context() -> ts.Context:
    # No fsync per chunk file: _fsync_tree() flushes them all once the item is written.
    return ts.Context({"file_io_concurrency": {"limit": 4}, "data_copy_concurrency": {"limit": 2},
                       "file_io_sync": False})


def _fsync_tree(directory: Path) -> None:
    """fsync every file under ``directory`` (the kernel has been writing them back meanwhile)."""
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


# ----------------------------------------------------------------------------- passes

def _pass_geometry(arrays: SsdArrays) -> tuple[int, int, int]:
    """(slot bytes, depth, block bytes) for streaming ``arrays``; errors name what is missing."""
    store = arrays.store
    slots = store.arena.slots(arrays.slot_class)
    if len(slots) < 2:
        raise ValueError(f"checkpoint: the arena has {len(slots)} slot(s) of class {arrays.slot_class!r}, a "
                         f"checkpoint pass needs at least 2; add checkpoint_arena_requests(cfg.offload) to the "
                         f"arena plan or pass the class of idle slots as SsdArrays.slot_class")
    block = store.cfg.block_bytes
    slot_bytes = min(s.nbytes for s in slots) // block * block
    if slot_bytes < 3 * block:
        raise ValueError(f"checkpoint: slots of class {arrays.slot_class!r} hold {slot_bytes} bytes; they must "
                         f"hold at least 3 SSD blocks ({3 * block} bytes)")
    depth = store.cfg.stream_depth if arrays.depth is None else int(arrays.depth)
    return slot_bytes, max(2, min(depth, len(slots))), block


def _regions_of(store, spec: ArraySpec) -> dict:
    """The store regions ``spec`` reads, checking that every span fits its region."""
    regions = {}
    for span in spec.spans:
        region = regions.setdefault(span.region, store.region(span.region))
        if span.offset + span.nbytes > region.nbytes:
            raise ValueError(f"checkpoint array {spec.name!r}: bytes [{span.offset}, {span.offset + span.nbytes}) "
                             f"do not fit region {region.name!r} ({region.nbytes} bytes)")
    return regions


def validate_arrays(arrays: SsdArrays) -> None:
    """Checks, without any I/O, that ``arrays`` can be streamed: enough slots of its class, and
    every span inside its region (``ValueError`` naming the class or the array)."""
    _pass_geometry(arrays)
    for spec in arrays.specs:
        _regions_of(arrays.store, spec)


def _whole_blocks(lo: int, hi: int, block: int, region_bytes: int) -> tuple[int, int]:
    """The smallest block-aligned byte range around ``[lo, hi)`` (ending at most at the region's end)."""
    return lo // block * block, min(-(-hi // block) * block, region_bytes)


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
            out.append((ci, span.region, lo, hi, *_whole_blocks(lo, hi, block, regions[span.region].nbytes), a))
            a += hi - lo
    return out


def save_arrays(directory: Path, arrays: SsdArrays, compression: str = "none") -> dict:
    """Streams every array of ``arrays`` into ``directory`` (layout in the module docstring);
    returns the manifest it wrote."""
    if compression not in COMPRESSORS:
        raise ValueError(f"checkpoint.compression: expected one of {', '.join(COMPRESSORS)}, got {compression!r}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    store = arrays.store
    slot_bytes, depth, block = _pass_geometry(arrays)
    # A chunk plus the partial blocks around it fits a slot; the cap bounds the memory of a restore
    # (one chunk) and of a chunk assembled across spans, whatever the slots' size.
    cap = store.cfg.chunk_bytes if arrays.max_chunk_bytes is None else int(arrays.max_chunk_bytes)
    max_chunk_bytes = max(1, min(slot_bytes - 2 * block, cap))
    context = _ts_context()
    carry = None  # assembles a zarr chunk that spans several store spans (allocated on first use)
    entries = []
    for spec in arrays.specs:
        regions = _regions_of(store, spec)
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
                        "spans": [[x.region, x.offset, x.nbytes] for x in spec.spans]})
    _fsync_tree(directory)
    manifest = {"format": FORMAT, "compression": compression, "arrays": entries}
    (directory / "_METADATA").write_text(json.dumps(orbax_tree_metadata([s.keys for s in arrays.specs])))
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1))
    return manifest


def read_manifest(directory: Path) -> dict:
    """The manifest of an ``offloaded`` item; :class:`CorruptCheckpointError` naming the file if unreadable."""
    path = Path(directory) / MANIFEST_FILE
    try:
        manifest = json.loads(path.read_text())
        if manifest.get("format") != FORMAT:
            raise ValueError(f"format is {manifest.get('format')!r}, expected {FORMAT!r}")
        for e in manifest["arrays"]:
            e["shape"], e["chunks"], e["crc32c"] = list(e["shape"]), list(e["chunks"]), list(e["crc32c"])
    except FileNotFoundError:
        raise CorruptCheckpointError(f"checkpoint file {path} is missing") from None
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise CorruptCheckpointError(f"checkpoint file {path} is corrupt ({err})") from None
    return manifest


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


class _ChunkReader:
    """An array's zarr chunks read one at a time in flat order, each checked against its crc32c
    before any of its bytes are used: every chunk file is read once, one chunk in memory."""

    def __init__(self, src, grid: list, crcs: list, array_dir: Path, manifest_path: Path, itemsize: int):
        if len(crcs) != len(grid):
            raise CorruptCheckpointError(f"checkpoint file {manifest_path} lists {len(crcs)} checksums for "
                                         f"{array_dir}, which has {len(grid)} chunks")
        self.src, self.grid, self.crcs, self.dir, self.manifest = src, grid, crcs, array_dir, manifest_path
        self.itemsize = itemsize
        self.index, self.data = -1, np.zeros(0, np.uint8)

    def copy_to(self, out: np.ndarray, flat_byte: int) -> None:
        """Fills ``out`` (uint8) with the array's bytes from byte ``flat_byte`` on."""
        pos = 0
        while pos < out.size:
            at = flat_byte + pos
            start = self._load(at)
            take = min(out.size - pos, start + self.data.size - at)
            out[pos:pos + take] = self.data[at - start:at - start + take]
            pos += take

    def _load(self, at: int) -> int:
        """Makes the chunk holding byte ``at`` current; returns its first byte. Chunks before it
        are skipped unread, so a reader can start anywhere (one layer of a stacked array)."""
        while self.index < 0 or self.grid[self.index][3] * self.itemsize <= at:
            self.index += 1
            idx, box, _, stop = self.grid[self.index]
            if stop * self.itemsize <= at:
                continue
            path = self.dir / (".".join(str(i) for i in idx) or "0")
            self.data = np.zeros(0, np.uint8)  # drop the previous chunk before reading the next
            try:
                values = self.src[box].read().result()
            except ValueError as err:
                raise CorruptCheckpointError(f"checkpoint file {path} cannot be read ({err})") from None
            self.data = np.ascontiguousarray(values).reshape(-1).view(np.uint8)
            crc = _native.crc32c(self.data)
            if crc != self.crcs[self.index]:
                raise CorruptCheckpointError(f"checkpoint file {path} is corrupt: its data has crc32c {crc:#010x}, "
                                             f"{self.manifest} recorded {self.crcs[self.index]:#010x}")
        return self.grid[self.index][2] * self.itemsize


def _restore_passes(spec: ArraySpec, regions: dict, block: int, piece_bytes: int) -> list[list[tuple]]:
    """The spans cut at block-aligned ``piece_bytes`` boundaries: ``(region, lo, hi, write_lo,
    write_hi, flat)``, grouped into passes in which no two pieces touch the same block (a shared
    block is read, merged and written; the next piece must see that write)."""
    passes, current, touched, flat = [], [], set(), 0
    for span in spec.spans:
        lo, end = span.offset, span.offset + span.nbytes
        while lo < end:
            hi = min(end, lo // block * block + piece_bytes)
            write_lo, write_hi = _whole_blocks(lo, hi, block, regions[span.region].nbytes)
            ends = {(span.region, write_lo // block), (span.region, (write_hi - 1) // block)}
            if ends & touched:
                passes.append(current)
                current, touched = [], set()
            current.append((span.region, lo, hi, write_lo, write_hi, flat))
            touched |= ends
            flat += hi - lo
            lo = hi
    return passes + [current] if current else passes


def restore_arrays(directory: Path, arrays: SsdArrays) -> dict:
    """Streams every array of ``arrays`` from ``directory`` back into its store spans, one zarr
    chunk in memory at a time, each checked against its crc32c; returns the manifest. On an
    error the regions hold a partial restore."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    check_arrays_match(manifest, arrays.specs, directory)
    saved = {e["name"]: e for e in manifest["arrays"]}
    store = arrays.store
    slot_bytes, depth, block = _pass_geometry(arrays)
    context = _ts_context()
    for spec in arrays.specs:
        regions = _regions_of(store, spec)
        entry, array_dir = saved[spec.name], directory / spec.dirname
        try:
            src = ts.open(zarr_spec(array_dir), open=True, context=context).result()
        except ValueError as err:
            raise CorruptCheckpointError(f"checkpoint array {array_dir} cannot be opened ({err})") from None
        layout = list(src.chunk_layout.read_chunk.shape or ())
        dtype = numpy_dtype(src.dtype.name)
        if list(src.shape) != list(spec.shape) or dtype != spec.dtype or layout != entry["chunks"]:
            raise CorruptCheckpointError(
                f"checkpoint file {array_dir / '.zarray'} says {src.dtype.name}{tuple(src.shape)} in chunks "
                f"{layout}, {directory / MANIFEST_FILE} says {entry['dtype']}{tuple(entry['shape'])} in chunks "
                f"{entry['chunks']}")
        reader = _ChunkReader(src, chunk_grid(spec.shape, entry["chunks"]), entry["crc32c"], array_dir,
                              directory / MANIFEST_FILE, spec.dtype.itemsize)
        for pieces in _restore_passes(spec, regions, block, slot_bytes):
            # A piece that covers only part of its first or last block reads it first (merge).
            segments = [[Segment(r, wl, wh - wl, read=(wl < lo or wh > hi), write=True)]
                        for r, lo, hi, wl, wh, _ in pieces]
            with store.stream(segments, arrays.slot_class, depth=depth) as stream:
                for chunk in stream:
                    _, lo, hi, write_lo, _, flat = pieces[chunk.index]
                    reader.copy_to(chunk.arrays[0][lo - write_lo:hi - write_lo], flat)
    return manifest


# ----------------------------------------------------------------------------- Orbax handler

class SsdArraysHandler(ocp.CheckpointHandler):
    """Orbax ``CheckpointHandler`` for the ``offloaded`` item (synchronous: it streams through
    the arena while the caller waits; the training loop must not touch the store meanwhile)."""

    def save(self, directory, args: "SsdArraysSave") -> None:
        save_arrays(Path(str(directory)), args.arrays, args.compression)

    def restore(self, directory, args: "SsdArraysRestore") -> dict:
        return restore_arrays(Path(str(directory)), args.arrays)

    def metadata(self, directory) -> dict:
        return read_manifest(Path(str(directory)))


@ocp.args.register_with_handler(SsdArraysHandler, for_save=True)
@dataclasses.dataclass
class SsdArraysSave(ocp.args.CheckpointArgs):
    arrays: SsdArrays
    compression: str = "none"


@ocp.args.register_with_handler(SsdArraysHandler, for_restore=True)
@dataclasses.dataclass
class SsdArraysRestore(ocp.args.CheckpointArgs):
    arrays: SsdArrays
