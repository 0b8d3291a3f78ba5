"""The SSD engine: everything that owns native I/O resources.

* :class:`HostArena` / :class:`ArenaPlan` -- one pinned, preallocated host allocation, carved
  into exact-size slots per shape class (:class:`SlotRequest`); :func:`arena_shortfall`, its
  check of ``offload.arena_bytes``, for the planner to make before anything is allocated;
* :class:`SsdStore` -- checksummed ``O_DIRECT`` shard files of named regions, streamed through
  the arena in pipelined passes (:class:`Segment`, :func:`~jaxascend.ssd.store.chunk_segments`, :class:`~jaxascend.ssd.stream.SsdStream`);
* :func:`page_cache_bytes` / :class:`MemorySampler` -- what the page cache holds of the shard
  files (``mincore``) and the process's RSS, sampled on a thread;
* :func:`measure_disk_gbps` -- the offload filesystem's speed through the store (the planner's).

Imports only :mod:`jaxascend.config`, :mod:`jaxascend.native` and the extension.
"""

from jaxascend.ssd.arena import (ArenaError, ArenaPlan, HostArena, SlotRequest, arena_shortfall, format_bytes,
                                round_to_alignment)
from jaxascend.ssd.disk_speed import measure_disk_gbps
from jaxascend.ssd.memory_probe import MemorySampler, page_cache_bytes
from jaxascend.ssd.store import (LOCK_FILE, ChecksumError, Segment, SsdStore, StoreError, StoreLockedError,
                                 clear_faults, inject_fault)

__all__ = [
    "LOCK_FILE", "ArenaError", "ArenaPlan", "ChecksumError", "HostArena", "MemorySampler", "Segment", "SlotRequest",
    "SsdStore", "StoreError", "StoreLockedError", "arena_shortfall", "clear_faults", "format_bytes", "inject_fault",
    "measure_disk_gbps", "page_cache_bytes", "round_to_alignment",
]
