"""Lean safetensors reading and writing: one tensor at a time, never a whole file in memory.

The format (https://huggingface.co/docs/safetensors) is an 8-byte little-endian header length,
a JSON header ``{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}`` and
the raw tensor bytes. We parse the header ourselves so that

* every tensor is read with ``pread`` straight into a buffer the caller owns (no mmap: mapped
  pages would count towards the loader's resident memory), and
* a truncated or malformed file is caught before any data is read, with an error naming it.

    with SafetensorsFile("model.safetensors") as f:
        entry = f.entries["model.norm.weight"]
        out = np.empty(entry.shape, entry.numpy_dtype)
        f.read_into(entry, out)

:func:`write_safetensors` streams tensors into a file whose header is computed up front;
:func:`write_sharded` splits a tensor list over several files plus the
``model.safetensors.index.json`` that ``transformers`` reads.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import ml_dtypes
import numpy as np

from jaxascend.formats import DTYPE_NAMES  # our dtype names -> safetensors names (no JAX: the CLIs' --help)
from jaxascend.hf.errors import CorruptFileError, HFCheckpointError, format_shape, one_line

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# safetensors dtype names -> numpy dtypes (bfloat16 and 8-bit floats come from ml_dtypes).
DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8), "U64": np.dtype(np.uint64), "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
# The dtypes a model weight may be stored in (8-bit floats need scales we do not read).
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")

_MAX_HEADER_BYTES = 100 * 2**20  # the reference implementation's limit
_ALIGN = 8  # header padded with spaces so the data starts 8-byte aligned, as safetensors does
_MAX_IO = 1 << 30  # bytes per pread/write call (Linux caps single calls just under 2 GiB)


def dominant_dtype(entries) -> str:
    """The dtype (``float32``/``float16``/``bfloat16``) that holds most of the float bytes among
    ``entries`` (:class:`TensorEntry` values): what "the checkpoint's dtype" means for export."""
    names = {v: k for k, v in DTYPE_NAMES.items()}
    totals: dict[str, int] = {}
    for e in entries:
        if e.dtype in names:
            totals[names[e.dtype]] = totals.get(names[e.dtype], 0) + e.nbytes
    return max(totals, key=totals.get) if totals else "float32"


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of one file: where its bytes are (absolute offsets) and what they hold."""

    name: str
    dtype: str  # safetensors name, e.g. "BF16"
    shape: tuple[int, ...]
    file: str
    begin: int  # absolute byte offset in ``file``
    end: int

    @property
    def numpy_dtype(self) -> np.dtype:
        return DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class SafetensorsFile:
    """The parsed header of one ``.safetensors`` file and an open descriptor to read from.

    Construction validates the header completely (dtypes, shapes, offsets against the file
    size), so a truncated file fails here, naming the file, before any data is read.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        self._fd = -1
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError as err:
            raise HFCheckpointError(f"{self.path}: cannot open ({err.strerror})") from None
        try:
            self.entries, self.metadata = _parse_header(self.path, fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def read_into(self, entry: TensorEntry, out: np.ndarray) -> np.ndarray:
        """Reads ``entry``'s bytes into ``out`` (C-contiguous, ``entry.nbytes`` bytes) and returns
        ``out``. ``out`` may have any dtype of the right byte size; typically the tensor's own."""
        if not out.flags.c_contiguous or out.nbytes != entry.nbytes:
            raise ValueError(f"{self.path}: buffer for {entry.name!r} must be C-contiguous with "
                             f"{entry.nbytes} bytes, got {out.nbytes} bytes")
        view = memoryview(out.reshape(-1).view(np.uint8))
        done = 0
        while done < entry.nbytes:
            n = os.preadv(self._fd, [view[done:done + _MAX_IO]], entry.begin + done)
            if n <= 0:
                raise CorruptFileError(f"{self.path}: file ended while reading tensor {entry.name!r} "
                                       f"(byte {entry.begin + done} of an expected {entry.end}); "
                                       "the file is truncated")
            done += n
        return out

    def read(self, entry: TensorEntry) -> np.ndarray:
        """Reads one tensor into a new array of its own dtype and shape."""
        return self.read_into(entry, np.empty(entry.shape, entry.numpy_dtype))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if getattr(self, "_fd", -1) >= 0:
            self.close()


