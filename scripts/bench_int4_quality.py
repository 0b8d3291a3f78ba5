"""Would 4-bit moments hold? The quality rule of issue 39 applied to a simulation of them, before
any kernel is written. Prints JSON, writes ``docs/bench_int4_quality.{json,png}``.

The moments of Li et al. (NeurIPS 2023, "Memory efficient optimizers with 4-bit states"), as
``scripts/bench_state_codes.py`` defines them: m block-wise (128) with a sign and a 3-bit dynamic
exponent; v rank-1 normalised (each element over the smaller of its row's and its column's
maximum; a vector block-wise) on 16 linear levels without zero. The in-memory engine (optax's
AdamW, float32 master and moments) trains with its moments replaced by their 4-bit values after
every update (``jnp`` arithmetic inside the jitted step): the optimizer sees exactly what a
4-bit store would hand back. Beside it, the same engine unmodified (float32) and with eps 1e-5 of
itself larger (the perturbation spread).

The rule is ``bench_master_quality``'s, fixed before running: the last 10% of steps' mean loss
within 1% of float32's or of its perturbation spread, and in fine-tuning the weights' drift from
where they started too, in its two regimes (training the tiny model from scratch for ``--steps``;
fine-tuning ``bench_master_quality``'s pretrained tiny model on numpy's sources at 1e-5 and 5e-5
for ``--finetune-steps``; run ``bench_master_quality.py --only finetune`` first for its
``pretrained`` folder).

    python scripts/bench_int4_quality.py                                 # both regimes (~1 hour)
    python scripts/bench_int4_quality.py --steps 30 --finetune-steps 20  # smoke run
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
from bench_master_quality import BASE, PERTURBED_EPS, TOLERANCE, drift, numpy_sources, save, verdict, weights  # noqa: E402
from bench_state_codes import dynamic_exponent_levels  # noqa: E402
from bench_state_quality import train  # noqa: E402
from bench_step import cpu_model  # noqa: E402

IN_MEMORY = ["offload.enabled=false", "optimizer.master_dtype=float32", "optimizer.state_dtype=float32"]
RUNS = {"float32": [], "float32-perturbed": [f"optimizer.eps={PERTURBED_EPS}"], "int4": ["MOMENTS=int4"]}
M_BLOCK, V_BLOCK = 128, 128

# ---------------------------------------------------------------- the 4-bit moments, in jnp
def _nearest(r, levels):
    import jax.numpy as jnp
    i = jnp.clip(jnp.searchsorted(levels, r), 1, levels.shape[0] - 1)
    lo, hi = levels[i - 1], levels[i]
    return jnp.where(r - lo <= hi - r, lo, hi)

def _blocks(x, block):
    import jax.numpy as jnp
    flat = x.reshape(-1)
    pad = -flat.size % block
    return jnp.pad(flat, (0, pad)).reshape(-1, block), pad

def int4_m(m):
    """m through the 4-bit code: block-wise absmax, sign + nearest dynamic-exponent magnitude."""
    import jax.numpy as jnp
    b, pad = _blocks(m.astype(jnp.float32), M_BLOCK)
    scale = jnp.abs(b).max(axis=1, keepdims=True)
    r = jnp.where(scale > 0, jnp.abs(b) / jnp.where(scale > 0, scale, 1), 0)
    q = jnp.sign(b) * _nearest(r, jnp.asarray(dynamic_exponent_levels(3), jnp.float32)) * scale
    return q.reshape(-1)[:m.size].reshape(m.shape).astype(m.dtype)

def int4_v(v):
    """v through the 4-bit code: rank-1 normalised (a matrix: the smaller of its row's and
    column's maximum, per trailing matrix; a vector block-wise), nearest of (k + 1) / 16."""
    import jax.numpy as jnp
    x = v.astype(jnp.float32)
    if x.ndim >= 2:
        norm = jnp.minimum(x.max(axis=-1, keepdims=True), x.max(axis=-2, keepdims=True))
    else:
        b, pad = _blocks(x, V_BLOCK)
        norm = jnp.broadcast_to(b.max(axis=1, keepdims=True), b.shape).reshape(-1)[:x.size].reshape(x.shape)
    r = jnp.where(norm > 0, x / jnp.where(norm > 0, norm, 1), 0)
    levels = jnp.arange(1, 17, dtype=jnp.float32) / 16
    return (_nearest(r, levels) * norm).astype(v.dtype)

def with_int4_moments(tx):
    """``tx`` whose Adam moments are stored through the 4-bit codes after every update."""
    import jax
    import optax

    def squeeze(state):
        if isinstance(state, optax.ScaleByAdamState):
            return state._replace(mu=jax.tree.map(int4_m, state.mu), nu=jax.tree.map(int4_v, state.nu))
        if isinstance(state, tuple):
            parts = [squeeze(s) for s in state]
            return type(state)(*parts) if hasattr(state, "_fields") else tuple(parts)
        return state

    def update(updates, state, params=None):
        updates, state = tx.update(updates, state, params)
        return updates, squeeze(state)

    return optax.GradientTransformation(tx.init, update)

def child(argv: list[str]) -> int:
    """``jaxascend.train`` with the in-memory engine's AdamW given 4-bit moments."""
    import jaxascend.in_memory_engine as engine
    from jaxascend import train as entry
    inner = engine.adamw_in_memory
    engine.adamw_in_memory = lambda cfg, steps: with_int4_moments(inner(cfg, steps))
    return entry.main(argv)

# ---------------------------------------------------------------- the two regimes
def run(name: str, overrides: list[str], work: Path, reuse: bool) -> dict:
    moments = [o for o in overrides if o.startswith("MOMENTS=")]
    rest = [o for o in overrides if not o.startswith("MOMENTS=")]
    entry = [str(Path(__file__).resolve()), "--child"] if moments else None
    return train(name, BASE + IN_MEMORY + rest, work, reuse, entry=entry)

def scratch(args, work: Path) -> dict:
    runs = {name: run(f"int4-scratch-{name}", extra + [f"train.steps={args.steps}"], work, args.reuse)
            for name, extra in RUNS.items()}
    return {"steps": args.steps, "runs": runs, "verdict": verdict(runs)}

def finetune(args, work: Path, runs_of: dict = RUNS, prefix: str = "int4", run_one=None) -> dict:
    """``runs_of`` (name -> overrides; ``run_one(folder, overrides, work, reuse)`` runs one, default
    :func:`run`) fine-tuning the pretrained tiny model at each learning rate, with their drifts."""
    run_one = run_one or run
    pre = Path(args.pretrained)
    if not (pre / "hf").is_dir():
        raise SystemExit(f"{pre / 'hf'}: no pretrained export; run bench_master_quality.py --only finetune first")
    start = weights(pre / "hf")
    data = [f"model.path={pre / 'hf'}", "data.tokenizer=byte", f"data.paths=[{numpy_sources()}]",
            "data.include=['*.py']", f"train.steps={args.finetune_steps}", "optimizer.warmup_steps=0",
            "export.enabled=true", "export.dtype=float32"]
    out = {}
    for lr in args.learning_rates:
        runs = {}
        for name, extra in runs_of.items():
            folder = f"{prefix}-finetune-{lr:g}-{name}"
            runs[name] = run_one(folder, extra + data + [f"optimizer.learning_rate={lr}"], work, args.reuse)
            runs[name]["drift"] = drift(start, weights(work / folder / "hf"))
            print(f"finetune {lr:g} {name}: drift {runs[name]['drift']:.6f}", file=sys.stderr, flush=True)
        out[f"{lr:g}"] = {"runs": runs, "verdict": verdict(runs)}
    return {"steps": args.finetune_steps, "learning_rates": out}

def regime_arguments(p: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The two regimes' options of a simulation benchmark called ``name`` (its folders and output)."""
    p.add_argument("--only", choices=["scratch", "finetune"], default=None)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--finetune-steps", type=int, default=300)
    p.add_argument("--learning-rates", type=float, nargs="+", default=[1e-5, 5e-5])
    p.add_argument("--work-dir", default=f"/tmp/jaxascend-bench-{name}")
    p.add_argument("--pretrained", default="/tmp/jaxascend-bench-master/pretrained")
    p.add_argument("--out", default=str(REPO / "docs" / f"bench_{name}_quality"))
    p.add_argument("--reuse", action="store_true", help="keep runs already finished in --work-dir")
    return p

def main(argv=None) -> dict:
    args = regime_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]), "int4").parse_args(argv)
    work = Path(args.work_dir)
    results = {"tolerance": TOLERANCE, "cpu": cpu_model(), "moments": "int4 (Li et al.), simulated"}
    if args.only in (None, "scratch"):
        results["scratch"] = scratch(args, work)
    if args.only in (None, "finetune"):
        results["finetune"] = finetune(args, work)
    return save(results, Path(args.out), prefix="4-bit moments (simulated), ")

if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        sys.exit(child(sys.argv[2:]))
    main()
