"""Host-memory accounting that RSS alone misses: page cache held by the offload files.

Buffered file I/O hides its cost in the kernel's page cache, outside the process's RSS; a fair
comparison of I/O engines counts both. :func:`page_cache_bytes` asks the kernel (``mincore``)
which pages of the given files are resident; :class:`MemorySampler` samples RSS and that page
cache on a background thread, keeping peaks and a time series for plots.

    with MemorySampler(lambda: glob.glob("offload/*.bin"), interval=0.1) as sampler:
        ...train...
    sampler.peak_rss, sampler.peak_page_cache, sampler.samples
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import threading
import time
from typing import Callable, Iterable, NamedTuple

import numpy as np
import psutil

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.mmap.restype = ctypes.c_void_p
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
_MAP_FAILED = ctypes.c_void_p(-1).value
PAGE = mmap.PAGESIZE


def file_page_cache_bytes(path: str) -> int:
    """Bytes of ``path`` resident in the page cache now (0 for a missing or empty file)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return 0
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            err = ctypes.get_errno()
            raise OSError(err, f"mmap of {path} for mincore failed: {os.strerror(err)}")
        try:
            pages = (size + PAGE - 1) // PAGE
            vec = (ctypes.c_ubyte * pages)()
            if _libc.mincore(addr, size, vec) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"mincore on {path} failed: {os.strerror(err)}")
            return int(np.count_nonzero(np.frombuffer(vec, np.uint8) & 1)) * PAGE  # bit 0: resident
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def page_cache_bytes(paths: Iterable[str]) -> int:
    """Sum of :func:`file_page_cache_bytes` over ``paths``."""
    return sum(file_page_cache_bytes(p) for p in paths)


class MemorySample(NamedTuple):
    t: float  # seconds since the sampler started
    rss: int  # process resident set size, bytes
    page_cache: int  # page cache held by the watched files, bytes


class MemorySampler:
    """Samples RSS and the page cache of ``files()`` every ``interval`` seconds on a thread."""

    def __init__(self, files: Callable[[], Iterable[str]] = lambda: (), interval: float = 0.2):
        self._files = files
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)
        self._process = psutil.Process()
        self._t0 = time.perf_counter()
        self.samples: list[MemorySample] = []
        self.peak_rss = 0
        self.peak_page_cache = 0
        self.peak_total = 0

    def sample(self) -> MemorySample:
        s = MemorySample(time.perf_counter() - self._t0, self._process.memory_info().rss,
                         page_cache_bytes(list(self._files())))
        self.samples.append(s)
        self.peak_rss = max(self.peak_rss, s.rss)
        self.peak_page_cache = max(self.peak_page_cache, s.page_cache)
        self.peak_total = max(self.peak_total, s.rss + s.page_cache)
        return s

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.sample()

    def __enter__(self) -> "MemorySampler":
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()
