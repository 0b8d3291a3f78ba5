"""The 7B row of bench_scale: a full fine-tune of the Qwen2.5-7B shape on this machine, as shipped.

    python scripts/bench_scale_7b.py                      # configs/qwen2.5-7b.yaml, 3 steps, a kill in step 2
    python scripts/bench_scale_7b.py --no-kill            # the measured run only
    python scripts/bench_scale_7b.py --replot             # the .md from docs/bench_scale_7b.json

The model folder holds ``config.json`` alone (``jaxascend.hf.presets``: the published one), so the
run starts from a random initialization (``model.init: random``) with its 152064-token vocabulary
and the byte tokenizer. The config is the shipped one with the run's shape on top: seq 128, batch
1, grad_accum 1, 3 steps over one record (the same batch each step), a constant learning rate of
1e-4 (the shipped 5e-6 with 50 warmup steps barely moves a random model in 3 steps).

1. **straight**: the run, sampled from outside every ``--interval`` seconds (``bench_child``: RSS
   of the process tree and the page cache of the offload files; this script: the filesystem's used
   bytes against those before the run). Its export is checked with ``transformers`` (the config it
   loads; the safetensors index names every tensor of every shard, and their parameters add up to
   the model's), hashed, and removed (two exports and the offload files do not fit this disk).
2. **killed**: the same command, SIGKILLed in the middle of step 2's update
   (``JAXASCEND_KILL_AT=optimizer_chunk:N + N/2``, N chunks an update), then the same command
   again, which resumes from the offload files (``offload.durable``). Its losses and its export
   must equal the straight run's, byte for byte.

Per step (``metrics.jsonl``): the wall time, the forward/backward (with the waits for streamed
weights), the update, and its overlap; the SSD floor is the planned bytes of a step at the disk
speed measured first (``jaxascend.ssd.disk_speed``). Writes ``docs/bench_scale_7b.json`` (and
``.md``) and prints the JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench_child import run_sampled_child

REPO = Path(__file__).resolve().parent.parent
RECORD = "The quick brown fox jumps over the lazy dog; a 7B model learns one sentence, again and again."
SHAPE = ["data.seq_len=128", "data.batch_size=1", "train.grad_accum=1", "train.steps=3", "train.log_every=1",
         "train.progress=false", "optimizer.learning_rate=1e-4", "optimizer.warmup_steps=0",
         "optimizer.schedule=constant", "model.init=random"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(REPO / "configs" / "qwen2.5-7b.yaml"))
    p.add_argument("--preset", default="qwen2:7B", help="jaxascend.hf.presets arch:size of its config.json")
    p.add_argument("--work-dir", default="/tmp/jaxascend-bench-7b")
    p.add_argument("--out", default=str(REPO / "docs" / "bench_scale_7b.json"))
    p.add_argument("--interval", type=float, default=0.5)
    p.add_argument("--timeout", type=float, default=4 * 3600)
    p.add_argument("--no-kill", action="store_true", help="the measured run only")
    p.add_argument("--replot", action="store_true")
    p.add_argument("--set", dest="extra", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    return p.parse_args()


class DiskSampler:
    """The filesystem's used bytes, sampled on a thread; ``peak`` above those at the start."""

    def __init__(self, path: Path, interval: float):
        self.path, self.interval, self.peak = path, interval, 0
        self.base = shutil.disk_usage(path).used
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, shutil.disk_usage(self.path).used - self.base)
            self._stop.wait(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def command(args, folder: Path, data: Path, out: Path) -> list[str]:
    sets = [f"model.path={folder}", f"data.paths=[{data}]", f"train.out_dir={out}", f"offload.dir={out / 'offload'}",
            *SHAPE, *args.extra]
    cmd = [sys.executable, "-m", "jaxascend.train", "--config", args.config]
    for s in sets:
        cmd += ["--set", s]
    return cmd


def chunks_per_update(args, folder: Path, data: Path, out: Path) -> int:
    """The chunks one update streams (the kill point counts them), from the layout the run plans."""
    from jaxascend.config import load_config
    from jaxascend.offload import job_state_layout
    from jaxascend.preparation import resolve_model_config
    sets = command(args, folder, data, out)[6::2]
    cfg = load_config(args.config, sets)
    return len(job_state_layout(cfg, resolve_model_config(cfg), stream=cfg.offload.params == "ssd").chunks())


def lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def export_check(hf: Path, num_params: int) -> dict:
    """What transformers reads of the export, and its index against the shards' own headers."""
    import transformers
    config = transformers.AutoConfig.from_pretrained(str(hf), local_files_only=True)
    index_file = hf / "model.safetensors.index.json"
    index = json.loads(index_file.read_text()) if index_file.exists() else None  # one shard: no index
    names, params, digests = set(), 0, {}
    for shard in sorted(set(index["weight_map"].values())) if index else ["model.safetensors"]:
        raw = (hf / shard).open("rb")
        size = int.from_bytes(raw.read(8), "little")
        header = json.loads(raw.read(size))
        raw.close()
        for name, entry in header.items():
            if name != "__metadata__":
                names.add(name)
                params += math.prod(entry["shape"])
        digests[shard] = sha256(hf / shard)
    return {"model_type": config.model_type, "hidden_size": config.hidden_size, "vocab_size": config.vocab_size,
            "num_hidden_layers": config.num_hidden_layers, "shards": len(digests),
            "index_tensors": len(index["weight_map"]) if index else None,
            "index_matches_shards": names == set(index["weight_map"]) if index else None, "parameters": params,
            "parameters_match": params == num_params, "digests": digests}


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def per_step(metrics: Path, plan: dict, gbps: float) -> list[dict]:
    floor = (plan["ssd_read_step"] + plan["ssd_write_step"]) / (gbps * 1e9)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    out, before = [], 0.0
    for r in records:
        out.append({"step": r["step"], "loss": r["loss"], "wall_s": round(r["elapsed_s"] - before, 2),
                    **{k: r.get(k) for k in ("fwd_bwd_seconds", "optimizer_seconds", "param_wait_seconds",
                                             "optimizer_wait_seconds", "overlap_fraction", "ssd_read_bytes",
                                             "ssd_written_bytes", "stream_gbps")},
                    "ssd_floor_s": round(floor, 2)})
        before = r["elapsed_s"]
    return out


def measured_run(args, folder: Path, data: Path, out: Path, work: Path) -> dict:
    cmd = command(args, folder, data, out)
    with DiskSampler(work, args.interval) as disk:
        run = run_sampled_child(cmd, str(out / "offload" / "*.bin"), lambda: lines(out / "metrics.jsonl"),
                                work / "straight.log", steps=3, cwd=REPO, interval=args.interval,
                                timeout=args.timeout, finish=True)
    summary = json.loads((out / "summary.json").read_text())
    plan = json.loads((out / "plan.json").read_text())
    return {"run": run, "disk_peak": disk.peak, "summary": summary, "plan": plan}


def killed_and_resumed(args, folder: Path, data: Path, out: Path, work: Path, kill_at: str) -> dict:
    cmd = command(args, folder, data, out)
    env = {**os.environ, "JAXASCEND_KILL_AT": kill_at}
    with DiskSampler(work, args.interval) as disk:
        with (work / "killed.log").open("w") as log:
            killed = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout)
        start = time.perf_counter()
        with (work / "resumed.log").open("w") as log:
            resumed = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout)
    text = (work / "resumed.log").read_text()
    return {"kill_at": kill_at, "killed_returncode": killed.returncode, "resumed_returncode": resumed.returncode,
            "resume_line": next((line for line in text.splitlines() if "resuming from" in line), None),
            "resume_seconds": round(time.perf_counter() - start, 1), "disk_peak_bytes": disk.peak,
            "summary": json.loads((out / "summary.json").read_text()) if resumed.returncode == 0 else None}


