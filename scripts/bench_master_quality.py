"""16-bit master weights against float32 ones, in the two regimes of issue 39. Prints JSON, writes
``docs/bench_master_quality.{json,png}``.

The rule is fixed before running (``TOLERANCE``, the rule of ``bench_state_quality``): the mean
loss over the last 10% of steps within 1% of the float32-master run's, or within that run's own
perturbation spread (a float32 run whose eps is 1e-5 of itself larger: the same data and weights,
a trajectory that drifts apart as any perturbation's does). In the fine-tuning regime the drift
of the weights from where they started, ``|W_T - W_0| / |W_0|`` over every parameter, must meet
the same rule against float32's drift.

1. **Training from scratch** (``scratch``): the tiny config for ``--steps`` (default 1000) at its
   learning rate 2e-3, once per master (float32; bfloat16 ``compensated``; ``stochastic``; and
   each beside int8 moments; ``--masters`` chooses), then the 0.54B Llama shape of
   ``bench_state_quality`` for ``--large-steps`` (default 100) at 3e-4.
2. **Fine-tuning at a small learning rate** (``finetune``): the tiny model is trained to
   convergence on the standard library's Python (``--pretrain-steps``, default 1000, at 2e-3,
   float32 master), exported in bfloat16 (so every master starts from the same weights exactly), then fine-tuned on other data (numpy's Python sources) at 1e-5 and
   at 5e-5 for ``--finetune-steps`` (default 300) from the exported weights. This is where a
   bfloat16 weight rounded to nearest stops moving: an update below half its ulp (0.2-0.4% of
   the weight) is lost. ``nearest`` (a bfloat16 master without compensation) shows it.

Every run trains the same data in the same order from the same weights (``model.dtype:
bfloat16``, the compute dtype a bfloat16 master needs, for every run).

    python scripts/bench_master_quality.py                         # both regimes (about 2 hours on 2 cores)
    python scripts/bench_master_quality.py --only finetune --finetune-steps 50 --pretrain-steps 100   # smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
from bench_state_quality import LARGE, PERTURBED_EPS, smooth, train  # noqa: E402
from bench_step import cpu_model  # noqa: E402

TOLERANCE = 0.01  # relative, of the last 10% of steps' mean loss (and of the weights' drift)
MASTERS = {  # name -> overrides
    "float32": ["optimizer.master_dtype=float32"],
    "bfloat16-compensated": ["optimizer.master_dtype=bfloat16", "optimizer.master_rounding=compensated"],
    "bfloat16-stochastic": ["optimizer.master_dtype=bfloat16", "optimizer.master_rounding=stochastic"],
}
NEAREST = {"bfloat16-nearest": ["optimizer.master_dtype=bfloat16", "optimizer.master_rounding=nearest"]}
COMPACT = {"bfloat16-stochastic+int8": MASTERS["bfloat16-stochastic"] + ["optimizer.state_dtype=int8"],
           "bfloat16-compensated+int8": MASTERS["bfloat16-compensated"] + ["optimizer.state_dtype=int8"]}
PERTURBED = {"float32-perturbed": MASTERS["float32"] + [f"optimizer.eps={PERTURBED_EPS}"]}
# The 0.54B regime's further perturbations of float32 (its learning rate, 3e-4, 1e-5 of itself up
# and down): the eps one touches only the updates where sqrt(v) is near eps, these every update.
PERTURBED_LR = {"float32-perturbed-lr+": MASTERS["float32"] + ["optimizer.learning_rate=3.00003e-4"],
                "float32-perturbed-lr-": MASTERS["float32"] + ["optimizer.learning_rate=2.99997e-4"]}
BASE = ["model.dtype=bfloat16", "model.param_dtype=float32"]
# The 0.54B regime's held-out statistic (``--large-heldout``, fixed before its runs on 2026-12-05):
# the loss of the weights after the last step on the first 64 rows of 128 tokens of numpy's Python
# sources (data no run trains on), in 8 batches of 8; the same bound as the training loss's.
HELDOUT_ROWS = (8, 8)  # eval.batches, eval.batch_size


def numpy_sources() -> str:
    import numpy
    return str(Path(numpy.__file__).parent)


def weights(folder: Path) -> dict:
    """The Hugging Face export's tensors as float32 arrays by name: the pretrained weights in
    bfloat16 (where every fine-tuning run starts, a bfloat16 master exactly), a fine-tuned run's
    in float32 (its master's values; a compensated master's joined halves)."""
    from jaxascend.hf import CheckpointFiles
    files = CheckpointFiles(folder)
    try:
        return {name: np.asarray(files.read(entry), np.float32) for name, entry in files.entries.items()}
    finally:
        files.close()


def drift(start: dict, end: dict) -> float:
    num = sum(float(np.sum((end[k] - start[k]) ** 2)) for k in start)
    den = sum(float(np.sum(start[k] ** 2)) for k in start)
    return (num / den) ** 0.5


def verdict(runs: dict, heldout: bool = False, spread_from: dict | None = None) -> dict:
    """Each run's last-10% mean (``heldout``: its held-out loss at the end) against float32's; the
    spread is the farthest float32-perturbed run's (or ``spread_from``'s, an earlier verdict of the
    same float32 run, whose perturbed runs it keeps)."""
    def statistic(r):
        if heldout:
            return float(r["eval_loss"])
        x = np.asarray(r["losses"])
        return float(x[-max(1, len(x) // 10):].mean())

    base = statistic(runs["float32"])
    perturbed = [r for name, r in runs.items() if name.startswith("float32-perturbed")]
    spread = max((abs(statistic(r) / base - 1) for r in perturbed), default=0.0)
    out = {}
    if spread_from is not None:
        spread = max(spread, spread_from["perturbation_spread"])
        out.update({name: r for name, r in spread_from["runs"].items() if name.startswith("float32-perturbed")})
    for name, r in runs.items():
        if name == "float32":
            continue
        rel = statistic(r) / base - 1
        entry = {"final_relative_difference": round(rel, 5),
                 "within_rule": abs(rel) <= max(TOLERANCE, spread)}
        if "drift" in r and "drift" in runs["float32"]:
            d = r["drift"] / runs["float32"]["drift"] - 1
            d_spread = max((abs(p["drift"] / runs["float32"]["drift"] - 1) for p in perturbed), default=0.0)
            entry.update(drift=round(r["drift"], 6), drift_relative_difference=round(d, 5),
                         drift_within_rule=abs(d) <= max(TOLERANCE, d_spread))
            entry["within_rule"] = entry["within_rule"] and entry["drift_within_rule"]
        out[name] = entry
    return {"perturbation_spread": round(spread, 5), "runs": out}


def scratch(args, work: Path) -> dict:
    """Regime 1 on the tiny config for ``--steps``: float32, its perturbation, the masters of
    ``--masters`` and their ``--compact`` combinations."""
    masters = {k: v for k, v in MASTERS.items() if k == "float32" or k in args.masters}
    compact = {k: v for k, v in COMPACT.items() if k in args.compact and k.split("+")[0] in masters}
    return _from_scratch("scratch", {**masters, **PERTURBED, **compact}, [], args.steps, work, args.reuse)


def scratch_large(args, work: Path) -> dict:
    """Regime 1 on the 0.54B Llama shape of ``bench_state_quality`` for ``--large-steps``: float32,
    its perturbation, and the combinations of ``--large`` (about 10 minutes a run on 2 cores)."""
    moments_only = {"float32+int8": MASTERS["float32"] + ["optimizer.state_dtype=int8"]}  # the int8 moments' part
    chosen = {k: v for k, v in {**MASTERS, **COMPACT, **moments_only}.items() if k == "float32" or k in args.large}
    label, shape = "scratch 0.54b", LARGE
    if args.large_heldout:  # other folders: the earlier runs have no held-out loss
        label, shape = "scratch 0.54b heldout", LARGE + [
            f"eval.paths=[{numpy_sources()}]", f"eval.batches={HELDOUT_ROWS[0]}", f"eval.batch_size={HELDOUT_ROWS[1]}"]
    if args.large_spread_from:
        return _from_scratch(label, chosen, shape, args.large_steps, work, args.reuse,
                             _earlier_spread(Path(args.large_spread_from), args.large_steps))
    perturbed = {**PERTURBED, **(PERTURBED_LR if args.large_spread else {})}
    return _from_scratch(label, {**chosen, **perturbed}, shape, args.large_steps, work, args.reuse)


def _earlier_spread(path: Path, steps: int) -> dict:
    """The 0.54B regime of an earlier ``bench_master_quality.json``: its float32 run's final loss
    and the verdict holding its perturbed runs, for a float32 run that ends where it did."""
    try:
        earlier = json.loads(path.read_text())["scratch_0.54b"]
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"--large-spread-from {path}: no 0.54B regime to take the spread from ({e})")
    if earlier["steps"] != steps:
        raise SystemExit(f"--large-spread-from {path}: its 0.54B runs are {earlier['steps']} steps, not {steps}")
    return {"path": str(path), "final_loss": earlier["runs"]["float32"]["final_loss"], **earlier["verdict"]}


def _from_scratch(label: str, chosen: dict, shape: list[str], steps: int, work: Path, reuse: bool,
                  spread_from: dict | None = None) -> dict:
    """Each of ``chosen`` (name -> overrides) trained ``steps`` from the same initialisation on the
    tiny config with ``shape`` over it, and the rule's verdict. With ``spread_from``, float32 is run
    first and must end at its earlier final loss, bit for bit (the runs are deterministic), so the
    earlier perturbed runs stand for this one's."""
    runs = {}
    for name, overrides in chosen.items():
        folder = label.replace(" ", "-") + f"-{name}"
        runs[name] = train(folder, BASE + shape + overrides + [f"train.steps={steps}"], work, reuse)
        print(f"{label} {name}: final loss {runs[name]['losses'][-1]:.4f}", file=sys.stderr)
        if name == "float32" and spread_from and runs[name]["losses"][-1] != spread_from["final_loss"]:
            raise SystemExit(f"{label}: float32 ended at {runs[name]['losses'][-1]!r}, not at "
                             f"{spread_from['final_loss']!r} as in {spread_from['path']}: run its perturbations")
    out = {"steps": steps, "num_params": runs["float32"]["num_params"], "runs": runs,
           "verdict": verdict(runs, spread_from=spread_from)}
    if all("eval_loss" in r for r in runs.values()):
        out["verdict_heldout"] = verdict(runs, heldout=True)
    if spread_from:
        out["perturbations_from"] = spread_from["path"]
    return out


