"""SSD engine throughput vs the raw disk, on the same sizes in one run; prints JSON, writes a PNG.

Measures, each ``--repeats`` times (median reported):
  * raw O_DIRECT: this script's own sequential ``pwrite``/``preadv`` of ``--raw-request`` bytes
    on an O_DIRECT file descriptor, from one page-aligned (mmap) buffer of random bytes;
  * engine: the SSD engine streaming a state of ``--size`` bytes (4 regions, like master/m/v/grad)
    through arena slots: a write pass, a read pass (every block's crc32c verified) and an
    update pass (read + write back, as the optimizer does);
  * buffered: plain ``write`` + ``fsync``, and ``read`` after dropping the file from the page
    cache with ``posix_fadvise(DONTNEED)``, for contrast.
GB/s is bytes / wall time of the whole pass (pipeline start-up and drain included). The target
is engine >= 0.9 x raw in both directions; "ratio_engine_to_raw" compares the medians and
"ratio_engine_to_raw_paired" is the median of the per-repeat ratios (steadier on a noisy disk).

    python scripts/bench_io.py --size 256MiB          # smoke run
    python scripts/bench_io.py                        # 2 GiB
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxascend.config import OffloadConfig, parse_bytes
from jaxascend.ssd import ArenaPlan, HostArena, Segment, SsdStore

REGIONS = ("master", "m", "v", "grad")


def random_buffer(nbytes: int) -> mmap.mmap:
    """A page-aligned anonymous buffer (valid for O_DIRECT) full of random bytes."""
    buf = mmap.mmap(-1, nbytes)
    np.frombuffer(buf, np.uint8)[:] = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    return buf


def raw_direct(path: Path, size: int, request: int) -> tuple[float, float]:
    """Sequential O_DIRECT write then read of ``size`` bytes; returns (write GB/s, read GB/s)."""
    buf = random_buffer(request)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        os.posix_fallocate(fd, 0, size)  # like the engine, which preallocates its shards
        t0 = time.perf_counter()
        for off in range(0, size, request):
            n = os.pwrite(fd, memoryview(buf)[:min(request, size - off)], off)
            if n != min(request, size - off):
                raise OSError(f"short raw write at {off}: {n}")
        write_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for off in range(0, size, request):
            n = os.preadv(fd, [memoryview(buf)[:min(request, size - off)]], off)
            if n != min(request, size - off):
                raise OSError(f"short raw read at {off}: {n}")
        read_s = time.perf_counter() - t0
    finally:
        os.close(fd)
        buf.close()
        path.unlink()
    return size / write_s / 1e9, size / read_s / 1e9


def buffered(path: Path, size: int, request: int) -> tuple[float, float]:
    """write + fsync, then read after dropping the page cache; returns (write GB/s, read GB/s)."""
    buf = random_buffer(request)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        t0 = time.perf_counter()
        for off in range(0, size, request):
            os.pwrite(fd, memoryview(buf)[:min(request, size - off)], off)
        os.fsync(fd)
        write_s = time.perf_counter() - t0
        os.posix_fadvise(fd, 0, size, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        for off in range(0, size, request):
            os.preadv(fd, [memoryview(buf)[:min(request, size - off)]], off)
        read_s = time.perf_counter() - t0
    finally:
        os.close(fd)
        buf.close()
        path.unlink()
    return size / write_s / 1e9, size / read_s / 1e9


def engine(store_dir: Path, size: int, cfg_fields: dict) -> dict:
    """Write, read and update passes of the SSD engine over ``size`` bytes of state."""
    cfg = OffloadConfig(dir=str(store_dir), **cfg_fields)
    chunk = cfg.chunk_bytes
    plan = ArenaPlan().extend(SsdStore.arena_requests(cfg)).add("bench", chunk, cfg.stream_depth)
    region_bytes = -(-size // len(REGIONS) // cfg.block_bytes) * cfg.block_bytes
    out = {}
    with HostArena(plan, cfg) as arena, SsdStore(cfg, arena) as store:
        for name in REGIONS:
            store.add_region(name, region_bytes)
        total = region_bytes * len(REGIONS)
        for slot in arena.slots("bench"):  # random content: the disk must not see zeros
            arena.array(slot)[:] = np.random.default_rng(slot.id).integers(0, 256, slot.nbytes, dtype=np.uint8)

        def run(read: bool, write: bool) -> float:
            chunks = [[Segment(name, off, min(chunk, region_bytes - off), read=read, write=write)]
                      for name in REGIONS for off in range(0, region_bytes, chunk)]
            t0 = time.perf_counter()
            with store.stream(chunks, "bench") as stream:
                for _ in stream:
                    pass
            return time.perf_counter() - t0

        out["write_gbps"] = total / run(read=False, write=True) / 1e9
        out["read_gbps"] = total / run(read=True, write=False) / 1e9
        out["update_gbps"] = 2 * total / run(read=True, write=True) / 1e9  # bytes read + written
        out["stats"] = store.stats()
        out["arena_high_water_bytes"] = arena.high_water_bytes
        out["direct_io"] = store.direct_io
    for p in store_dir.glob("shard-*.bin"):  # the benchmark's own scratch files
        p.unlink()
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [("raw O_DIRECT", "raw_direct"), ("engine", "engine"), ("buffered", "buffered")]
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    width = 0.26
    for i, (label, key) in enumerate(kinds):
        vals = [result[key]["write_gbps"], result[key]["read_gbps"]]
        bars = ax.bar(np.arange(2) + (i - 1) * width, vals, width, label=label)
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set_xticks(np.arange(2), ["write", "read"])
    ax.set_ylabel("GB/s")
    ratio = result["ratio_engine_to_raw"]
    ax.set_title(f"SSD engine vs raw disk, {result['size_bytes'] / 2**30:.2f} GiB "
                 f"(engine/raw: write {ratio['write']:.2f}, read {ratio['read']:.2f})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="2GiB", help="state size (default 2GiB)")
    ap.add_argument("--dir", default=None, help="parent folder for scratch files (default: system temp)")
    ap.add_argument("--out", default="docs", help="folder for bench_io.png")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--raw-request", default="64MiB", help="request size of the raw/buffered loops")
    ap.add_argument("--block", default="1MiB", help="offload.block_bytes")
    ap.add_argument("--chunk", default="64MiB", help="offload.chunk_bytes")
    ap.add_argument("--threads", type=int, default=8, help="offload.io_threads")
    ap.add_argument("--depth", type=int, default=3, help="offload.stream_depth")
    args = ap.parse_args(argv)

    size = parse_bytes(args.size, "--size")
    request = parse_bytes(args.raw_request, "--raw-request")
    cfg_fields = dict(block_bytes=args.block, chunk_bytes=args.chunk, io_threads=args.threads,
                      stream_depth=args.depth, staging_bytes=args.block, shard_bytes="1GiB")
    work = Path(tempfile.mkdtemp(prefix="jaxascend-bench-io-", dir=args.dir))
    samples = {k: {"write_gbps": [], "read_gbps": []} for k in ("raw_direct", "engine", "buffered")}
    samples["engine"]["update_gbps"] = []
    last_engine = {}
    try:
        for _ in range(args.repeats):
            w, r = raw_direct(work / "raw.bin", size, request)
            samples["raw_direct"]["write_gbps"].append(w)
            samples["raw_direct"]["read_gbps"].append(r)
            last_engine = engine(work / "store", size, cfg_fields)
            for k in ("write_gbps", "read_gbps", "update_gbps"):
                samples["engine"][k].append(last_engine[k])
            w, r = buffered(work / "buffered.bin", size, request)
            samples["buffered"]["write_gbps"].append(w)
            samples["buffered"]["read_gbps"].append(r)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # only the folder this run created

    result = {"size_bytes": size, "repeats": args.repeats, "raw_request_bytes": request,
              "engine_config": {**cfg_fields, "direct_io": last_engine.get("direct_io")}}
    for kind, metrics in samples.items():
        result[kind] = {k: round(statistics.median(v), 3) for k, v in metrics.items()}
    result["ratio_engine_to_raw"] = {
        d: round(result["engine"][f"{d}_gbps"] / result["raw_direct"][f"{d}_gbps"], 3) for d in ("write", "read")}
    # The disk is noisy (+-2x between back-to-back runs here): the ratio within each repeat,
    # where raw and engine ran seconds apart, is the steadier comparison.
    result["ratio_engine_to_raw_paired"] = {
        d: round(statistics.median(e / r for e, r in zip(samples["engine"][f"{d}_gbps"],
                                                         samples["raw_direct"][f"{d}_gbps"])), 3)
        for d in ("write", "read")}
    result["target_ratio"] = 0.9
    result["meets_target"] = {d: r >= 0.9 for d, r in result["ratio_engine_to_raw"].items()}
    result["engine_stats_last_run"] = {k: (round(v, 4) if isinstance(v, float) else v)
                                       for k, v in last_engine.get("stats", {}).items()}
    result["engine_arena_high_water_bytes"] = last_engine.get("arena_high_water_bytes")
    result["samples"] = {k: {m: [round(x, 3) for x in v] for m, v in d.items()} for k, d in samples.items()}
    png = Path(args.out) / "bench_io.png"
    plot(result, png)
    result["plot"] = str(png)
    json.dump(result, sys.stdout, indent=2)
    print()
    return result


if __name__ == "__main__":
    main()
