"""Checkpoint throughput and memory: SSD-resident optimizer state streamed into an Orbax checkpoint.

Lays out ``--state`` bytes of fp32 master/m/v in an SSD store the way the offloaded AdamW owner
does (``jaxascend.offload.OffloadLayout``: one region per leaf and layer, ``master[n] | m[n] | v[n]``
records per chunk of ``offload.chunk_bytes``, m and v in ``--state-dtype``), fills it with random values, then measures:
  * save: ``Checkpointer.save`` of the state (plus a small params tree) until the checkpoint is
    finalised; GB/s = state bytes / wall time;
  * peak RSS during the save above the RSS just before it (``VmHWM`` reset through
    ``/proc/self/clear_refs``), relative to the arena's size (target <= 1.0x);
  * restore: ``Checkpointer.restore`` back into the store after dropping the checkpoint files from
    the page cache (``posix_fadvise(DONTNEED)``); GB/s likewise; then every region's crc32c is
    compared with the one before the save.
Prints one JSON object.

    python scripts/bench_checkpoint.py --state 256MiB        # smoke run
    python scripts/bench_checkpoint.py                       # 2 GiB of optimizer state
    python scripts/bench_checkpoint.py --state-dtype int8    # the same parameters, 8-bit moments
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxascend.native import extension as _native
from jaxascend.checkpoint import CHECKPOINT_SHAPE_CLASS, Checkpointer, SsdArrays, checkpoint_arena_requests
from jaxascend.config import CheckpointConfig, OffloadConfig, parse_bytes
from jaxascend.metrics import rss_bytes
from jaxascend.offload import OffloadLayout, specs_for_offload_layout
from jaxascend.optim import StateFormat
from jaxascend.ssd import ArenaPlan, HostArena, Segment, SsdStore


def peak_rss_since_reset() -> int:
    """VmHWM: the peak resident set since the last :func:`reset_peak_rss`."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM line")


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def make_layout(state_bytes: int, leaves: int, cfg: OffloadConfig, layers: int, state: StateFormat):
    """jaxascend.offload's layout of ``leaves`` stacked leaves [layers, rows, cols] holding as many
    parameters as ``state_bytes`` of fp32 master+m+v, their moments in ``state``'s format."""
    params = state_bytes // 12
    per_layer = max(1, params // (leaves * layers))
    cols = 1024
    rows = max(1, per_layer // cols)
    # uneven sizes: chunks and blocks do not line up
    spec = {f"w{i}": jax.ShapeDtypeStruct((layers, rows + (i % 3), cols), jnp.bfloat16) for i in range(leaves)}
    return OffloadLayout.plan({"layers": spec}, cfg, stacked=True, state=state)


def fill_random(store: SsdStore, regions: list[str], slot_bytes: int) -> dict[str, int]:
    """Writes random fp32 values into every region through the arena; returns each region's crc32c."""
    rng = np.random.default_rng(0)
    crcs = {}
    for name in regions:
        nbytes = store.region(name).nbytes
        pieces = [(a, min(slot_bytes, nbytes - a)) for a in range(0, nbytes, slot_bytes)]
        crc = 0
        with store.stream([[Segment(name, a, n, read=False, write=True)] for a, n in pieces],
                          CHECKPOINT_SHAPE_CLASS) as stream:
            for chunk in stream:
                raw = chunk.arrays[0]
                raw.view(np.float32)[:] = rng.standard_normal(raw.size // 4, dtype=np.float32)
                crc = _native.crc32c(raw, crc)
        crcs[name] = crc
    return crcs


def region_crcs(store: SsdStore, regions: list[str], slot_bytes: int) -> dict[str, int]:
    crcs = {}
    for name in regions:
        nbytes = store.region(name).nbytes
        pieces = [(a, min(slot_bytes, nbytes - a)) for a in range(0, nbytes, slot_bytes)]
        crc = 0
        with store.stream([[Segment(name, a, n, read=True, write=False)] for a, n in pieces],
                          CHECKPOINT_SHAPE_CLASS) as stream:
            for chunk in stream:
                crc = _native.crc32c(chunk.arrays[0], crc)
        crcs[name] = crc
    return crcs


def drop_from_page_cache(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--state", default="2GiB", help="bytes of fp32 master+m+v (default 2GiB)")
    ap.add_argument("--chunk", default="64MiB", help="offload.chunk_bytes: checkpoint slot size and layout chunk")
    ap.add_argument("--block", default="1MiB", help="offload.block_bytes")
    ap.add_argument("--leaves", type=int, default=12)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--compression", default="none", choices=["none", "zstd"])
    ap.add_argument("--state-dtype", default="float32", choices=["float32", "bfloat16", "int8"],
                    help="optimizer.state_dtype of the moments (--state still counts fp32 bytes: the parameters)")
    ap.add_argument("--state-block", type=int, default=2048, help="optimizer.state_block of int8 state")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temporary one, removed after)")
    args = ap.parse_args()

    state_bytes = parse_bytes(args.state, "--state")
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench_checkpoint_"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        cfg = OffloadConfig(dir=str(root / "offload"), chunk_bytes=args.chunk, block_bytes=args.block,
                            shard_bytes="1GiB", pin_memory=False)
        plan = ArenaPlan().extend(SsdStore.arena_requests(cfg)).extend(checkpoint_arena_requests(cfg))
        with HostArena(plan, cfg) as arena, SsdStore(cfg, arena) as store:
            fmt = StateFormat.of(args.state_dtype, args.state_block)
            layout = make_layout(state_bytes, args.leaves, cfg, args.layers, fmt)
            regions = []
            for leaf in layout.leaves:
                for name in leaf.state_regions:
                    store.add_region(name, layout.state_layer_bytes(leaf))
                    regions.append(name)
            actual_state = sum(store.region(n).nbytes for n in regions)
            slot_bytes = min(s.nbytes for s in arena.slots(CHECKPOINT_SHAPE_CLASS))
            before = fill_random(store, regions, slot_bytes // cfg.block_bytes * cfg.block_bytes)
            ssd = SsdArrays(store, specs_for_offload_layout(layout), attributes={"state": fmt.describe()})
            params = {"embed": np.ones((256, 256), np.float32)}

            ckpt_cfg = CheckpointConfig(dir=str(root / "checkpoints"), compression=args.compression)
            with Checkpointer(ckpt_cfg) as ckpt:
                rss_before = rss_bytes()
                reset_peak_rss()
                t0 = time.perf_counter()
                ckpt.save(1, params=params, ssd=ssd, meta={"bench": True})
                ckpt.wait()
                save_s = time.perf_counter() - t0
                save_peak = peak_rss_since_reset()

                drop_from_page_cache(root / "checkpoints")
                rss_before_restore = rss_bytes()
                reset_peak_rss()
                t0 = time.perf_counter()
                ckpt.restore(1, params_like=params, ssd=ssd)
                restore_s = time.perf_counter() - t0
                restore_peak = peak_rss_since_reset()
            after = region_crcs(store, regions, slot_bytes // cfg.block_bytes * cfg.block_bytes)
            on_disk = sum(p.stat().st_size for p in (root / "checkpoints").rglob("*") if p.is_file())
            result = {
                "state_bytes": actual_state,
                "state_dtype": fmt.dtype,
                "arrays": len(ssd.specs),
                "compression": args.compression,
                "chunk_bytes": cfg.chunk_bytes,
                "block_bytes": cfg.block_bytes,
                "direct_io": store.direct_io,
                "arena_bytes": arena.capacity,
                "save_seconds": round(save_s, 3),
                "save_gbps": round(actual_state / save_s / 1e9, 3),
                "save_rss_before_bytes": rss_before,
                "save_peak_rss_increase_bytes": save_peak - rss_before,
                "save_peak_rss_increase_vs_arena": round((save_peak - rss_before) / arena.capacity, 3),
                "restore_seconds": round(restore_s, 3),
                "restore_gbps": round(actual_state / restore_s / 1e9, 3),
                "restore_peak_rss_increase_bytes": restore_peak - rss_before_restore,
                "restore_peak_rss_increase_vs_arena": round((restore_peak - rss_before_restore) / arena.capacity, 3),
                "checkpoint_bytes_on_disk": on_disk,
                "bit_identical_after_restore": before == after,
            }
        print(json.dumps(result, indent=1))
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
