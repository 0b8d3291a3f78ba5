"""Pipelined passes over SSD-resident state: read-ahead and write-behind through arena slots.

A pass walks a list of chunks; each chunk is a list of :class:`~jaxascend.ssd.store.Segment` (a
byte range of a region, read from disk first and/or written back after). This module only wraps
the native pass that :meth:`SsdStore.stream <jaxascend.ssd.store.SsdStore.stream>` starts; it
knows nothing of the store. With ``depth`` stages (default
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
from typing import Iterator, Sequence

import numpy as np

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

    @property
    def written_through(self) -> int:
        """Every chunk up to this index is written back to disk (-1: none known yet)."""
        return self._native.written_through

    def wait_written_through(self, k: int) -> None:
        """Waits until every chunk up to ``k`` (before the one in hand) is written back to disk."""
        self._native.wait_written_through(int(k))

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
