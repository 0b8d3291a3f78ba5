"""One full streamed AdamW step over SSD-resident state vs the raw disk; prints JSON.

Lays out ``--params`` parameters (bf16 compute params: a stack of ``--layer-elements`` layers plus
one odd-sized leaf for the remainder; fp32 master/m/v = 12 B/param on SSD, the gradient 2 B/param),
writes the state and one gradient, then times ``--repeats`` steps of
:meth:`OffloadedAdamState.step` (read master/m/v + grad of chunk k+1 while the fused kernel
updates chunk k and chunk k-1 is written back). In the same run, before each step, it measures
the raw disk: sequential O_DIRECT writes then reads (``bench_io.raw_direct``) of as many bytes
as the step reads, and converts both rates into the time the raw disk needs for the step's
bytes (read + written). Target: step time <= 1.15 x that raw time (the compute hides behind
the I/O). Peak RSS is reported for the whole process and for the step alone (VmHWM reset
through /proc/self/clear_refs just before it).

    python scripts/bench_optimizer_step.py --params 20M      # smoke run
    python scripts/bench_optimizer_step.py                   # 180M params: 2.16 GB of state
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_io import raw_direct  # noqa: E402  (the same raw O_DIRECT measurement as bench_io.py)

from jaxascend.config import OffloadConfig, parse_bytes  # noqa: E402
from jaxascend.offload import OffloadedAdamState  # noqa: E402
from jaxascend.optim import AdamHyperParams  # noqa: E402


def parse_count(text: str) -> int:
    """'180M', '1.5B', '20000000' -> an integer parameter count."""
    scale = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9}.get(text[-1:].upper(), 1)
    return int(float(text[:-1] if scale != 1 else text) * scale)


def vm_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def reset_peak_rss() -> bool:
    """Resets VmHWM to the current RSS (Linux >= 4.0); False where not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def model_spec(n_params: int, layer_elements: int) -> tuple[dict, dict]:
    """A stack of layers plus one leaf holding the remainder (an odd size, like an embedding)."""
    layers = max(1, n_params // layer_elements) if n_params >= layer_elements else 0
    rest = n_params - layers * layer_elements
    spec, stacked = {}, {}
    if layers:
        spec["layers"] = jax.ShapeDtypeStruct((layers, layer_elements), jnp.bfloat16)
        stacked["layers"] = True
    if rest:
        spec["embedding"] = jax.ShapeDtypeStruct((rest,), jnp.bfloat16)
        stacked["embedding"] = False
    return spec, stacked


def fill_state(state: OffloadedAdamState, seed: int) -> float:
    """init() from random bf16 params (generated one layer at a time); returns its seconds."""
    rng = np.random.default_rng(seed)
    params = []
    for leaf in state.leaves:
        p = np.empty((leaf.layers, leaf.layer_elements), ml_dtypes.bfloat16)
        for layer in range(leaf.layers):
            p[layer] = rng.standard_normal(leaf.layer_elements, dtype=np.float32) * np.float32(0.02)
        params.append(p.reshape(leaf.shape))
    t0 = time.perf_counter()
    state.init(state.layout.treedef.unflatten(params))
    return time.perf_counter() - t0


def write_gradients(state: OffloadedAdamState, grad: np.ndarray) -> None:
    """The same random gradient into every layer's region, as the backward pass's sink would."""
    for leaf in state.leaves:
        for region in leaf.grad_regions:
            state.store.write(region, grad[:leaf.layer_elements], wait=False)
    state.store.flush()  # on disk before the step starts: the step's counters are its own
    state.mark_gradients_written()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="180M", help="parameter count (default 180M = 2.16 GB of fp32 state)")
    ap.add_argument("--layer-elements", default="16M", help="elements per stacked layer")
    ap.add_argument("--dir", default=None, help="parent folder for scratch files (default: system temp)")
    ap.add_argument("--repeats", type=int, default=3, help="timed steps (each after a raw measurement)")
    ap.add_argument("--chunk", default="64MiB", help="offload.chunk_bytes (fp32 bytes per state tensor)")
    ap.add_argument("--block", default="1MiB", help="offload.block_bytes")
    ap.add_argument("--io-threads", type=int, default=8)
    ap.add_argument("--depth", type=int, default=3, help="offload.stream_depth")
    ap.add_argument("--kernel-threads", type=int, default=1)
    ap.add_argument("--raw-request", default="64MiB", help="request size of the raw O_DIRECT loop")
    args = ap.parse_args(argv)

    n_params = parse_count(args.params)
    spec, stacked = model_spec(n_params, parse_count(args.layer_elements))
    work = Path(tempfile.mkdtemp(prefix="jaxascend-bench-step-", dir=args.dir))
    cfg = OffloadConfig(dir=str(work / "offload"), chunk_bytes=args.chunk, block_bytes=args.block,
                        staging_bytes=args.block, shard_bytes="1GiB", io_threads=args.io_threads,
                        stream_depth=args.depth)
    steps, raws = [], []
    try:
        with OffloadedAdamState.create(spec, cfg, stacked=stacked, kernel_threads=args.kernel_threads) as state:
            init_seconds = fill_state(state, seed=0)
            arena = state.store.arena
            largest = max(leaf.layer_elements for leaf in state.leaves)
            grad = (np.random.default_rng(1).standard_normal(largest, dtype=np.float32)
                    * np.float32(1e-3)).astype(ml_dtypes.bfloat16)
            scalars = [np.asarray(AdamHyperParams(lr=1e-4, weight_decay=0.01, count=i).scalars())
                       for i in range(args.repeats)]
            peak_before_steps = vm_kib("VmHWM") * 1024
            params = None
            for i in range(args.repeats):
                read_bytes = state.layout.state_bytes + state.layout.grad_bytes
                w_gbps, r_gbps = raw_direct(work / "raw.bin", read_bytes, parse_bytes(args.raw_request, "--raw"))
                write_gradients(state, grad)  # not timed: the backward pass writes these
                params = None  # the step does not need the old params: drop them first
                rss_before = vm_kib("VmRSS") * 1024
                reset_ok = reset_peak_rss()
                params = state.step(scalars[i])
                jax.block_until_ready(params)
                s = state.last_step
                raw_seconds = s.bytes_read / (r_gbps * 1e9) + s.bytes_written / (w_gbps * 1e9)
                raws.append({"write_gbps": round(w_gbps, 3), "read_gbps": round(r_gbps, 3),
                             "seconds_for_step_bytes": round(raw_seconds, 3)})
                steps.append({"seconds": round(s.seconds, 3), "bytes_read": s.bytes_read,
                              "bytes_written": s.bytes_written, "ssd_gbps": round(s.ssd_gbps, 3),
                              "read_busy_seconds": round(s.read_busy_seconds, 3),
                              "write_busy_seconds": round(s.write_busy_seconds, 3),
                              "ratio_to_raw": round(s.seconds / raw_seconds, 3),
                              "rss_before_bytes": rss_before,
                              "peak_rss_step_bytes": vm_kib("VmHWM") * 1024 if reset_ok else None})
            result = {
                "params": state.layout.num_parameters, "leaves": {leaf.path: list(leaf.shape) for leaf in state.leaves},
                "state_bytes": state.layout.state_bytes, "grad_bytes": state.layout.grad_bytes,
                "compute_param_bytes": state.layout.grad_bytes, "chunk_elements": state.layout.chunk_elements,
                "arena_bytes": arena.capacity, "arena_high_water_bytes": arena.high_water_bytes,
                "direct_io": state.store.direct_io, "init_seconds": round(init_seconds, 3),
                "config": {"chunk_bytes": cfg.chunk_bytes, "block_bytes": cfg.block_bytes,
                           "io_threads": cfg.io_threads, "stream_depth": cfg.stream_depth,
                           "kernel_threads": args.kernel_threads},
            }
    finally:
        shutil.rmtree(work, ignore_errors=True)  # only the folder this run created

    result["steps"] = steps
    result["raw_direct"] = raws
    result["step_seconds"] = statistics.median(s["seconds"] for s in steps)
    result["ssd_gbps"] = statistics.median(s["ssd_gbps"] for s in steps)
    result["raw_seconds_for_step_bytes"] = statistics.median(r["seconds_for_step_bytes"] for r in raws)
    # The disk is noisy: each step's ratio to the raw run seconds before it is the fair one.
    result["ratio_step_to_raw"] = statistics.median(s["ratio_to_raw"] for s in steps)
    result["target_ratio"] = 1.15
    result["meets_target"] = result["ratio_step_to_raw"] <= 1.15
    step_peaks = [s["peak_rss_step_bytes"] for s in steps if s["peak_rss_step_bytes"] is not None]
    # VmHWM was reset before each step, so the process peak is the larger of the peak before
    # the steps (setup: params for init, arena) and the steps' own peaks.
    result["peak_rss_bytes"] = max([peak_before_steps, vm_kib("VmHWM") * 1024] + step_peaks)
    result["peak_rss_step_bytes"] = max(step_peaks) if step_peaks else None
    json.dump(result, sys.stdout, indent=2)
    print()
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
