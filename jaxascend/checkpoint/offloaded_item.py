"""The ``offloaded`` item on disk: its files, its manifest, and its arrays read back chunk by chunk.

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

An array named ``"master/layers/mlp/w"`` is the leaf ``tree["master"]["layers"]["mlp"]["w"]``
of ``ocp.StandardCheckpointer().restore(".../offloaded")``, or
``ts.open({"driver": "zarr", "kvstore": {"driver": "file", "path": ".../offloaded/master.layers.mlp.w"}})``.
A zarr chunk is a run of whole rows (shape ``(1, .., 1, k, *trailing)``), i.e. one contiguous
byte range of the array. :class:`ChunkReader` reads a saved array's chunks one at a time (one
chunk of host memory) and checks each one's crc32c against the manifest before using it: a
garbled or truncated file is reported by its path instead of being trained on.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import tensorstore as ts

from jaxascend.native import extension as _native
from jaxascend.checkpoint.errors import CorruptCheckpointError
from jaxascend.checkpoint.zarr_layout import chunk_grid, numpy_dtype, zarr_spec

MANIFEST_FILE = "jaxascend_arrays.json"
PROCESSES_FILE = "jaxascend_processes.json"  # a data-parallel save: how many process<i>/ parts
FORMAT = "jaxascend-offloaded/1"


def ts_context() -> ts.Context:
    # No fsync per chunk file: a save flushes them all once the item is written.
    return ts.Context({"file_io_concurrency": {"limit": 4}, "data_copy_concurrency": {"limit": 2},
                       "file_io_sync": False})


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


def chunk_reader(directory: Path, entry: dict, context=None) -> "ChunkReader":
    """A reader of the saved array ``entry`` of the item part in ``directory``."""
    array_dir = directory / entry["name"].replace("/", ".")
    manifest_path = directory / MANIFEST_FILE
    src = _open_zarr(array_dir, entry, manifest_path, context)
    return ChunkReader(src, chunk_grid(tuple(entry["shape"]), entry["chunks"]), entry["crc32c"], array_dir,
                       manifest_path, numpy_dtype(entry["dtype"]).itemsize)


class ChunkReader:
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
