"""Dense against blockwise attention alone: forward + backward time and XLA's temporary memory,
by row length, at one layer of a model's attention shape (default Qwen2.5-0.5B's: 14 query heads,
2 key/value heads, head width 64), batch 1, float32 inputs as the CPU backend computes them.
``--part loss``: the same for the LM head and loss, whole logits against blocked
(models.blocked_loss), at Qwen2.5-0.5B's tied 151936 x 896 bfloat16 table in its 16 blocks.

    python scripts/bench_attention.py                       # T = 1024 .. 8192
    python scripts/bench_attention.py --lengths 2048,4096 --repeats 5
    python scripts/bench_attention.py --part loss --lengths 256,512,1024,2048,4096

The contenders alternate within each repeat; the JSON has every time, the medians and the
blockwise/dense ratio with its range. A length whose dense scores would not fit in
``--dense-limit`` bytes runs blockwise alone. Used to choose ``BLOCKWISE_FROM`` (``model.attention:
auto``); the whole-run figures (peak system memory by context length) are the planner's
calibration in ``scripts/bench_plan.py``.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import optax

from jaxascend.models import attention, blocked_token_losses, table_blocks, table_head


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("attention", "loss"), default="attention")
    p.add_argument("--lengths", default="1024,2048,4096,8192")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dense-limit", type=float, default=8 * 2**30, help="bytes of dense float32 scores to try")
    return p.parse_args()


def compiled(fn, *inputs):
    """The jitted forward + backward of ``sum(fn(*inputs) * w)`` with respect to every float
    input, compiled, and its temp bytes."""
    out = jax.eval_shape(fn, *inputs)
    w = jax.random.normal(jax.random.key(3), out.shape, jnp.float32)
    wrt = tuple(i for i, x in enumerate(inputs) if jnp.issubdtype(x.dtype, jnp.floating))

    def loss(*inputs):
        return jnp.sum(fn(*inputs) * w)

    step = jax.jit(jax.value_and_grad(loss, argnums=wrt)).lower(*inputs).compile()
    return step, step.memory_analysis().temp_size_in_bytes


def seconds(step, args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(step(*args))
    return time.perf_counter() - start


def attention_case(length: int, args) -> tuple[dict, tuple]:
    """(the contenders, their inputs) of the attention at ``length``: blockwise, and dense while
    its float32 scores fit ``--dense-limit``."""
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (1, length, args.heads, args.head_dim), jnp.float32)
    k, v = (jax.random.normal(key, (1, length, args.kv_heads, args.head_dim), jnp.float32) for key in keys[1:])
    contenders = {"blockwise": functools.partial(attention, implementation="blockwise")}
    if 4 * length * length * args.heads <= args.dense_limit:
        contenders["dense"] = functools.partial(attention, implementation="dense")
    return contenders, (q, k, v)


def loss_case(length: int, args) -> tuple[dict, tuple]:
    """(the contenders, their inputs) of the head and loss at ``length``: blocked, and the whole
    float32 logits while they fit ``--dense-limit``."""
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (1, length, args.hidden), jnp.float32).astype(jnp.bfloat16)
    table = (0.02 * jax.random.normal(keys[1], (args.vocab, args.hidden), jnp.float32)).astype(jnp.bfloat16)
    targets = jax.random.randint(keys[2], (1, length), 0, args.vocab)

    def blocked(x, table, targets):
        return blocked_token_losses(x, table_head(table, jnp.bfloat16), targets)

    def dense(x, table, targets):
        logits = jnp.einsum("BTD,VD->BTV", x, table, preferred_element_type=jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets)

    contenders = {"blockwise": blocked}
    if 4 * length * args.vocab <= args.dense_limit:
        contenders["dense"] = dense
    return contenders, (x, table, targets)


def measure(length: int, args) -> dict:
    contenders, inputs = (loss_case if args.part == "loss" else attention_case)(length, args)
    steps = {name: compiled(fn, *inputs) for name, fn in contenders.items()}
    times = {name: [] for name in contenders}
    for name, (step, _) in steps.items():
        seconds(step, inputs)  # warm
    for _ in range(args.repeats):
        for name, (step, _) in steps.items():
            times[name].append(seconds(step, inputs))
    out = {"length": length, "temp_bytes": {n: s[1] for n, s in steps.items()}, "seconds": times,
           "median_s": {n: statistics.median(t) for n, t in times.items()}}
    if "dense" in times:
        ratios = [b / d for b, d in zip(times["blockwise"], times["dense"])]
        out["blockwise_over_dense"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    return out


def main() -> int:
    args = parse_args()
    results = []
    for length in (int(x) for x in args.lengths.split(",")):
        results.append(measure(length, args))
        print(json.dumps(results[-1]), file=sys.stderr)
    shape = ({"vocab": args.vocab, "hidden": args.hidden, "blocks": table_blocks(args.vocab, args.hidden)}
             if args.part == "loss" else {"heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim})
    print(json.dumps({"part": args.part, "shape": shape, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
