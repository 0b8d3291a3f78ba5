"""Long context: peak system memory and seconds per step against ``data.seq_len``, per contender,
at the Qwen2.5-0.5B widths (issue 27).

    python scripts/bench_context.py                                   # 1k .. 16k, every contender
    python scripts/bench_context.py --lengths 32768,65536 --contenders blockwise --merge
    python scripts/bench_context.py --replot                          # only redraw from --out

Shape: Qwen2.5-0.5B's widths (hidden 896, MLP 4864, 14 query heads, 2 key/value heads of width
64, q/k/v bias, its real 151936-row vocabulary, tied embeddings) with ``--layers`` of its 24 layers
(one step at 16k tokens on 2 CPU cores takes far over 10 minutes with all 24), random bf16
weights, batch 1, ``model.remat: full``, ``--steps`` steps (the first compiles; s/step is the
last one's).

Contenders (``CONTENDERS``: each jaxascend one is only ``--set`` overrides): dense and blockwise
jaxascend, each ``python -m jaxascend.train`` on the bundled @stdlib data (byte tokenizer) in its
own process, measured from outside like ``bench_plan.py`` (RSS of the process tree + page cache
of its offload files, or the kernel's high-water mark); and ``deepspeed``: DeepSpeed ZeRO-Infinity
(ZeRO-3, optimizer state on NVMe) on transformers' Qwen2 with ``sdpa`` attention and gradient
checkpointing (``zinf_qwen2.py`` in the peer venv, ``shared/peers/``), measured from outside
the same way (its swap files' page cache included).

A jaxascend length whose plan (``python -m jaxascend.plan``, the trainer's own) exceeds
``--limit-gib`` is not run (unless ``--run-past-plan`` names the contender); any run is killed
once it passes the limit. After a contender does
not fit (or fails) at one length, its longer lengths are skipped. Contenders alternate their
order from one length to the next; ``--repeats`` runs every length again (medians and ranges).
Writes ``--out`` (JSON: every run, the summary by contender and length, the targets) and a
plot of memory against length beside it (``.png``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import psutil

from bench_child import OverLimit, run_sampled_child
from bench_plan import planned, run_case, run_sets
from bench_scale import cpu_model

REPO = Path(__file__).resolve().parent.parent
GIB = 2**30
PEER = "deepspeed"
# contender -> the --set overrides that make it
CONTENDERS = {
    "dense": ["model.attention=dense", "model.loss=dense"],
    "blockwise": ["model.attention=blockwise", "model.loss=blocked"],
}
# Qwen2.5-0.5B's widths (its config.json), for both jaxascend and the peer.
WIDTHS = {"hidden": 896, "intermediate": 4864, "heads": 14, "kv_heads": 2, "head_dim": 64, "vocab": 151936}
FULL_LAYERS = 24
RUN = ["model.dtype=bfloat16", "model.param_dtype=bfloat16", "model.remat=full", "data.tokenizer=byte",
       "data.batch_size=1", "offload.chunk_bytes=16MiB", "offload.params=resident"]
# Lets the trainer start where its plan exceeds what the machine can give (--run-past-plan).
PAST_PLAN = "offload.host_memory_budget=64GiB"
# The peer: zinf_train.py's "lean" settings (its README: the lowest peak of those it tried).
PEER_FLAGS = ["--offload-param", "none", "--sub-group-size", "100000000",
              "--reduce-bucket-size", "50000000", "--max-live-params", "100000000"]
PEER_DIFFERENCES = [
    "model: transformers 5 Qwen2ForCausalLM (q/k/v bias, the same widths and layers) with sdpa attention, built "
    "under deepspeed.zero.Init (zinf_train.py via scripts/zinf_qwen2.py); asked for tied embeddings, its head "
    "came out untied there (see each peer run's num_params); rope_theta 10000 (Qwen2Config's default; ours 1e6)",
    "remat: transformers' gradient checkpointing of every decoder layer (non-reentrant); the loss is "
    "transformers' (the logits upcast to float32), no blocked loss",
    "data: random token ids over the whole vocabulary (labels = inputs); jaxascend: @stdlib bytes",
    "optimizer: DeepSpeedCPUAdam (Adam, lr 1e-4), fp32 master/m/v on NVMe; jaxascend: AdamW, fp32 state on SSD",
    "DeepSpeed settings: stage 3, offload_optimizer nvme, offload_param none, sub_group_size 1e8, "
    "reduce_bucket_size 5e7, stage3_max_live_parameters 1e8 (zinf README's 'lean')",
]


def simd_flags() -> list[str]:
    """The CPU's vector extensions (/proc/cpuinfo flags): bf16 matmul speed hangs on them."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return [f for f in line.split(":", 1)[1].split() if f.startswith(("avx", "amx", "fma", "f16c"))]
    return []


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="1024,2048,4096,8192,16384", help="comma-separated data.seq_len values")
    p.add_argument("--layers", type=int, default=2, help=f"decoder layers (Qwen2.5-0.5B has {FULL_LAYERS})")
    p.add_argument("--contenders", default=",".join([*CONTENDERS, PEER]))
    p.add_argument("--limit-gib", type=float, default=20.0)
    p.add_argument("--run-past-plan", default="", metavar="CONTENDERS",
                   help="comma-separated contenders to run even where the plan exceeds the limit (still killed there)")
    p.add_argument("--spare-gib", type=float, default=1.0,
                   help="kill a run when the machine has less available (others share it)")
    p.add_argument("--steps", type=int, default=2, help="1: peak memory only (no s/step)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--peer-python", default="/tmp/peer/venv/bin/python")
    p.add_argument("--peer-dtype", choices=["bf16", "fp32"], default="bf16",
                   help="the peer's dtype; not bf16: its rows are the contender deepspeed-<dtype>")
    p.add_argument("--work-dir", default="/tmp/jaxascend-bench-context")
    p.add_argument("--out", default=str(REPO / "docs" / "bench_context.json"))
    p.add_argument("--merge", action="store_true", help="add these runs to those already in --out")
    p.add_argument("--interval", type=float, default=0.05)
    p.add_argument("--timeout", type=float, default=3600, help="per run, seconds")
    p.add_argument("--replot", action="store_true")
    return p.parse_args()