def finetune(args, work: Path) -> dict:
    pre = work / "pretrained"
    train("pretrained", BASE + MASTERS["float32"] + [f"train.steps={args.pretrain_steps}", "export.enabled=true",
                                                     f"export.dir={pre / 'hf'}", "export.dtype=bfloat16"],
          work, args.reuse)
    start = weights(pre / "hf")  # every run starts from these, a bfloat16 master exactly
    data = [f"model.path={pre / 'hf'}", "data.tokenizer=byte", f"data.paths=[{numpy_sources()}]",
            "data.include=['*.py']", f"train.steps={args.finetune_steps}", "optimizer.warmup_steps=0"]
    out = {}
    for lr in args.learning_rates:
        runs = {}
        masters = {k: v for k, v in {**MASTERS, **NEAREST}.items() if k == "float32" or k in args.masters}
        compact = {k: v for k, v in COMPACT.items() if k in args.compact and k.split("+")[0] in masters}
        for name, overrides in {**masters, **PERTURBED, **compact}.items():
            run_name = f"finetune-{lr:g}-{name}"
            try:
                r = train(run_name, BASE + overrides + data + [f"optimizer.learning_rate={lr}", "export.enabled=true",
                                                                "export.dtype=float32"], work, args.reuse)
            except SystemExit as err:
                if name not in NEAREST:  # the ablation may be missing from a build; the others may not fail
                    raise
                print(f"{run_name}: skipped: {str(err).splitlines()[-1]}", file=sys.stderr)
                continue
            r["drift"] = drift(start, weights(work / run_name / "hf"))
            runs[name] = r
            print(f"finetune {lr:g} {name}: loss {r['losses'][-1]:.4f} drift {r['drift']:.6f}", file=sys.stderr)
        out[f"{lr:g}"] = {"runs": runs, "verdict": verdict(runs)}
    return {"pretrain_steps": args.pretrain_steps, "steps": args.finetune_steps, "learning_rates": out}


