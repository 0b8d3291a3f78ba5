"""A user's own Flax NNX training loop, switched from ``optax.adamw`` to jaxascend's AdamW on SSD.

Nothing here is jaxascend's trainer: it is the loop any Flax user already has (a model, an
``nnx.Optimizer``, a jitted train step). Switching the optimizer is the few lines in
``make_optimizer``: lay out the state on SSD, then pass ``ssd_adamw`` where ``optax.adamw`` was.
The fp32 master weights and both moments then live in shard files under ``--offload-dir``;
the optimizer state in RAM is two scalars. Prints one JSON line per logged step and a summary::

    python scripts/finetune_flax_example.py --optimizer optax    # the usual in-memory AdamW
    python scripts/finetune_flax_example.py --optimizer ssd      # same numbers, state on SSD
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxascend.config import OffloadConfig
from jaxascend.offload import OffloadedAdamState, ssd_adamw


class MLP(nnx.Module):
    """A small regression network: in -> hidden -> hidden -> out, GELU."""

    def __init__(self, d_in: int, hidden: int, d_out: int, *, rngs: nnx.Rngs):
        self.fc1 = nnx.Linear(d_in, hidden, rngs=rngs)
        self.fc2 = nnx.Linear(hidden, hidden, rngs=rngs)
        self.out = nnx.Linear(hidden, d_out, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.gelu(self.fc2(nnx.gelu(self.fc1(x)))))


def make_optimizer(model: MLP, args) -> tuple[nnx.Optimizer, OffloadedAdamState | None]:
    """The only place that knows which AdamW runs."""
    if args.optimizer == "optax":
        tx = optax.adamw(args.lr, weight_decay=args.weight_decay)
        return nnx.Optimizer(model, tx, wrt=nnx.Param), None
    # --- AdamW with fp32 master weights, m and v on SSD: these lines are the whole switch ---
    params = nnx.state(model, nnx.Param)
    ssd_state = OffloadedAdamState.create(params, OffloadConfig(dir=args.offload_dir, chunk_bytes="1MiB"))
    tx = ssd_adamw(args.lr, weight_decay=args.weight_decay, state=ssd_state)
    return nnx.Optimizer(model, tx, wrt=nnx.Param), ssd_state


def batches(args):
    """Synthetic regression data from a fixed random teacher, ``args.batch`` rows at a time."""
    rng = np.random.default_rng(args.seed)
    teacher = rng.standard_normal((args.d_in, args.d_out)).astype(np.float32) / np.sqrt(args.d_in)
    while True:
        x = rng.standard_normal((args.batch, args.d_in)).astype(np.float32)
        yield x, np.sin(x @ teacher)


@nnx.jit
def train_step(model: MLP, optimizer: nnx.Optimizer, x, y):
    def loss_fn(model):
        return jnp.mean((model(x) - y) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)  # with ssd_adamw: an ordered host callback does the SSD step
    return loss


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--optimizer", choices=["optax", "ssd"], default="ssd")
    ap.add_argument("--offload-dir", default="runs/finetune_flax_example/offload",
                    help="where the SSD optimizer state lives (locked while running)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--d-in", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--d-out", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    model = MLP(args.d_in, args.hidden, args.d_out, rngs=nnx.Rngs(args.seed))
    optimizer, ssd_state = make_optimizer(model, args)
    losses = []
    start = time.perf_counter()
    try:
        data = batches(args)
        for step in range(1, args.steps + 1):
            x, y = next(data)
            loss = float(train_step(model, optimizer, x, y))  # host sync: read the loss
            losses.append(loss)
            if step % args.log_every == 0 or step == args.steps:
                print(json.dumps({"step": step, "loss": round(loss, 6)}), flush=True)
    finally:
        if ssd_state is not None:
            jax.block_until_ready(nnx.state(optimizer))  # the last SSD update runs asynchronously
            ssd_state.close()
    summary = {"optimizer": args.optimizer, "steps": args.steps, "first_loss": losses[0], "last_loss": losses[-1],
               "seconds": round(time.perf_counter() - start, 3),
               "parameters": int(sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))),
               "losses": losses}
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