def shape_sets(layers: int, length: int) -> list[str]:
    w = WIDTHS
    return ["model.arch=qwen2", f"model.hidden_size={w['hidden']}", f"model.intermediate_size={w['intermediate']}",
            f"model.num_hidden_layers={layers}", f"model.num_attention_heads={w['heads']}",
            f"model.num_key_value_heads={w['kv_heads']}", f"model.head_dim={w['head_dim']}",
            f"model.vocab_size={w['vocab']}", "model.tie_word_embeddings=true", "model.attention_bias=true",
            "model.rope_theta=1000000.0", f"model.max_position_embeddings={max(length, 2048)}",
            f"data.seq_len={length}"]


def run_jaxascend(contender: str, length: int, name: str, args) -> dict:
    case = {"shape": f"Qwen2.5-0.5B widths, {args.layers} layers", "steps": args.steps,
            "limit": int(args.limit_gib * GIB), "spare": int(args.spare_gib * GIB),
            "sets": RUN + shape_sets(args.layers, length) + CONTENDERS[contender]}
    work = Path(args.work_dir)
    plan = planned(run_sets(case, work / name, work))["host_peak"]
    if plan > args.limit_gib * GIB:
        if contender not in args.run_past_plan.split(","):
            return {"status": "does not fit", "note": f"does not fit (planned {plan / GIB:.2f} GiB)",
                    "predicted_bytes": plan}
        case["sets"].append(PAST_PLAN)  # the trainer's own check; the run is still killed at the limit
    r = run_case(name, case, args)
    return {"status": "ran", "peak_bytes": r["measured_bytes"], "peak_rss_bytes": r["measured_rss_bytes"],
            "page_cache_bytes": r["page_cache_bytes"], "step_s": r["step_s"][-1] if r["step_s"] else None,
            "first_step_at_s": r["first_step_at_s"],
            "predicted_bytes": r["predicted_bytes"], "ratio": r["ratio"], "num_params": r["num_params"],
            "predicted_parts": r["predicted_parts"], "phase": r["phase"],
            "run_past_plan": plan > args.limit_gib * GIB}


