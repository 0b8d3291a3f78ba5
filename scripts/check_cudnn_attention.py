"""cuDNN's fused attention as the training attention takes it on a GPU, against the dense reference.

    python scripts/check_cudnn_attention.py                          # bfloat16 and float16, T = 128, 1000, 4096
    python scripts/check_cudnn_attention.py --lengths 2048 --out /tmp/cudnn.json

For each shape (GQA as Qwen2.5-0.5B; a static window as Mistral; Gemma 3's traced per-layer
window on and off, head width 256, its scale), dtype and length it runs
``models.attention(implementation="blockwise")``, forward and the gradient of
``sum(out * w)``, with ``JAXASCEND_ATTENTION_BACKEND`` as the environment sets it (default auto:
cuDNN on a GPU), and checks that the compiled program holds cuDNN's fused attention
(``__cudnn$fmha``). Errors (max abs of out, dq, dk, dv per unit of the largest reference value,
at least 1) are against the float32 dense attention on the same rounded inputs; our dense
attention in the same low dtype gives the error low precision costs anyway. A row passes when
cuDNN's error is at most twice that, or under a floor (bfloat16 1e-2, float16 2e-3). A shape the
dispatcher leaves to the pure-JAX path (a ``note:`` says why) is reported as "fallback", not
failed. Without a GPU or without cuDNN attention it prints why and exits 0.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from jaxascend.models import attention

FLOORS = {"bfloat16": 1e-2, "float16": 2e-3}
BACKEND_ENV = "JAXASCEND_ATTENTION_BACKEND"  # jaxascend.models.fused_attention's switch


class Shape(NamedTuple):
    name: str
    heads: int
    kv_heads: int
    head_dim: int
    window: Optional[int]
    sliding: Optional[bool]  # None: the window (if any) on every call; else Gemma's traced flag
    scale: Optional[float]


SHAPES = (
    Shape("gqa-qwen2.5-0.5b", 14, 2, 64, None, None, None),
    Shape("window-mistral", 8, 2, 128, 256, None, None),
    Shape("gemma3-sliding", 4, 1, 256, 512, True, 256 ** -0.5),
    Shape("gemma3-global", 4, 1, 256, 512, False, 256 ** -0.5),
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="128,1000,4096")
    p.add_argument("--dtypes", default="bfloat16,float16")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    return p.parse_args()


def inputs(shape: Shape, length: int, dtype):
    keys = jax.random.split(jax.random.key(length), 4)
    q = jax.random.normal(keys[0], (1, length, shape.heads, shape.head_dim)).astype(dtype)
    k, v = (jax.random.normal(key, (1, length, shape.kv_heads, shape.head_dim)).astype(dtype) for key in keys[1:3])
    return q, k, v, jax.random.normal(keys[3], q.shape, jnp.float32)


def out_and_grads(attend, shape: Shape, q, k, v, w):
    """``(out, dq, dk, dv)`` and the lowered program's text; ``sliding`` goes in traced."""
    def run(q, k, v, sliding):
        kwargs = dict(sliding_window=shape.window, scale=shape.scale, is_sliding=sliding)

        def loss(q, k, v):
            out = attend(q, k, v, **kwargs)
            return jnp.sum(out.astype(jnp.float32) * w), out
        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return (out, *grads)

    sliding = None if shape.sliding is None else jnp.asarray(shape.sliding)
    lowered = jax.jit(run).lower(q, k, v, sliding)
    return [x.astype(jnp.float32) for x in lowered.compile()(q, k, v, sliding)], lowered.as_text()


def errors(ref, got) -> list[float]:
    return [float(jnp.max(jnp.abs(a - b)) / jnp.maximum(1.0, jnp.max(jnp.abs(a)))) for a, b in zip(ref, got)]


def check(shape: Shape, dtype_name: str, length: int) -> dict:
    dtype = jnp.dtype(dtype_name)
    q, k, v, w = inputs(shape, length, dtype)
    dense_attention = functools.partial(attention, implementation="dense")  # never fused
    ref, _ = out_and_grads(dense_attention, shape, *(x.astype(jnp.float32) for x in (q, k, v)), w)
    dense, _ = out_and_grads(dense_attention, shape, q, k, v, w)
    fused, program = out_and_grads(functools.partial(attention, implementation="blockwise"), shape, q, k, v, w)
    taken = "__cudnn$fmha" in program
    err_fused, err_dense = errors(ref, fused), errors(ref, dense)
    bound = max(2 * max(err_dense), FLOORS[dtype_name])
    status = ("pass" if max(err_fused) <= bound else "FAIL") if taken else "fallback"
    return dict(shape=shape.name, dtype=dtype_name, length=length, status=status, cudnn=taken,
                max_error_cudnn=max(err_fused), max_error_dense_same_dtype=max(err_dense), bound=bound,
                errors_out_dq_dk_dv=err_fused)


def cudnn_unavailable() -> Optional[str]:
    """Why cuDNN attention cannot run here (None: a small call compiles and runs)."""
    if jax.default_backend() != "gpu":
        return f"the JAX backend is {jax.default_backend()!r}, not a GPU"
    q = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
    try:
        jax.block_until_ready(jax.jit(lambda q: jax.nn.dot_product_attention(
            q, q, q, is_causal=True, implementation="cudnn"))(q))
    except Exception as err:  # any refusal, at trace, compile or run time, means: skip, and say why
        text = str(err).strip()
        return f"jax.nn.dot_product_attention(implementation='cudnn') failed: {text.splitlines()[0] if text else err!r}"
    return None


def main() -> int:
    args = parse_args()
    print(f"jax {jax.__version__}, devices {jax.devices()}, {BACKEND_ENV}="
          f"{os.environ.get(BACKEND_ENV, 'auto')}")
    reason = cudnn_unavailable()
    if reason is not None:
        print(f"skipped: {reason}")
        return 0
    rows = []
    for dtype in args.dtypes.split(","):
        for shape in SHAPES:
            for length in (int(n) for n in args.lengths.split(",")):
                row = check(shape, dtype, length)
                rows.append(row)
                print(f"{row['status']:8s} {shape.name:18s} {dtype:8s} T={length:5d}  max error cuDNN "
                      f"{row['max_error_cudnn']:.2e}  dense {dtype} {row['max_error_dense_same_dtype']:.2e}  "
                      f"bound {row['bound']:.1e}  (out, dq, dk, dv: "
                      f"{', '.join(f'{e:.1e}' for e in row['errors_out_dq_dk_dv'])})", flush=True)
    failed = [r for r in rows if r["status"] == "FAIL"]
    fallback = [r for r in rows if r["status"] == "fallback"]
    print(f"cuDNN attention: {len(rows) - len(failed) - len(fallback)} passed, {len(failed)} failed, "
          f"{len(fallback)} left to the pure-JAX path, of {len(rows)}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