def _parse_header(path: str, fd: int) -> tuple[dict[str, TensorEntry], dict]:
    size = os.fstat(fd).st_size
    if size < 8:
        raise CorruptFileError(f"{path}: {size} bytes is too short for a safetensors file (truncated?)")
    (header_len,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    if header_len > min(size - 8, _MAX_HEADER_BYTES):
        raise CorruptFileError(f"{path}: header length {header_len} exceeds the file size {size} "
                               "(truncated or not a safetensors file)")
    raw = os.pread(fd, header_len, 8)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CorruptFileError(f"{path}: header is not valid JSON ({one_line(err)}); "
                               "the file is corrupt or not a safetensors file") from None
    if not isinstance(header, dict):
        raise CorruptFileError(f"{path}: header must be a JSON object, got {type(header).__name__}")
    data_start = 8 + header_len
    metadata = header.pop("__metadata__", None) or {}
    entries = {}
    for name, info in header.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise CorruptFileError(f"{path}: header entry for {name!r} lacks dtype/shape/data_offsets") from None
        if dtype not in DTYPES:
            raise CorruptFileError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
        if (not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape)
                or not all(isinstance(o, int) for o in (begin, end)) or not 0 <= begin <= end):
            raise CorruptFileError(f"{path}: tensor {name!r} has a malformed shape or data_offsets")
        expected = math.prod(shape) * DTYPES[dtype].itemsize
        if end - begin != expected:
            raise CorruptFileError(f"{path}: tensor {name!r} {dtype}{format_shape(shape)} needs "
                                   f"{expected} bytes but its data_offsets span {end - begin}")
        if data_start + end > size:
            raise CorruptFileError(f"{path}: tensor {name!r} ends at byte {data_start + end} but the "
                                   f"file has only {size} bytes; the file is truncated")
        entries[name] = TensorEntry(name, dtype, tuple(shape), path, data_start + begin, data_start + end)
    return entries, metadata


# ----------------------------------------------------------------------------- checkpoints

class CheckpointFiles:
    """All tensors of a Hugging Face model folder: ``model.safetensors`` or the shards listed in
    ``model.safetensors.index.json``. ``entries`` maps every tensor name to its location."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = str(folder)
        index_path = os.path.join(self.folder, INDEX_FILE)
        single_path = os.path.join(self.folder, SINGLE_FILE)
        self.files: dict[str, SafetensorsFile] = {}
        self.entries: dict[str, TensorEntry] = {}
        if os.path.isfile(index_path):
            weight_map = _read_index(index_path)
            try:
                for shard in sorted(set(weight_map.values())):
                    shard_path = os.path.join(self.folder, shard)
                    if not os.path.isfile(shard_path):
                        raise CorruptFileError(f"{index_path}: lists shard {shard!r} which does not exist")
                    self.files[shard] = SafetensorsFile(shard_path)
                for name, shard in weight_map.items():
                    entry = self.files[shard].entries.get(name)
                    if entry is None:
                        raise CorruptFileError(f"{index_path}: says {name!r} is in {shard!r}, "
                                               "but that shard does not hold it")
                    self.entries[name] = entry
                for shard, f in self.files.items():
                    for name in f.entries:
                        if weight_map.get(name) != shard:
                            raise CorruptFileError(f"{f.path}: holds {name!r}, which {INDEX_FILE} "
                                                   f"places in {weight_map.get(name)!r}")
            except BaseException:
                self.close()
                raise
        elif os.path.isfile(single_path):
            f = SafetensorsFile(single_path)
            self.files[SINGLE_FILE] = f
            self.entries = dict(f.entries)
        else:
            present = sorted(os.listdir(self.folder)) if os.path.isdir(self.folder) else []
            weights = [p for p in present if p.endswith((".bin", ".pt", ".pth", ".h5", ".msgpack"))]
            hint = (f"; found {', '.join(weights[:3])}: only safetensors weights are read"
                    if weights else "")
            raise HFCheckpointError(f"{self.folder}: no {SINGLE_FILE} or {INDEX_FILE}{hint}")
        self._by_path = {f.path: f for f in self.files.values()}

    def read_into(self, entry: TensorEntry, out: np.ndarray) -> np.ndarray:
        """Reads ``entry`` (from :attr:`entries`) into ``out``; see :meth:`SafetensorsFile.read_into`."""
        return self._by_path[entry.file].read_into(entry, out)

    def read(self, entry: TensorEntry) -> np.ndarray:
        """Reads ``entry`` into a new array of its own dtype and shape."""
        return self._by_path[entry.file].read(entry)

    def close(self) -> None:
        for f in self.files.values():
            f.close()

    def __enter__(self) -> "CheckpointFiles":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _read_index(index_path: str) -> dict[str, str]:
    try:
        with open(index_path, encoding="utf-8") as fh:
            index = json.load(fh)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CorruptFileError(f"{index_path}: cannot be read as JSON ({one_line(err)})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise CorruptFileError(f"{index_path}: expected a 'weight_map' of tensor name -> shard file")
    for shard in set(weight_map.values()):
        if os.path.basename(shard) != shard:
            raise CorruptFileError(f"{index_path}: shard name {shard!r} must be a plain file name")
    return weight_map


# ----------------------------------------------------------------------------- writing

@dataclass(frozen=True)
class TensorSpec:
    """A tensor to be written: its name, safetensors dtype and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


