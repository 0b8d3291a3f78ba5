"""Times a jitted forward+backward (mean cross-entropy, gradients for every parameter) of the
models in jaxascend.models, per compute dtype and remat policy.

    python scripts/bench_models.py                              # default ModelConfig, fp32 and bf16
    python scripts/bench_models.py --arch gpt2 --remat full offload
    python scripts/bench_models.py --hidden-size 64 --layers 2 --steps 2   # smoke run

Prints one JSON object: parameter count, compile time and the median step time per
(dtype, remat), and tokens/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxascend.config import ModelConfig
from jaxascend.models import REMAT_POLICIES, build_model, count_params


def _loss_and_grad_fn(graphdef):
    def loss(state, ids):
        logits = nnx.merge(graphdef, state)(ids[:, :-1])
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1))

    return jax.jit(jax.value_and_grad(loss))


def _time_one(cfg: ModelConfig, vocab: int, ids: jax.Array, steps: int) -> dict:
    graphdef, state = nnx.split(build_model(cfg, vocab, rngs=nnx.Rngs(0)))
    fn = _loss_and_grad_fn(graphdef)
    start = time.perf_counter()
    compiled = fn.lower(state, ids).compile()
    compile_s = time.perf_counter() - start
    jax.block_until_ready(compiled(state, ids))  # first run: allocation, warm caches
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        loss, grads = compiled(state, ids)
        jax.block_until_ready(grads)  # sync: the step is done when the gradients exist
        times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    return {"dtype": cfg.dtype, "remat": cfg.remat, "compile_s": round(compile_s, 2),
            "step_s": round(step_s, 4), "step_s_min": round(min(times), 4),
            "tokens_per_s": round(ids.shape[0] * (ids.shape[1] - 1) / step_s, 1),
            "loss": float(loss)}


def main() -> None:
    defaults = ModelConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default=defaults.arch, choices=["llama", "qwen2", "mistral", "gpt2"])
    parser.add_argument("--hidden-size", type=int, default=defaults.hidden_size)
    parser.add_argument("--intermediate-size", type=int, default=defaults.intermediate_size)
    parser.add_argument("--layers", type=int, default=defaults.num_hidden_layers)
    parser.add_argument("--heads", type=int, default=defaults.num_attention_heads)
    parser.add_argument("--kv-heads", type=int, default=None, help="default: ModelConfig's (gpt2: --heads)")
    parser.add_argument("--vocab", type=int, default=259, help="259 = the byte tokenizer's vocabulary")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                        choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--remat", nargs="+", default=["none"], choices=list(REMAT_POLICIES))
    args = parser.parse_args()

    kv_heads = args.kv_heads or (args.heads if args.arch == "gpt2" else defaults.num_key_value_heads)
    fields = dict(arch=args.arch, hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
                  num_hidden_layers=args.layers, num_attention_heads=args.heads,
                  num_key_value_heads=kv_heads, max_position_embeddings=max(2048, args.seq_len + 1))
    # seq_len + 1 tokens: the loss predicts tokens 1..T from 0..T-1, so the model sees T.
    ids = jnp.asarray(np.random.default_rng(0).integers(0, args.vocab, (args.batch_size, args.seq_len + 1)),
                      jnp.int32)
    params = count_params(nnx.eval_shape(lambda: build_model(ModelConfig(**fields), args.vocab,
                                                             rngs=nnx.Rngs(0))))
    runs = [_time_one(ModelConfig(**fields, dtype=dtype, remat=remat), args.vocab, ids, args.steps)
            for dtype in args.dtypes for remat in args.remat]
    print(json.dumps({"arch": args.arch, "params": params, "batch_size": args.batch_size,
                      "seq_len": args.seq_len, "vocab": args.vocab, "backend": jax.default_backend(),
                      "devices": len(jax.devices()), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
