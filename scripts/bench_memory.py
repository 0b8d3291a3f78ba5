"""Host memory of one training run per mode: in-memory optax, a ZeRO-Infinity-style baseline,
each ablation switch alone, and jaxascend.

    python scripts/bench_memory.py                  # ~0.5B-parameter Llama, seq 128, batch 1, 3 steps
    python scripts/bench_memory.py --size small     # a smoke run (seconds per mode)

Each mode is a separate process (``python -m jaxascend.train --config configs/tiny.yaml
--set ...``: the bundled @stdlib data, byte tokenizer), run one after another. While it runs,
this script samples the child's RSS and the page cache held by its offload shard files
(``mincore``, :func:`jaxascend.ssd.memory_probe.page_cache_bytes`) every ``--interval`` seconds.
System memory = RSS + that page cache: buffered I/O hides its cost in the page cache, outside
RSS. The child is stopped once the last step's metrics line is written (unless ``--finish``):
the end-of-run checkpoint and weight export are not part of a training step's memory
(``scripts/bench_checkpoint.py`` measures checkpoints).

Every mode uses ``model.remat=full`` (as every shipped config but ``tiny`` does). The offloaded
modes compute in bfloat16, build the initial model in bfloat16 (``model.param_dtype``: the fp32
master weights on SSD start from those values, as they would from a bf16 checkpoint) and stream
the optimizer step in 16 MiB chunks (``offload.chunk_bytes``); ``--set`` adds or overrides
fields for every mode. Two peaks are reported: over the whole run up to the last step
(start-up included), and over the steady state (from the end of the first step on).

Modes (``offload.*`` switches as documented in docs/architecture.md, "Ablation switches"):

* ``in-memory``: ``optax.adamw`` with fp32 params, jitted, everything in RAM (how JAX users train);
* ``zero-infinity``: every switch on (pow2 buffers, one pool sized for the largest tensor, a full
  fp32 host gradient buffer, the post-backward overflow scan, buffered page-cache I/O);
* ``pow2_buffers``, ``single_pool``, ``fp32_grad_buffer``, ``post_backward_overflow_check``,
  ``buffered_io``: one switch on, the rest as jaxascend;
* ``jaxascend``: every switch off (O_DIRECT, exact-size arena, instant gradient offload).

Writes a JSON table to stdout and ``--out`` (default docs/bench_memory.json), a Markdown table
(``.md``) and a plot of system memory over time (``.png``) beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
from pathlib import Path

import psutil

from bench_child import run_train_child

REPO = Path(__file__).resolve().parent.parent

SIZES = {
    # ~0.50B parameters: 26 Llama layers of 16.8M (hidden 1024, MLP 4096, 16 heads, no GQA) plus
    # untied 32000 x 1024 embedding and head (2 x 32.8M).
    "0.5b": {"model.hidden_size": 1024, "model.intermediate_size": 4096, "model.num_hidden_layers": 26,
             "model.num_attention_heads": 16, "model.num_key_value_heads": 16, "model.vocab_size": 32000,
             "model.tie_word_embeddings": "false"},
    "small": {"model.hidden_size": 128, "model.intermediate_size": 512, "model.num_hidden_layers": 4,
              "model.num_attention_heads": 4, "model.num_key_value_heads": 2, "model.vocab_size": 4096,
              "model.tie_word_embeddings": "false"},
}

SWITCHES = {
    "pow2_buffers": ["offload.pow2_buffers=true"],
    "single_pool": ["offload.single_pool=true"],
    "fp32_grad_buffer": ["offload.fp32_grad_buffer=true"],
    "post_backward_overflow_check": ["offload.post_backward_overflow_check=true"],
    "buffered_io": ["offload.direct_io=false", "offload.drop_page_cache=false"],
}
OFFLOADED = ["offload.enabled=true", "model.dtype=bfloat16", "model.param_dtype=bfloat16",
             "offload.chunk_bytes=16MiB"]
MODES = {
    "in-memory": ["offload.enabled=false", "model.dtype=float32", "model.param_dtype=float32"],
    "zero-infinity": OFFLOADED + sum(SWITCHES.values(), []),
    **{name: OFFLOADED + overrides for name, overrides in SWITCHES.items()},
    "jaxascend": OFFLOADED,
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(SIZES), default="0.5b")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of: " + ", ".join(MODES))
    p.add_argument("--work-dir", default="/tmp/jaxascend-bench-memory", help="run outputs and offload shards")
    p.add_argument("--out", default=str(REPO / "docs" / "bench_memory.json"))
    p.add_argument("--interval", type=float, default=0.1, help="sampling period, seconds")
    p.add_argument("--timeout", type=float, default=3600, help="per mode, seconds")
    p.add_argument("--finish", action="store_true", help="let each run finish (end checkpoint, exports)")
    p.add_argument("--replot", action="store_true", help="only rewrite the .md and .png from an existing --out")
    p.add_argument("--set", dest="extra", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="extra override for every mode, e.g. --set offload.chunk_bytes=16MiB")
    return p.parse_args()


def count_parameters(overrides: list[str]) -> int:
    """Parameters of the model the overrides describe (abstract: nothing is allocated)."""
    from flax import nnx

    from jaxascend.config import load_config
    from jaxascend.models import build_model, count_params

    cfg = load_config(str(REPO / "configs" / "tiny.yaml"), overrides)
    abstract = nnx.eval_shape(lambda: build_model(cfg.model, cfg.model.vocab_size, rngs=nnx.Rngs(0)))
    return count_params(abstract)


def run_mode(name: str, overrides: list[str], args: argparse.Namespace) -> dict:
    out_dir = Path(args.work_dir) / name
    offload_dir = out_dir / "offload"
    shutil.rmtree(out_dir, ignore_errors=True)  # this mode's own scratch folder
    out_dir.mkdir(parents=True)
    sets = overrides + [f"offload.dir={offload_dir}", f"train.out_dir={out_dir / 'run'}",
                        f"checkpoint.dir={out_dir / 'checkpoints'}", "export.save_params=false"]
    cmd = [sys.executable, "-m", "jaxascend.train", "--config", str(REPO / "configs" / "tiny.yaml")]
    for s in sets:
        cmd += ["--set", s]
    metrics_path = out_dir / "run" / "metrics.jsonl"
    try:
        child = run_train_child(cmd, offload_dir, metrics_path, out_dir / "stdout.txt", steps=args.steps, cwd=REPO,
                                interval=args.interval, timeout=args.timeout, finish=args.finish)
    except RuntimeError as err:
        raise RuntimeError(f"{name}: {err}") from None
    samples, records = child.samples, child.records
    first_step_at, steps_done_at = child.first_step_at, child.steps_done_at
    window = [s for s in samples if s[0] <= steps_done_at]
    steady = [s for s in window if s[0] >= first_step_at] or window[-1:]
    peak_rss = max(s[1] for s in window)
    peak_cache = max(s[2] for s in window)
    peak_system = max(s[1] + s[2] for s in window)
    elapsed = [r["elapsed_s"] for r in records[:args.steps]]
    step_times = [b - a for a, b in zip(elapsed, elapsed[1:])]
    last = records[args.steps - 1]
    for scratch in (offload_dir, out_dir / "checkpoints"):  # GBs of shards
        shutil.rmtree(scratch, ignore_errors=True)
    return {
        "mode": name,
        "overrides": overrides,
        "peak_rss_bytes": peak_rss,
        "peak_page_cache_bytes": peak_cache,
        "peak_system_bytes": peak_system,  # max over samples of RSS + page cache
        "steady_peak_system_bytes": max(s[1] + s[2] for s in steady),  # after the first step
        "steady_peak_rss_bytes": max(s[1] for s in steady),
        "steady_peak_page_cache_bytes": max(s[2] for s in steady),
        "peak_rss_bytes_self_reported": last["peak_rss_bytes"],  # ru_maxrss at the last step
        "arena_capacity_bytes": last.get("arena_capacity_bytes", 0),
        "host_grad_buffer_bytes": last.get("host_grad_buffer_bytes", 0),
        "step_time_s": statistics.median(step_times) if step_times else None,
        "first_step_s": elapsed[0],
        "final_loss": last["loss"],
        "losses": [r["loss"] for r in records[:args.steps]],
        "ssd_read_bytes_step": last.get("ssd_read_bytes_step", 0),
        "ssd_write_bytes_step": last.get("ssd_write_bytes_step", 0),
        "samples": samples,  # (seconds since start, RSS, page cache of the offload files)
        "first_step_done_s": first_step_at,
        "steps_done_s": steps_done_at,
    }


def summarize(results: list[dict], num_params: int) -> dict:
    by_mode = {r["mode"]: r for r in results}
    for r in results:
        r["bytes_per_param"] = r["peak_system_bytes"] / num_params
        r["steady_bytes_per_param"] = r["steady_peak_system_bytes"] / num_params
    ratios = {}
    ours = by_mode.get("jaxascend")
    for ref in ("in-memory", "zero-infinity"):
        if ours and ref in by_mode:
            ratios[f"jaxascend / {ref}"] = ours["peak_system_bytes"] / by_mode[ref]["peak_system_bytes"]
            ratios[f"jaxascend / {ref}, steady state"] = (ours["steady_peak_system_bytes"] /
                                                          by_mode[ref]["steady_peak_system_bytes"])
    return {"num_params": num_params, "ratios": ratios}


def write_markdown(path: Path, table: dict) -> None:
    gib = 2**30
    lines = [f"# Host memory per mode ({table['size']}: {table['num_params'] / 1e9:.3f}B parameters, "
             f"seq {table['seq_len']}, batch {table['batch']}, {table['steps']} steps)", "",
             "System memory = RSS + page cache held by the offload shard files, sampled every "
             f"{table['interval_s']} s while the steps ran (`scripts/bench_memory.py`).", "",
             "| mode | peak system (GiB) | peak RSS (GiB) | peak page cache (GiB) | bytes/param | "
             "steady-state peak system (GiB) | steady bytes/param | arena (GiB) | step time (s) | final loss |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in table["results"]:
        step = f"{r['step_time_s']:.2f}" if r["step_time_s"] is not None else "-"
        lines.append(f"| {r['mode']} | {r['peak_system_bytes'] / gib:.2f} | {r['peak_rss_bytes'] / gib:.2f} | "
                     f"{r['peak_page_cache_bytes'] / gib:.2f} | {r['bytes_per_param']:.1f} | "
                     f"{r['steady_peak_system_bytes'] / gib:.2f} | {r['steady_bytes_per_param']:.1f} | "
                     f"{r['arena_capacity_bytes'] / gib:.2f} | {step} | {r['final_loss']:.4f} |")
    lines.append("")
    for k, v in table["ratios"].items():
        lines.append(f"- peak system memory, {k}: **{v:.3f}**")
    lines += ["", "Machine: " + ", ".join(f"{k} {v}" for k, v in table.get("machine", {}).items()), ""]
    if table.get("notes"):  # analysis added after the run (see the JSON's "notes")
        lines += ["## Notes", ""] + [f"- {note}" for note in table["notes"]]
    path.write_text("\n".join(lines) + "\n")


HEADLINE = ("in-memory", "zero-infinity", "jaxascend")


def plot(path: Path, table: dict) -> None:
    """Host memory over time: the three headline modes (left) and each switch alone (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = table["results"]
    panels = [("in-memory optax vs ZeRO-Infinity-style vs jaxascend", [r for r in results if r["mode"] in HEADLINE]),
              ("one ablation switch on (jaxascend for reference)",
               [r for r in results if r["mode"] not in HEADLINE[:2]])]
    panels = [(title, rs) for title, rs in panels if rs]
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 5.5), sharey=True, squeeze=False)
    for ax, (title, rs) in zip(axes[0], panels):
        for r in rs:
            end = r["steps_done_s"]
            samples = [s for s in r["samples"] if s[0] <= end]
            t = [s[0] for s in samples]
            line, = ax.plot(t, [(s[1] + s[2]) / 2**30 for s in samples],
                            label=f"{r['mode']} (peak {r['peak_system_bytes'] / 2**30:.1f} GiB)")
            if r["peak_page_cache_bytes"]:
                ax.plot(t, [s[1] / 2**30 for s in samples], color=line.get_color(), linestyle=":", linewidth=1)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("seconds since process start")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    axes[0][0].set_ylabel("GiB: RSS + page cache of the offload files (dotted: RSS alone)")
    fig.suptitle(f"Host memory while training {table['num_params'] / 1e9:.2f}B parameters "
                 f"(seq {table['seq_len']}, batch {table['batch']}, {table['steps']} steps)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    args = parse_args()
    if args.replot:
        out = Path(args.out)
        table = json.loads(out.read_text())
        write_markdown(out.with_suffix(".md"), table)
        plot(out.with_suffix(".png"), table)
        return
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"--modes: unknown {unknown}; choose from {', '.join(MODES)}")
    shape = [f"{k}={v}" for k, v in SIZES[args.size].items()]
    common = shape + [f"data.seq_len={args.seq_len}", f"data.batch_size={args.batch}",
                      f"train.steps={args.steps}", "train.log_every=1", "train.progress=false",
                      "optimizer.warmup_steps=0", "model.remat=full"]
    num_params = count_parameters(common)
    results = []
    for name in modes:
        print(f"[bench_memory] {name} ({num_params / 1e9:.3f}B params) ...", file=sys.stderr, flush=True)
        r = run_mode(name, common + MODES[name] + args.extra, args)
        print(f"[bench_memory] {name}: peak system {r['peak_system_bytes'] / 2**30:.2f} GiB "
              f"(RSS {r['peak_rss_bytes'] / 2**30:.2f}, page cache {r['peak_page_cache_bytes'] / 2**30:.2f}), "
              f"step {r['step_time_s']} s, loss {r['final_loss']:.4f}", file=sys.stderr, flush=True)
        results.append(r)
    table = {"size": args.size, "seq_len": args.seq_len, "batch": args.batch, "steps": args.steps,
             "interval_s": args.interval, "common_overrides": common, "machine": _machine(),
             "results": results}
    table.update(summarize(results, num_params))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table, indent=1))
    write_markdown(out.with_suffix(".md"), table)
    plot(out.with_suffix(".png"), table)
    brief = {**table, "results": [{k: v for k, v in r.items() if k != "samples"} for r in results]}
    print(json.dumps(brief, indent=1))


def _machine() -> dict:
    return {"cpus": os.cpu_count(), "ram_bytes": psutil.virtual_memory().total,
            "load_avg_at_start": os.getloadavg()}


if __name__ == "__main__":
    main()