def write_safetensors(path: str | os.PathLike, specs: Sequence[TensorSpec],
                      produce: Callable[[TensorSpec], np.ndarray],
                      metadata: Optional[dict[str, str]] = None) -> int:
    """Writes ``specs`` to ``path``, asking ``produce(spec)`` for one tensor at a time.

    ``produce`` must return an array of exactly ``spec``'s shape and dtype; it is written and
    dropped before the next is requested. The file appears under ``path`` only when complete
    (written as ``path + ".tmp"`` and renamed). Returns the file size in bytes.
    """
    header: dict = {"__metadata__": dict(metadata or {})}
    offset = 0
    for spec in specs:
        header[spec.name] = {"dtype": spec.dtype, "shape": list(spec.shape),
                             "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-(8 + len(raw)) % _ALIGN)
    tmp = str(path) + ".tmp"
    with open(tmp, "wb", buffering=0) as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        for spec in specs:
            array = produce(spec)
            if tuple(array.shape) != spec.shape or array.dtype != DTYPES[spec.dtype]:
                raise ValueError(f"{path}: tensor {spec.name!r} must be {spec.dtype}"
                                 f"{format_shape(spec.shape)}, got {array.dtype}{format_shape(array.shape)}")
            _write_all(fh, np.ascontiguousarray(array))
            del array
    os.replace(tmp, path)
    return 8 + len(raw) + offset


def _write_all(fh, array: np.ndarray) -> None:
    view = memoryview(array.reshape(-1).view(np.uint8))
    for start in range(0, len(view), _MAX_IO):
        chunk = view[start:start + _MAX_IO]
        while len(chunk):
            chunk = chunk[fh.write(chunk):]


def plan_shards(specs: Sequence[TensorSpec], shard_bytes: int) -> list[list[TensorSpec]]:
    """Splits ``specs`` (in order) into groups of at most ``shard_bytes`` each; a tensor larger
    than ``shard_bytes`` gets a shard of its own (as ``transformers`` does)."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def write_sharded(folder: str | os.PathLike, specs: Sequence[TensorSpec],
                  produce: Callable[[TensorSpec], np.ndarray], shard_bytes: int,
                  metadata: Optional[dict[str, str]] = None) -> list[Path]:
    """Writes ``specs`` as ``model.safetensors`` (one shard) or ``model-0000i-of-0000n.safetensors``
    plus ``model.safetensors.index.json``, each shard at most ``shard_bytes`` (unless a single
    tensor is larger). Returns the paths written."""
    folder = Path(folder)
    shards = plan_shards(specs, shard_bytes)
    if len(shards) == 1:
        write_safetensors(folder / SINGLE_FILE, shards[0], produce, metadata)
        return [folder / SINGLE_FILE]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    written = []
    for name, group in zip(names, shards):
        write_safetensors(folder / name, group, produce, metadata)
        written.append(folder / name)
    index = {"metadata": {"total_size": sum(s.nbytes for s in specs)},
             "weight_map": {spec.name: name for name, group in zip(names, shards) for spec in group}}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    written.append(folder / INDEX_FILE)
    return written