def _zinf_steps(log: Path) -> int:
    try:
        return sum(1 for line in log.read_text().splitlines() if line.startswith("[zinf] step "))
    except FileNotFoundError:
        return 0


def run_peer(length: int, name: str, args) -> dict:
    out_dir = Path(args.work_dir) / name
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    w, log, nvme = WIDTHS, out_dir / "stdout.txt", out_dir / "nvme"
    cmd = [args.peer_python, str(REPO / "scripts" / "zinf_qwen2.py"), "--layers", str(args.layers),
           "--hidden", str(w["hidden"]), "--intermediate", str(w["intermediate"]), "--vocab", str(w["vocab"]),
           "--heads", str(w["heads"]), "--kv-heads", str(w["kv_heads"]), "--seq", str(length), "--batch", "1",
           "--steps", str(args.steps), "--nvme-dir", str(nvme), "--dtype", args.peer_dtype] + PEER_FLAGS
    run = run_sampled_child(cmd, str(nvme / "**" / "*"), lambda: _zinf_steps(log), log, steps=args.steps, cwd=REPO,
                            interval=args.interval, timeout=args.timeout, finish=True, limit=int(args.limit_gib * GIB),
                            spare=int(args.spare_gib * GIB))
    shutil.rmtree(nvme, ignore_errors=True)
    lines = [line for line in log.read_text().splitlines() if line.startswith("{")]
    own = json.loads(lines[-1])
    return {"status": "ran", "peak_bytes": run.peak_system, "peak_rss_bytes": run.peak_rss,
            "page_cache_bytes": run.peak_page_cache, "step_s": own["step_s"][-1] if args.steps > 1 else None,
            "first_step_at_s": run.first_step_at,
            "num_params": own["params"], "peer_own": {k: own[k] for k in (
                "peak_rss_bytes", "peak_vm_locked_bytes_sampled", "peak_nvme_page_cache_bytes", "step_s", "losses",
                "deepspeed", "torch", "transformers", "threads", "ds_init_s")}}


def label(contender: str, args) -> str:
    """The name a contender's rows go by: the peer's carries its dtype unless that is bf16."""
    return f"{PEER}-{args.peer_dtype}" if contender == PEER and args.peer_dtype != "bf16" else contender


