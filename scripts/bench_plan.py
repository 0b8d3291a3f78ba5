"""The run planner against measured runs: predicted and measured peak system memory, by shape,
sequence length and remat policy.

    python scripts/bench_plan.py                          # every case, once
    python scripts/bench_plan.py --cases tiny-512-none    # some of them (comma-separated names)
    python scripts/bench_plan.py --merge --cases ...      # add to --out, replacing those cases
    python scripts/bench_plan.py --replot                 # only rewrite the .md from --out

Cases: configs/tiny.yaml's shape (3M parameters, byte tokenizer, the bundled @stdlib data) at
``data.seq_len`` 128, 512 and 2048 (batch 16, 16 and 4) with ``model.remat`` none and full; and
the Qwen2.5-0.5B shape (a random bf16 checkpoint in Hugging Face layout from
``scripts/make_hf_checkpoint.py``, its tokenizer) at seq 128 and 1024, batch 1, remat full, the
weights resident and streamed from SSD (``qwen0.5B-*-ssd``), dense attention and loss; then
blockwise attention with the dense loss, and with the blocked loss at 1024 and 4096 tokens.
Each run is ``python -m jaxascend.train`` in its own process, sampled from outside
(``bench_child``: RSS of the process tree and the page cache of
its offload files, with the kernel's RSS high-water mark) until it has logged its steps; the
prediction is the plan the trainer itself made and wrote (``plan.json``) before allocating
anything. Writes JSON to ``--out`` (default docs/bench_plan.json) and a Markdown table (``.md``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from bench_child import run_train_child
from bench_scale import cpu_model, make_checkpoint

REPO = Path(__file__).resolve().parent.parent
COMMON = ["train.log_every=1", "optimizer.warmup_steps=0", "train.progress=false", "export.save_params=false",
          "checkpoint.every_steps=0"]
TINY = ["model.max_position_embeddings=2048"]
QWEN = ["model.dtype=bfloat16", "model.param_dtype=bfloat16", "model.remat=full", "data.tokenizer=model",
        "data.batch_size=1", "offload.chunk_bytes=16MiB", "model.max_position_embeddings=32768"]


def cases() -> dict[str, dict]:
    """name -> {"shape", "sets", "steps"}; optional: "checkpoint", the qwen2 preset to start from,
    "limit", the bytes past which the run is killed (``bench_child.OverLimit``), and "spare", the
    machine's available bytes under which it is killed."""
    out = {}
    for seq, batch in ((128, 16), (512, 16), (2048, 4)):
        for remat in ("none", "full"):
            out[f"tiny-{seq}-{remat}"] = {"shape": "tiny", "steps": 3, "sets": TINY + [
                f"data.seq_len={seq}", f"data.batch_size={batch}", f"model.remat={remat}", "model.attention=dense"]}
    # long rows: blockwise attention (model.attention auto picks it from 1024 tokens up)
    for seq, batch, remat, attention in ((2048, 4, "full", "blockwise"), (8192, 1, "full", "auto"),
                                         (8192, 1, "none", "auto"), (16384, 1, "full", "auto")):
        out[f"tiny-{seq}-{remat}-{attention}"] = {"shape": "tiny", "steps": 3, "sets": [
            f"model.max_position_embeddings={seq}", f"data.seq_len={seq}", f"data.batch_size={batch}",
            f"model.remat={remat}", f"model.attention={attention}"]}
    for seq in (128, 1024):
        for params in ("resident", "ssd"):
            out[f"qwen0.5B-{seq}-{params}"] = {
                "shape": "0.5B", "checkpoint": "0.5B", "steps": 3 if seq <= 128 else 2, "sets": QWEN + [
                    f"data.seq_len={seq}", f"offload.params={params}", "model.attention=dense", "model.loss=dense"]}
    out["qwen0.5B-1024-blockwise"] = {"shape": "0.5B", "checkpoint": "0.5B", "steps": 2, "sets": QWEN + [
        "data.seq_len=1024", "offload.params=resident", "model.attention=blockwise", "model.loss=dense"]}
    # what model.attention and model.loss auto choose from 1024 tokens: blockwise, blocked (logits never whole)
    for seq in (1024, 4096):
        out[f"qwen0.5B-{seq}-blocked"] = {"shape": "0.5B", "checkpoint": "0.5B", "steps": 2, "sets": QWEN + [
            f"data.seq_len={seq}", "offload.params=resident", "model.attention=blockwise", "model.loss=blocked"]}
    # vertical micro-batches: the layer boundaries of all A x B rows, one micro-batch's layer
    out["tiny-512-full-a4"] = {"shape": "tiny", "steps": 3, "sets": TINY + [
        "data.seq_len=512", "data.batch_size=4", "train.grad_accum=4", "model.remat=full", "model.attention=dense"]}
    out["qwen0.5B-512-ssd-a8"] = {"shape": "0.5B", "checkpoint": "0.5B", "steps": 2, "sets": QWEN + [
        "data.seq_len=512", "offload.params=ssd", "train.grad_accum=8"]}
    return out


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(cases()), help="comma-separated case names (default: all)")
    p.add_argument("--work-dir", default="/tmp/jaxascend-bench-plan")
    p.add_argument("--out", default=str(REPO / "docs" / "bench_plan.json"))
    p.add_argument("--merge", action="store_true", help="add to --out, replacing the cases run again")
    p.add_argument("--interval", type=float, default=0.05)
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--replot", action="store_true")
    return p.parse_args()