def plot(results: dict, path: Path, prefix: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(name, results[key]["runs"]) for key, name in (("scratch", "scratch"), ("scratch_0.54b", "scratch, 0.54B"))
              if key in results] + \
        [(f"fine-tune lr {lr}", r["runs"]) for lr, r in results.get("finetune", {}).get("learning_rates", {}).items()]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (title, runs) in zip(axes[0], panels):
        for k, (name, r) in enumerate(runs.items()):
            y = smooth(np.asarray(r["losses"]), 10)
            ax.plot(np.arange(len(y)) + 10, y, lw=1.1, color=f"C{k}",
                    label=name + (f" (drift {r['drift']:.2e})" if "drift" in r else "")
                    + (f" (held-out {r['eval_loss']:.5f})" if "eval_loss" in r else ""))
        ax.set_title(prefix + title)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (mean of 10 steps)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=["scratch", "finetune"], default=None)
    p.add_argument("--steps", type=int, default=1000, help="steps of the tiny regime (0: skip it)")
    p.add_argument("--large-steps", type=int, default=100, help="steps of the 0.54B regime (0: skip it)")
    p.add_argument("--large", nargs="*", default=["bfloat16-compensated+int8"],
                   help="which combinations the 0.54B regime runs beside float32 and its perturbation")
    p.add_argument("--large-spread", action="store_true",
                   help="the 0.54B regime's float32 also with its learning rate 1e-5 up and down (two runs more)")
    p.add_argument("--large-spread-from", metavar="JSON",
                   help="take the 0.54B regime's perturbed float32 runs from an earlier output of this benchmark "
                        "instead of running them (float32 must end at that output's final loss, bit for bit)")
    p.add_argument("--large-heldout", action="store_true",
                   help="the 0.54B runs also evaluate their last weights on held-out rows (HELDOUT_ROWS of numpy's "
                        "Python sources), and the rule is applied to that loss too (with --large-spread: all three "
                        "perturbations; not with --large-spread-from, whose runs have no held-out loss)")
    p.add_argument("--pretrain-steps", type=int, default=1000)
    p.add_argument("--finetune-steps", type=int, default=300)
    p.add_argument("--learning-rates", type=float, nargs="+", default=[1e-5, 5e-5])
    p.add_argument("--compact", nargs="*", default=list(COMPACT), help="which combinations with int8 moments to run")
    p.add_argument("--masters", nargs="*", default=list(MASTERS) + list(NEAREST),
                   help="which 16-bit masters (and their --compact combinations) to run beside float32 and its "
                        "perturbation (bfloat16-nearest, the ablation: only in fine-tuning)")
    p.add_argument("--work-dir", default="/tmp/jaxascend-bench-master")
    p.add_argument("--out", default=str(REPO / "docs" / "bench_master_quality"))
    p.add_argument("--reuse", action="store_true", help="keep runs already finished in --work-dir")
    args = p.parse_args(argv)
    if args.large_heldout and args.large_spread_from:
        p.error("--large-heldout with --large-spread-from: the earlier perturbed runs have no held-out loss")
    work = Path(args.work_dir)
    results = {"tolerance": TOLERANCE, "cpu": cpu_model()}
    if args.only in (None, "scratch") and args.steps:
        results["scratch"] = scratch(args, work)
    if args.only in (None, "scratch") and args.large_steps:
        results["scratch_0.54b"] = scratch_large(args, work)
    if args.only in (None, "finetune"):
        results["finetune"] = finetune(args, work)
    return save(results, Path(args.out))


def save(results: dict, out: Path, prefix: str = "") -> dict:
    """Plots ``results`` into ``out``.png, writes them (each run's final loss instead of its
    curve) into ``out``.json and prints them."""
    plot(results, out.with_suffix(".png"), prefix)
    strip = json.loads(json.dumps(results, default=float))
    for r in [strip.get("scratch", {}), strip.get("scratch_0.54b", {})] + \
            list(strip.get("finetune", {}).get("learning_rates", {}).values()):
        for run in r.get("runs", {}).values():
            run["final_loss"] = run.pop("losses", [None])[-1]
    out.with_suffix(".json").write_text(json.dumps(strip, indent=1) + "\n")
    print(json.dumps(strip, indent=1))
    return strip


if __name__ == "__main__":
    main()
