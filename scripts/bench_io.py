"""SSD engine throughput against the strongest baseline on the same disk, in one run; prints JSON
and writes a PNG.

Contenders, each run once per round, in an order that rotates from round to round (the disk is
shared and noisy, so they alternate rather than run back to back):

  * engine: the SSD engine streaming a state of ``--size`` bytes (4 regions, like master/m/v/grad)
    through arena slots, every block's crc32c computed on write and verified on read: one write
    pass onto freshly preallocated shards (``write_fresh``), ``--iters`` overwrite passes
    (``write``), ``--iters`` read passes (``read``) and one update pass (read + write back, as the
    optimizer does; ``update``, bytes read + written);
  * raw_qd<N>: this script's deep-queue O_DIRECT baseline, no checksums, no store: N Python
    threads issuing ``os.pwrite``/``os.preadv`` of ``--raw-request`` bytes (the GIL is released
    in the syscall; it measured as fast as the same loop in C++), each from its own piece of one
    private buffer of N x request bytes advised into transparent huge pages (the engine's arena
    gets the same advice), over one file truncated and preallocated like the engine's shards: one
    fresh write, ``--iters`` overwrites, ``--iters`` reads; one contender per ``--raw-qd`` value,
    and raw_qd<N>_engine_footprint (first --raw-qd): the same loop cycling through a buffer as
    large as the engine's stream slots (chunk x depth), since on the measured VM the
    destination's footprint alone moved reads from 3.6 to 2.5 GB/s (docs/bench_io.md);
  * deepspeed_aio: DeepSpeed's ``aio_handle`` (libaio, O_DIRECT) through
    ``/work/shared/peers/bench_ds_aio.py --size <size> --qd 8 --intra 1 --iters <iters>`` run by
    ``--peer-python`` (default ``/tmp/peer/venv/bin/python``) as a subprocess; its JSON gives
    write_fresh_GBps (one write to a new file), write_GBps and read_GBps (medians of its iters);
    skipped, with the reason in the JSON, when that interpreter or script is missing;
  * buffered (with ``--buffered``): ``write`` + ``fsync``, and ``read`` after
    ``posix_fadvise(DONTNEED)``; page-cache I/O for contrast, not a baseline.

GB/s is bytes / wall time of the whole pass (pipeline start-up and drain included), GB = 1e9 B.
Per contender and direction the JSON gives the median, min and max over rounds (each round's
value is the median of its iters). The engine is judged against the best baseline (raw_qd* or
deepspeed_aio, whichever has the higher median in that direction): ``ratio_engine_to_best`` divides
the medians, ``ratio_engine_to_best_paired`` is the median over rounds of engine / best baseline
of that round (the steadier figure on a noisy disk). Target: >= 1.0 for ``read`` and ``write``.

    python scripts/bench_io.py --size 256MiB --rounds 1 --iters 1      # smoke run
    python scripts/bench_io.py                                         # 2 GiB, 3 rounds
    python scripts/bench_io.py --io-engine threads --rounds 5          # the thread engine

Flags: --size, --rounds, --iters, --dir (scratch parent; default the system temp), --out (folder
for bench_io.png and bench_io.json), --block/--chunk/--depth (offload.block_bytes, chunk_bytes,
stream_depth), --io-engine/--queue-depth/--threads (offload.io_engine, queue_depth, io_threads),
--no-huge-pages (offload.huge_pages false, and the raw baseline's buffer on 4 KiB pages too),
--raw-qd (comma list), --raw-request, --no-footprint-baseline, --peer-python, --peer-script,
--no-deepspeed, --buffered.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from jaxascend.config import OffloadConfig, parse_bytes
from jaxascend.ssd import ArenaPlan, HostArena, Segment, SsdStore

REGIONS = ("master", "m", "v", "grad")
HUGE_PAGE = 2 << 20
DIRECTIONS = ("write_fresh", "write", "read")
PEER_SCRIPT = "/work/shared/peers/bench_ds_aio.py"
PEER_PYTHON = "/tmp/peer/venv/bin/python"


# ---------------------------------------------------------------------------- raw baseline
class AlignedBuffer:
    """``nbytes`` of anonymous memory at a 2 MiB-aligned address (valid for O_DIRECT), optionally
    advised into transparent huge pages before it is touched, filled with random bytes."""

    def __init__(self, nbytes: int, huge_pages: bool):
        # Private, not mmap's default shared mapping: shared anonymous memory is shmem, which gets
        # no transparent huge pages unless shmem_enabled says so.
        self._map = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        address = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self.offset = -address % HUGE_PAGE
        if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
            self._map.madvise(mmap.MADV_HUGEPAGE, self.offset, nbytes // HUGE_PAGE * HUGE_PAGE or HUGE_PAGE)
        self.view = memoryview(self._map)[self.offset:self.offset + nbytes]
        np.frombuffer(self.view, np.uint8)[:] = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)

    def close(self) -> None:
        self.view.release()
        self._map.close()


def _raw_pass(fd: int, size: int, request: int, qd: int, buf: AlignedBuffer, write: bool) -> float:
    """``qd`` threads move ``size`` bytes in ``request``-byte pieces of ``buf``; returns GB/s.
    ``os.pwrite``/``os.preadv`` release the GIL during the syscall."""
    next_piece = iter(range(0, size, request))
    lock = threading.Lock()
    errors = []

    pieces = len(buf.view) // request

    def worker(k: int) -> None:
        while True:
            with lock:
                off = next(next_piece, None)
            if off is None:
                return
            n = min(request, size - off)
            # Thread k's piece when the buffer is qd pieces long; else the pieces in turn, as the
            # engine cycles through its arena slots.
            piece = k if pieces == qd else off // request % pieces
            mine = buf.view[piece * request:(piece + 1) * request]
            got = os.pwrite(fd, mine[:n], off) if write else os.preadv(fd, [mine[:n]], off)
            if got != n:
                errors.append(f"short raw {'write' if write else 'read'} at {off}: {got} of {n}")
                return

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(qd)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    if errors:
        raise OSError(errors[0])
    return size / seconds / 1e9


def raw_deep_queue(path: Path, size: int, request: int, qd: int, iters: int, huge_pages: bool,
                   footprint: int = 0) -> dict:
    """Fresh write, ``iters`` overwrites and ``iters`` reads of one O_DIRECT file at queue depth
    ``qd``, through a buffer of ``footprint`` bytes (default: one request per thread)."""
    buf = AlignedBuffer(max(footprint // request, qd) * request, huge_pages)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        os.posix_fallocate(fd, 0, size)  # like the engine, which preallocates its shards
        out = {"write_fresh": _raw_pass(fd, size, request, qd, buf, write=True)}
        out["write"] = statistics.median(_raw_pass(fd, size, request, qd, buf, True) for _ in range(iters))
        out["read"] = statistics.median(_raw_pass(fd, size, request, qd, buf, False) for _ in range(iters))
    finally:
        os.close(fd)
        buf.close()
        path.unlink()
    return out


def raw_direct(path: Path, size: int, request: int) -> tuple[float, float]:
    """Sequential queue-depth-1 O_DIRECT write then read of ``size`` bytes; (write GB/s, read GB/s).
    Kept for scripts/bench_optimizer_step.py; this script's baseline is :func:`raw_deep_queue`."""
    buf = AlignedBuffer(request, huge_pages=False)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        os.posix_fallocate(fd, 0, size)
        t0 = time.perf_counter()
        for off in range(0, size, request):
            n = os.pwrite(fd, buf.view[:min(request, size - off)], off)
            if n != min(request, size - off):
                raise OSError(f"short raw write at {off}: {n}")
        write_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for off in range(0, size, request):
            n = os.preadv(fd, [buf.view[:min(request, size - off)]], off)
            if n != min(request, size - off):
                raise OSError(f"short raw read at {off}: {n}")
        read_s = time.perf_counter() - t0
    finally:
        os.close(fd)
        buf.close()
        path.unlink()
    return size / write_s / 1e9, size / read_s / 1e9


