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

A data-parallel job's checkpoint (``P`` processes, each owning a slice of every tensor, see
:mod:`jaxascend.offload.partition`) holds one such directory per process, each written by its
own process, and the number of them::

    offloaded/
      jaxascend_processes.json   {"processes": P}
      process0/ ... process<P-1>/   as above; an array is that process's [layers, s] slice

Restore re-partitions as it streams: a run of any number of processes reads its own slice of
every tensor from whichever saved slices hold it (:class:`SavedTensor`).

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

from jaxascend.native import extension as _native
from jaxascend.checkpoint.errors import CorruptCheckpointError, IncompatibleCheckpointError
from jaxascend.checkpoint.zarr_layout import (chunk_grid, numpy_dtype, orbax_tree_metadata, zarr_chunk_shape,
                                              zarr_dtype, zarr_spec)
from jaxascend.config import OffloadConfig
from jaxascend.kill_points import kill_point
from jaxascend.optim import StateFormat
from jaxascend.optim.state_codes import StateRecord
from jaxascend.ssd import Segment, SlotRequest

CHECKPOINT_SHAPE_CLASS = "checkpoint"
MANIFEST_FILE = "jaxascend_arrays.json"
PROCESSES_FILE = "jaxascend_processes.json"  # a data-parallel save: how many process<i>/ parts
FORMAT = "jaxascend-offloaded/1"
COMPRESSORS = {"none": None, "zstd": {"id": "zstd", "level": 1}}  # zstd level 1: Orbax's own choice


