"""DeepSpeed ZeRO-Infinity with gradient accumulation, timed by phase: the peer of
``scripts/bench_step.py --grad-accum``. Run with the peer venv's Python (``../shared/peers/``).

    /tmp/peer/venv/bin/python scripts/zinf_accum.py --grad-accum 4 --layers 8 --hidden 2048 \\
        --intermediate 5632 --vocab 32000 --heads 16 --kv-heads 16 --seq 128 --steps 3 --nvme-dir /tmp/z

The model and the ZeRO-3 settings are those of ``shared/peers/zero_infinity/zinf_train.py``
(``transformers.LlamaForCausalLM`` with ``sdpa`` attention and an untied head, built under
``deepspeed.zero.Init``, the optimizer state on NVMe, the lean buffer settings passed as flags),
with ``gradient_accumulation_steps`` = A: a step is A micro-batches, each a forward and a
``engine.backward``, and one ``engine.step`` that runs the optimizer at the boundary. That file
runs one micro-batch per step and is other teams' too, so this loop is its own.

Per step it reports the wall time, the forward/backward time of its A micro-batches (the peer's
compute alone: the gradients' reduction and copy to host are part of its backward, as the
jaxascend compute contender's sink is part of its), the optimizer step's time, and the bytes the
process read and wrote (``/proc/self/io``). The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import sys
import time

# One local process, as zinf_train.py sets it up (before DeepSpeed is imported).
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", "/tmp/peer/torch_ext")
for _key, _value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                     ("LOCAL_SIZE", "1")):
    os.environ.setdefault(_key, _value)
if "MASTER_PORT" not in os.environ:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as _s:
        _s.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(_s.getsockname()[1])


def proc_io() -> dict:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f.read().splitlines())}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("layers", 2), ("hidden", 256), ("intermediate", 688), ("vocab", 32000), ("heads", 4),
                          ("kv-heads", 4), ("seq", 128), ("batch", 1), ("steps", 3), ("grad-accum", 1)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--nvme-dir", default="/tmp/zinf_accum/nvme")
    ap.add_argument("--sub-group-size", type=int, default=int(1e8))
    ap.add_argument("--reduce-bucket-size", type=int, default=int(5e7))
    ap.add_argument("--max-live-params", type=int, default=int(1e8))
    return ap.parse_args(argv)


def ds_config(args) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": args.grad_accum,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}},
        "zero_optimization": {
            "stage": 3, "sub_group_size": args.sub_group_size, "reduce_bucket_size": args.reduce_bucket_size,
            "stage3_prefetch_bucket_size": int(5e7), "stage3_max_live_parameters": args.max_live_params,
            "offload_optimizer": {"device": "nvme", "nvme_path": args.nvme_dir, "pin_memory": True, "buffer_count": 4},
        },
        "aio": {"block_size": 1048576, "queue_depth": 8, "single_submit": False, "overlap_events": True},
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }
    if args.dtype == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def main(argv=None) -> int:
    args = parse_args(argv)
    import deepspeed
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    shutil.rmtree(args.nvme_dir, ignore_errors=True)
    os.makedirs(args.nvme_dir)
    deepspeed.init_distributed(dist_backend="gloo")
    config = ds_config(args)
    model_cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                            num_hidden_layers=args.layers, num_attention_heads=args.heads,
                            num_key_value_heads=args.kv_heads, max_position_embeddings=max(args.seq, 128),
                            tie_word_embeddings=False, use_cache=False)
    model_cfg._attn_implementation = "sdpa"
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = LlamaForCausalLM(model_cfg)
    params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    engine.train()
    g = torch.Generator().manual_seed(0)
    steps = []
    for _ in range(args.steps):
        io0, t0 = proc_io(), time.perf_counter()
        compute, losses = 0.0, []
        for _ in range(args.grad_accum):
            ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
            c0 = time.perf_counter()
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            compute += time.perf_counter() - c0
            engine.step()  # a no-op but at the accumulation boundary (the last micro-batch)
            losses.append(float(loss.detach().float()))
        wall = time.perf_counter() - t0
        io1 = proc_io()
        steps.append({"step_s": wall, "compute_s": compute, "optimizer_s": wall - compute,
                      "read_bytes": io1["read_bytes"] - io0["read_bytes"],
                      "write_bytes": io1["write_bytes"] - io0["write_bytes"], "loss": sum(losses) / len(losses)})
        print(f"[zinf_accum] step {len(steps)}: {wall:.2f} s (compute {compute:.2f} s)", file=sys.stderr, flush=True)
    shutil.rmtree(args.nvme_dir, ignore_errors=True)
    print(json.dumps({"impl": "deepspeed_zero3_infinity", "deepspeed": deepspeed.__version__, "torch": torch.__version__,
                      "grad_accum": args.grad_accum, "params": params, "threads": torch.get_num_threads(),
                      "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "steps": steps}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
