"""The bundled default's settings, decided by measurement: ``configs/tiny.yaml`` with ``model.remat:
none`` (the resident weights then refuse ``offload.overlap``: the optimizer runs after the
backward) against ``model.remat: dots`` (overlap on: the optimizer of step t beside step t+1's
forward/backward), alternating in one run. Prints JSON and writes a PNG.

    python scripts/bench_default.py                  # 2 rounds of the whole 300-step run (~25 min)
    python scripts/bench_default.py --steps 60 --rounds 1     # a smoke run

Per contender and round: s/step (the records' ``elapsed_s`` from the second logged step to the
last, so the compile is left out), the peak system memory sampled from outside (RSS of the process
tree + the offload files' page cache, scripts/bench_child.py), and the loss curve (every
``train.log_every``-th step). Ratios dots/none are medians over rounds with their ranges; the
loss curves are compared by the mean of the last 30 steps' logged losses.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from bench_child import run_train_child  # noqa: E402

from jaxascend.provenance import collect  # noqa: E402

CONTENDERS = {"none": ["model.remat=none"], "dots": ["model.remat=dots"]}


def run_once(name: str, steps: int, work: Path) -> dict:
    out = work / name
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "jaxascend.train", "--config", "configs/tiny.yaml",
           "--set", f"train.steps={steps}", "--set", f"train.out_dir={out}", "--set", "train.progress=false",
           ] + [a for o in CONTENDERS[name] for a in ("--set", o)]
    log_every = 10
    run = run_train_child(cmd, out / "offload", out / "metrics.jsonl", work / f"{name}.log",
                          steps=steps // log_every, cwd=REPO, finish=True)
    records = run.records
    first, last = records[0], records[-1]
    log_text = (work / f"{name}.log").read_text()
    return {"s_per_step": (last["elapsed_s"] - first["elapsed_s"]) / (last["step"] - first["step"]),
            "peak_system_bytes": run.peak_system,
            "losses": [(r["step"], r["loss"]) for r in records],
            "overlap_note": [line for line in log_text.splitlines() if "offload.overlap" in line]}


def ratio(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="bench_default")
    args = parser.parse_args(argv)
    results: dict[str, list] = {name: [] for name in CONTENDERS}
    with tempfile.TemporaryDirectory(dir=REPO) as tmp:
        for r in range(args.rounds):
            order = list(CONTENDERS) if r % 2 == 0 else list(reversed(CONTENDERS))
            for name in order:
                results[name].append(run_once(name, args.steps, Path(tmp)))
                print(f"round {r + 1} {name}: {results[name][-1]['s_per_step']:.3f} s/step", file=sys.stderr)
    tail = lambda run: statistics.mean(loss for _, loss in run["losses"][-3:])  # noqa: E731
    summary = {
        "machine": collect().one_line(),
        "steps": args.steps, "rounds": args.rounds,
        "s_per_step": {n: [run["s_per_step"] for run in runs] for n, runs in results.items()},
        "peak_system_gib": {n: [run["peak_system_bytes"] / 2**30 for run in runs] for n, runs in results.items()},
        "last_losses_mean": {n: [tail(run) for run in runs] for n, runs in results.items()},
        "dots_over_none": {
            "s_per_step": ratio([d["s_per_step"] / n["s_per_step"] for d, n in zip(results["dots"], results["none"])]),
            "peak_system": ratio([d["peak_system_bytes"] / n["peak_system_bytes"]
                                  for d, n in zip(results["dots"], results["none"])]),
        },
        "overlap_notes": {n: runs[0]["overlap_note"] for n, runs in results.items()},
    }
    print(json.dumps(summary, indent=1))
    _plot(results, Path(args.out + ".png"))
    return 0


def _plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, runs in results.items():
        for i, run in enumerate(runs):
            steps, losses = zip(*run["losses"])
            ax.plot(steps, losses, label=f"remat {name} (round {i + 1}, {run['s_per_step']:.2f} s/step)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    sys.exit(main())
