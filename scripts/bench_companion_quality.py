"""Would an 8-bit companion hold? The quality rule of issue 39 applied to a simulation of a
bfloat16 master whose companion keeps 8 bits of the float32 master's low 16, before any kernel
is written. Prints JSON, writes ``docs/bench_companion_quality.{json,png}``.

A compensated master with a 16-bit companion is the float32 master (``optim/master_codes.py``).
With an 8-bit one the master has 16 significant bits (a bfloat16 and 8 more): a float32 whose low
8 bits are zero. The in-memory engine (optax's AdamW, float32 master and moments) trains with its
master put on those 24-bit values after every update (``jnp`` arithmetic inside the jitted step:
the update is replaced by ``round24(w + u) - w``), rounded

* ``stochastic``: up with the probability of the dropped fraction (a counter-keyed random draw
  per element and step): unbiased, no companion of the companion;
* ``nearest`` (the ablation): half an ulp of 2^-15 relative is larger than a 1e-5 update of a
  weight near 1 (the norms), which then stop moving.

Beside them the same engine unmodified (float32), and from scratch with eps 1e-5 of itself
larger (its perturbation spread; in fine-tuning it was 0.00-0.01%, so the bound there is 1%). The
rule is ``bench_master_quality``'s, fixed before running: the last 10% of steps' mean loss within
1% of float32's or of its perturbation spread, and in fine-tuning the weights' drift from where
they started too; the tiny model from scratch for ``--steps``, and
``bench_master_quality``'s pretrained tiny model fine-tuned on numpy's sources at 1e-5 and 5e-5
for ``--finetune-steps`` (run ``bench_master_quality.py --only finetune`` first for it), and the
0.54B shape from scratch for ``--large-steps`` (about 10 GiB of host memory in the in-memory engine).

    python scripts/bench_companion_quality.py --pretrained /tmp/jaxascend-bench-master/pretrained
    python scripts/bench_companion_quality.py --steps 30 --finetune-steps 20   # smoke run
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
from bench_int4_quality import finetune, regime_arguments  # noqa: E402
from bench_master_quality import BASE, PERTURBED_EPS, TOLERANCE, save, verdict  # noqa: E402
from bench_state_quality import LARGE, train  # noqa: E402
from bench_step import cpu_model  # noqa: E402

IN_MEMORY = ["offload.enabled=false", "optimizer.master_dtype=float32", "optimizer.state_dtype=float32"]
MASTERS = {"float32": [], "master24-stochastic": ["MASTER=stochastic"], "master24-nearest": ["MASTER=nearest"]}
PERTURBED = {"float32-perturbed": [f"optimizer.eps={PERTURBED_EPS}"]}  # from scratch: float32's own spread
DROPPED = 8  # of the float32 master's 32 bits: a bfloat16 (16) and an 8-bit companion


def round24(x, rounding: str, bits=None):
    """``x`` (float32) on the values whose low :data:`DROPPED` bits are zero: to nearest (ties
    away) or stochastically with ``bits`` (uint32, the low ones used)."""
    import jax
    import jax.numpy as jnp
    raw = jax.lax.bitcast_convert_type(x, jnp.uint32)
    low = (1 << DROPPED) - 1
    add = jnp.uint32(1 << (DROPPED - 1)) if rounding == "nearest" else bits & jnp.uint32(low)
    return jax.lax.bitcast_convert_type((raw + add) & jnp.uint32(~low & 0xFFFFFFFF), jnp.float32)


def with_master24(tx, rounding: str):
    """``tx`` whose updates put the float32 master on 24-bit values (``round24``)."""
    import jax
    import jax.numpy as jnp
    import optax

    def init(params):
        return (tx.init(params), jnp.zeros((), jnp.uint32))

    def update(updates, state, params=None):
        inner, count = state
        updates, inner = tx.update(updates, inner, params)
        leaves, treedef = jax.tree.flatten(updates)
        keys = jax.random.split(jax.random.fold_in(jax.random.key(39), count), len(leaves))
        landed = [round24(p + u, rounding, jax.random.bits(k, u.shape, jnp.uint32)) - p
                  for p, u, k in zip(jax.tree.leaves(params), leaves, keys)]
        return jax.tree.unflatten(treedef, landed), (inner, count + 1)

    return optax.GradientTransformation(init, update)


def child(argv: list[str]) -> int:
    """``jaxascend.train`` with the in-memory engine's master on 24 bits (``MASTER=`` first)."""
    import jaxascend.in_memory_engine as engine
    from jaxascend import train as entry
    rounding = argv[0].split("=", 1)[1]
    inner = engine.adamw_in_memory
    engine.adamw_in_memory = lambda cfg, steps: with_master24(inner(cfg, steps), rounding)
    return entry.main(argv[1:])


def run(name: str, overrides: list[str], work: Path, reuse: bool) -> dict:
    master = [o for o in overrides if o.startswith("MASTER=")]
    rest = [o for o in overrides if not o.startswith("MASTER=")]
    entry = [str(Path(__file__).resolve()), "--child", *master] if master else None
    return train(name, BASE + IN_MEMORY + rest, work, reuse, entry=entry)


def scratch(args, work: Path) -> dict:
    runs = {name: run(f"c8-scratch-{name}", extra + [f"train.steps={args.steps}"], work, args.reuse)
            for name, extra in {**MASTERS, **PERTURBED}.items() if name != "master24-nearest"}
    return {"steps": args.steps, "runs": runs, "verdict": verdict(runs)}


def scratch_large(args, work: Path) -> dict:
    """The 0.54B Llama shape of ``bench_state_quality`` from scratch, in the in-memory engine."""
    runs = {name: run(f"c8-scratch-0.54b-{name}", extra + LARGE + [f"train.steps={args.large_steps}"], work,
                      args.reuse)
            for name, extra in {**MASTERS, **PERTURBED}.items() if name != "master24-nearest"}
    return {"steps": args.large_steps, "runs": runs, "verdict": verdict(runs)}


def main(argv=None) -> dict:
    p = regime_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]), "companion")
    p.add_argument("--large-steps", type=int, default=100, help="steps of the 0.54B regime (0: skip it)")
    args = p.parse_args(argv)
    work = Path(args.work_dir)
    results = {"tolerance": TOLERANCE, "cpu": cpu_model(), "master": "bfloat16 + an 8-bit companion, simulated"}
    if args.only in (None, "finetune"):
        results["finetune"] = finetune(args, work, MASTERS, "c8", run)
    if args.only in (None, "scratch"):
        results["scratch"] = scratch(args, work)
        if args.large_steps:
            results["scratch_0.54b"] = scratch_large(args, work)
    return save(results, Path(args.out), prefix="an 8-bit companion (simulated), ")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        sys.exit(child(sys.argv[2:]))
    main()
