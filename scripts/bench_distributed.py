"""Data-parallel offloaded training, P = 1 and P = 2 processes on 127.0.0.1 (and D2: one process
on two devices), the same model and global batch, interleaved. Per process per step: SSD bytes read and written (target: 1/P of the
P = 1 figure within 5 %), the state's bytes on disk, peak system memory (RSS) and the step time.
Prints JSON, writes docs/bench_distributed.{json,png}.

Each contender is a fresh set of processes (``jax.distributed`` over gloo, one CPU device
each) running :class:`~jaxascend.offload.OffloadEngine` with a ``StepPlan`` of ``Partition(i, P)`` on
random token batches; a step's time is the time between consecutive returns of
``engine.step`` after ``--warmup`` steps (which compile). The processes of P = 2 share the
machine's cores and disk, so the step time here says what the partitioned step costs on one
machine, not what two machines would gain. D2 is one process whose two (CPU) devices share the
rows and the one SSD state (``--xla_force_host_platform_device_count=2``).

    python scripts/bench_distributed.py                        # ~55M-parameter Llama, 2 rounds
    python scripts/bench_distributed.py --shape small --rounds 1   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHAPES = {
    "55m": {"layers": 6, "hidden": 768, "intermediate": 2048, "vocab": 8192, "heads": 12, "kv_heads": 4},
    "small": {"layers": 4, "hidden": 256, "intermediate": 688, "vocab": 4096, "heads": 4, "kv_heads": 4},
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="55m")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=5, help="steps per run (the first --warmup excluded)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch", type=int, default=4, help="global batch rows")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--dir", default="/tmp/bench_distributed", help="scratch directory (offload state)")
    p.add_argument("--out", default=str(REPO / "docs" / "bench_distributed.json"))
    p.add_argument("--child", nargs=2, metavar=("OUT", "SHAPE"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def child(args) -> None:
    """One process of a contender: trains, then writes its figures to OUT/result-<i>.json."""
    import numpy as np
    from flax import nnx

    from jaxascend.config import load_config
    from jaxascend.distributed import initialize
    from jaxascend.models import build_model, token_batch
    from jaxascend.offload import JobShape, OffloadEngine, StepPlan

    out, shape = Path(args.child[0]), SHAPES[args.child[1]]
    group = initialize(None)
    cfg = load_config(str(REPO / "configs" / "tiny.yaml"), [
        f"model.hidden_size={shape['hidden']}", f"model.intermediate_size={shape['intermediate']}",
        f"model.num_hidden_layers={shape['layers']}", f"model.num_attention_heads={shape['heads']}",
        f"model.num_key_value_heads={shape['kv_heads']}", f"model.vocab_size={shape['vocab']}",
        "model.tie_word_embeddings=false", "model.remat=full", f"data.seq_len={args.seq}",
        f"data.batch_size={args.batch}", "offload.overlap=false", "offload.chunk_bytes=8MiB",
        f"offload.dir={out}/offload-{group.index}", f"train.out_dir={out}"])
    model = build_model(cfg.model, shape["vocab"], rngs=nnx.Rngs(0))
    from jaxascend.models import count_params
    params = count_params(model)
    import jax

    plan = StepPlan.resolve(cfg, cfg.model, JobShape(group.count, group.index, jax.local_device_count()))
    rng = np.random.default_rng(0)
    times, reads, writes, losses = [], [], [], []
    with OffloadEngine(cfg, model, cfg.model, plan) as engine:
        del model
        last = time.perf_counter()
        for step in range(args.warmup + args.steps):
            tokens = rng.integers(0, shape["vocab"], (1, args.batch, args.seq + 1)).astype(np.int32)
            read0, written0 = engine.ssd_bytes_read, engine.ssd_bytes_written
            stats = engine.step(token_batch(tokens))
            now = time.perf_counter()
            if step >= args.warmup:
                times.append(now - last)
                reads.append(engine.ssd_bytes_read - read0)
                writes.append(engine.ssd_bytes_written - written0)
            losses.append(stats.loss)
            last = now
        disk = sum(os.path.getsize(f) for f in engine.shard_files())
        state = sum(r.nbytes for r in engine.state.store.regions())
    (out / f"result-{group.index}.json").write_text(json.dumps({
        "step_s": times, "read_bytes": reads, "written_bytes": writes, "disk_bytes": disk, "state_bytes": state,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "losses": losses,
        "params": params}))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_contender(args, processes: int, out: Path, devices: int = 1) -> list[dict]:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    port, procs = _free_port(), []
    for i in range(processes):
        env = dict(os.environ)
        if devices > 1:
            env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
        if processes > 1:
            env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(processes),
                       JAX_PROCESS_ID=str(i))
        procs.append(subprocess.Popen(
            [sys.executable, __file__, "--child", str(out), args.shape, "--steps", str(args.steps),
             "--warmup", str(args.warmup), "--batch", str(args.batch), "--seq", str(args.seq)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate()
        if p.returncode:
            raise SystemExit(f"P={processes}: a process failed: {err.strip().splitlines()[-1] if err.strip() else p.returncode}")
    results = [json.loads((out / f"result-{i}.json").read_text()) for i in range(processes)]
    shutil.rmtree(out, ignore_errors=True)
    return results


def _cpu() -> str:
    """The CPU model and whether AVX-512 is there (the machines vary)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    return f"{name}, {'AVX-512' if 'avx512f' in info else 'AVX2 only' if 'avx2' in info else 'no AVX2'}, {os.cpu_count()} cores"