@dataclasses.dataclass(frozen=True)
class Span:
    """``nbytes`` at byte ``offset`` of store region ``region``: one contiguous piece of an array."""

    region: str
    offset: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Piece:
    """Where an array sits in a tensor split over ``count`` processes (see
    :mod:`jaxascend.offload.partition`): each of the tensor's layers (``shape[0]`` of a
    ``stacked`` tensor, else one) is split as a flat array of ``size`` elements, and process
    ``index`` holds elements ``[index * s, (index + 1) * s)`` with ``s = ceil(size / count)``,
    zero-padded; the array is ``[layers, s]`` (``[s]`` unstacked). ``count`` 1: the whole
    tensor, in its own shape."""

    index: int
    count: int
    shape: tuple  # the whole tensor's
    stacked: bool

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if not 0 <= self.index < self.count:
            raise ValueError(f"Piece: process {self.index} of {self.count}")

    @property
    def layers(self) -> int:
        return self.shape[0] if self.stacked else 1

    @property
    def size(self) -> int:
        return math.prod(self.shape[1:] if self.stacked else self.shape)

    @property
    def slice_size(self) -> int:
        return -(-self.size // self.count)

    def to_dict(self) -> dict:
        return {"index": self.index, "count": self.count, "shape": list(self.shape), "stacked": self.stacked}


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
    piece: Optional[Piece] = None  # its place in a tensor split over processes (None: not known)

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
        piece = self.piece
        if piece is not None and self.size != piece.layers * piece.slice_size:
            raise ValueError(f"ArraySpec.piece of {self.name!r}: {self.shape} is not process {piece.index} of "
                             f"{piece.count}'s slice of {piece.shape}")

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
    # Recorded in the manifest and checked on restore: {"state": StateFormat.describe()} (the
    # format of the optimizer's moments), compared key by key where both sides have the key.
    attributes: Optional[dict] = None

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

    @property
    def process(self) -> tuple[int, int]:
        """``(index, count)``: this process's place in the job the arrays are split over ((0, 1):
        one process, or no split recorded)."""
        places = {(s.piece.index, s.piece.count) for s in self.specs if s.piece is not None}
        if len(places) > 1:
            raise ValueError(f"SsdArrays: the arrays disagree on their process: {sorted(places)}")
        return places.pop() if places else (0, 1)

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


SCALE_ARRAYS = ("m_scale", "v_scale")  # int8 state: one float32 scale per block of each layer


def specs_for_offload_layout(layout, pieces: Optional[Sequence[Piece]] = None) -> list[ArraySpec]:
    """Array specs for :class:`jaxascend.offload.layout.OffloadLayout`'s state regions: per leaf
    ``"master/<leaf path>"`` (float32) and ``"m/..."``, ``"v/..."`` in the layout's state format
    (float32, bfloat16, or uint8 codes), each of the leaf's shape, gathered from every layer's
    chunk records ``master[n] | m[n] | v[n] (| pad | m_scale | v_scale)``; int8 state adds
    ``"m_scale/..."`` and ``"v_scale/..."``, float32 ``[layers, blocks per layer]`` (``[blocks]``
    for a leaf of one layer). A leaf whose compute weights are streamed from SSD adds
    ``"params/<leaf path>"`` in its dtype. ``pieces`` (one per leaf): where each leaf sits in the
    whole tensor (a data-parallel process's slices), so that a restore can re-partition; the
    scales of int8 state belong to their process's slices and record none."""
    specs = []
    chunk = layout.chunk_elements
    fmt = getattr(layout, "state", None) or StateFormat()
    stride = getattr(layout, "state_stride", 0) or 12 * chunk
    pieces = list(pieces) if pieces is not None else [None] * len(layout.leaves)
    for leaf, piece in zip(layout.leaves, pieces):
        per_layer = leaf.layer_elements
        spans: dict[str, list] = {name: [] for name in ("master", "m", "v") + SCALE_ARRAYS}
        for region in leaf.state_regions:
            for j, start in enumerate(range(0, per_layer, chunk)):
                record, base = StateRecord(fmt, min(chunk, per_layer - start)), j * stride
                moment_bytes = fmt.moment_itemsize * record.count
                spans["master"].append(Span(region, base, 4 * record.count))
                spans["m"].append(Span(region, base + record.m_offset, moment_bytes))
                spans["v"].append(Span(region, base + record.v_offset, moment_bytes))
                if record.blocks:
                    scales = base + record.scales_offset
                    spans["m_scale"].append(Span(region, scales, 4 * record.blocks))
                    spans["v_scale"].append(Span(region, scales + 4 * record.blocks, 4 * record.blocks))
        for name in ("master", "m", "v"):
            dtype = np.float32 if name == "master" else fmt.moment_dtype(name)
            specs.append(ArraySpec(f"{name}/{leaf.path}", leaf.shape, dtype, tuple(spans[name]), piece))
        if fmt.block:  # a chunk is whole blocks (but the last of a layer): the layer's blocks in order
            blocks = fmt.blocks(per_layer)
            shape = (leaf.layers, blocks) if leaf.layers > 1 else (blocks,)
            for name in SCALE_ARRAYS:
                specs.append(ArraySpec(f"{name}/{leaf.path}", shape, np.float32, tuple(spans[name])))
        if getattr(leaf, "param_regions", ()):  # offload.params: ssd: the compute weights live on SSD too
            size = leaf.dtype.itemsize
            param_spans = [Span(region, size * start, size * min(chunk, per_layer - start))
                           for region in leaf.param_regions for start in range(0, per_layer, chunk)]
            specs.append(ArraySpec(f"params/{leaf.path}", leaf.shape, leaf.dtype, tuple(param_spans), piece))
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
                        "spans": [[x.region, x.offset, x.nbytes] for x in spec.spans],
                        **({"piece": spec.piece.to_dict()} if spec.piece is not None else {})})
    _fsync_tree(directory)
    manifest = {"format": FORMAT, "compression": compression, "arrays": entries,
                **({"attributes": arrays.attributes} if arrays.attributes else {})}
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
                    f"{_describe_state(want)} (optimizer.state_dtype); resume with the checkpoint's")
            raise IncompatibleCheckpointError(f"checkpoint {where}: {key} is {have!r}, this run has {want!r}")