def main() -> int:
    args = parse_args()
    out_json = Path(args.out)
    if args.replot:
        write_md(json.loads(out_json.read_text()), out_json.with_suffix(".md"))
        return 0
    from jaxascend.config import OffloadConfig
    from jaxascend.hf import preset_config
    from jaxascend.ssd import measure_disk_gbps

    work = Path(args.work_dir)
    shutil.rmtree(work, ignore_errors=True)
    folder, data = work / "model", work / "data.jsonl"
    folder.mkdir(parents=True)
    arch, size = args.preset.split(":")
    (folder / "config.json").write_text(json.dumps(preset_config(arch, size), indent=1))
    data.write_text(json.dumps({"text": RECORD}) + "\n")
    gbps = measure_disk_gbps(OffloadConfig(dir=str(work / "probe")), nbytes=1 << 30)
    print(f"disk: {gbps:.2f} GB/s; free {shutil.disk_usage(work).free / 2**30:.1f} GiB", file=sys.stderr)

    straight = measured_run(args, folder, data, work / "straight", work)
    run, summary, plan = straight["run"], straight["summary"], straight["plan"]
    check = export_check(work / "straight" / "hf", summary["num_params"])
    shutil.rmtree(work / "straight" / "hf")
    steps = per_step(work / "straight" / "metrics.jsonl", plan, gbps)
    # the whole run's peak (the init, the steps, the export): the tree's RSS + page cache, or VmHWM
    hwm = max(s[3] for s in run.samples)
    peak = max(max(s[1] + s[2] for s in run.samples), hwm)
    report = {
        "cpu": platform.processor() or cpu_model(), "config": os.path.relpath(args.config, REPO), "shape": SHAPE,
        "extra": args.extra, "num_params": summary["num_params"], "disk_gbps_measured": round(gbps, 3),
        "planned": {"host_peak_bytes": plan["host_peak"], "disk_bytes": sum(fs["need"] for fs in plan["disk"]),
                    "ssd_bytes_step": plan["ssd_read_step"] + plan["ssd_write_step"], "host": plan["host"]},
        "measured": {"peak_system_bytes": peak, "peak_rss_bytes": max(max(s[1] for s in run.samples), hwm),
                     "peak_page_cache_bytes": max(s[2] for s in run.samples), "peak_in_steps_bytes": run.peak_system,
                     "rss_vs_plan": round(peak / plan["host_peak"] - 1, 4),
                     "disk_peak_bytes": straight["disk_peak"],
                     # the steps with an update beside them (overlapped, the first step runs none)
                     "ssd_bytes_step": statistics.median(s["ssd_read_bytes"] + s["ssd_written_bytes"]
                                                         for s in steps[1:] or steps),
                     "initial_write": summary.get("initial_write"), "wall_seconds": round(run.wall_seconds, 1),
                     "losses": summary["losses"]},
        "steps": steps, "export": check,
    }
    n = summary["num_params"]
    report["bytes_per_param"] = {"host_peak": peak / n, "disk_peak": straight["disk_peak"] / n,
                                 "ssd_step": report["measured"]["ssd_bytes_step"] / n}
    if not args.no_kill:
        kill_at = f"optimizer_chunk:{(k := chunks_per_update(args, folder, data, work / 'killed')) + k // 2}"
        resumed = killed_and_resumed(args, folder, data, work / "killed", work, kill_at)
        if resumed["summary"] is not None:
            again = export_check(work / "killed" / "hf", n)
            resumed["losses_equal"] = resumed["summary"]["losses"] == summary["losses"]
            resumed["export_equal"] = again["digests"] == check["digests"]
            resumed["losses"] = resumed.pop("summary")["losses"]
        report["kill"] = resumed
    out_json.write_text(json.dumps(report, indent=1))
    write_md(report, out_json.with_suffix(".md"))
    print(json.dumps(report, indent=1))
    return 0


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def write_md(report: dict, path: Path) -> None:
    gib = 2**30
    p, m = report["planned"], report["measured"]
    rows = [f"CPU: {report['cpu']}; {report['config']}, {report['num_params']:,} parameters; disk "
            f"{report['disk_gbps_measured']} GB/s measured", "",
            "| | planned | measured |", "|---|---|---|",
            f"| peak host memory (RSS of the tree + page cache) | {p['host_peak_bytes'] / gib:.2f} GiB | "
            f"{m['peak_system_bytes'] / gib:.2f} GiB ({m['rss_vs_plan']:+.1%}) |",
            f"| disk high-water | {p['disk_bytes'] / gib:.2f} GiB | {m['disk_peak_bytes'] / gib:.2f} GiB |",
            f"| SSD bytes a step | {p['ssd_bytes_step'] / gib:.2f} GiB | {m['ssd_bytes_step'] / gib:.2f} GiB |",
            "", "| step | loss | wall s | fwd/bwd s | update s | SSD floor s |", "|---|---|---|---|---|---|"]
    for s in report["steps"]:
        rows.append(f"| {s['step']} | {s['loss']:.4f} | {s['wall_s']} | {s['fwd_bwd_seconds']} | "
                    f"{s['optimizer_seconds']} | {s['ssd_floor_s']} |")
    if "kill" in report:
        k = report["kill"]
        rows += ["", f"kill: {k['kill_at']} -> {k['killed_returncode']}; resumed: {k['resume_line']}; "
                     f"losses equal: {k.get('losses_equal')}; export equal: {k.get('export_equal')}"]
    path.write_text("\n".join(rows) + "\n")


if __name__ == "__main__":
    sys.exit(main())