def run_one(contender: str, length: int, repeat: int, args) -> dict:
    contender = label(contender, args)
    name = f"{contender}-{length}-r{repeat}"
    print(f"[bench_context] {name} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        r = run_peer(length, name, args) if contender.startswith(PEER) else run_jaxascend(contender, length, name, args)
    except OverLimit as err:
        r = {"status": "does not fit", "note": f"does not fit ({err})"}
    except RuntimeError as err:
        r = {"status": "failed", "note": str(err)[-1500:]}
    r = {"contender": contender, "length": length, "repeat": repeat, "steps": args.steps,
         "wall_s": time.perf_counter() - start, "load_avg": os.getloadavg(), **r}
    print(json.dumps({k: v for k, v in r.items() if k not in ("predicted_parts", "peer_own")}), file=sys.stderr,
          flush=True)
    return r


def r_squared(xs: list[float], ys: list[float]) -> float:
    """R² of the least-squares straight line through (xs, ys)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    residual = sum((y - my - slope * (x - mx)) ** 2 for x, y in zip(xs, ys))
    total = sum((y - my) ** 2 for y in ys)
    return 1 - residual / total if total else 1.0


def summarize(results: list[dict], limit: float) -> dict:
    """By contender and length: medians and ranges of what ran; what did not fit; the targets."""
    table: dict[str, dict[int, dict]] = {}
    for c in dict.fromkeys(r["contender"] for r in results):
        table[c] = {}
        for length in sorted({r["length"] for r in results if r["contender"] == c}):
            runs = [r for r in results if r["contender"] == c and r["length"] == length]
            ran = [r for r in runs if r["status"] == "ran"]
            if not ran:
                table[c][length] = {"status": runs[-1]["status"], "note": runs[-1].get("note", "")}
                continue
            row = {"status": "ran", "runs": len(ran), "fits": max(r["peak_bytes"] for r in ran) <= limit}
            for key in ("peak_bytes", "step_s", "ratio"):
                values = [r[key] for r in ran if r.get(key) is not None]
                if values:
                    row[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
            table[c][length] = row
    longest = {c: max((n for n, row in rows.items() if row.get("fits")), default=None) for c, rows in table.items()}
    return {"by_contender": {c: {str(n): row for n, row in rows.items()} for c, rows in table.items()},
            "longest_fitting": longest, "targets": targets(table, longest, limit)}


def targets(table: dict, longest: dict, limit: float) -> dict:
    out = {}
    block = table.get("blockwise", {})
    if block.get(16384, {}).get("status") == "ran":
        peak = block[16384]["peak_bytes"]["median"]
        out["16k_within_6GiB"] = {"peak_GiB": peak / GIB, "met": peak <= 6 * GIB}
    line = sorted((n, row["peak_bytes"]["median"]) for n, row in block.items() if n >= 2048 and row.get("fits"))
    if len(line) >= 3:
        r2 = r_squared([n for n, _ in line], [p for _, p in line])
        out["linear_from_2k"] = {"lengths": [n for n, _ in line], "r2": r2, "met": r2 >= 0.99}
    for peer in (c for c in longest if c.startswith(PEER) and longest[c] and longest.get("blockwise")):
        # A longest length is only a bound unless the next one was found not to fit.
        bounded = {c: any(row["status"] == "does not fit" or row.get("fits") is False for row in table[c].values())
                   for c in ("blockwise", peer)}
        ratio = longest["blockwise"] / longest[peer]
        met = True if bounded[peer] and ratio >= 4 else False if all(bounded.values()) and ratio < 4 else None
        out[f"longest_vs_{peer}"] = {"blockwise": longest["blockwise"], peer: longest[peer], "ratio": ratio,
                                     "limit_reached": bounded, "met": met}
    ratios = [(c, n, row["ratio"]) for c, rows in table.items() for n, row in rows.items() if "ratio" in row]
    if ratios:
        worst = max(ratios, key=lambda x: max(abs(x[2]["min"] - 1), abs(x[2]["max"] - 1)))
        out["planner_within_15pct"] = {"worst": {"contender": worst[0], "length": worst[1], **worst[2]},
                                       "met": all(0.85 <= x[2]["min"] and x[2]["max"] <= 1.15 for x in ratios)}
    both = [n for n in block if n >= 2048 and "step_s" in block[n] and "step_s" in table.get("dense", {}).get(n, {})]
    if both:
        slow = {str(n): block[n]["step_s"]["median"] / table["dense"][n]["step_s"]["median"] for n in sorted(both)}
        out["blockwise_step_vs_dense"] = {"ratio_by_length": slow, "met": all(v <= 1.15 for v in slow.values())}
    return out


def plot(path: Path, report: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, speed) = plt.subplots(1, 2, figsize=(13, 5.5))
    for c, rows in report["summary"]["by_contender"].items():
        ran = sorted((int(n), row) for n, row in rows.items() if row["status"] == "ran")
        if not ran:
            continue
        xs = [n for n, _ in ran]
        peaks = [row["peak_bytes"] for _, row in ran]
        errors = [[(p["median"] - p["min"]) / GIB for p in peaks], [(p["max"] - p["median"]) / GIB for p in peaks]]
        line = mem.errorbar(xs, [p["median"] / GIB for p in peaks], yerr=errors, marker="o", capsize=3,
                            label=f"{c} (measured)")[0]
        planned_runs = sorted((r["length"], r["predicted_bytes"]) for r in report["results"]
                              if r["contender"] == c and r.get("predicted_bytes"))
        if planned_runs:
            mem.plot([n for n, _ in planned_runs], [b / GIB for _, b in planned_runs], linestyle="--", marker="x",
                     color=line.get_color(), alpha=0.7, label=f"{c} (planner)")
        timed = [(n, row["step_s"]["median"]) for n, row in ran if "step_s" in row]
        if timed:
            speed.plot([n for n, _ in timed], [s for _, s in timed], marker="o", color=line.get_color(), label=c)
    mem.axhline(report["limit_gib"], color="grey", linestyle=":", label=f"{report['limit_gib']:g} GiB")
    mem.set_ylabel("peak system memory, GiB (process tree RSS + offload page cache)")
    speed.set_ylabel("seconds per step")
    speed.set_title("runs of 2 or more steps; each run's load average is in the JSON", fontsize=9)
    mem.set_title("dashed: the planner's prediction; dotted: the limit (runs are killed past it)", fontsize=9)
    for ax in (mem, speed):
        if ax.lines:
            ax.set_xscale("log", base=2)
        ax.set_xlabel("data.seq_len (tokens, batch 1)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if speed.lines:  # runs of 1 step have no s/step
        speed.set_yscale("log")
    fig.suptitle(f"Long context at Qwen2.5-0.5B widths, vocab {WIDTHS['vocab']}, {report['layers']} of "
                 f"{FULL_LAYERS} layers, remat full ({report['cpu']}, {report['cpus']} cores)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write(report: dict, out: Path) -> None:
    report["summary"] = summarize(report["results"], report["limit_gib"] * GIB)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    plot(out.with_suffix(".png"), report)


def main() -> int:
    args = parse_args()
    out = Path(args.out)
    if args.replot:
        write(json.loads(out.read_text()), out)
        return 0
    contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = [c for c in contenders if c not in CONTENDERS and c != PEER]
    if unknown:
        print(f"error: --contenders: unknown {', '.join(unknown)} (known: {', '.join([*CONTENDERS, PEER])})",
              file=sys.stderr)
        return 2
    lengths = sorted(int(x) for x in args.lengths.split(","))
    old = json.loads(out.read_text())["results"] if args.merge and out.exists() else []
    report = {"issue": 27, "cpu": cpu_model(), "cpu_simd": simd_flags(), "cpus": os.cpu_count(), "ram_bytes": psutil.virtual_memory().total,
              "layers": args.layers, "full_layers": FULL_LAYERS, "widths": WIDTHS, "batch": 1, "remat": "full",
              "limit_gib": args.limit_gib, "contenders": {**CONTENDERS, PEER: PEER_FLAGS + ["--dtype", "bf16|fp32"]},
              "shape_note": f"Qwen2.5-0.5B widths with {args.layers} of its {FULL_LAYERS} layers: one step at 16k "
                            "tokens with all 24 takes far over 10 minutes on these cores",
              "jaxascend_sets": RUN + shape_sets(args.layers, 0)[:-2], "peer_differences": PEER_DIFFERENCES,
              "step_s": "the last step's wall time (the first compiles; none in runs of 1 step)",
              "results": old}
    stopped: set[str] = set()
    for repeat in range(args.repeats):
        stopped.clear()
        for i, length in enumerate(lengths):
            order = contenders if (i + repeat) % 2 == 0 else contenders[::-1]
            for c in order:
                if c in stopped:
                    r = {"contender": label(c, args), "length": length, "repeat": repeat, "status": "skipped",
                         "note": "did not fit or failed at a shorter length"}
                else:
                    r = run_one(c, length, repeat, args)
                    if r["status"] != "ran" or r["peak_bytes"] > args.limit_gib * GIB:
                        stopped.add(c)
                report["results"].append(r)
                write(report, out)
    print(json.dumps(report["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
