"""Loss curves with float32, bfloat16 and int8 optimizer state: does compressing the moments
change training? Prints JSON, writes ``docs/bench_state_quality.{json,png}``.

Trains the same run once per ``optimizer.state_dtype`` (same data order, same initialisation) on
two models: the tiny config (~3M parameters, ``--tiny-steps``, default 1000) and the 0.54B Llama
shape of ``bench_step.py`` (8 x 2048, MLP 5632, vocabulary 32000 untied; seq 128, batch 1,
``--large-steps``, default 100), both on the standard-library corpus with the byte tokenizer.

The tolerance is fixed before running (``TOLERANCE``): over the last 10% of steps, the mean loss
with compressed state within 1% of the float32-state run's. Dettmers et al. (ICLR 2022, "8-bit
Optimizers via Block-wise Quantization") report 8-bit block-wise Adam matching 32-bit Adam in
language modelling to within the run-to-run spread (perplexity differences of about 1%, i.e.
well under 1% of the loss); a bf16 moment is 16x finer than their 8-bit one. The report also
gives the largest gap between the curves smoothed over 20 steps, and the seed-to-seed spread of
the float32 runs where ``--seed-spread`` adds a second float32 run with another data seed, and
the chaos floor where ``--noise-floor`` adds a float32 run perturbed only in its eps (1e-5 of it):
how far the curve of an equally good optimizer drifts once anything changes the trajectory.
Compressed runs use ``optimizer.state_rounding`` ``--rounding`` (default stochastic).

    python scripts/bench_state_quality.py --noise-floor tiny    # both models (about 90 minutes)
    python scripts/bench_state_quality.py --only tiny --tiny-steps 100   # smoke run
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
from bench_step import cpu_model  # noqa: E402

DTYPES = ("float32", "bfloat16", "int8")
PERTURBED_EPS = "1.00001e-8"  # the default eps, 1e-5 of itself larger
TOLERANCE = 0.01  # relative, of the mean loss over the last 10% of steps (see the docstring)
LARGE = ["model.arch=llama", "model.hidden_size=2048", "model.intermediate_size=5632",
         "model.num_hidden_layers=8", "model.num_attention_heads=16", "model.num_key_value_heads=16",
         "model.vocab_size=32000", "model.tie_word_embeddings=false", "model.remat=dots",
         "data.seq_len=128", "data.batch_size=1", "offload.chunk_bytes=8MiB", "offload.staging_bytes=8MiB",
         "optimizer.learning_rate=3e-4", "optimizer.warmup_steps=10"]


def train(name: str, overrides: list[str], work: Path, reuse: bool = False, entry=None) -> dict:
    """One run of ``jaxascend.train`` (or of ``entry``, the arguments after the interpreter that
    stand for it) on the tiny config with ``overrides``: its losses and figures."""
    out = work / name
    steps = int(next(o for o in reversed(overrides) if o.startswith("train.steps=")).split("=")[1])
    if reuse and (out / "summary.json").exists():
        summary = json.loads((out / "summary.json").read_text())
        if summary["steps"] == steps:  # a finished run of this length: its curve stands
            return _figures(summary, seconds=None)
    args = [sys.executable, *(entry or ["-m", "jaxascend.train"]), "--config", str(REPO / "configs" / "tiny.yaml")]
    for o in overrides + [f"train.out_dir={out}", f"offload.dir={out}/offload", "train.progress=false",
                          "train.log_every=1", "checkpoint.every_steps=0", "export.save_params=false",
                          "train.resume=none"]:
        args += ["--set", o]
    started = time.perf_counter()
    done = subprocess.run(args, capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"{name}: training failed:\n{done.stderr[-3000:]}")
    return _figures(json.loads((out / "summary.json").read_text()), round(time.perf_counter() - started, 1))


def _figures(summary: dict, seconds) -> dict:
    return {"losses": summary["losses"], "seconds": seconds,
            "ssd_bytes_per_step": (summary["ssd_bytes_read"] + summary["ssd_bytes_written"])
            / max(summary["steps_this_run"], 1),
            "ssd_bytes_written_run": summary["ssd_bytes_written_run"], "num_params": summary["num_params"],
            **({"eval_loss": summary["eval_loss"]} if summary.get("eval_loss") is not None else {})}


def smooth(x: np.ndarray, k: int = 20) -> np.ndarray:
    k = max(1, min(k, len(x)))
    return np.convolve(x, np.ones(k) / k, mode="valid")


def compare(runs: dict) -> dict:
    base = np.asarray(runs["float32"]["losses"])
    tail = max(1, len(base) // 10)
    out = {}
    for d, r in runs.items():
        if d == "float32":
            continue
        x = np.asarray(r["losses"])
        final = float(x[-tail:].mean() / base[-tail:].mean() - 1)
        gap = smooth(x) / smooth(base) - 1
        out[d] = {"final_relative_difference": round(final, 5), "within_tolerance": abs(final) <= TOLERANCE,
                  "largest_smoothed_gap": round(float(np.abs(gap).max()), 5)}
    floor = runs.get("float32 perturbed")
    if floor is not None:  # each against float32 perturbed, as float32 is against it
        other = np.asarray(floor["losses"])[-tail:].mean()
        for d in out:
            if d != "float32 perturbed":
                out[d]["vs_float32_perturbed"] = round(float(np.asarray(runs[d]["losses"])[-tail:].mean() / other - 1), 5)
    return out


def plot(results: dict, path: Path) -> None:
    """One PNG: per model, the loss curves (top) and each compressed run's smoothed loss relative
    to the float32-state run's, with the tolerance band (bottom)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(results), figsize=(6.5 * len(results), 7.0), squeeze=False,
                             gridspec_kw={"height_ratios": [2, 1]})
    for k, (model, res) in enumerate(results.items()):
        top, bottom = axes[0][k], axes[1][k]
        base = smooth(np.asarray(res["runs"]["float32"]["losses"]), 10)
        for d, r in res["runs"].items():
            y = smooth(np.asarray(r["losses"]), 10)
            color = f"C{DTYPES.index(d)}" if d in DTYPES else "0.55"
            label = f"{d} state" if d in DTYPES else "float32 state, eps x (1 + 1e-5)"
            top.plot(np.arange(len(y)) + 10, y, label=label, lw=1.2, color=color)
            if d != "float32":
                bottom.plot(np.arange(len(y)) + 10, (y / base - 1) * 100, label=label, lw=1.0, color=color)
        top.set_title(f"{model}: {res['num_params'] / 1e6:.0f}M params, {res['steps']} steps")
        top.set_ylabel("training loss (mean of 10 steps)")
        verdict = ", ".join(f"{d}: {c['final_relative_difference'] * 100:+.2f}%" for d, c in res["comparison"].items())
        top.text(0.98, 0.95, f"last 10% vs float32: {verdict}\ntolerance ±{TOLERANCE * 100:.0f}%",
                 transform=top.transAxes, ha="right", va="top", fontsize=8)
        top.legend(loc="lower left", fontsize=8)
        bottom.axhspan(-TOLERANCE * 100, TOLERANCE * 100, color="0.9", label="tolerance")
        bottom.axhline(0, color="0.5", lw=0.6)
        bottom.set_xlabel("step")
        bottom.set_ylabel("vs float32 state (%)")
        bottom.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def report_of(results: dict) -> dict:
    return {"tolerance": TOLERANCE, "cpu": cpu_model(), "models": {
        m: {k: v for k, v in r.items() if k != "runs"} | {"runs": {d: {k: v for k, v in x.items() if k != "losses"}
                                                                    | {"final_loss": x["losses"][-1]}
                                                                    for d, x in r["runs"].items()}}
        for m, r in results.items()}}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=["tiny", "0.54b"], default=None)
    p.add_argument("--tiny-steps", type=int, default=1000)
    p.add_argument("--large-steps", type=int, default=100)
    p.add_argument("--seed-spread", default="", help="comma-separated models (tiny, 0.54b) that get a second "
                   "float32 run with data.seed=1: the run-to-run spread beside the state dtypes' differences")
    p.add_argument("--noise-floor", default="", help="comma-separated models (tiny, 0.54b) that get a second "
                   f"float32 run with optimizer.eps={PERTURBED_EPS}: how far a perturbation alone moves the curve")
    p.add_argument("--dtypes", default=",".join(DTYPES),
                   help="comma-separated state dtypes to train (float32, the baseline, always among them)")
    p.add_argument("--rounding", choices=["stochastic", "nearest"], default="stochastic",
                   help="optimizer.state_rounding of the compressed runs (their work dirs say which)")
    p.add_argument("--work-dir", default="/tmp/jaxascend-bench-quality")
    p.add_argument("--out", default=str(REPO / "docs" / "bench_state_quality"))
    p.add_argument("--reuse", action="store_true",
                   help="keep the curve of a run already finished in --work-dir (same name and steps)")
    p.add_argument("--replot", type=Path, default=None,
                   help="redraw the PNG (and the JSON's comparison) from a saved JSON instead of training")
    args = p.parse_args(argv)
    dtypes = [d for d in DTYPES if d in args.dtypes.split(",")]
    unknown = set(args.dtypes.split(",")) - set(DTYPES)
    if unknown or "float32" not in dtypes:
        p.error(f"--dtypes {args.dtypes!r}: each one of {', '.join(DTYPES)}, float32 among them")
    out = Path(args.out)
    if args.replot is not None:
        saved = json.loads(args.replot.read_text())
        results = {}
        for m, r in saved["models"].items():
            runs = {d: x | {"losses": saved["losses"][m][d]} for d, x in r["runs"].items()}
            r["comparison"] = compare(runs)
            results[m] = r | {"runs": runs}
        args.replot.write_text(json.dumps(saved) + "\n")
        plot(results, out.with_suffix(".png"))
        return saved
    work = Path(args.work_dir)
    models = {"0.54b": (LARGE + [f"train.steps={args.large_steps}"], args.large_steps),
              "tiny": ([f"train.steps={args.tiny_steps}"], args.tiny_steps)}
    if args.only:
        models = {args.only: models[args.only]}
    results = {}
    for model, (overrides, steps) in models.items():
        runs = {}
        for d in dtypes:
            name = f"{model}-{d}" if d == "float32" else f"{model}-{d}-{args.rounding}"
            runs[d] = train(name, overrides + [f"optimizer.state_dtype={d}", f"optimizer.state_rounding={args.rounding}"],
                            work, args.reuse)
            print(f"{model} {d}: final loss {runs[d]['losses'][-1]:.4f} in {runs[d]['seconds']} s", file=sys.stderr)
        res = {"steps": steps, "num_params": runs["float32"]["num_params"], "runs": runs, "comparison": compare(runs)}
        if model in args.seed_spread.split(","):
            other = train(f"{model}-float32-seed1", overrides + ["data.seed=1"], work, args.reuse)
            res["seed_spread_final_relative_difference"] = compare({"float32": runs["float32"],
                                                                    "seed1": other})["seed1"]["final_relative_difference"]
        if model in args.noise_floor.split(","):
            # The same float32 run with eps 1e-5 of itself larger: the same data and weights, a
            # trajectory that drifts apart as any perturbation's does (the chaos floor).
            other = train(f"{model}-float32-eps", overrides + ["optimizer.state_dtype=float32",
                                                               f"optimizer.eps={PERTURBED_EPS}"], work, args.reuse)
            res["runs"]["float32 perturbed"] = other
            res["comparison"] = compare(res["runs"])
        results[model] = res
    report = report_of(results) | {"state_rounding": args.rounding}
    out.parent.mkdir(parents=True, exist_ok=True)
    (out.with_suffix(".json")).write_text(json.dumps(report | {"losses": {m: {d: x["losses"] for d, x in
                                                                             r["runs"].items()}
                                                                          for m, r in results.items()}}) + "\n")
    plot(results, out.with_suffix(".png"))
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
