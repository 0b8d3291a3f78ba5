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
    python scripts/bench_optimizer_step.py --state-dtypes float32,bfloat16,int8   # compressed moments

With several ``--state-dtypes`` the states are laid out side by side and their steps alternate
round by round (the order flips each round); the comparison reports the SSD bytes per parameter
of a training step (the backward's gradient write + the optimizer's reads and writes) and the
optimizer-phase time ratio against the bytes ratio (``time_over_bytes`` 1.0: time follows bytes).
"""

from __future__ import annotations

import argparse
import contextlib
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
from bench_step import cpu_model  # noqa: E402

from jaxascend.config import OffloadConfig, parse_bytes  # noqa: E402
from jaxascend.offload import OffloadedAdamState  # noqa: E402
from jaxascend.optim import AdamHyperParams, StateFormat  # noqa: E402


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


def _median_range(values) -> dict:
    values = list(values)
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4), "max": round(max(values), 4)}


def plot(result: dict, path: Path) -> None:
    """Per state dtype: SSD bytes per parameter of a training step, and the optimizer step's
    seconds (median, min-max) beside the float32 time scaled by the bytes ratio."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per = result["state_dtypes"]
    names = list(per)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    a.bar(names, [per[d]["ssd_bytes_per_param_step"] for d in names], color=[f"C{i}" for i in range(len(names))])
    for i, d in enumerate(names):
        a.text(i, per[d]["ssd_bytes_per_param_step"], f"{per[d]['ssd_bytes_per_param_step']:.1f}", ha="center",
               va="bottom")
    a.set_ylabel("SSD bytes / parameter / step")
    a.set_title(f"{result['params'] / 1e6:.0f}M params: gradient + optimizer traffic")
    med = [per[d]["step_seconds"]["median"] for d in names]
    err = [[m - per[d]["step_seconds"]["min"] for d, m in zip(names, med)],
           [per[d]["step_seconds"]["max"] - m for d, m in zip(names, med)]]
    b.bar(names, med, yerr=err, capsize=4, color=[f"C{i}" for i in range(len(names))], label="measured")
    base = names[0]
    scaled = [per[base]["step_seconds"]["median"] * per[d]["optimizer_bytes_per_param"]
              / per[base]["optimizer_bytes_per_param"] for d in names]
    b.scatter(names, scaled, color="red", marker="_", s=900, zorder=3, label=f"{base} time x bytes ratio")
    b.set_ylabel("optimizer step (s)")
    b.set_title(result.get("cpu", ""), fontsize=8)
    b.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def state_format(name: str, args) -> StateFormat:
    """``DTYPE`` (a float32 master) or ``DTYPE:ROUNDING`` (a bfloat16 master rounded so)."""
    dtype, _, rounding = name.partition(":")
    return StateFormat.of(dtype, args.state_block, args.state_rounding, *(("bfloat16", rounding) if rounding else ()))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="180M", help="parameter count (default 180M = 2.16 GB of fp32 state)")
    ap.add_argument("--layer-elements", default="16M", help="elements per stacked layer")
    ap.add_argument("--dir", default=None, help="parent folder for scratch files (default: system temp)")
    ap.add_argument("--repeats", type=int, default=3, help="timed steps per state dtype (rounds, alternating)")
    ap.add_argument("--chunk", default="64MiB", help="offload.chunk_bytes (fp32 bytes per state tensor)")
    ap.add_argument("--block", default="1MiB", help="offload.block_bytes")
    ap.add_argument("--io-threads", type=int, default=8)
    ap.add_argument("--depth", type=int, default=3, help="offload.stream_depth")
    ap.add_argument("--kernel-threads", type=int, default=1)
    ap.add_argument("--raw-request", default="64MiB", help="request size of the raw O_DIRECT loop")
    ap.add_argument("--state-dtypes", default="float32",
                    help="comma-separated optimizer.state_dtype values to compare in one run, alternating "
                         "(e.g. float32,bfloat16,int8; the first is the baseline of the ratios); each may name a "
                         "bfloat16 master after a colon: int8:compensated, int8:stochastic")
    ap.add_argument("--state-block", type=int, default=2048, help="optimizer.state_block of int8 state")
    ap.add_argument("--state-rounding", choices=["stochastic", "nearest"], default="stochastic",
                    help="optimizer.state_rounding of bfloat16/int8 state")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here (and a PNG beside it)")
    ap.add_argument("--replot", type=Path, default=None, help="only redraw the PNG of a saved JSON")
    args = ap.parse_args(argv)
    if args.replot is not None:
        result = json.loads(args.replot.read_text())
        plot(result, args.replot.with_suffix(".png"))
        return result

    dtypes = [d.strip() for d in args.state_dtypes.split(",") if d.strip()]
    formats = {d: state_format(d, args) for d in dtypes}
    n_params = parse_count(args.params)
    spec, stacked = model_spec(n_params, parse_count(args.layer_elements))
    work = Path(tempfile.mkdtemp(prefix="jaxascend-bench-step-", dir=args.dir))
    steps: dict[str, list] = {d: [] for d in dtypes}
    raws, per_dtype = [], {}
    try:
        with contextlib.ExitStack() as stack:
            states = {}
            for d in dtypes:
                cfg = OffloadConfig(dir=str(work / f"offload-{d}"), chunk_bytes=args.chunk, block_bytes=args.block,
                                    staging_bytes=args.block, shard_bytes="1GiB", io_threads=args.io_threads,
                                    stream_depth=args.depth)
                states[d] = stack.enter_context(OffloadedAdamState.create(
                    spec, cfg, stacked=stacked, kernel_threads=args.kernel_threads, state=formats[d]))
                per_dtype[d] = {"init_seconds": round(fill_state(states[d], seed=0), 3)}
            first = states[dtypes[0]]
            largest = max(leaf.layer_elements for leaf in first.leaves)
            grad = (np.random.default_rng(1).standard_normal(largest, dtype=np.float32)
                    * np.float32(1e-3)).astype(ml_dtypes.bfloat16)
            scalars = [np.asarray(AdamHyperParams(lr=1e-4, weight_decay=0.01, count=i).scalars())
                       for i in range(args.repeats)]
            peak_before_steps = vm_kib("VmHWM") * 1024
            for i in range(args.repeats):
                read_bytes = first.layout.state_bytes + first.layout.grad_bytes
                w_gbps, r_gbps = raw_direct(work / "raw.bin", read_bytes, parse_bytes(args.raw_request, "--raw"))
                raws.append({"write_gbps": round(w_gbps, 3), "read_gbps": round(r_gbps, 3)})
                order = dtypes if i % 2 == 0 else dtypes[::-1]  # alternate who goes first
                for d in order:
                    state = states[d]
                    before = state.store.stats()["bytes_written"]
                    write_gradients(state, grad)  # not timed: the backward pass writes these
                    grad_written = state.store.stats()["bytes_written"] - before
                    rss_before = vm_kib("VmRSS") * 1024
                    reset_ok = reset_peak_rss()
                    params = state.step(scalars[i])
                    jax.block_until_ready(params)
                    del params
                    s = state.last_step
                    raw_seconds = s.bytes_read / (r_gbps * 1e9) + s.bytes_written / (w_gbps * 1e9)
                    steps[d].append({"seconds": round(s.seconds, 3), "bytes_read": s.bytes_read,
                                     "bytes_written": s.bytes_written, "gradient_bytes_written": grad_written,
                                     "ssd_gbps": round(s.ssd_gbps, 3),
                                     "read_busy_seconds": round(s.read_busy_seconds, 3),
                                     "write_busy_seconds": round(s.write_busy_seconds, 3),
                                     "raw_seconds_for_step_bytes": round(raw_seconds, 3),
                                     "ratio_to_raw": round(s.seconds / raw_seconds, 3),
                                     "rss_before_bytes": rss_before,
                                     "peak_rss_step_bytes": vm_kib("VmHWM") * 1024 if reset_ok else None})
            n = first.layout.num_parameters
            for d, state in states.items():
                arena = state.store.arena
                per_dtype[d].update({
                    "state_bytes": state.layout.state_bytes, "state_bytes_per_param": round(state.layout.state_bytes / n, 4),
                    "chunk_elements": state.layout.chunk_elements, "arena_bytes": arena.capacity,
                    "arena_high_water_bytes": arena.high_water_bytes, "direct_io": state.store.direct_io})
            result = {
                "params": n, "leaves": {leaf.path: list(leaf.shape) for leaf in first.leaves},
                "grad_bytes": first.layout.grad_bytes, "compute_param_bytes": first.layout.grad_bytes,
                "config": {"chunk_bytes": args.chunk, "block_bytes": args.block, "io_threads": args.io_threads,
                           "stream_depth": args.depth, "kernel_threads": args.kernel_threads,
                           "state_block": args.state_block, "state_rounding": args.state_rounding},
            }
    finally:
        shutil.rmtree(work, ignore_errors=True)  # only the folder this run created

    for d in dtypes:
        runs = steps[d]
        r = per_dtype[d]
        r["steps"] = runs
        r["step_seconds"] = _median_range(x["seconds"] for x in runs)
        # What one training step moves on SSD per parameter: the backward's gradient write, then
        # the optimizer's reads (state records + gradient) and writes (state records).
        r["ssd_bytes_per_param_step"] = round(statistics.median(
            (x["bytes_read"] + x["bytes_written"] + x["gradient_bytes_written"]) / n for x in runs), 3)
        r["optimizer_bytes_per_param"] = round(statistics.median((x["bytes_read"] + x["bytes_written"]) / n
                                                                 for x in runs), 3)
        r["ssd_gbps"] = statistics.median(x["ssd_gbps"] for x in runs)
        r["ratio_step_to_raw"] = _median_range(x["ratio_to_raw"] for x in runs)
        peaks = [x["peak_rss_step_bytes"] for x in runs if x["peak_rss_step_bytes"] is not None]
        r["peak_rss_step_bytes"] = max(peaks) if peaks else None
    base = dtypes[0]
    comparison = {}
    for d in dtypes[1:]:
        # per round (the two steps ran back to back), then the median and range over rounds
        time_ratios = [a["seconds"] / b["seconds"] for a, b in zip(steps[d], steps[base])]
        byte_ratio = per_dtype[d]["optimizer_bytes_per_param"] / per_dtype[base]["optimizer_bytes_per_param"]
        time_ratio = statistics.median(time_ratios)
        comparison[f"{d} vs {base}"] = {
            "ssd_bytes_per_param_step": [per_dtype[base]["ssd_bytes_per_param_step"],
                                         per_dtype[d]["ssd_bytes_per_param_step"]],
            "optimizer_bytes_ratio": round(byte_ratio, 4),
            "optimizer_time_ratio": _median_range(time_ratios),
            # "down in proportion": the time ratio over the bytes ratio, 1.0 when time follows bytes
            "time_over_bytes": round(time_ratio / byte_ratio, 4),
            "within_15_percent": abs(time_ratio / byte_ratio - 1) <= 0.15,
        }
    result["state_dtypes"] = per_dtype
    result["comparison"] = comparison
    result["raw_direct"] = raws
    result["step_seconds"] = per_dtype[base]["step_seconds"]["median"]
    result["ratio_step_to_raw"] = per_dtype[base]["ratio_step_to_raw"]["median"]
    result["target_ratio"] = 1.15
    result["meets_target"] = result["ratio_step_to_raw"] <= 1.15
    result["peak_rss_bytes"] = max([peak_before_steps, vm_kib("VmHWM") * 1024])
    result["cpu"] = cpu_model()
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
        if len(dtypes) > 1:
            plot(result, args.out.with_suffix(".png"))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