def _describe_state(record: dict) -> str:
    dtype = record.get("state_dtype")
    return f"{dtype} (blocks of {record['block']})" if dtype == "int8" and "block" in record else str(dtype)


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
        are skipped unread, so a reader can start anywhere (one layer of a stacked array); reading
        before the current chunk starts over from the first."""
        if self.index >= 0 and at < self.grid[self.index][2] * self.itemsize:
            self.index, self.data = -1, np.zeros(0, np.uint8)
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


def saved_processes(directory: Path) -> int:
    """How many processes saved the ``offloaded`` item in ``directory`` (1: the plain layout)."""
    path = Path(directory) / PROCESSES_FILE
    if not path.exists():
        return 1
    try:
        record = json.loads(path.read_text())
        count = record["processes"]
        if record.get("format") != FORMAT or not isinstance(count, int) or count < 2:
            raise ValueError(f"expected format {FORMAT!r} and processes >= 2, got {record}")
    except (ValueError, KeyError, TypeError) as err:
        raise CorruptCheckpointError(f"checkpoint file {path} is corrupt ({err})") from None
    return count


def part_directory(directory: Path, index: int, count: int) -> Path:
    """Where process ``index`` of ``count`` keeps its arrays in an ``offloaded`` item."""
    return Path(directory) if count == 1 else Path(directory) / f"process{index}"


def _open_zarr(array_dir: Path, entry: dict, manifest_path: Path, context=None):
    """The zarr array of a manifest entry, checked against it."""
    try:
        src = ts.open(zarr_spec(array_dir), open=True, context=context).result()
    except ValueError as err:
        raise CorruptCheckpointError(f"checkpoint array {array_dir} cannot be opened ({err})") from None
    layout = list(src.chunk_layout.read_chunk.shape or ())
    if (list(src.shape) != list(entry["shape"]) or numpy_dtype(src.dtype.name).name != entry["dtype"]
            or layout != entry["chunks"]):
        raise CorruptCheckpointError(
            f"checkpoint file {array_dir / '.zarray'} says {src.dtype.name}{tuple(src.shape)} in chunks "
            f"{layout}, {manifest_path} says {entry['dtype']}{tuple(entry['shape'])} in chunks {entry['chunks']}")
    return src


def _chunk_reader(directory: Path, entry: dict, context=None) -> "_ChunkReader":
    """A reader of the saved array ``entry`` of the item part in ``directory``."""
    array_dir = directory / entry["name"].replace("/", ".")
    manifest_path = directory / MANIFEST_FILE
    src = _open_zarr(array_dir, entry, manifest_path, context)
    return _ChunkReader(src, chunk_grid(tuple(entry["shape"]), entry["chunks"]), entry["crc32c"], array_dir,
                        manifest_path, numpy_dtype(entry["dtype"]).itemsize)


class SavedTensor:
    """One tensor of a saved ``offloaded`` item as a whole, whatever the number of processes that
    saved it: :meth:`copy` reads a run of one layer's elements from whichever slices hold them,
    one zarr chunk in memory at a time (each checked against its crc32c)."""

    def __init__(self, name: str, parts: list[tuple[Path, dict]], context=None):
        self.name, self.parts, self.context = name, parts, context
        entry = parts[0][1]
        self.dtype = numpy_dtype(entry["dtype"])
        self.count = len(parts)
        piece = entry.get("piece")
        self.shape = tuple(piece["shape"]) if piece else tuple(entry["shape"])
        self.stacked = bool(piece["stacked"]) if piece else None  # unknown for a plain save
        self._readers: list[Optional[_ChunkReader]] = [None] * self.count

    def slice_size(self, stacked: bool) -> int:
        size = math.prod(self.shape[1:] if stacked else self.shape)
        return -(-size // self.count)

    def copy(self, out: np.ndarray, layer: Optional[int], start: int) -> None:
        """Fills ``out`` (uint8, whole elements) with elements ``start, start + 1, ...`` of ``layer``
        (None: the tensor has no layers) as a flat array."""
        isz, n, pos = self.dtype.itemsize, out.size // self.dtype.itemsize, 0
        if self.count == 1:  # one array of the tensor's shape
            row = math.prod(self.shape[1:]) if layer is not None else 0
            self._reader(0).copy_to(out, ((layer or 0) * row + start) * isz)
            return
        s = self.slice_size(layer is not None)
        while pos < n:
            p, offset = divmod(start + pos, s)
            take = min(n - pos, s - offset)
            self._reader(p).copy_to(out[pos * isz:(pos + take) * isz], ((layer or 0) * s + offset) * isz)
            pos += take

    def release(self) -> None:
        """Drops the chunks the readers hold (the next :meth:`copy` opens them again)."""
        self._readers = [None] * self.count

    def _reader(self, p: int) -> "_ChunkReader":
        if self._readers[p] is None:
            directory, entry = self.parts[p]
            self._readers[p] = _chunk_reader(directory, entry, self.context)
        return self._readers[p]


def saved_tensors(directory: Path, context=None) -> dict[str, SavedTensor]:
    """Every array of the ``offloaded`` item in ``directory`` as a :class:`SavedTensor`, by name."""
    directory = Path(directory)
    count = saved_processes(directory)
    parts = [part_directory(directory, p, count) for p in range(count)]
    manifests = [read_manifest(d) for d in parts]
    names = [e["name"] for e in manifests[0]["arrays"]]
    by_name: dict[str, list] = {name: [] for name in names}
    for p, (d, manifest) in enumerate(zip(parts, manifests)):
        entries = {e["name"]: e for e in manifest["arrays"]}
        if sorted(entries) != sorted(names):
            raise CorruptCheckpointError(f"checkpoint {d} holds other arrays than {parts[0]}")
        for name in names:
            piece = entries[name].get("piece")
            if count > 1 and (not piece or piece["index"] != p or piece["count"] != count):
                raise CorruptCheckpointError(f"checkpoint file {d / MANIFEST_FILE}: array {name!r} is not process "
                                             f"{p} of {count}'s slice (it records {piece})")
            by_name[name].append((d, entries[name]))
    return {name: SavedTensor(name, by_name[name], context) for name in names}


def _check_tensors_match(tensors: dict[str, SavedTensor], specs: Sequence[ArraySpec], where: Path, saved: int,
                         count: int) -> None:
    """Refuses to re-partition arrays whose names, whole shapes or dtypes differ from the checkpoint's."""
    no_piece = [s.name for s in specs if s.piece is None]
    if any(name.split("/")[0] in SCALE_ARRAYS for name in no_piece):
        raise IncompatibleCheckpointError(f"checkpoint {where} was saved by {saved} process(es), this run has "
                                          f"{count}: int8 optimizer state is coded in blocks of each process's "
                                          f"slices and cannot be re-split; resume with {saved} process(es)")
    if no_piece:
        raise IncompatibleCheckpointError(f"checkpoint {where} was saved by {saved} process(es), this run has "
                                          f"{count}, and array {no_piece[0]!r} records no partition to re-split")
    missing = sorted({s.name for s in specs} - set(tensors))
    extra = sorted(set(tensors) - {s.name for s in specs})
    if missing or extra:
        raise IncompatibleCheckpointError(
            f"checkpoint {where} holds other optimizer-state arrays than this run: "
            f"not in the checkpoint: {missing[:5] or 'none'}; only in the checkpoint: {extra[:5] or 'none'}")
    for spec in specs:
        t = tensors[spec.name]
        stacked_differs = t.stacked is not None and t.stacked != spec.piece.stacked
        if t.shape != spec.piece.shape or t.dtype != spec.dtype or stacked_differs:
            raise IncompatibleCheckpointError(
                f"checkpoint {where}: array {spec.name!r} is {t.dtype.name}{t.shape} in the checkpoint, "
                f"{spec.dtype.name}{spec.piece.shape} in this run")