def run_sets(case: dict, out_dir: Path, work: Path) -> list[str]:
    """Every ``--set`` of ``case``'s training run writing under ``out_dir`` (its checkpoint made)."""
    sets = COMMON + case["sets"] + [f"train.steps={case['steps']}", f"train.out_dir={out_dir / 'run'}",
                                    f"offload.dir={out_dir / 'offload'}"]
    if case.get("checkpoint"):
        checkpoint = work / f"qwen2.5-{case['checkpoint']}"
        make_checkpoint(case["checkpoint"], checkpoint)
        sets.append(f"model.path={checkpoint}")
    return sets


def command(module: str, sets: list[str]) -> list[str]:
    """``python -m module`` on configs/tiny.yaml with ``sets``."""
    cmd = [sys.executable, "-m", module, "--config", str(REPO / "configs" / "tiny.yaml")]
    for s in sets:
        cmd += ["--set", s]
    return cmd


def planned(sets: list[str]) -> dict:
    """The plan (``python -m jaxascend.plan --json``) the trainer would make for ``sets``."""
    done = subprocess.run(command("jaxascend.plan", sets) + ["--json"], cwd=REPO, capture_output=True, text=True)
    try:
        return json.loads(done.stdout)
    except json.JSONDecodeError:
        raise RuntimeError(f"jaxascend.plan failed ({done.returncode}): {done.stderr[-2000:]}") from None


def run_case(name: str, case: dict, args) -> dict:
    """One training run of ``case`` in its own process under ``args.work_dir``: the trainer's
    plan against the peak measured from outside (``args.interval``, ``args.timeout``)."""
    work = Path(args.work_dir)
    out_dir = work / name
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    cmd = command("jaxascend.train", run_sets(case, out_dir, work))
    run = run_train_child(cmd, out_dir / "offload", out_dir / "run" / "metrics.jsonl", out_dir / "stdout.txt",
                          steps=case["steps"], cwd=REPO, interval=args.interval, timeout=args.timeout,
                          limit=case.get("limit"), spare=case.get("spare"))
    plan = json.loads((out_dir / "run" / "plan.json").read_text())
    shutil.rmtree(out_dir / "offload", ignore_errors=True)
    peak_at = max(run.window, key=lambda x: x[1] + x[2])[0]
    result = {"case": name, "shape": case["shape"], "sets": case["sets"], "steps": case["steps"],
              "peak_at_s": peak_at, "first_step_at_s": run.first_step_at, "steps_done_at_s": run.steps_done_at,
              "rss_by_step": [r.get("rss_bytes") for r in run.records],
              "step_s": [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(run.records, run.records[1:])],
              "num_params": plan["num_params"], "params": plan["params"], "phase": plan["phase"],
              "predicted_bytes": plan["host_peak"], "predicted_parts": plan["host"],
              "measured_bytes": run.peak_system, "measured_rss_bytes": run.peak_rss,
              "high_water_bytes": run.high_water, "page_cache_bytes": run.peak_page_cache,
              "ratio": plan["host_peak"] / run.peak_system}
    print(json.dumps({k: v for k, v in result.items() if k not in ("predicted_parts", "sets")}), file=sys.stderr)
    return result


def write_outputs(report: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    gib = 2**30
    lines = [f"CPU: {report['cpu']}. Predicted: the plan the trainer made before allocating (`plan.json`); "
             "measured: peak RSS of the process tree (or its VmHWM) + page cache of the offload files, sampled "
             "from outside until the steps were logged.", "",
             "| case | params | seq | batch | remat | weights | phase | predicted | measured | ratio | runtime | "
             "arena | params | activations | temporaries |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        sets = dict(s.split("=", 1) for s in r["sets"])
        parts = r["predicted_parts"]
        lines.append(f"| {r['case']} | {r['num_params'] / 1e6:.0f}M | {sets['data.seq_len']} | {sets['data.batch_size']} | "
                     f"{sets.get('model.remat', 'full')} | {r['params']} | {r['phase']} | "
                     f"{r['predicted_bytes'] / gib:.2f} GiB | {r['measured_bytes'] / gib:.2f} GiB | {r['ratio']:.3f} | "
                     + " | ".join(f"{parts.get(k, 0) / gib:.2f}" for k in ("runtime", "arena", "resident params",
                                                                            "activations", "temporaries")) + " |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main() -> int:
    args, known = parse_args(), cases()
    out = Path(args.out)
    names = [n.strip() for n in args.cases.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        print(f"error: --cases: unknown {', '.join(unknown)} (known: {', '.join(known)})", file=sys.stderr)
        return 2
    if args.replot:  # the tables again, from the JSON
        write_outputs(json.loads(out.read_text()), out)
        return 0
    failed = []
    for name in names:  # each result is written as soon as it is measured
        try:
            result = run_case(name, known[name], args)
        except RuntimeError as err:
            print(f"{name}: {err}", file=sys.stderr)
            failed.append(name)
            continue
        old = json.loads(out.read_text())["results"] if (args.merge or name != names[0]) and out.exists() else []
        results = [r for r in old if r["case"] != name] + [result]
        results.sort(key=lambda r: list(known).index(r["case"]) if r["case"] in known else len(known))
        write_outputs({"cpu": cpu_model(), "results": results}, out)
    if out.exists():
        print(out.with_suffix(".md").read_text())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
