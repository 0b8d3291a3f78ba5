"""The SSD engine: everything that owns native I/O resources.

* :class:`HostArena` / :class:`ArenaPlan` -- one pinned, preallocated host allocation, carved
  into exact-size slots per shape class (:class:`SlotRequest`);
* :class:`SsdStore` -- checksummed ``O_DIRECT`` shard files of named regions, streamed through
  the arena in pipelined passes (:class:`Segment`, :func:`chunk_segments`, :class:`SsdStream`);
* :func:`page_cache_bytes` / :class:`MemorySampler` -- what the page cache holds of the shard
  files (``mincore``) and the process's RSS, sampled on a thread;
* :func:`measure_disk_gbps` -- the offload filesystem's speed through the store (the planner's).

Imports only :mod:`jaxascend.config`, :mod:`jaxascend.native` and the extension.
"""

from jaxascend.ssd.arena import (ArenaError, ArenaPlan, HostArena, Slot, SlotRequest, format_bytes,
                                 physical_memory_bytes, round_to_alignment)
from jaxascend.ssd.disk_speed import measure_disk_gbps
from jaxascend.ssd.memory_probe import MemorySampler, file_page_cache_bytes, page_cache_bytes
from jaxascend.ssd.store import (ChecksumError, Region, Segment, SsdStore, StoreError, StoreLockedError,
                                 chunk_segments, clear_faults, inject_fault, injected_faults)
from jaxascend.ssd.stream import SsdStream, StreamChunk

__all__ = [
    "ArenaError", "ArenaPlan", "ChecksumError", "HostArena", "MemorySampler", "Region", "Segment", "Slot",
    "SlotRequest", "SsdStore", "SsdStream", "StoreError", "StoreLockedError", "StreamChunk", "chunk_segments",
    "clear_faults", "file_page_cache_bytes", "format_bytes", "inject_fault", "injected_faults",
    "measure_disk_gbps", "page_cache_bytes", "physical_memory_bytes", "round_to_alignment",
]