class _SliceReader:
    """``copy_to(out, flat_byte)`` over this process's slice array of a tensor (``piece``),
    read from a :class:`SavedTensor` saved by another number of processes; the padding past the
    tensor's end reads as zeros."""

    def __init__(self, tensor: SavedTensor, piece: Piece, itemsize: int):
        self.tensor, self.piece, self.itemsize = tensor, piece, itemsize
        self.s = piece.slice_size

    def copy_to(self, out: np.ndarray, flat_byte: int) -> None:
        isz, piece = self.itemsize, self.piece
        first, n, pos = flat_byte // isz, out.size // isz, 0
        while pos < n:
            layer, k = divmod(first + pos, self.s)
            take = min(n - pos, self.s - k)
            g = piece.index * self.s + k  # the element of the whole layer
            inside = max(0, min(take, piece.size - g))
            view = out[pos * isz:(pos + take) * isz]
            if inside:
                self.tensor.copy(view[:inside * isz], layer if piece.stacked else None, g)
            view[inside * isz:] = 0
            pos += take


def restore_arrays(directory: Path, arrays: SsdArrays) -> dict:
    """Streams every array of ``arrays`` from ``directory`` back into its store spans, one zarr
    chunk in memory at a time, each checked against its crc32c; returns the manifest. A
    checkpoint saved by another number of processes is re-partitioned as it streams: each array
    is this process's slice of its tensor (:class:`Piece`), read from the saved slices. On an
    error the regions hold a partial restore."""
    directory = Path(directory)
    saved = saved_processes(directory)
    index, count = arrays.process
    context = _ts_context()
    if saved == count:  # each process reads back the arrays it wrote
        part = part_directory(directory, index, count)
        manifest = read_manifest(part)
        check_attributes_match(manifest, arrays.attributes, part)
        check_arrays_match(manifest, arrays.specs, part)
        entries = {e["name"]: e for e in manifest["arrays"]}

        def open_reader(spec):
            return _chunk_reader(part, entries[spec.name], context)
    else:
        manifest = read_manifest(part_directory(directory, 0, saved))
        check_attributes_match(manifest, arrays.attributes, directory)
        tensors = saved_tensors(directory, context)
        _check_tensors_match(tensors, arrays.specs, directory, saved, count)

        def open_reader(spec):
            for t in tensors.values():
                t.release()  # one array's chunks in memory at a time
            return _SliceReader(tensors[spec.name], spec.piece, spec.dtype.itemsize)
    store = arrays.store
    slot_bytes, depth, block = _pass_geometry(arrays)
    for spec in arrays.specs:
        regions = _regions_of(store, spec)
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


# ----------------------------------------------------------------------------- Orbax handler

class SsdArraysHandler(ocp.CheckpointHandler):
    """Orbax ``CheckpointHandler`` for the ``offloaded`` item (synchronous: it streams through
    the arena while the caller waits; the training loop must not touch the store meanwhile)."""

    def save(self, directory, args: "SsdArraysSave") -> None:
        # Every process of a job saves its own slices; Orbax finalises the step once all have.
        save_item(Path(str(directory)), args.arrays, args.compression)

    def restore(self, directory, args: "SsdArraysRestore") -> dict:
        return restore_arrays(Path(str(directory)), args.arrays)

    def metadata(self, directory) -> dict:
        directory = Path(str(directory))
        return read_manifest(part_directory(directory, 0, saved_processes(directory)))


@ocp.args.register_with_handler(SsdArraysHandler, for_save=True)
@dataclasses.dataclass
class SsdArraysSave(ocp.args.CheckpointArgs):
    arrays: SsdArrays
    compression: str = "none"


@ocp.args.register_with_handler(SsdArraysHandler, for_restore=True)
@dataclasses.dataclass
class SsdArraysRestore(ocp.args.CheckpointArgs):
    arrays: SsdArrays