# ---------------------------------------------------------------------------- DeepSpeed aio
def deepspeed_unavailable(peer_python: str, peer_script: str) -> str:
    """Why DeepSpeed aio cannot run here ('' if it can)."""
    if not Path(peer_python).exists():
        return f"{peer_python} not found (run /work/shared/peers/setup_peer.sh)"
    if not Path(peer_script).exists():
        return f"{peer_script} not found"
    return ""


def deepspeed_aio(peer_python: str, peer_script: str, path: Path, size: int, iters: int) -> dict:
    """One run of the peer script; raises RuntimeError with its stderr tail when it fails."""
    cmd = [peer_python, peer_script, "--file", str(path), "--size", str(size), "--qd", "8", "--intra", "1",
           "--iters", str(iters)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}")
    got = json.loads(lines[-1])
    if not got.get("data_ok"):
        raise RuntimeError(f"DeepSpeed aio read back wrong data: {got}")
    return {"write_fresh": got["write_fresh_GBps"], "write": got["write_GBps"], "read": got["read_GBps"]}


# ---------------------------------------------------------------------------- buffered contrast
def buffered(path: Path, size: int, request: int) -> dict:
    """write + fsync, then read after dropping the page cache (one thread)."""
    buf = AlignedBuffer(request, huge_pages=False)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        t0 = time.perf_counter()
        for off in range(0, size, request):
            os.pwrite(fd, buf.view[:min(request, size - off)], off)
        os.fsync(fd)
        write_s = time.perf_counter() - t0
        os.posix_fadvise(fd, 0, size, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        for off in range(0, size, request):
            os.preadv(fd, [buf.view[:min(request, size - off)]], off)
        read_s = time.perf_counter() - t0
    finally:
        os.close(fd)
        buf.close()
        path.unlink()
    return {"write": size / write_s / 1e9, "read": size / read_s / 1e9}


# ---------------------------------------------------------------------------- the engine
def engine(store_dir: Path, size: int, iters: int, cfg_fields: dict) -> dict:
    """Write (fresh, then overwrites), read and update passes of the SSD engine over ``size`` bytes."""
    cfg = OffloadConfig(dir=str(store_dir), **cfg_fields)
    chunk = cfg.chunk_bytes
    plan = ArenaPlan().extend(SsdStore.arena_requests(cfg)).add("bench", chunk, cfg.stream_depth)
    region_bytes = -(-size // len(REGIONS) // cfg.block_bytes) * cfg.block_bytes
    total = region_bytes * len(REGIONS)
    out = {}
    with HostArena(plan, cfg) as arena, SsdStore(cfg, arena) as store:
        for name in REGIONS:
            store.add_region(name, region_bytes)
        for slot in arena.slots("bench"):  # random content: the disk must not see zeros
            arena.array(slot)[:] = np.random.default_rng(slot.id).integers(0, 256, slot.nbytes, dtype=np.uint8)

        def run(read: bool, write: bool) -> float:
            chunks = [[Segment(name, off, min(chunk, region_bytes - off), read=read, write=write)]
                      for name in REGIONS for off in range(0, region_bytes, chunk)]
            t0 = time.perf_counter()
            with store.stream(chunks, "bench") as stream:
                for _ in stream:
                    pass
            return (2 if read and write else 1) * total / (time.perf_counter() - t0) / 1e9

        out["write_fresh"] = run(read=False, write=True)
        out["write"] = statistics.median(run(read=False, write=True) for _ in range(iters))
        out["read"] = statistics.median(run(read=True, write=False) for _ in range(iters))
        out["update"] = run(read=True, write=True)  # bytes read + written
        out["stats"] = store.stats()
        out["io_engine"] = store.io_engine
        out["io_engine_status"] = store.io_engine_status
        out["direct_io"] = store.direct_io
        out["huge_page_status"] = arena.huge_page_status
        out["arena_high_water_bytes"] = arena.high_water_bytes
    for p in store_dir.glob("shard-*.bin"):  # the benchmark's own scratch files
        p.unlink()
    return out


# ---------------------------------------------------------------------------- report
def summarize(samples: list) -> dict:
    return {"median": round(statistics.median(samples), 3), "min": round(min(samples), 3),
            "max": round(max(samples), 3), "samples": [round(x, 3) for x in samples]}


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or "unknown"


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, c in result["contenders"].items() if "skipped" not in c]
    fig, ax = plt.subplots(figsize=(7.6, 4.0))
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        c = result["contenders"][name]
        dirs = [d for d in DIRECTIONS if d in c]
        x = np.array([DIRECTIONS.index(d) for d in dirs]) + (i - (len(names) - 1) / 2) * width
        med = np.array([c[d]["median"] for d in dirs])
        err = np.array([[m - c[d]["min"] for d, m in zip(dirs, med)], [c[d]["max"] - m for d, m in zip(dirs, med)]])
        bars = ax.bar(x, med, width, yerr=err, capsize=2, label=name)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks(np.arange(len(DIRECTIONS)), ["write (fresh file)", "write (overwrite)", "read"])
    ax.set_ylabel("GB/s (median; bars: min-max over rounds)")
    r = result["ratio_engine_to_best_paired"]
    title = (f"SSD engine ({result['io_engine']}, chunk {result['engine_config']['chunk_bytes']}) vs baselines, "
             f"{result['size_bytes'] / 2**30:.2f} GiB, {result['rounds']} rounds\n"
             f"engine/best (paired): write {r['write']:.2f}, read {r['read']:.2f}, fresh {r['write_fresh']:.2f}")
    ds = result.get("ratio_engine_to_deepspeed_paired")
    if ds:
        title += f"; engine/DeepSpeed aio: write {ds['write']:.2f}, read {ds['read']:.2f}, fresh {ds['write_fresh']:.2f}"
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="2GiB", help="bytes per pass (default 2GiB)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every contender (default 3)")
    ap.add_argument("--iters", type=int, default=3, help="overwrite and read passes per round (default 3)")
    ap.add_argument("--dir", default=None, help="parent folder for scratch files (default: system temp)")
    ap.add_argument("--out", default="docs", help="folder for bench_io.png and bench_io.json")
    ap.add_argument("--block", default="1MiB", help="offload.block_bytes")
    ap.add_argument("--chunk", default="64MiB", help="offload.chunk_bytes")
    ap.add_argument("--depth", type=int, default=3, help="offload.stream_depth")
    ap.add_argument("--io-engine", default="auto", help="offload.io_engine: auto, io_uring or threads")
    ap.add_argument("--queue-depth", type=int, default=OffloadConfig.queue_depth, help="offload.queue_depth")
    ap.add_argument("--threads", type=int, default=OffloadConfig.io_threads, help="offload.io_threads")
    ap.add_argument("--no-huge-pages", action="store_true", help="4 KiB pages for the arena and the raw buffer")
    ap.add_argument("--raw-qd", default="8,32", help="queue depths of the raw baseline (comma list)")
    ap.add_argument("--raw-request", default="1MiB", help="request size of the raw and buffered loops")
    ap.add_argument("--no-footprint-baseline", action="store_true",
                    help="skip the raw baseline through a buffer as large as the engine's stream slots")
    ap.add_argument("--peer-python", default=PEER_PYTHON, help="the interpreter with DeepSpeed")
    ap.add_argument("--peer-script", default=PEER_SCRIPT, help="the DeepSpeed aio benchmark")
    ap.add_argument("--no-deepspeed", action="store_true", help="skip the DeepSpeed aio baseline")
    ap.add_argument("--buffered", action="store_true", help="also run the buffered page-cache contrast")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.iters < 1:
        ap.error("--rounds and --iters must be >= 1")

    size = parse_bytes(args.size, "--size")
    request = parse_bytes(args.raw_request, "--raw-request")
    raw_qds = [int(q) for q in args.raw_qd.split(",") if q.strip()]
    huge = not args.no_huge_pages
    cfg_fields = dict(block_bytes=args.block, chunk_bytes=args.chunk, stream_depth=args.depth,
                      io_engine=args.io_engine, queue_depth=args.queue_depth, io_threads=args.threads,
                      huge_pages=huge, staging_bytes=args.block, shard_bytes="1GiB")
    OffloadConfig(**cfg_fields)  # a bad flag fails here, before any I/O
    ds_skip = "--no-deepspeed" if args.no_deepspeed else deepspeed_unavailable(args.peer_python, args.peer_script)

    work = Path(tempfile.mkdtemp(prefix="jaxascend-bench-io-", dir=args.dir))
    contenders = {"engine": lambda: engine(work / "store", size, args.iters, cfg_fields)}
    for qd in raw_qds:
        contenders[f"raw_qd{qd}"] = lambda qd=qd: raw_deep_queue(work / "raw.bin", size, request, qd, args.iters, huge)
    # The destination's footprint matters on the measured VM (docs/bench_io.md): the same loop
    # through as many bytes as the engine's stream slots hold.
    engine_footprint = OffloadConfig(**cfg_fields).chunk_bytes * args.depth
    if not args.no_footprint_baseline:
        contenders[f"raw_qd{raw_qds[0]}_engine_footprint"] = lambda: raw_deep_queue(
            work / "raw.bin", size, request, raw_qds[0], args.iters, huge, footprint=engine_footprint)
    if not ds_skip:
        contenders["deepspeed_aio"] = lambda: deepspeed_aio(args.peer_python, args.peer_script, work / "aio.bin",
                                                            size, args.iters)
    if args.buffered:
        contenders["buffered"] = lambda: buffered(work / "buffered.bin", size, request)
    samples = {name: {} for name in contenders}
    last_engine = {}
    order = list(contenders)
    try:
        for k in range(args.rounds):
            for name in order[k % len(order):] + order[:k % len(order)]:  # rotate who goes first
                got = contenders[name]()
                if name == "engine":
                    last_engine = got
                for metric in ("write_fresh", "write", "read", "update"):
                    if metric in got:
                        samples[name].setdefault(metric, []).append(got[metric])
                print(f"round {k}: {name} " + " ".join(f"{m}={v[-1]:.3f}" for m, v in samples[name].items()),
                      file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # only the folder this run created

    baselines = [n for n in samples if n.startswith("raw_qd") or n == "deepspeed_aio"]
    result_footprint = {"engine_stream_slot_bytes": engine_footprint,
                        **{f"raw_qd{qd}_buffer_bytes": qd * request for qd in raw_qds}}
    result = {
        "size_bytes": size, "rounds": args.rounds, "iters": args.iters, "cpu": cpu_model(),
        "kernel": platform.release(), "raw_request_bytes": request,
        "engine_config": {**cfg_fields, "direct_io": last_engine.get("direct_io")},
        "io_engine": last_engine.get("io_engine"), "io_engine_status": last_engine.get("io_engine_status"),
        "huge_page_status": last_engine.get("huge_page_status"),
        "footprints": result_footprint,
        "contenders": {name: {m: summarize(v) for m, v in s.items()} for name, s in samples.items()},
    }
    if ds_skip:
        result["contenders"]["deepspeed_aio"] = {"skipped": ds_skip}
    best, ratio, paired = {}, {}, {}
    for d in DIRECTIONS:
        best[d] = max(baselines, key=lambda n: statistics.median(samples[n][d]))
        ratio[d] = round(statistics.median(samples["engine"][d]) / statistics.median(samples[best[d]][d]), 3)
        per_round = [e / max(samples[n][d][k] for n in baselines) for k, e in enumerate(samples["engine"][d])]
        paired[d] = round(statistics.median(per_round), 3)
    result["best_baseline"] = best
    result["ratio_engine_to_best"] = ratio
    result["ratio_engine_to_best_paired"] = paired
    if "deepspeed_aio" in samples:
        result["ratio_engine_to_deepspeed_paired"] = {
            d: round(statistics.median(e / s for e, s in zip(samples["engine"][d], samples["deepspeed_aio"][d])), 3)
            for d in DIRECTIONS}
    footprint_name = f"raw_qd{raw_qds[0]}_engine_footprint"
    if footprint_name in samples:
        result["ratio_engine_to_raw_at_engine_footprint_paired"] = {
            d: round(statistics.median(e / s for e, s in zip(samples["engine"][d], samples[footprint_name][d])), 3)
            for d in DIRECTIONS}
    result["target_ratio"] = 1.0
    result["meets_target"] = {d: paired[d] >= 1.0 for d in ("write", "read")}
    result["engine_stats_last_run"] = {k: (round(v, 4) if isinstance(v, float) else v)
                                       for k, v in last_engine.get("stats", {}).items()}
    result["engine_arena_high_water_bytes"] = last_engine.get("arena_high_water_bytes")
    out = Path(args.out)
    plot(result, out / "bench_io.png")
    result["plot"] = str(out / "bench_io.png")
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_io.json").write_text(json.dumps(result, indent=2) + "\n")
    json.dump(result, sys.stdout, indent=2)
    print()
    return result


if __name__ == "__main__":
    main()
