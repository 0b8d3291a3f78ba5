"""The SSD engine's owner class: optimizer state and gradients in checksummed shard files.

Each parameter tensor's state (fp32 master, m, v) and gradient live as named *regions* in shard
files under ``offload.dir``, read and written with ``O_DIRECT`` through io_uring (``queue_depth``
requests in flight; ``offload.io_engine``) or a pool of ``io_threads`` pread/pwrite workers where
io_uring is refused (logged once; :attr:`SsdStore.io_engine` says which runs), a crc32c per
``block_bytes`` block verified on every read. The directory is locked while the store is open;
closing flushes and unlocks; nothing is ever deleted. Where the filesystem refuses ``O_DIRECT`` (tmpfs) the store falls back
to buffered I/O with ``posix_fadvise(DONTNEED)`` and logs one warning (``offload.drop_page_cache:
false`` keeps the pages cached instead: ZeRO-Infinity's page-cache I/O, an ablation baseline).
Layout and rules are in ``ffi/ssd_shard_store.h``; streaming (read-ahead + write-behind through
arena slots) is :meth:`SsdStore.stream` (see :mod:`jaxascend.ssd.stream`)::

    plan = ArenaPlan().extend(SsdStore.arena_requests(cfg))
    with HostArena(plan, cfg) as arena, SsdStore(cfg, arena) as store:
        store.add_region("layers.0.mlp.m", nbytes)
        store.write("layers.0.mlp.m", np.zeros(n, np.float32))
        m = store.read("layers.0.mlp.m", dtype=np.float32)
        print(store.stats())                 # bytes, seconds, GB/s per direction, in flight

Errors: :class:`StoreError` (an ``OSError`` with ``errno``; message names the file, offset and
operation), :class:`ChecksumError`, :class:`StoreLockedError`; ``ValueError`` for bad arguments
(unknown region, unaligned offset, oversized request). Tests make the N-th read or write fail
with :func:`injected_faults` or ``JAXASCEND_FAULT="write:3:ENOSPC"``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence, Union

import numpy as np

from jaxascend.native import extension as _native
from jaxascend.config import OffloadConfig
from jaxascend.ssd.arena import HostArena, Slot, SlotRequest
from jaxascend.ssd.stream import SsdStream

log = logging.getLogger(__name__)

StoreError = _native.StoreError  # OSError: I/O failures (ENOSPC, EIO, short transfers)
ChecksumError = _native.ChecksumError  # StoreError: crc32c mismatch on read
StoreLockedError = _native.StoreLockedError  # StoreError: the offload directory is in use

STAGING_SHAPE_CLASS = "ssd_staging"
LOCK_FILE = "jaxascend.lock"  # in the store's directory, held while a store is open (ffi/ssd_shard_store_layout.cc)


@dataclass(frozen=True)
class Extent:
    """A contiguous piece of a region in one shard file."""

    shard_path: str
    file_offset: int
    region_offset: int
    disk_bytes: int


@dataclass(frozen=True)
class Region:
    """A named byte range in the store: one tensor's state or gradient. An in-memory region
    (:meth:`SsdStore.add_region`'s ``in_memory``) has no extents."""

    name: str
    id: int
    nbytes: int
    num_blocks: int
    extents: tuple[Extent, ...]
    in_memory: bool = False


RegionRef = Union[str, Region]


@dataclass(frozen=True)
class Segment:
    """``nbytes`` at byte ``offset`` of ``region``; ``read``: filled from disk, ``write``: written
    back, there or (``write_region``, ``write_offset``: copy on write) elsewhere."""

    region: RegionRef
    offset: int
    nbytes: int
    read: bool = True
    write: bool = True
    write_region: Optional[RegionRef] = None
    write_offset: int = 0


def inject_fault(spec: str) -> None:
    """Arms faults, e.g. ``"write:3:ENOSPC"`` (the 3rd block write from now fails with ENOSPC),
    ``"read:1:EIO"``, ``"write:2:SHORT"``, ``"mlock:1:ENOMEM"``, ``"open_direct:1:EINVAL"``,
    ``"fallocate:1:ENOSPC"``, ``"io_uring_setup:1:EPERM"`` (the next store falls back to the thread
    engine); several separated by commas. Each fires once."""
    _native.arm_fault(spec)


def clear_faults() -> None:
    """Disarms every injected fault."""
    _native.clear_faults()


@contextlib.contextmanager
def injected_faults(spec: str) -> Iterator[None]:
    """``with injected_faults("write:2:EIO"): ...`` arms faults for the block and clears them after."""
    inject_fault(spec)
    try:
        yield
    finally:
        clear_faults()


class SsdStore:
    """Owner of one open shard store (one locked ``offload.dir``)."""

    @staticmethod
    def arena_requests(cfg: OffloadConfig) -> list[SlotRequest]:
        """The arena slots the store needs: ``staging_slots`` staging buffers of ``staging_bytes``."""
        return [SlotRequest(STAGING_SHAPE_CLASS, cfg.staging_bytes, cfg.staging_slots)]

    def __init__(self, cfg: OffloadConfig, arena: HostArena, keep_files: bool = False):
        if cfg.dir is None:  # load_config fills in <train.out_dir>/offload; a bare OffloadConfig may not
            raise ValueError("offload.dir: not set; give the directory for the shard files")
        self.cfg = cfg
        self.arena = arena
        env_problem = _native.fault_environment_status()
        if env_problem:
            raise ValueError(env_problem)
        options = _native.StoreOptions()
        options.dir = str(cfg.dir)
        options.shard_bytes = cfg.shard_bytes
        options.block_bytes = cfg.block_bytes
        options.staging_bytes = cfg.staging_bytes
        options.staging_slots = cfg.staging_slots
        options.io_threads = cfg.io_threads
        options.io_engine = cfg.io_engine
        options.queue_depth = cfg.queue_depth
        options.direct_io = cfg.direct_io
        options.preallocate = cfg.preallocate
        options.drop_page_cache = cfg.drop_page_cache
        # a resume from the files a run left (durable steps): add the regions as that run did
        options.keep_files = bool(keep_files)
        self._native = _native.ShardStore.open(options, arena.native)
        self._regions: dict[str, Region] = {}
        if cfg.direct_io and not self._native.direct_io:
            log.warning("ssd store: %s", self._native.io_mode_status)
        elif not cfg.direct_io:
            log.info("ssd store: %s", self._native.io_mode_status)
        if cfg.io_engine != "threads" and self.io_engine != "io_uring":
            # The one report of the fallback: a warning when io_uring was asked for by name.
            (log.warning if cfg.io_engine == "io_uring" else log.info)("ssd store: %s", self.io_engine_status)

    # ------------------------------------------------------------------ properties
    @property
    def native(self):
        """The ``jaxascend._native.ShardStore``."""
        return self._native

    @property
    def handle(self) -> int:
        """The integer by which native code (an FFI handler) finds this store: ``FindStore(handle)``."""
        return self._native.handle

    @property
    def direct_io(self) -> bool:
        """True when the shard files use ``O_DIRECT``; False in the buffered fallback."""
        return self._native.direct_io

    @property
    def io_mode_status(self) -> str:
        return self._native.io_mode_status

    @property
    def io_engine(self) -> str:
        """The engine that runs the I/O: ``"io_uring"`` or ``"threads"``."""
        return self._native.io_engine

    @property
    def io_engine_status(self) -> str:
        """How the I/O runs and why, e.g. ``"io_uring, queue depth 8"``, or the thread pool and the
        reason io_uring was refused."""
        return self._native.io_engine_status

    @property
    def closed(self) -> bool:
        return self._native.closed

    # ------------------------------------------------------------------ regions
    def add_region(self, name: str, nbytes: int, in_memory: bool = False) -> Region:
        """Reserves ``nbytes`` for ``name`` (reads back as zeros until written). ``in_memory``:
        in this process's memory instead of a shard file, read and written the same way (the
        gradients when they fit in RAM); the I/O counters count the disk only."""
        self._native.add_region(name, int(nbytes), bool(in_memory))
        return self.region(name)

    def region(self, ref: RegionRef) -> Region:
        """The region record for a name (``ValueError`` naming it if unknown)."""
        if isinstance(ref, Region):
            return ref
        found = self._regions.get(ref)
        if found is None:
            rid = self._native.find_region(ref)
            name, nbytes, num_blocks, extents, in_memory = self._native.region_info(rid)
            found = Region(name, rid, nbytes, num_blocks, tuple(
                Extent(self._native.shard_path(shard), fo, ro, db) for shard, fo, ro, db in extents), in_memory)
            self._regions[ref] = found
        return found

    def regions(self) -> list[Region]:
        return [self.region(self._native.region_info(i)[0]) for i in range(self._native.num_regions)]

    # ------------------------------------------------------------------ copying I/O
    def write(self, region: RegionRef, data, offset: int = 0, wait: bool = True) -> None:
        """Writes ``data`` (any contiguous array or bytes) at byte ``offset`` (a multiple of
        ``block_bytes``) through the arena's staging slots. With ``wait=False`` it returns once
        ``data`` may be reused; errors then surface on the next call or :meth:`flush`."""
        r = self.region(region)
        raw = _as_bytes(data)
        self._native.write(r.id, int(offset), raw, wait)

    def read(self, region: RegionRef, offset: int = 0, nbytes: Optional[int] = None, dtype=np.uint8,
             out: Optional[np.ndarray] = None) -> np.ndarray:
        """Reads ``nbytes`` (default: to the region's end) from byte ``offset`` into a new array
        (or ``out``), verifying every block's checksum; returns it viewed as ``dtype``."""
        r = self.region(region)
        nbytes = r.nbytes - int(offset) if nbytes is None else int(nbytes)
        if out is not None:
            raw = _as_bytes(out, writable=True)
            if raw.size != nbytes:
                raise ValueError(f"read of region {r.name!r}: out holds {raw.size} bytes, expected {nbytes}")
            self._native.read(r.id, int(offset), raw)
            return out
        raw = np.empty(max(nbytes, 0), np.uint8)
        self._native.read(r.id, int(offset), raw)
        return raw.view(dtype)

    # ------------------------------------------------------------------ zero-copy I/O
    def read_into(self, region: RegionRef, slot: Slot, offset: int = 0, nbytes: Optional[int] = None) -> None:
        """Reads straight into an arena slot (no copy): ``nbytes`` defaults to what fits."""
        r = self.region(region)
        nbytes = min(slot.nbytes, r.nbytes - int(offset)) if nbytes is None else int(nbytes)
        self._native.read_slot(r.id, int(offset), nbytes, slot.id)

    def write_from(self, region: RegionRef, slot: Slot, offset: int = 0, nbytes: Optional[int] = None) -> None:
        """Writes straight from an arena slot (no copy): ``nbytes`` defaults to what fits."""
        r = self.region(region)
        nbytes = min(slot.nbytes, r.nbytes - int(offset)) if nbytes is None else int(nbytes)
        self._native.write_slot(r.id, int(offset), nbytes, slot.id)

    # ------------------------------------------------------------------ streaming
    def stream(self, chunks: Sequence[Sequence[Segment]], slot_classes: Union[str, Sequence[str]],
               dtypes=None, depth: Optional[int] = None) -> SsdStream:
        """A pipelined pass over ``chunks`` (each a list of :class:`Segment`), staged in arena
        slots of ``slot_classes`` (one per segment position, or one for all); ``depth``
        defaults to ``offload.stream_depth``. See :class:`jaxascend.ssd.stream.SsdStream`."""
        n_seg = len(chunks[0]) if chunks else (1 if isinstance(slot_classes, str) else len(slot_classes))
        classes = [slot_classes] * n_seg if isinstance(slot_classes, str) else list(slot_classes)
        native_chunks = [[(self.region(s.region).id, int(s.offset), int(s.nbytes), bool(s.read), bool(s.write),
                           -1 if s.write_region is None else self.region(s.write_region).id, int(s.write_offset))
                          for s in chunk] for chunk in chunks]
        depth = self.cfg.stream_depth if depth is None else int(depth)
        native_pass = self._native.stream(native_chunks, classes, depth)
        if dtypes is None or isinstance(dtypes, (str, type, np.dtype)):
            dtypes = [np.dtype(dtypes or np.uint8)] * n_seg
        return SsdStream(native_pass, [np.dtype(d) for d in dtypes])

    # ------------------------------------------------------------------ freeing space
    def release(self, regions: Sequence[RegionRef]) -> int:
        """Gives the disk blocks of ``regions`` back to the filesystem (``fallocate`` punching
        holes; the shard files keep their size) once nothing will read them again: the end of a
        run frees its gradients' space for the outputs it writes next. Returns the bytes freed
        (0 where the filesystem cannot punch holes, or for in-memory regions)."""
        self.flush()  # no write to them is still queued
        extents = [e for ref in regions for e in self.region(ref).extents]
        return punch_holes(extents)

    # ------------------------------------------------------------------ lifetime
    def flush(self) -> None:
        """Waits for every queued request; raises the first deferred write error."""
        self._native.flush()

    def sync(self) -> None:
        """:meth:`flush`, then ``fdatasync`` of every shard file (what was written survives a power loss)."""
        self._native.sync()

    def stats(self) -> dict:
        """Bytes, busy seconds, GB/s and request counts per direction, requests in flight."""
        c = dict(self._native.counters())
        c["read_gbps"] = c["bytes_read"] / c["read_seconds"] / 1e9 if c["read_seconds"] > 0 else 0.0
        c["write_gbps"] = c["bytes_written"] / c["write_seconds"] / 1e9 if c["write_seconds"] > 0 else 0.0
        c["direct_io"] = self.direct_io
        c["io_engine"] = self.io_engine
        c["regions"] = self._native.num_regions
        c["shards"] = self._native.num_shards
        return c

    def close(self) -> None:
        """Flushes, closes the shard files, releases the staging slots and the directory lock."""
        self._native.close()

    def __enter__(self) -> "SsdStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("O_DIRECT" if self.direct_io else "buffered") + ", " + self.io_engine
        return f"SsdStore(dir={self.cfg.dir!r}, {state}, regions={self._native.num_regions})"


_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


def punch_holes(extents: Sequence[Extent]) -> int:
    """Frees ``extents``' blocks in their shard files; the bytes freed (0 where unsupported)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    freed = 0
    for path in sorted({e.shard_path for e in extents}):
        fd = os.open(path, os.O_WRONLY)
        try:
            for e in (e for e in extents if e.shard_path == path):
                if libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, e.file_offset, e.disk_bytes):
                    err = ctypes.get_errno()
                    if err in (errno.EOPNOTSUPP, errno.ENOSYS):
                        return freed
                    raise OSError(err, f"freeing {e.disk_bytes} bytes at {e.file_offset} of {path}: "
                                       f"{os.strerror(err)}")
                freed += e.disk_bytes
        finally:
            os.close(fd)
    return freed


def _as_bytes(data, writable: bool = False) -> np.ndarray:
    """A flat uint8 view of ``data`` (no copy for contiguous arrays)."""
    if isinstance(data, (bytes, bytearray, memoryview)) and not isinstance(data, np.ndarray):
        arr = np.frombuffer(data, np.uint8)
    else:
        arr = np.asarray(data)
    if not arr.flags.c_contiguous:
        if writable:
            raise ValueError("out must be a C-contiguous array")
        arr = np.ascontiguousarray(arr)
    return arr.reshape(-1).view(np.uint8)


def chunk_segments(store: SsdStore, specs: Sequence[tuple], chunk_elements: int) -> list[list[Segment]]:
    """Chunks over regions that hold the same number of elements in different dtypes.

    ``specs``: ``(region, dtype, mode)`` with mode ``"r"``, ``"w"`` or ``"rw"``. Chunk k covers
    elements ``[k * chunk_elements, (k + 1) * chunk_elements)`` of every region, so
    ``chunk_elements * itemsize`` must be a multiple of ``offload.block_bytes`` for each dtype.
    """
    block = store.cfg.block_bytes
    regions = []
    n_elements = None
    for region, dtype, mode in specs:
        r = store.region(region)
        itemsize = np.dtype(dtype).itemsize
        if mode not in ("r", "w", "rw"):
            raise ValueError(f"chunk_segments: mode for region {r.name!r} must be 'r', 'w' or 'rw', got {mode!r}")
        if r.nbytes % itemsize:
            raise ValueError(f"chunk_segments: region {r.name!r} ({r.nbytes} bytes) is not a whole number of "
                             f"{np.dtype(dtype)} elements")
        if (chunk_elements * itemsize) % block:
            raise ValueError(f"chunk_segments: {chunk_elements} {np.dtype(dtype)} elements = "
                             f"{chunk_elements * itemsize} bytes, not a multiple of offload.block_bytes={block}")
        count = r.nbytes // itemsize
        if n_elements is not None and count != n_elements:
            raise ValueError(f"chunk_segments: region {r.name!r} holds {count} elements, expected {n_elements}")
        n_elements = count
        regions.append((r, itemsize, mode))
    chunks = []
    for start in range(0, n_elements or 0, chunk_elements):
        n = min(chunk_elements, n_elements - start)
        chunks.append([Segment(r, start * size, n * size, read="r" in mode, write="w" in mode)
                       for r, size, mode in regions])
    return chunks
