"""Peak host memory while loading a Hugging Face checkpoint, as a ratio to the model's size in
the compute dtype (target <= 1.15).

    python scripts/bench_load.py                          # Llama 3.2 1B shapes, bf16 (~2.5 GB on disk)
    python scripts/bench_load.py --arch qwen2 --size tiny  # smoke run
    python scripts/bench_load.py --checkpoint /models/Qwen2.5-0.5B

The checkpoint is made with make_hf_checkpoint in a temporary folder unless ``--checkpoint`` is
given. The load runs in a fresh subprocess so the peak RSS (VmHWM) is the loader's alone; a
second fresh process that imports the same modules and touches jax gives the baseline, which is
subtracted for the net figure. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time

# Runs in the child processes. The baseline child stops before loading.
_CHILD = r"""
import json, sys, time
import jax, jax.numpy as jnp
from jaxascend.config import ModelConfig
from jaxascend.hf.config_map import model_config_from_hf
from jaxascend.hf.load import load_hf_params
jnp.zeros(1).block_until_ready()

def peak():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

folder, dtype, mode = sys.argv[1], sys.argv[2], sys.argv[3]
out = {"peak_rss_bytes": peak()}
if mode == "load":
    cfg = model_config_from_hf(folder, ModelConfig(dtype=dtype, param_dtype=dtype))
    start = time.perf_counter()
    state = load_hf_params(folder, cfg)
    leaves = jax.tree.leaves(state)
    jax.block_until_ready(leaves)
    out.update(seconds=time.perf_counter() - start, peak_rss_bytes=peak(),
               params=sum(int(x.size) for x in leaves),
               param_bytes=sum(int(x.size) * x.dtype.itemsize for x in leaves))
print(json.dumps(out))
"""


def _child(folder: str, dtype: str, mode: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", _CHILD, folder, dtype, mode], capture_output=True,
                          text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"error: {mode} subprocess failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="llama")
    p.add_argument("--size", default="1B")
    p.add_argument("--checkpoint", default=None, help="existing HF folder (default: make one)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="compute dtype to load into (the checkpoint is made in bf16)")
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="bench_load_") as tmp:
        folder = args.checkpoint
        make_seconds = None
        if folder is None:
            from jaxascend.hf import make_hf_checkpoint

            start = time.perf_counter()
            folder = str(make_hf_checkpoint(args.arch, args.size, f"{tmp}/ckpt", dtype="bfloat16"))
            make_seconds = time.perf_counter() - start
        baseline = _child(folder, args.dtype, "baseline")
        loaded = _child(folder, args.dtype, "load")
    model_bytes = loaded["param_bytes"]
    peak, base = loaded["peak_rss_bytes"], baseline["peak_rss_bytes"]
    print(json.dumps({
        "checkpoint": args.checkpoint or f"{args.arch}/{args.size} (made in bf16)",
        "dtype": args.dtype, "params": loaded["params"], "model_bytes": model_bytes,
        "make_seconds": None if make_seconds is None else round(make_seconds, 2),
        "load_seconds": round(loaded["seconds"], 2),
        "peak_rss_bytes": peak, "baseline_rss_bytes": base, "net_peak_bytes": peak - base,
        "ratio_raw": round(peak / model_bytes, 4), "ratio_net": round((peak - base) / model_bytes, 4),
        "target_ratio": 1.15,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
