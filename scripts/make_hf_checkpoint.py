"""Writes a randomly initialised model in Hugging Face layout (config.json, safetensors, tokenizer).

    python scripts/make_hf_checkpoint.py --arch llama --size 1B --out /tmp/llama-1b
    python scripts/make_hf_checkpoint.py --arch qwen2 --size tiny --out /tmp/q --dtype fp32

Sizes are presets copying the published configs (qwen2: 0.5B 1.5B 3B 7B; qwen3: 0.6B 1.7B 4B
8B; llama: 1B 3B 8B; mistral: 7B; phi3: mini-4k mini-128k; gpt2: 124M; gemma3: 1B and the 4B's
text model) plus ``tiny`` for tests. Tensors are
generated and written one at a time, so making an 8B folder needs about one tensor's worth of
memory. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from jaxascend.config import parse_bytes
from jaxascend.hf import DEFAULT_SHARD_BYTES, PRESETS, make_hf_checkpoint, model_config_from_hf, param_plan

DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32",
                 "bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", required=True, choices=list(PRESETS))
    p.add_argument("--size", required=True, help="preset name, e.g. tiny, 1B, 0.5B, 124M")
    p.add_argument("--out", required=True, help="folder to create (must not exist or be empty)")
    p.add_argument("--dtype", default="bf16", choices=list(DTYPE_ALIASES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-size", default=str(DEFAULT_SHARD_BYTES), help="largest shard, e.g. 2GB")
    p.add_argument("--random-norms", action="store_true",
                   help="random norm scales and biases too (default: ones and zeros)")
    args = p.parse_args(argv)
    start = time.perf_counter()
    try:
        out = make_hf_checkpoint(args.arch, args.size, args.out, dtype=DTYPE_ALIASES[args.dtype],
                                 seed=args.seed, random_norms=args.random_norms,
                                 shard_bytes=parse_bytes(args.shard_size, "--shard-size"))
    except ValueError as err:
        print(f"error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    cfg = model_config_from_hf(out)
    params = sum(math.prod(m.shape) for m in param_plan(cfg))
    files = sorted(Path(out).iterdir())
    print(json.dumps({"folder": str(out), "arch": args.arch, "size": args.size,
                      "dtype": DTYPE_ALIASES[args.dtype], "params": params,
                      "bytes": sum(f.stat().st_size for f in files),
                      "files": [f.name for f in files], "seconds": round(time.perf_counter() - start, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
