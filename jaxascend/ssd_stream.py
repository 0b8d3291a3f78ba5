"""Pipelined passes over SSD-resident state: read-ahead and write-behind through arena slots.

A pass walks a list of chunks; each chunk is a list of :class:`Segment` (a byte range of a
region, read from disk first and/or written back after). With ``depth`` stages (default
``offload.stream_depth`` = 3), while the consumer works on chunk k, chunk k+1 is being read and
chunk k-1 written::

    chunks = chunk_segments(store, [("w.master", np.float32, "rw"), ("w.m", np.float32, "rw"),
                                    ("w.v", np.float32, "rw"), ("w.grad", np.float16, "r")],
                            chunk_elements=1 << 20)
    with store.stream(chunks, ["state", "state", "state", "grad"],
                      dtypes=[np.float32] * 3 + [np.float16]) as stream:
        for chunk in stream:
            master, m, v, g = chunk.arrays      # zero-copy views of arena slots
            adam_update(master, m, v, g)        # in place; written back while k+1 is used

The views are valid until the next chunk is requested. Leaving the ``with`` block normally
finishes the pass (an early ``break`` still writes back the chunk in hand); an exception aborts
it (requests in flight land, nothing more is written). Slots are acquired from the arena when
the pass is created and released when it ends, so repeated passes allocate nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Sequence, Union

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from jaxascend.ssd_store import Region, SsdStore


@dataclass(frozen=True)
class Segment:
    """``nbytes`` at byte ``offset`` of ``region``; ``read``: filled from disk, ``write``: written back."""

    region: Union[str, "Region"]
    offset: int
    nbytes: int
    read: bool = True
    write: bool = True


@dataclass(frozen=True)
class StreamChunk:
    """The chunk in hand: its index and one array per segment (views of arena slots)."""

    index: int
    arrays: list[np.ndarray]


class SsdStream:
    """Iterator and context manager over one native ``StreamPass``; made by :meth:`SsdStore.stream`."""

    def __init__(self, native_pass, dtypes: Sequence[np.dtype]):
        self._native = native_pass
        self._dtypes = list(dtypes)
        self._done = False

    @property
    def num_chunks(self) -> int:
        return self._native.num_chunks

    @property
    def depth(self) -> int:
        return self._native.depth

    def __iter__(self) -> Iterator[StreamChunk]:
        while self._native.next():
            views = self._native.views()
            arrays = [_typed(v, dt, i) for i, (v, dt) in enumerate(zip(views, self._dtypes))]
            yield StreamChunk(self._native.current, arrays)
        self.finish()

    def finish(self) -> None:
        """Writes back the chunk in hand (if any), waits for all requests, releases the slots;
        raises the first I/O error of the pass."""
        if not self._done:
            self._done = True
            self._native.finish()

    def abort(self) -> None:
        """Waits for requests in flight and releases the slots, writing nothing more."""
        if not self._done:
            self._done = True
            self._native.abort()

    def __enter__(self) -> "SsdStream":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finish()
        else:
            self.abort()


def _typed(view: np.ndarray, dtype: np.dtype, segment: int) -> np.ndarray:
    if view.size % dtype.itemsize:
        raise ValueError(f"stream segment {segment}: {view.size} bytes are not a whole number of {dtype} elements")
    return view.view(dtype)


def chunk_segments(store: "SsdStore", specs: Sequence[tuple], chunk_elements: int) -> list[list[Segment]]:
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
