"""Step time of the offloaded step: overlapped vs sequential, against compute alone, the SSD floor
and DeepSpeed ZeRO-Infinity, in one run, interleaved. Prints JSON, writes a PNG and a timeline.

Contenders, each in its own process, in a rotating order every round:
  * ``overlap``: jaxascend with ``offload.overlap: true`` (the optimizer of step t on a thread
    beside step t+1's forward/backward);
  * ``sequential``: ``offload.overlap: false`` (forward/backward, then the streamed AdamW);
  * ``compute``: the forward/backward alone, the optimizer skipped (its gradients still go to
    SSD as they are computed: that is part of the backward);
  * ``overlap_ssd``: overlapped, with the layer stack's weights on SSD too (``offload.params:
    ssd``: less memory; each layer written by the update and read back by the backward's
    recomputation, the forward's copy handed over in memory);
  * only when ``--contenders`` names them: ``overlap_master16``/``overlap_host_grads`` (``overlap``
    with a bfloat16 compensated master / the gradients in RAM; ``_4layers``: the first 4 layers'
    only, ``offload.host_gradient_layers``), ``overlap_ssd_compact``(``_host``)
    (``overlap_ssd`` with a compensated master and int8 moments, gradients on SSD / in RAM: 17.7
    and 13.7 B/param a step at 7B), ``overlap``(``_ssd``)``_durable`` (``offload.durable``); each
    its own SSD floor: its measured bytes per step at the round's raw disk speeds;
  * ``deepspeed``: ``../shared/peers/zero_infinity/zinf_train.py`` with the lean settings
    (``sub_group_size`` 1e8, buckets 5e7, max live params 1e8), optimizer state on NVMe, when
    ``/tmp/peer/venv`` exists (``--peer off`` to skip);
  * ``disk``: ``scripts/bench_io.py`` once per round (2 GiB): the raw O_DIRECT baselines (a
    deep-queue reader/writer and DeepSpeed's aio) and the engine's own read/write bandwidth.

A step's time is the time between consecutive returns of ``engine.step`` (steady state: the
first ``--warmup`` steps, which compile, are left out); DeepSpeed's is its own ``step_s``
(forward, backward, ``engine.step``). Peak RSS is ``getrusage`` ``ru_maxrss`` for every
contender, as zinf_train.py reports it. The SSD floor is the traffic of one step at the best
raw speeds the same round measured, one direction at a time:
``params * (14 B / read GB/s + 14 B / write GB/s)`` (fp32 master+m+v and the 16-bit gradient,
read and written: 28 B/param). Ratios are medians over rounds with their ranges.

``--grad-accum 1,4,16`` runs every contender at each A (jaxascend's ``train.grad_accum``;
DeepSpeed's ``gradient_accumulation_steps`` through ``scripts/zinf_accum.py``, which also times
its forward/backward alone): s/step, tokens/s, peak RSS, SSD bytes a step, overlap fraction.

    python scripts/bench_step.py                      # 0.54B Llama shape, 3 rounds (~40 min)
    python scripts/bench_step.py --shape small --rounds 1 --peer off    # a smoke run (~2 min)
    python scripts/bench_step.py --grad-accum 1,4,8,16 --contenders overlap,compute,deepspeed --io-size 0"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_step_plots import plot, plot_accumulation  # scripts/ is on the path

REPO = Path(__file__).resolve().parent.parent
PEER_PY = Path("/tmp/peer/venv/bin/python")
ZINF = REPO.parent / "shared" / "peers" / "zero_infinity" / "zinf_train.py"
ZINF_ACCUM = REPO / "scripts" / "zinf_accum.py"

SHAPES = {
    # the 0.54B Llama shape of issue 13: 8 x 2048, MLP 5632, vocab 32000 (untied), 16 heads
    "0.54b": {"layers": 8, "hidden": 2048, "intermediate": 5632, "vocab": 32000, "heads": 16, "kv_heads": 16},
    "small": {"layers": 4, "hidden": 256, "intermediate": 688, "vocab": 4096, "heads": 4, "kv_heads": 4},
}
CONTENDERS = ("overlap", "sequential", "compute", "overlap_ssd", "deepspeed")
# With --contenders only: fewer bytes a step (issue 39) beside float32 and gradients on SSD,
# resident and on SSD. The compact state is the one whose quality holds: a compensated bfloat16
# master (the float32 step exactly) and int8 moments.
COMPACT_STATE = ["optimizer.master_dtype=bfloat16", "optimizer.state_dtype=int8"]
MASTER16 = {"overlap_master16": ["optimizer.master_dtype=bfloat16"],
            "overlap_host_grads": ["offload.gradients=host"],
            # the first 4 layers' gradients in RAM (0.54b: half the stack), the rest and the table's on SSD
            "overlap_host_grads_4layers": ["offload.gradients=host", "offload.host_gradient_layers=4"],
            "overlap_ssd_compact": COMPACT_STATE,  # 17.7 B/param a step at 7B, from 31.4
            "overlap_ssd_compact_host": [*COMPACT_STATE, "offload.gradients=host"],  # 13.7 B/param
            "overlap_durable": ["offload.durable=true"], "overlap_ssd_durable": ["offload.durable=true"],
            # durable steps with the gradients in RAM: each update first copies them to their log on SSD
            "overlap_host_durable": ["offload.gradients=host", "offload.durable=true"]}
JAX_MODES = ("overlap", "sequential", "compute", "overlap_ssd", *MASTER16)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="0.54b")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=5, help="steps per jaxascend run (the first --warmup excluded)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--grad-accum", default="1", help="comma-separated micro-batches per step (A), each run")
    p.add_argument("--peer", choices=["auto", "off"], default="auto")
    p.add_argument("--peer-dtype", choices=["bf16", "fp32"], default="bf16",
                   help="DeepSpeed's dtype (fp32 where torch's bf16 matmuls are slow: CPUs without AVX-512 BF16)")
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--io-size", default="2GiB", help="bench_io size per round ('0' skips the disk round)")
    p.add_argument("--work-dir", default="/tmp/jaxascend-bench-step")
    p.add_argument("--out", default=str(REPO / "docs" / "bench_step.json"))
    p.add_argument("--set", dest="extra", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="extra override for every jaxascend contender")
    p.add_argument("--child", choices=list(JAX_MODES), help=argparse.SUPPRESS)
    p.add_argument("--child-dir", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                flags = Path("/proc/cpuinfo").read_text()
                isa = "AVX-512" if " avx512f" in flags else ("AVX2" if " avx2" in flags else "no AVX2")
                return f"{line.split(':', 1)[1].strip()} ({isa}, {os.cpu_count()} cores)"
    except OSError:
        pass
    return "unknown"


def jaxascend_overrides(shape: dict, args, mode: str, work: Path) -> list[str]:
    return [
        "model.arch=llama", f"model.hidden_size={shape['hidden']}", f"model.intermediate_size={shape['intermediate']}",
        f"model.num_hidden_layers={shape['layers']}", f"model.num_attention_heads={shape['heads']}",
        f"model.num_key_value_heads={shape['kv_heads']}", f"model.vocab_size={shape['vocab']}",
        "model.tie_word_embeddings=false", "model.dtype=bfloat16", "model.param_dtype=bfloat16",
        # dots: matmul outputs are kept, the rest of each layer (and the fetch of its weights) recomputed
        "model.remat=dots", f"data.seq_len={args.seq_len}", f"data.batch_size={args.batch}",
        "offload.enabled=true", f"offload.params={'ssd' if 'ssd' in mode else 'resident'}", *MASTER16.get(mode, []),
        "offload.chunk_bytes=8MiB", "offload.staging_bytes=8MiB", "optimizer.warmup_steps=0",
        f"offload.overlap={'true' if mode.startswith('overlap') else 'false'}",
        f"offload.dir={work / 'offload'}", f"train.out_dir={work}", f"train.steps={args.steps}",
        f"train.grad_accum={args.grad_accum}", *args.extra,
    ]


# ---------------------------------------------------------------- child: one jaxascend contender
def child_main(args) -> int:
    """Builds the engine as the trainer does and times ``engine.step`` on random tokens."""
    import numpy as np

    from jaxascend.config import load_config
    from jaxascend.hf import build_model_lean
    from jaxascend.models import count_params
    from jaxascend.offload import StepPlan
    from jaxascend.preparation import resolve_model_config
    from jaxascend.trainer import build_engine

    work = Path(args.child_dir)
    cfg = load_config(str(REPO / "configs" / "tiny.yaml"),
                      jaxascend_overrides(SHAPES[args.shape], args, args.child, work))
    model_cfg = resolve_model_config(cfg)
    model = build_model_lean(model_cfg, model_cfg.vocab_size, cfg.train.seed)
    n_params = count_params(model)
    engine = build_engine(cfg, model, model_cfg, StepPlan.resolve(cfg, model_cfg))
    del model
    rng = np.random.default_rng(0)
    records, returns = [], []
    with engine:
        for _ in range(args.steps):
            tokens = rng.integers(0, model_cfg.vocab_size, (int(args.grad_accum), args.batch, args.seq_len + 1),
                                  dtype=np.int32)
            record = engine.step(tokens, optimizer=args.child != "compute")
            returns.append(time.perf_counter())
            records.append(record.record())
        engine.finish_update()
        timeline = engine.timeline()
        report = engine.report()
        journal = engine.state.records.figures()  # durable steps: the journal's writes, the spare slots' disk
    periods = [b - a for a, b in zip(returns, returns[1:])]
    measured = records[args.warmup:] or records[-1:]
    result = {"mode": args.child, "params": n_params, "periods": periods[args.warmup - 1:] if args.warmup else periods,
              "ssd_bytes_per_step": [r.get("ssd_read_bytes", 0) + r.get("ssd_written_bytes", 0) for r in measured],
              "ssd_read_per_step": [r.get("ssd_read_bytes", 0) for r in measured],
              "ssd_written_per_step": [r.get("ssd_written_bytes", 0) for r in measured],
              "overlap_fraction": [r["overlap_fraction"] for r in measured if r.get("overlap_fraction") is not None],
              "tokens_per_step": int(args.grad_accum) * args.batch * args.seq_len,
              "records": records, "timeline": timeline, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
              "arena_capacity_bytes": report.arena_capacity_bytes, "io_mode": report.io_engine or "", **journal}
    print("BENCH_STEP_JSON " + json.dumps(result))
    return 0


# ---------------------------------------------------------------- parent
def run_jaxascend(mode: str, args, round_dir: Path) -> dict:
    work = round_dir / mode
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", mode, "--child-dir", str(work),
           "--shape", args.shape, "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--seq-len", str(args.seq_len), "--batch", str(args.batch), "--grad-accum", str(args.grad_accum)]
    for s in args.extra:
        cmd += ["--set", s]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=3600)
    shutil.rmtree(work / "offload", ignore_errors=True)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH_STEP_JSON ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"{mode}: exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(line[len("BENCH_STEP_JSON "):])


def run_deepspeed(args, round_dir: Path) -> dict:
    shape = SHAPES[args.shape]
    nvme = round_dir / "zinf_nvme"
    shutil.rmtree(nvme, ignore_errors=True)
    sizes = ["--layers", str(shape["layers"]), "--hidden", str(shape["hidden"]), "--intermediate",
             str(shape["intermediate"]), "--vocab", str(shape["vocab"]), "--heads", str(shape["heads"]),
             "--kv-heads", str(shape["kv_heads"]), "--seq", str(args.seq_len), "--batch", str(args.batch),
             "--steps", str(args.steps), "--dtype", args.peer_dtype, "--nvme-dir", str(nvme),
             "--sub-group-size", "100000000",
             "--reduce-bucket-size", "50000000", "--max-live-params", "100000000"]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": "/tmp/peer/torch_ext"}
    if args.sweep:  # gradient accumulation, its forward/backward timed apart
        cmd = [str(PEER_PY), str(ZINF_ACCUM), *sizes, "--grad-accum", str(args.grad_accum)]
    else:
        cmd = [str(PEER_PY), str(ZINF), *sizes, "--offload-param", "none"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env)
    shutil.rmtree(nvme, ignore_errors=True)
    try:
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise RuntimeError(f"deepspeed: exit {proc.returncode}: {proc.stderr.strip().splitlines()[-3:]}") from None
    if args.sweep:
        measured = result["steps"][args.warmup:] or result["steps"][-1:]
        return {"mode": "deepspeed", "params": result["params"], "periods": [x["step_s"] for x in measured],
                "compute_periods": [x["compute_s"] for x in measured],
                "ssd_bytes_per_step": [x["read_bytes"] + x["write_bytes"] for x in measured],
                "tokens_per_step": args.grad_accum * args.batch * args.seq_len,
                "peak_rss_bytes": result["peak_rss_bytes"], "deepspeed": result.get("deepspeed")}
    steps = result["step_s"] if isinstance(result.get("step_s"), list) else [result["step_s"]]
    return {"mode": "deepspeed", "params": result["params"], "periods": steps[args.warmup:] or steps[-1:],
            "all_steps": steps, "peak_rss_bytes": result["peak_rss_bytes"], "deepspeed": result.get("deepspeed")}


def run_disk(args, round_dir: Path) -> dict:
    """bench_io.py, one round: the raw baselines and the engine, 2 GiB."""
    out = round_dir / "io"
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(REPO / "scripts" / "bench_io.py"), "--size", args.io_size, "--rounds", "1",
           "--iters", "1", "--dir", str(round_dir), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"bench_io: exit {proc.returncode}: {proc.stderr.strip().splitlines()[-3:]}")
    return json.loads(proc.stdout[proc.stdout.index("{"):])


def disk_speeds(io: dict) -> dict:
    """The best baseline's read and (over)write GB/s, and the engine's, from a bench_io result."""
    c, best = io["contenders"], io["best_baseline"]
    return {"raw_read_gbps": c[best["read"]]["read"]["median"], "raw_write_gbps": c[best["write"]]["write"]["median"],
            "raw_from": {"read": best["read"], "write": best["write"]},
            "engine_read_gbps": c["engine"]["read"]["median"], "engine_write_gbps": c["engine"]["write"]["median"],
            "engine_update_gbps": c["engine"].get("update", {}).get("median"), "io_engine": io.get("io_engine")}


def median_range(values) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def _own_floor(r: dict, mode: str):
    """A contender's own SSD floor in round ``r``: its measured bytes a step, read and written, at
    the raw speeds the round measured, one direction at a time (None without both)."""
    x, d = r.get(mode), r.get("disk")
    if not x or not d or not x.get("ssd_read_per_step"):
        return None
    return (statistics.median(x["ssd_read_per_step"]) / (d["raw_read_gbps"] * 1e9)
            + statistics.median(x["ssd_written_per_step"]) / (d["raw_write_gbps"] * 1e9))


def summarize(rounds: list[dict], args) -> dict:
    def per_round(mode, fn):
        return [fn(r[mode]) for r in rounds if mode in r]

    step = {m: per_round(m, lambda x: statistics.median(x["periods"])) for m in CONTENDERS + tuple(MASTER16)}
    rss = {m: per_round(m, lambda x: x["peak_rss_bytes"]) for m in CONTENDERS + tuple(MASTER16)}
    out = {"step_seconds": {m: median_range(v) for m, v in step.items() if v},
           "peak_rss_bytes": {m: median_range(v) for m, v in rss.items() if v}, "ratios": {}}
    ratios = out["ratios"]
    for r in rounds:
        if "disk" in r and "overlap" in r:
            d = r["disk"]
            n = r["overlap"]["params"]
            r["ssd_floor_seconds"] = n * (14 / (d["raw_read_gbps"] * 1e9) + 14 / (d["raw_write_gbps"] * 1e9))
    for r in rounds:
        if "overlap_host_grads" in r and "overlap_host_durable" in r:  # the gradients' log's cost
            ratios.setdefault("overlap_host_grads_vs_overlap_host_durable", []).append(
                statistics.median(r["overlap_host_grads"]["periods"]) /
                statistics.median(r["overlap_host_durable"]["periods"]))
        o = r.get("overlap")
        if not o:
            continue
        ostep = statistics.median(o["periods"])
        pairs = {"overlap_vs_sequential": "sequential", "overlap_vs_deepspeed": "deepspeed",
                 "overlap_vs_compute": "compute", "overlap_vs_overlap_master16": "overlap_master16",
                 "overlap_vs_overlap_host_grads": "overlap_host_grads", "overlap_vs_overlap_durable": "overlap_durable",
                 "overlap_vs_overlap_host_grads_4layers": "overlap_host_grads_4layers"}
        for name, other in pairs.items():
            if other in r:
                ratios.setdefault(name, []).append(ostep / statistics.median(r[other]["periods"]))
        for compact in ("overlap_ssd_compact", "overlap_ssd_compact_host", "overlap_ssd_durable"):  # on SSD
            if "overlap_ssd" in r and compact in r:
                ratios.setdefault(f"overlap_ssd_vs_{compact}", []).append(
                    statistics.median(r["overlap_ssd"]["periods"]) / statistics.median(r[compact]["periods"]))
        if "deepspeed" in r:
            ds = r["deepspeed"]
            ratios.setdefault("overlap_rss_vs_deepspeed", []).append(o["peak_rss_bytes"] / ds["peak_rss_bytes"])
            if "overlap_ssd" in r:
                ratios.setdefault("overlap_ssd_vs_deepspeed", []).append(
                    statistics.median(r["overlap_ssd"]["periods"]) / statistics.median(ds["periods"]))
                ratios.setdefault("overlap_ssd_rss_vs_deepspeed", []).append(
                    r["overlap_ssd"]["peak_rss_bytes"] / ds["peak_rss_bytes"])
        if "compute" in r and "ssd_floor_seconds" in r:
            bound = max(statistics.median(r["compute"]["periods"]), r["ssd_floor_seconds"])
            ratios.setdefault("overlap_vs_max_compute_floor", []).append(ostep / bound)
            if "sequential" in r:
                ratios.setdefault("sequential_vs_max_compute_floor", []).append(
                    statistics.median(r["sequential"]["periods"]) / bound)
        seq = r.get("sequential")
        if seq and "disk" in r:
            # The optimizer stream alone (its bytes over its own time, the gradients' flush left
            # out) against bench_io's engine update pass (read + write back of every chunk, as the
            # optimizer does, bytes read + written over its time).
            gbps = [rec["stream_gbps"] for rec in seq["records"][args.warmup:] if rec.get("stream_gbps")]
            engine_rw = r["disk"]["engine_update_gbps"] or \
                2 / (1 / r["disk"]["engine_read_gbps"] + 1 / r["disk"]["engine_write_gbps"])
            if gbps:
                ratios.setdefault("stream_vs_engine_rw", []).append(statistics.median(gbps) / engine_rw)
    for r in rounds:
        ds = r.get("deepspeed")
        if ds and ds.get("compute_periods") and "compute" in r:  # XLA's CPU compute against torch's
            ratios.setdefault("compute_vs_deepspeed_compute", []).append(
                statistics.median(r["compute"]["periods"]) / statistics.median(ds["compute_periods"]))
    out["ratios"] = {k: median_range(v) for k, v in ratios.items()}
    out["ssd_floor_seconds"] = median_range([r.get("ssd_floor_seconds") for r in rounds])
    for name, key in (("ssd_bytes_per_step", "ssd_bytes_per_step"), ("overlap_fraction", "overlap_fraction"),
                      ("deepspeed_compute_seconds", "compute_periods")):
        figures = {m: median_range([statistics.median(r[m][key]) for r in rounds if r.get(m, {}).get(key)])
                   for m in CONTENDERS + tuple(MASTER16)}
        out[name] = {m: v for m, v in figures.items() if v["n"]}
    out["contender_ssd_floor_seconds"] = {m: v for m, v in (
        (m, median_range([_own_floor(r, m) for r in rounds if _own_floor(r, m)])) for m in JAX_MODES) if v["n"]}
    out["tokens_per_second"] = {m: median_range([r[m]["tokens_per_step"] / statistics.median(r[m]["periods"])
                                                 for r in rounds if r.get(m, {}).get("tokens_per_step")])
                                for m in CONTENDERS + tuple(MASTER16)
                                if any(r.get(m, {}).get("tokens_per_step") for r in rounds)}
    return out


def accumulation(by_a: dict) -> dict:
    """Across the numbers of micro-batches: the large-batch issue's figures, from each A's summary."""
    first, last = min(by_a), max(by_a)

    def med(a, section, mode):
        return by_a[a]["summary"].get(section, {}).get(mode, {}).get("median")

    out = {"grad_accum": sorted(by_a), "per_a": {}}
    for a in sorted(by_a):
        summary = by_a[a]["summary"]
        out["per_a"][a] = {"step_seconds": {m: v["median"] for m, v in summary["step_seconds"].items()},
                           "tokens_per_second": {m: v["median"] for m, v in summary["tokens_per_second"].items()},
                           "ratios": {k: v["median"] for k, v in summary["ratios"].items()}}
    for mode in ("overlap", "deepspeed"):
        if med(first, "ssd_bytes_per_step", mode) and med(last, "ssd_bytes_per_step", mode):
            out[f"{mode}_ssd_bytes_a{last}_vs_a{first}"] = (med(last, "ssd_bytes_per_step", mode)
                                                           / med(first, "ssd_bytes_per_step", mode))
        if med(first, "tokens_per_second", mode) and med(last, "tokens_per_second", mode):
            out[f"{mode}_tokens_per_s_a{last}_vs_a{first}"] = (med(last, "tokens_per_second", mode)
                                                              / med(first, "tokens_per_second", mode))
    return out


def run_round(k: int, contenders: list[str], args, work: Path) -> dict:
    """One round: the disk once (unless --io-size 0), then each contender in a rotating order."""
    round_dir = work / f"round{k}-a{args.grad_accum}"
    round_dir.mkdir(parents=True, exist_ok=True)
    order = contenders[k % len(contenders):] + contenders[:k % len(contenders)]
    result = {}
    if args.io_size not in ("0", ""):
        result["disk"] = disk_speeds(run_disk(args, round_dir))
        print(f"round {k}: disk {result['disk']}", file=sys.stderr)
    for mode in order:
        result[mode] = run_deepspeed(args, round_dir) if mode == "deepspeed" else run_jaxascend(mode, args, round_dir)
        result[mode]["load_avg"] = list(os.getloadavg())  # the machine is shared: how busy it was
        print(f"round {k}, A={args.grad_accum}: {mode} step {statistics.median(result[mode]['periods']):.2f} s, "
              f"peak RSS {result[mode]['peak_rss_bytes'] / 2**30:.2f} GiB", file=sys.stderr)
    shutil.rmtree(round_dir, ignore_errors=True)
    for mode in JAX_MODES:  # keep the JSON small: one timeline
        if mode in result:
            result[mode]["last_timeline"] = result[mode].pop("timeline", None)
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args)
    contenders = [c for c in args.contenders.split(",") if c]
    unknown = [c for c in contenders if c not in CONTENDERS + tuple(MASTER16)]
    if unknown:
        print(f"error: --contenders: {', '.join(unknown)} not among {', '.join(CONTENDERS + tuple(MASTER16))}",
              file=sys.stderr)
        return 2
    try:
        accums = sorted({int(a) for a in args.grad_accum.split(",") if a.strip()})
    except ValueError:
        print(f"error: --grad-accum: expected comma-separated integers, got {args.grad_accum!r}", file=sys.stderr)
        return 2
    if not accums or accums[0] < 1:
        print(f"error: --grad-accum: each A must be >= 1, got {args.grad_accum!r}", file=sys.stderr)
        return 2
    args.sweep = accums != [1]
    if "deepspeed" in contenders and (args.peer == "off" or not PEER_PY.exists() or not ZINF.exists()):
        contenders.remove("deepspeed")
        print("bench_step: DeepSpeed not run (--peer off, or /tmp/peer/venv missing: ../shared/peers/setup_peer.sh)",
              file=sys.stderr)
    work = Path(args.work_dir)
    by_a = {a: [] for a in accums}
    for k in range(args.rounds):  # each round runs every A, the contenders alternating within it
        for a in (accums if k % 2 == 0 else accums[::-1]):
            args.grad_accum = a
            by_a[a].append(run_round(k, contenders, args, work))
    report = {"shape": args.shape, "seq_len": args.seq_len, "batch": args.batch, "cpu": cpu_model(),
              "peer_dtype": args.peer_dtype}
    timeline = next((r["overlap"]["last_timeline"] for a in accums[::-1] for r in reversed(by_a[a])
                     if r.get("overlap", {}).get("last_timeline")), None)
    for rounds in by_a.values():
        for r in rounds:
            for mode in r.values():
                if isinstance(mode, dict):
                    mode.pop("last_timeline", None)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.sweep:
        for a in accums:
            args.grad_accum = a
            report.setdefault("by_grad_accum", {})[a] = {"rounds": by_a[a], "summary": summarize(by_a[a], args)}
        report["accumulation"] = accumulation(report["by_grad_accum"])
        out.write_text(json.dumps(report, indent=1))
        plot_accumulation(report, out.with_suffix(".png"), CONTENDERS + tuple(MASTER16))
        printed = {"accumulation": report["accumulation"],
                   "by_grad_accum": {a: v["summary"] for a, v in report["by_grad_accum"].items()}}
    else:
        report.update(rounds=by_a[1], summary=summarize(by_a[1], args))
        out.write_text(json.dumps(report, indent=1))
        plot(report, out.with_suffix(".png"), CONTENDERS + tuple(MASTER16))
        printed = report["summary"]
    if timeline is not None:
        from jaxascend.offload import write_timeline_png
        # the default run's timeline is docs/step_timeline; any other --out keeps its own beside it
        name = "step_timeline" if out.stem == "bench_step" and not args.sweep else f"{out.stem}_timeline"
        (out.parent / f"{name}.json").write_text(json.dumps(timeline, indent=1))
        write_timeline_png(timeline, out.parent / f"{name}.png",
                           title=f"one overlapped step, {args.shape} Llama ({report['cpu']})")
    print(json.dumps(printed, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
