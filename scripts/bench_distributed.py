"""Data-parallel offloaded training, P = 1 and P = 2 processes on 127.0.0.1 (and, with
``--devices``, one process on two devices), the same model and global batch, interleaved. Per
process per step: SSD bytes read and written (target: 1/P of the P = 1 figure within 5 %), the
state's bytes on disk, peak RSS sampled from outside the process (psutil, with the kernel's
high-water mark, as ``bench_child.py`` samples a run) and the step time. Prints JSON, writes
docs/bench_distributed.{json,png}.

Each contender is a fresh set of processes (``jax.distributed`` over gloo, one CPU device
each) running :class:`~jaxascend.offload.OffloadEngine` with the ``StepPlan`` the trainer would
make (``Partition(i, P)``; the step overlapped with the update unless ``--no-overlap``) on
random token batches; a step's time is the time between consecutive returns of ``engine.step``
after ``--warmup`` steps (which compile). The processes of P = 2 share the machine's cores and
disk, so the step time here says what the partitioned step costs on one machine, not what two
machines would gain. D2 is one process whose two (CPU) devices share the rows and the one SSD
state (``--xla_force_host_platform_device_count=2``).

    python scripts/bench_distributed.py --shape qwen0.5b --rounds 1   # Qwen2.5-0.5B, its 151936-token table
    python scripts/bench_distributed.py                               # ~55M-parameter Llama, 2 rounds
    python scripts/bench_distributed.py --shape small --rounds 1      # a smoke run

``--stress N`` (shape ``table`` by default: a tied 151936-row table in 16 blocks at width 128)
runs the P = 2 job N times instead, each run from the same restored start (checkpoint step 0),
with a process burning a core from the second run on, and checks that every run is bit-identical
(the masters' SHA-256 and the losses): the collectives of a step run in the order the step fixes
(``offload.collective_order``) whatever the load. Prints JSON, writes
docs/bench_distributed_stress.json, and exits 1 if two runs differ.

    python scripts/bench_distributed.py --stress 10
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil

from bench_child import high_water, tree_rss

REPO = Path(__file__).resolve().parent.parent
SHAPES = {
    # Qwen2.5-0.5B (hf/presets "qwen2" "0.5B"): a tied 151936 x 896 table, computed and sent in
    # 16 blocks of rows (models.vocab), each block's state split between the processes.
    "qwen0.5b": {"layers": 24, "hidden": 896, "intermediate": 4864, "vocab": 151936, "heads": 14, "kv_heads": 2,
                 "tied": True},
    "55m": {"layers": 6, "hidden": 768, "intermediate": 2048, "vocab": 8192, "heads": 12, "kv_heads": 4,
            "tied": False},
    "small": {"layers": 4, "hidden": 256, "intermediate": 688, "vocab": 4096, "heads": 4, "kv_heads": 4,
              "tied": False},
    # --stress: Qwen's vocabulary, tied, at a small width (still 2^24 elements: 16 blocks of rows).
    "table": {"layers": 2, "hidden": 128, "intermediate": 256, "vocab": 151936, "heads": 4, "kv_heads": 2,
              "tied": True},
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), help="default: 55m (table with --stress)")
    p.add_argument("--layers", type=int, help="fewer layers than the shape's (the step time with all is long)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, help="steps per run (the first --warmup excluded; default: 5, 2 with --stress)")
    p.add_argument("--warmup", type=int, help="default: 2 (0 with --stress)")
    p.add_argument("--batch", type=int, default=4, help="global batch rows")
    p.add_argument("--seq", type=int, help="default: 128 (16 with --stress)")
    p.add_argument("--no-overlap", dest="overlap", action="store_false",
                   help="the update after the forward/backward (default: overlapped, as the trainer runs)")
    p.add_argument("--devices", action="store_true", help="also one process on two devices (D2)")
    p.add_argument("--stress", type=int, default=0, metavar="N",
                   help="instead: the P = 2 job N times from one restored start, a core busy from the second run "
                        "on; checks every run is bit-identical (default shape: table, --steps 2 --warmup 0 "
                        "--seq 16)")
    p.add_argument("--dir", default="/tmp/bench_distributed", help="scratch directory (offload state)")
    p.add_argument("--out", help="default: docs/bench_distributed.json (docs/bench_distributed_stress.json with "
                                 "--stress)")
    p.add_argument("--child", nargs=2, metavar=("OUT", "SHAPE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    defaults = {"shape": "table", "steps": 2, "warmup": 0, "seq": 16} if args.stress else \
        {"shape": "55m", "steps": 5, "warmup": 2, "seq": 128}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.stress < 0 or args.stress == 1:
        p.error(f"--stress: at least 2 runs to compare, got {args.stress}")
    if args.out is None:
        args.out = str(REPO / "docs" / ("bench_distributed_stress.json" if args.stress else "bench_distributed.json"))
    return args


def _shape(args) -> dict:
    shape = dict(SHAPES[args.child[1] if args.child else args.shape])
    if args.layers:
        shape["layers"] = args.layers
    return shape


def _child_config(args, out: Path, shape: dict, index: int):
    from jaxascend.config import load_config

    return load_config(str(REPO / "configs" / "tiny.yaml"), [
        f"model.hidden_size={shape['hidden']}", f"model.intermediate_size={shape['intermediate']}",
        f"model.num_hidden_layers={shape['layers']}", f"model.num_attention_heads={shape['heads']}",
        f"model.num_key_value_heads={shape['kv_heads']}", f"model.vocab_size={shape['vocab']}",
        f"model.tie_word_embeddings={str(shape['tied']).lower()}", "model.param_dtype=bfloat16",
        "model.remat=full", "model.loss=blocked", f"data.seq_len={args.seq}", f"data.batch_size={args.batch}",
        f"offload.overlap={str(args.overlap).lower()}", "offload.chunk_bytes=8MiB",
        f"offload.dir={out}/offload-{index}", f"train.out_dir={out}", f"checkpoint.dir={out}/checkpoints"])


def child(args) -> None:
    """One process of a contender: trains, then writes its figures to OUT/result-<i>.json."""
    import jax
    import numpy as np
    from flax import nnx

    from jaxascend.distributed import initialize
    from jaxascend.models import build_model, count_params, token_batch
    from jaxascend.offload import JobShape, OffloadEngine, StepPlan

    out, shape = Path(args.child[0]), _shape(args)
    group = initialize(None)
    cfg = _child_config(args, out, shape, group.index)
    model = build_model(cfg.model, shape["vocab"], rngs=nnx.Rngs(0))
    params = count_params(model)
    plan = StepPlan.resolve(cfg, cfg.model, JobShape(group.count, group.index, jax.local_device_count()))
    rng = np.random.default_rng(0)
    times, reads, writes, losses = [], [], [], []
    with OffloadEngine(cfg, model, cfg.model, plan) as engine:
        del model
        blocks = max(leaf.row_blocks for leaf in engine.state.leaves)
        (out / f"started-{group.index}").touch()  # the parent samples the steps from here
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
        engine.finish_update()
        disk = sum(os.path.getsize(f) for f in engine.shard_files())
        state = sum(r.nbytes for r in engine.state.store.regions())
    (out / f"result-{group.index}.json").write_text(json.dumps({
        "step_s": times, "read_bytes": reads, "written_bytes": writes, "disk_bytes": disk, "state_bytes": state,
        "losses": losses, "params": params, "table_blocks": blocks, "overlap": plan.overlap}))


def stress_child(args) -> None:
    """One process of the stressed job: ``--stress`` runs of ``--steps`` steps, each from the
    restored step 0, a core kept busy from the second run on (by process 0); writes each run's
    losses and the SHA-256 of its master weights to OUT/result-<i>.json."""
    import hashlib

    import jax
    import numpy as np
    from flax import nnx

    from jaxascend.checkpoint import Checkpointer
    from jaxascend.distributed import initialize
    from jaxascend.models import build_model, token_batch
    from jaxascend.offload import JobShape, OffloadEngine, StepPlan

    out, shape = Path(args.child[0]), _shape(args)
    group = initialize(None)
    cfg = _child_config(args, out, shape, group.index)
    model = build_model(cfg.model, shape["vocab"], rngs=nnx.Rngs(0))
    plan = StepPlan.resolve(cfg, cfg.model, JobShape(group.count, group.index, jax.local_device_count()))
    runs, burner = [], None
    with OffloadEngine(cfg, model, cfg.model, plan) as engine, Checkpointer(cfg.checkpoint, cfg) as ckpt:
        del model
        blocks = max(leaf.row_blocks for leaf in engine.state.leaves)
        engine.save_checkpoint(ckpt, 0, {})
        ckpt.wait()
        try:
            for run in range(args.stress):
                if run == 1 and group.index == 0:  # the first run compiles the step
                    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
                engine.restore_checkpoint(ckpt, 0)
                rng = np.random.default_rng(0)
                started = time.perf_counter()
                losses = [engine.step(token_batch(rng.integers(0, shape["vocab"], (1, args.batch, args.seq + 1))
                                                  .astype(np.int32))).loss for _ in range(args.steps)]
                engine.finish_update()
                digest = hashlib.sha256()
                for leaf in engine.state.leaves:
                    digest.update(engine.state.read_state(leaf, "master").tobytes())
                runs.append({"losses": [float(x) for x in losses], "master_sha256": digest.hexdigest(),
                             "seconds": time.perf_counter() - started, "core_busy": burner is not None})
        finally:
            if burner is not None:
                burner.kill()
                burner.wait()
    (out / f"result-{group.index}.json").write_text(json.dumps({"runs": runs, "table_blocks": blocks,
                                                                "overlap": plan.overlap}))


def stress(args) -> int:
    """The P = 2 job's runs under load: bit-identical or not (exit status 1), as JSON."""
    started = time.time()
    results = run_contender(args, 2, Path(args.dir) / "stress")
    runs = [r["runs"] for r in results]
    per_process = [{"distinct_masters": len({r["master_sha256"] for r in process}),
                    "distinct_losses": len({tuple(r["losses"]) for r in process})} for process in runs]
    identical = all(p["distinct_masters"] == 1 and p["distinct_losses"] == 1 for p in per_process)
    shape = _shape(args)
    report = {"stress_runs": args.stress, "processes": 2, "shape": args.shape, "layers": shape["layers"],
              "hidden": shape["hidden"], "vocab": shape["vocab"], "tied": shape["tied"],
              "table_blocks": results[0]["table_blocks"], "overlap": results[0]["overlap"], "steps": args.steps,
              "global_batch": [args.batch, args.seq], "cpu": _cpu(), "per_process": per_process,
              "losses": runs[0][0]["losses"], "master_sha256_per_process": [p[0]["master_sha256"] for p in runs],
              "run_seconds": summarize([r["seconds"] for process in runs for r in process[1:]] or [0.0]),
              "peak_rss_bytes": [r["peak_rss_bytes"] for r in results],
              "bit_identical": identical, "wall_seconds": round(time.time() - started)}
    print(json.dumps(report, indent=1))
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    if not identical:
        print(f"error: the {args.stress} runs of the job are not bit-identical: {per_process}", file=sys.stderr)
    return 0 if identical else 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_contender(args, processes: int, out: Path, devices: int = 1) -> list[dict]:
    """One contender's processes, each sampled from outside (RSS of it and anything it starts,
    and its kernel high-water mark) every 0.2 s; returns each process's figures."""
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
        cmd = [sys.executable, __file__, "--child", str(out), args.shape, "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--batch", str(args.batch), "--seq", str(args.seq),
               "--stress", str(args.stress)]
        cmd += (["--layers", str(args.layers)] if args.layers else []) + ([] if args.overlap else ["--no-overlap"])
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    watched = [psutil.Process(p.pid) for p in procs]
    peaks = [0] * processes  # the largest RSS sampled (whole run) ...
    step_peaks = [0] * processes  # ... and once the engine was built (the steps)
    while any(p.poll() is None for p in procs):
        for i, (p, w) in enumerate(zip(procs, watched)):
            if p.poll() is not None:
                continue
            try:
                rss = max(tree_rss(w), high_water(p.pid))
            except psutil.NoSuchProcess:
                continue
            peaks[i] = max(peaks[i], rss)
            if (out / f"started-{i}").exists():
                step_peaks[i] = max(step_peaks[i], tree_rss(w))
        time.sleep(0.2)
    for p in procs:
        log = p.communicate()[0]
        if p.returncode:
            raise SystemExit(f"P={processes}: a process failed:\n{log[-3000:]}")
    results = [json.loads((out / f"result-{i}.json").read_text()) for i in range(processes)]
    for r, peak, during in zip(results, peaks, step_peaks):
        r["peak_rss_bytes"], r["steps_rss_bytes"] = peak, during
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
        (stress_child if args.stress else child)(args)
        return 0
    if args.stress:
        return stress(args)
    names = ("P1", "P2", "D2") if args.devices else ("P1", "P2")
    rounds: dict[str, list[list[dict]]] = {name: [] for name in names}
    started = time.time()
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:  # alternate who goes first
            processes, devices = (int(name[1]), 1) if name[0] == "P" else (1, int(name[1]))
            rounds[name].append(run_contender(args, processes, Path(args.dir) / name, devices))
            print(f"round {r + 1}: {name} done ({time.time() - started:.0f} s)", file=sys.stderr)
    metrics = {"read_bytes_per_step": lambda p: statistics.median(p["read_bytes"]),
               "written_bytes_per_step": lambda p: statistics.median(p["written_bytes"]),
               "disk_bytes": lambda p: p["disk_bytes"], "state_bytes": lambda p: p["state_bytes"],
               "peak_rss_bytes": lambda p: p["peak_rss_bytes"], "steps_rss_bytes": lambda p: p["steps_rss_bytes"],
               "step_s": lambda p: statistics.median(p["step_s"])}
    per_process = {}
    for name, runs in rounds.items():
        procs = [p for run in runs for p in run]
        per_process[name] = {k: summarize([get(p) for p in procs]) for k, get in metrics.items()}
    # Per round: the other contenders' median process over the P = 1 process's figure of the same round.
    ratios = {name: {k: summarize([statistics.median([get(p) for p in other]) / get(one[0])
                                   for one, other in zip(rounds["P1"], rounds[name])]) for k, get in metrics.items()}
              for name in names[1:]}
    losses_agree = all(abs(a - b) <= 1e-2 * abs(b) for name in names[1:]
                       for one, other in zip(rounds["P1"], rounds[name])
                       for a, b in zip(other[0]["losses"], one[0]["losses"]))
    shape = _shape(args)
    first = rounds["P1"][0][0]
    report = {"shape": args.shape, "layers": shape["layers"], "vocab": shape["vocab"], "tied": shape["tied"],
              "table_blocks": first["table_blocks"], "params": first["params"], "rounds": args.rounds,
              "steps": args.steps, "warmup": args.warmup, "global_batch": [args.batch, args.seq],
              "overlap": first["overlap"], "cpu": _cpu(), "per_process": per_process,
              "ratio_P2_over_P1": ratios["P2"], **({"ratio_D2_over_P1": ratios["D2"]} if args.devices else {}),
              "io_target_met": all(abs(ratios["P2"][k]["median"] - 0.5) <= 0.05 * 0.5
                                   for k in ("read_bytes_per_step", "written_bytes_per_step")),
              "losses_agree_1e-2": losses_agree, "wall_seconds": round(time.time() - started)}
    print(json.dumps(report, indent=1))
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np
    except ImportError:
        print("note: matplotlib is not installed; no PNG", file=sys.stderr)
        return 0
    keys = list(metrics)
    fig, ax = plt.subplots(figsize=(8, 3.5))
    x = np.arange(len(keys))
    width = 0.8 / (len(names) - 1)
    for j, (name, color) in enumerate(zip(names[1:], ("tab:blue", "tab:orange"))):
        label = "P=2 (per process)" if name == "P2" else "1 process, 2 devices"
        ax.bar(x + (j - (len(names) - 2) / 2) * width, [ratios[name][k]["median"] for k in keys], width,
               color=color, label=label)
    ax.axhline(0.5, color="gray", linestyle="--", label="1/P")
    ax.set_xticks(range(len(keys)), [k.replace("_", " ") for k in keys], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("over P=1")
    ax.set_title(f"data parallel, {args.shape} ({shape['layers']} layers, vocab {shape['vocab']}): per process "
                 f"over P=1", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(Path(args.out).with_suffix(".png"), dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