def summarize(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        child(args)
        return 0
    rounds: dict[str, list[list[dict]]] = {"P1": [], "P2": [], "D2": []}
    for r in range(args.rounds):
        order = ("P1", "P2", "D2") if r % 2 == 0 else ("D2", "P2", "P1")  # alternate who goes first
        for name in order:
            processes, devices = (int(name[1]), 1) if name[0] == "P" else (1, int(name[1]))
            rounds[name].append(run_contender(args, processes, Path(args.dir) / name, devices))
            print(f"round {r + 1}: {name} done", file=sys.stderr)
    metrics = {"read_bytes_per_step": lambda p: statistics.median(p["read_bytes"]),
               "written_bytes_per_step": lambda p: statistics.median(p["written_bytes"]),
               "disk_bytes": lambda p: p["disk_bytes"], "state_bytes": lambda p: p["state_bytes"],
               "peak_rss_bytes": lambda p: p["peak_rss_bytes"], "step_s": lambda p: statistics.median(p["step_s"])}
    per_process = {}
    for name, runs in rounds.items():
        procs = [p for run in runs for p in run]
        per_process[name] = {k: summarize([get(p) for p in procs]) for k, get in metrics.items()}
    # Per round: the P = 2 processes' median over the P = 1 process's figure of the same round.
    ratios = {k: summarize([statistics.median([get(p) for p in two]) / get(one[0])
                            for one, two in zip(rounds["P1"], rounds["P2"])]) for k, get in metrics.items()}
    ratios_d2 = {k: summarize([get(d[0]) / get(one[0]) for one, d in zip(rounds["P1"], rounds["D2"])])
                 for k, get in metrics.items()}
    losses_equal = all(abs(a - b) <= 1e-3 * abs(b) for run1, run2 in
                       [*zip(rounds["P1"], rounds["P2"]), *zip(rounds["P1"], rounds["D2"])]
                       for a, b in zip(run2[0]["losses"], run1[0]["losses"]))
    report = {"shape": args.shape, "params": rounds["P1"][0][0]["params"], "rounds": args.rounds, "steps": args.steps,
              "global_batch": [args.batch, args.seq], "cpu": _cpu(),
              "per_process": per_process, "ratio_P2_over_P1": ratios, "ratio_D2_over_P1": ratios_d2,
              "io_target_met": all(abs(ratios[k]["median"] - 0.5) <= 0.05 * 0.5
                                   for k in ("read_bytes_per_step", "written_bytes_per_step")),
              "losses_agree_1e-3": losses_equal}
    print(json.dumps(report, indent=1))
    Path(args.out).write_text(json.dumps(report, indent=1))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np
    except ImportError:
        print("note: matplotlib is not installed; no PNG", file=sys.stderr)
        return 0
    keys = list(ratios)
    fig, ax = plt.subplots(figsize=(8, 3.5))
    x = np.arange(len(keys))
    ax.bar(x - 0.2, [ratios[k]["median"] for k in keys], 0.4, color="tab:blue", label="P=2 (per process)")
    ax.bar(x + 0.2, [ratios_d2[k]["median"] for k in keys], 0.4, color="tab:orange", label="1 process, 2 devices")
    ax.axhline(0.5, color="gray", linestyle="--", label="1/P")
    ax.set_xticks(range(len(keys)), [k.replace("_", " ") for k in keys], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("over P=1")
    ax.set_title(f"data parallel, {args.shape}: per-process figures over P=1 (median of {args.rounds} rounds)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(Path(args.out).with_suffix(".png"), dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
