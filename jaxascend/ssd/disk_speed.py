"""How fast the offload filesystem moves bytes: one write and one read of a scratch region.

    gbps = measure_disk_gbps(cfg.offload)   # mean of the write and read speed, GB/s

Measured the way a step moves its state: through the store (``O_DIRECT`` where the filesystem
allows it, the configured block size and I/O threads), in a temporary directory beside
``offload.dir`` that is removed afterwards.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time

import numpy as np

from jaxascend.config import OffloadConfig
from jaxascend.ssd.arena import ArenaPlan, HostArena
from jaxascend.ssd.store import SsdStore


def _existing_parent(path: str) -> str:
    path = os.path.abspath(os.path.expanduser(path))
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def measure_disk_gbps(cfg: OffloadConfig, nbytes: int = 256 * 2**20) -> float:
    """Writes then reads ``nbytes`` through a scratch store on ``cfg.dir``'s filesystem; returns
    the mean of the two speeds in GB/s (10^9 bytes per second)."""
    nbytes = max(cfg.block_bytes, nbytes // cfg.block_bytes * cfg.block_bytes)
    with tempfile.TemporaryDirectory(prefix=".jaxascend-disk-", dir=_existing_parent(str(cfg.dir or "."))) as tmp:
        scratch = dataclasses.replace(cfg, dir=tmp, pin_memory=False, lock_memory=False)
        with HostArena(ArenaPlan().extend(SsdStore.arena_requests(scratch)), scratch) as arena, \
                SsdStore(scratch, arena) as store:
            store.add_region("disk_speed", nbytes)
            data = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
            start = time.perf_counter()
            store.write("disk_speed", data)
            store.flush()
            write_s = time.perf_counter() - start
            start = time.perf_counter()
            store.read("disk_speed", out=data)
            read_s = time.perf_counter() - start
    return (nbytes / write_s + nbytes / read_s) / 2 / 1e9
