"""Peak system memory against model size: compute params resident vs streamed from SSD.

    python scripts/bench_scale.py                          # Qwen2.5 shapes 0.5B, 1.5B, 3B
    python scripts/bench_scale.py --sizes 0.5B --repeats 3 # the step-time comparison only
    python scripts/bench_scale.py --sizes 7B               # larger, if the disk allows
    python scripts/bench_scale_7b.py                       # the 7B row as shipped: configs/qwen2.5-7b.yaml,
                                                           # random init, a kill and resume (docs/bench_scale_7b.json)

For each size a random bf16 checkpoint in Hugging Face layout is made with
``scripts/make_hf_checkpoint.py`` (Qwen2.5 shapes), then 2-3 optimizer steps of it are run
(seq 128, batch 1, bf16, remat full, the bundled @stdlib data with the checkpoint's tokenizer),
each mode in its own process (``python -m jaxascend.train``), the modes alternating
(resident, ssd, resident, ssd, ... with ``--repeats``):

* ``resident``: ``offload.params: resident``: compute params in RAM (2 B/param);
* ``ssd``: ``offload.params: ssd``: the layer stack's compute params on SSD, read layer by layer;
* ``optax``: the in-memory baseline (``offload.enabled: false``, fp32), at the smallest size only
  (25 B/param does not fit this machine beyond it): the plain-optax line of the plot.

Per run: peak RSS and peak page cache of the offload files (sampled by
``scripts/bench_child.py``), bytes/param, seconds per step (median of the steps after the first,
which compiles) split into forward/backward (including the weights' reads for ``ssd``), the wait
for the last gradient writes, and the optimizer stream, SSD GB/s, and the planner's predicted
peak (``<out_dir>/plan.json``, written by the trainer before it allocates anything) beside the
measurement. Free disk is checked first; a size that does not fit is skipped with a message.

Writes JSON to stdout and ``--out`` (default docs/bench_scale.json), a Markdown table (``.md``)
and a PNG of peak system memory against model size (``.png``) beside it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_child import run_train_child

REPO = Path(__file__).resolve().parent.parent
BASE = ["optimizer.warmup_steps=0", "model.dtype=bfloat16", "model.param_dtype=bfloat16", "model.remat=full",
        "data.tokenizer=model", "train.log_every=1", "train.progress=false", "export.save_params=false",
        "optimizer.grad_clip_norm=1.0"]
OFFLOADED = ["offload.enabled=true", "offload.chunk_bytes=16MiB"]
MODES = {
    "resident": OFFLOADED + ["offload.params=resident"],
    "ssd": OFFLOADED + ["offload.params=ssd"],
    "optax": ["offload.enabled=false", "model.dtype=float32", "model.param_dtype=float32"],
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="0.5B,1.5B,3B", help="Qwen2.5 preset sizes, comma-separated")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=1, help="runs of each offloaded mode per size (alternating)")
    p.add_argument("--repeats-first", type=int, default=2, help="repeats at the smallest size (the timing ratio)")
    p.add_argument("--no-optax", action="store_true", help="skip the plain-optax run")
    p.add_argument("--modes", default="resident,ssd,optax", help="comma-separated subset of: " + ", ".join(MODES))
    p.add_argument("--merge", action="store_true",
                   help="add this run's results to --out, replacing those of the same size and mode")
    p.add_argument("--work-dir", default="/tmp/jaxascend-bench-scale")
    p.add_argument("--out", default=str(REPO / "docs" / "bench_scale.json"))
    p.add_argument("--interval", type=float, default=0.1)
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--keep", action="store_true", help="keep the checkpoints and offload files")
    p.add_argument("--replot", action="store_true", help="only rewrite the .md and .png from --out")
    p.add_argument("--set", dest="extra", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    return p.parse_args()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def preset_parameters(size: str) -> int:
    from jaxascend.hf import model_config_from_hf_dict, param_plan, preset_config

    cfg = model_config_from_hf_dict(preset_config("qwen2", size))
    return sum(int(math.prod(m.shape)) for m in param_plan(cfg))


def disk_free(path: Path) -> int:
    probe = path
    while not probe.exists():
        probe = probe.parent
    return shutil.disk_usage(probe).free


def make_checkpoint(size: str, folder: Path) -> None:
    if (folder / "config.json").exists():
        return
    shutil.rmtree(folder, ignore_errors=True)
    subprocess.run([sys.executable, str(REPO / "scripts" / "make_hf_checkpoint.py"), "--arch", "qwen2", "--size",
                    size, "--out", str(folder), "--dtype", "bf16"], check=True, stdout=subprocess.DEVNULL)


def run_one(size: str, mode: str, repeat: int, ckpt: Path, args) -> dict:
    name = f"{size}-{mode}-{repeat}"
    out_dir = Path(args.work_dir) / name
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    sets = BASE + MODES[mode] + [f"model.path={ckpt}", f"data.seq_len={args.seq_len}",
                                 f"data.batch_size={args.batch}", f"train.steps={args.steps}",
                                 f"offload.dir={out_dir / 'offload'}", f"train.out_dir={out_dir / 'run'}",
                                 f"checkpoint.dir={out_dir / 'checkpoints'}"] + args.extra
    cmd = [sys.executable, "-m", "jaxascend.train", "--config", str(REPO / "configs" / "tiny.yaml")]
    for s in sets:
        cmd += ["--set", s]
    run = run_train_child(cmd, out_dir / "offload", out_dir / "run" / "metrics.jsonl", out_dir / "stdout.txt",
                          steps=args.steps, cwd=REPO, interval=args.interval, timeout=args.timeout)
    plan = json.loads((out_dir / "run" / "plan.json").read_text())
    n = plan["num_params"]
    later = run.records[1:] or run.records

    def med(key):
        values = [r[key] for r in later if key in r]
        return statistics.median(values) if values else None

    step_s = statistics.median(b["elapsed_s"] - a["elapsed_s"] for a, b in zip(run.records, run.records[1:])) \
        if len(run.records) > 1 else None
    moved = []
    for a, b in zip(run.records, run.records[1:]):
        source = b.get("param_source_bytes_read", 0) - a.get("param_source_bytes_read", 0)
        moved.append(b.get("ssd_read_bytes_step", 0) + b.get("ssd_write_bytes_step", 0) + source)
    result = {
        "size": size, "mode": mode, "repeat": repeat, "num_params": n,
        "peak_rss_bytes": run.peak_rss, "peak_page_cache_bytes": run.peak_page_cache,
        "peak_system_bytes": run.peak_system, "bytes_per_param": run.peak_system / n,
        "predicted_peak_bytes": plan["host_peak"], "predicted_parts": plan["host"],
        "prediction_error": plan["host_peak"] / run.peak_system - 1,
        "step_seconds": step_s, "fwd_bwd_seconds": med("fwd_bwd_seconds"),
        "param_wait_seconds": med("param_wait_seconds"), "grad_flush_seconds": med("grad_flush_seconds"),
        "optimizer_seconds": med("optimizer_seconds"),
        "ssd_bytes_step": statistics.median(moved) if moved else None,
        "param_source_misses": run.records[-1].get("param_source_misses"),
        "losses": [r["loss"] for r in run.records],
    }
    if step_s and moved:
        result["ssd_gbps"] = statistics.median(moved) / step_s / 1e9
    if not args.keep:
        shutil.rmtree(out_dir / "offload", ignore_errors=True)
    print(json.dumps({k: v for k, v in result.items() if k not in ("predicted_parts", "losses")}), file=sys.stderr)
    return result


def summarize(results: list[dict]) -> dict:
    by = {}
    for r in results:
        by.setdefault((r["size"], r["mode"]), []).append(r)
    rows = []
    for (size, mode), rs in by.items():
        rows.append({"size": size, "mode": mode, "runs": len(rs), "num_params": rs[0]["num_params"],
                     "peak_system_bytes": max(r["peak_system_bytes"] for r in rs),
                     "bytes_per_param": max(r["bytes_per_param"] for r in rs),
                     "predicted_peak_bytes": rs[0]["predicted_peak_bytes"],
                     "worst_prediction_error": max((r["prediction_error"] for r in rs), key=abs),
                     "step_seconds": statistics.median(r["step_seconds"] for r in rs if r["step_seconds"]),
                     **{k: statistics.median(r[k] for r in rs if r.get(k) is not None)
                        for k in ("fwd_bwd_seconds", "grad_flush_seconds", "optimizer_seconds", "ssd_gbps",
                                  "param_wait_seconds") if any(r.get(k) is not None for r in rs)}})
    ratios = {}
    for size in {r["size"] for r in results}:
        res = [r["step_seconds"] for r in by.get((size, "resident"), []) if r["step_seconds"]]
        ssd = [r["step_seconds"] for r in by.get((size, "ssd"), []) if r["step_seconds"]]
        pairs = [s / r for r, s in zip(res, ssd)]
        if pairs:
            ratios[size] = {"median": statistics.median(pairs), "min": min(pairs), "max": max(pairs),
                            "pairs": len(pairs)}
    return {"rows": rows, "ssd_over_resident_step_time": ratios}


def seven_b_row(path: Path) -> list[str]:
    """The 7B row (``scripts/bench_scale_7b.py``: the shipped config, compact and durable, weights
    on SSD), in this table's columns, when its JSON is beside this one's."""
    if not path.exists():
        return []
    r, gib = json.loads(path.read_text()), 2**30
    m, steps = r["measured"], r["steps"][1:] or r["steps"]
    med = lambda key: statistics.median(s[key] for s in steps)  # noqa: E731
    return [f"| 7B | ssd, {r['config']} (bench_scale_7b, {r['cpu']}) | {r['num_params'] / 1e9:.2f}B | "
            f"{m['peak_system_bytes'] / gib:.2f} GiB | {r['bytes_per_param']['host_peak']:.2f} | "
            f"{r['planned']['host_peak_bytes'] / gib:.2f} GiB | {m['rss_vs_plan'] * 100:+.1f}% | {med('wall_s'):.2f} | "
            f"{med('fwd_bwd_seconds'):.2f} | - | {med('optimizer_seconds'):.2f} (overlapped; SSD floor "
            f"{steps[0]['ssd_floor_s']:.1f} s) | {m['ssd_bytes_step'] / med('wall_s') / 1e9:.2f} |"]


def write_outputs(report: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    gib = 2**30
    lines = [f"CPU: {report['cpu']}; seq {report['seq_len']}, batch {report['batch']}, bf16, remat full, "
             f"{report['steps']} steps per run", "",
             "| size | mode | params | peak system | B/param | predicted | error | s/step | fwd/bwd | grad out | "
             "optimizer | SSD GB/s |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["summary"]["rows"]:
        def f(key, fmt="{:.2f}"):
            return fmt.format(r[key]) if r.get(key) is not None else "-"
        lines.append(f"| {r['size']} | {r['mode']} | {r['num_params'] / 1e9:.2f}B | "
                     f"{r['peak_system_bytes'] / gib:.2f} GiB | {r['bytes_per_param']:.2f} | "
                     f"{r['predicted_peak_bytes'] / gib:.2f} GiB | {r['worst_prediction_error'] * 100:+.1f}% | "
                     f"{f('step_seconds')} | {f('fwd_bwd_seconds')} | {f('grad_flush_seconds')} | "
                     f"{f('optimizer_seconds')} | {f('ssd_gbps')} |")
    lines += seven_b_row(out.parent / "bench_scale_7b.json")
    for size, ratio in sorted(report["summary"]["ssd_over_resident_step_time"].items()):
        lines.append("")
        lines.append(f"{size}: ssd / resident step time, median {ratio['median']:.3f} "
                     f"(range {ratio['min']:.3f}-{ratio['max']:.3f}, {ratio['pairs']} alternating pairs)")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    rows = report["summary"]["rows"]
    sizes = sorted({r["num_params"] for r in rows})
    for mode, style in (("resident", "o-"), ("ssd", "s-")):
        pts = sorted((r["num_params"], r["peak_system_bytes"]) for r in rows if r["mode"] == mode)
        if pts:
            ax.plot([p[0] / 1e9 for p in pts], [p[1] / gib for p in pts], style, label=f"jaxascend, params {mode}")
    optax = [r for r in rows if r["mode"] == "optax"]
    if optax and sizes:
        per_param = optax[0]["bytes_per_param"]
        ax.plot([s / 1e9 for s in sizes], [s * per_param / gib for s in sizes], "k--",
                label=f"plain optax ({per_param:.1f} B/param, measured at {optax[0]['size']})")
        ax.plot([optax[0]["num_params"] / 1e9], [optax[0]["peak_system_bytes"] / gib], "k^")
    ax.set_xlabel("parameters (billions)")
    ax.set_ylabel("peak system memory (GiB, RSS + page cache)")
    ax.set_title("Peak system memory against model size (seq 128, batch 1)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)


def main() -> int:
    args = parse_args()
    out = Path(args.out)
    if args.replot:
        write_outputs(json.loads(out.read_text()), out)
        return 0
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    results, skipped = [], []
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    for i, size in enumerate(sizes):
        n = preset_parameters(size)
        need = n * (2 + 16) + 2 * 2**30  # checkpoint (bf16) + offload files (state, grads, weights) + margin
        free = disk_free(work)
        if need > free:
            msg = f"{size}: skipped: needs about {need / 1e9:.1f} GB on {work}, {free / 1e9:.1f} GB free"
            print(msg, file=sys.stderr)
            skipped.append(msg)
            continue
        ckpt = work / f"qwen2.5-{size}"
        start = time.perf_counter()
        make_checkpoint(size, ckpt)
        print(f"{size}: checkpoint ready in {time.perf_counter() - start:.0f} s", file=sys.stderr)
        repeats = args.repeats_first if i == 0 else args.repeats
        modes = [m for m in args.modes.split(",") if m]
        for repeat in range(repeats):
            for mode in ("resident", "ssd"):
                if mode in modes:
                    results.append(run_one(size, mode, repeat, ckpt, args))
        if i == 0 and "optax" in modes and not args.no_optax and n * 26 < _physical_memory() * 0.8:
            results.append(run_one(size, "optax", 0, ckpt, args))
        if not args.keep:
            shutil.rmtree(ckpt, ignore_errors=True)
    if args.merge and out.exists():
        old = json.loads(out.read_text())
        fresh = {(r["size"], r["mode"]) for r in results}
        results = [r for r in old["results"] if (r["size"], r["mode"]) not in fresh] + results
        skipped = old.get("skipped", []) + skipped
    report = {"cpu": cpu_model(), "seq_len": args.seq_len, "batch": args.batch, "steps": args.steps,
              "results": results, "skipped": skipped, "summary": summarize(results)}
    write_outputs(report, out)
    print(json.dumps(report["summary"], indent=1))
    return 0


def _physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


if __name__ == "__main__":
    sys.exit(main())
