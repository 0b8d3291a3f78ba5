"""The training loop: build, restore, loop, checkpoint, report.

``run(cfg)`` reads top to bottom. Host<->device synchronisation happens only where marked
``# SYNC``; everything else is dispatched asynchronously by JAX.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
from pathlib import Path
from typing import Any, Callable, Optional

import jax
import numpy as np
import yaml
from flax import nnx
from jax.experimental import multihost_utils

from jaxascend import console
from jaxascend.checkpoint import Checkpointer, complete_steps
from jaxascend.config import Config, ModelConfig
from jaxascend.distributed import initialize as initialize_distributed
from jaxascend.distributed import job_errors, process_dir
from jaxascend.data import make_batch_stream, tokenizer_folder
from jaxascend.devices import DeviceMonitor, backend_line
from jaxascend.engine_contract import Engine, EngineReport
from jaxascend.hf import HFParamReader
from jaxascend.generation import SamplePrompts
from jaxascend.in_memory_engine import InMemoryEngine
from jaxascend.metrics import MetricsLog, describe_rate, format_bytes, peak_rss_bytes, summary_table
from jaxascend.models import count_params
from jaxascend.offload import (EngineSettings, JobShape, PlannedOffloadEngine, StepPlan, load_model, read_journal,
                               write_timeline_png)
from jaxascend.preparation import PreparedRun, prepare_run
from jaxascend.provenance import RunStack
from jaxascend.provenance import collect as collect_stack
from jaxascend.reporting import Reporter
from jaxascend.resuming import files_point, resume_point, with_schedule
from jaxascend.finishing import finish_from_checkpoint, remove_offload_files, stopped_line
from jaxascend.run_outputs import Provenance, TrainResult, write_samples, write_summary, write_weights
from jaxascend.stopping import StopSignals
from jaxascend.training_loop import LoopSettings, TrainingLoop, tokens_per_step
from jaxascend.ssd import MemorySampler

log = logging.getLogger(__name__)

MasterReader = Callable[[tuple, Optional[int]], np.ndarray]


def build_engine(cfg: Config, model: nnx.Module, model_cfg: ModelConfig, plan: StepPlan,
                 master: Optional[MasterReader] = None, from_files: Optional[int] = None) -> Engine:
    """The offloaded engine (state on SSD) or the in-memory baseline, per ``plan.engine``;
    ``master`` reads the checkpoint's own values for the offloaded fp32 master weights;
    ``from_files``: the step of the offload files a durable run left that is the state. The offloaded engine
    takes typed settings, built here from ``cfg``."""
    if plan.engine == "offload":
        return PlannedOffloadEngine(model, model_cfg, plan, EngineSettings.of(cfg, model_cfg, model), master=master,
                                    from_files=from_files)
    return InMemoryEngine(cfg, model)


@dataclasses.dataclass
class _Run:
    """One invocation's decisions, shared by its phases."""

    cfg: Config
    prepared: PreparedRun
    out_dir: Path
    main: bool  # process 0: it writes the run's outputs
    start: int  # the step resumed from (0: a fresh run)
    group: Any = None  # this process's place in the job (jaxascend.distributed.ProcessGroup)
    origin: Optional[Provenance] = None
    stack: Optional[RunStack] = None  # what made the run (versions, CPU, kernel, devices)
    devices: str = ""  # the run's first line: backend, devices, their memory (process 0's)
    num_params: int = 0
    from_files: bool = False  # durable steps: resumed from the offload files, not a checkpoint
    resumed_meta: Optional[dict] = None  # the resumed step's record (data position, losses)

    @classmethod
    def of(cls, cfg: Config, prepared: PreparedRun, group, stack: RunStack, point) -> "_Run":
        """The run of ``cfg`` in ``group``, starting where ``point`` (a ResumePoint) says."""
        return cls(cfg, prepared, Path(cfg.train.out_dir), group.is_main, point.step, group=group, stack=stack,
                   from_files=point.from_files, resumed_meta=point.meta)

    @property
    def last(self) -> int:
        return self.cfg.train.stop_at_step or self.cfg.train.steps

    @property
    def stopped(self) -> bool:
        """The run ends at train.stop_at_step, before train.steps: a resume point, not a finished run."""
        return self.last < self.cfg.train.steps


def run(cfg: Config) -> TrainResult:
    """Trains ``cfg.train.steps`` optimizer steps and writes metrics and a summary to ``out_dir``."""
    # Join the job (train.distributed, or the JAX_* / SLURM / Open MPI environment): one process
    # unless either asks for more. Every process reads its rows of each global batch and owns
    # 1/P of the SSD state in its own offload directory; process 0 alone writes the run's
    # outputs (metrics, plan, exports). A process that loses its peers stops (JobLostError).
    group = initialize_distributed(cfg.train.distributed)
    with job_errors(group):
        return _run(cfg, group, collect_stack(cfg.optimizer.state_dtype))


def _run(cfg: Config, group, stack: RunStack) -> TrainResult:
    if not group.is_main:
        logging.getLogger("jaxascend").setLevel(logging.ERROR)  # process 0 speaks for the job
    cfg = dataclasses.replace(cfg, offload=dataclasses.replace(cfg.offload, dir=process_dir(cfg.offload.dir, group)))
    # Check: everything the run reads (config.json, tokenizer, data, the weights' names and
    # shapes), and plan: host memory, disk, the step's modes (offload.params resolved). Where the
    # run starts: the checkpoint to resume from (checked), or nothing left to do. A run that
    # cannot fit or run stops here, naming the part; nothing is written before.
    prepared = prepare_run(cfg, JobShape(group.count, group.index, jax.local_device_count()))
    last = prepared.cfg.train.stop_at_step or prepared.cfg.train.steps  # train.steps counted from train.epochs
    point = _start_point(prepared.cfg, group, last)
    if point.step >= last:  # nothing left to train; outputs a kill left unwritten are written
        return finish_from_checkpoint(prepared, point, last, group.is_main, stack.to_dict())
    prepared.resources.check()
    cfg, schedule_notes = with_schedule(prepared.cfg, point)  # a resumed run keeps its recorded schedule
    samples = SamplePrompts.from_config(cfg, prepared.tokenizer, prepared.sized)
    r = _Run.of(cfg, prepared, group, stack, point)
    devices = DeviceMonitor()
    if r.main:  # the backend, the devices and their memory (process 0 speaks for the job); then every
        r.devices = backend_line()  # choice the user did not ask for, and where the run starts
        print(r.devices, flush=True)
        for line in prepared.notes + prepared.step_plan.notes + schedule_notes:
            console.note(line)
        if point.step:
            console.note(point.resume_line())
            changed = stack.resume_note(point.meta.get("stack") or {}, point.step)
            if changed:  # another jax, CPU or kernel: the resumed steps may differ in the last bits
                console.note(changed)
            saved_source = (point.meta.get("origin") or {}).get("model_source")  # the folder it trained from
            moved = prepared.source.resume_note(saved_source, point.step) if prepared.source else None
            if moved:  # a hub id that now resolves to another snapshot than the checkpoint's
                console.note(moved)
    with StopSignals(cfg.train.stop_signals, newest=_what_resumes(cfg, prepared.step_plan, point)) as signals:
        engine = _build(r)
        with engine, Checkpointer(cfg.checkpoint, run_config=cfg) as ckpt, \
                Reporter(cfg.train.report_to, r.out_dir, run_config=cfg.to_dict(), resumed_from=point.step,
                         enabled=r.main) as reporter, \
                MetricsLog(r.out_dir, resumed_from=point.step, enabled=r.main, reporter=reporter) as log, \
                MemorySampler(engine.shard_files, interval=0.2) as memory:
            if r.main:
                (r.out_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
            stream, losses = _restore(r, engine, ckpt, log)
            skipped_before = engine.report().skipped_steps
            loop = TrainingLoop(_loop_settings(r, ckpt), engine, ckpt, log, memory, devices, signals)
            throughput, final_eval = loop.train(stream, losses)
            ckpt.wait()  # SYNC: the last (asynchronous) save is complete before the run reports success
            if not r.stopped:  # a run stopped at train.stop_at_step is a resume point: no final outputs
                _save_and_sample(r, engine, samples, reporter)
            report = engine.report()
            shard_files = engine.shard_files()
            if r.main:
                _write_timeline(engine.timeline(), r.out_dir)
    offload_files = (remove_offload_files(cfg, shard_files, r.last) if prepared.step_plan.engine == "offload"
                     else "none")
    start = point.step
    tokens = (r.last - start) * tokens_per_step(cfg, prepared.step_plan.grad_accum)
    steady = throughput.steady()
    result = TrainResult(steps=len(losses), losses=losses, num_params=r.num_params,
                         peak_rss_bytes=peak_rss_bytes(), peak_page_cache_bytes=memory.peak_page_cache,
                         tokens_per_s=steady.tokens_per_s if steady else None,
                         tokens_per_s_steps=[steady.first, steady.last] if steady else None,
                         tokens_per_s_with_compile=tokens / max(throughput.elapsed(), 1e-9), engine=engine.name,
                         skipped_steps=report.skipped_steps, arena_capacity_bytes=report.arena_capacity_bytes or 0,
                         arena_high_water_bytes=report.arena_high_water_bytes or 0,
                         ssd_bytes_read=report.ssd_read_bytes_steps or 0,
                         ssd_bytes_written=report.ssd_written_bytes_steps or 0,
                         ssd_bytes_first_step=tuple(report.ssd_bytes_first_step or (0, 0)),
                         out_dir=str(r.out_dir), eval_loss=final_eval["eval_loss"] if final_eval else None,
                         data=stream.stats(), updates_this_run=r.last - start - (report.skipped_steps - skipped_before),
                         ssd_bytes_written_run=report.ssd_written_bytes_run or 0,
                         state_dtype=report.state_dtype or "float32", steps_this_run=r.last - start,
                         offload_files=offload_files, stop_at_step=r.last if r.stopped else None,
                         stack=stack.to_dict(), devices=r.devices, peak_device_mem_bytes=devices.peak(),
                         epochs=prepared.epochs.to_dict() if prepared.epochs else None, initial_write=report.initial_write)
    if r.main:
        write_summary(r.out_dir, result)  # last: with its step, it says the run's outputs are complete
        print(_summary(result, report, describe_rate(steady, start + 1), stack.one_line()))
        if r.stopped:
            print(stopped_line(r.last, cfg.train.steps, point.directory), file=console.terminal(), flush=True)
    return result


def _build(r: _Run) -> Engine:
    """The model, loaded tensor by tensor (or initialised lean), and the engine around it;
    creates the output directory and writes ``plan.json``."""
    cfg, prepared = r.cfg, r.prepared
    model_cfg = prepared.model_cfg
    folder = prepared.model_folder  # model.path's folder (a hub id's snapshot in the Hugging Face cache)
    weights = prepared.weights_folder  # None: a random init (from scratch, or model.init: random)
    # The checkpoint's tensors (names, shapes, dtypes) are checked when the reader opens.
    with HFParamReader(weights, model_cfg) if weights else contextlib.nullcontext() as source:
        r.origin = Provenance(prepared.sized, tokenizer_folder(cfg.data.tokenizer, folder), folder,
                              source.source_dtype if source else model_cfg.param_dtype)
        r.out_dir.mkdir(parents=True, exist_ok=True)
        if r.main:
            (r.out_dir / "plan.json").write_text(json.dumps({**prepared.resources.to_dict(),
                                                             "step": prepared.step_plan.describe()}, indent=1))
        # The model as the step's plan needs it (the layer stack left out when it streams from
        # SSD), and where the fp32 master weights start: the checkpoint's own values, not the
        # rounded compute copy.
        loaded = load_model(prepared.step_plan, model_cfg, prepared.sized, cfg.train.seed, source=source)
        r.num_params = count_params(loaded.model)
        # The engine holds what it needs (compute params; master weights on SSD).
        return build_engine(cfg, loaded.model, model_cfg, prepared.step_plan, master=loaded.master,
                            from_files=r.start if r.from_files else None)


def _start_point(cfg: Config, group, last: int):
    """Where the run starts: the checkpoint ``train.resume`` names, or (durable steps) the step the
    offload files hold, where newer (a job's: the latest step every process's files reach)."""
    gather = (lambda values: _gather(values, group)) if group.count > 1 else None
    return files_point(cfg, resume_point(cfg, group.count), last, gather=gather)


def _restore(r: _Run, engine: Engine, ckpt: Checkpointer, log: MetricsLog) -> tuple[Any, list[float]]:
    """The batch stream and the losses so far: from the checkpoint checked at the start
    (``train.resume: auto`` picks the newest), the offload files, or from the beginning."""
    if not r.start:
        return r.prepared.stream, []
    if r.from_files:  # the records a kill cut before the step's update was rolled forward
        log.fill(list(r.resumed_meta["losses"]), r.cfg.train.log_every)
    meta = r.resumed_meta if r.from_files else engine.restore_checkpoint(ckpt, r.start)
    stream = make_batch_stream(r.cfg.data, r.prepared.tokenizer, state=meta["data_state"])
    if r.cfg.train.resume != "auto":
        ckpt.discard_after(r.start)  # an explicit earlier step replaces the later ones
    return stream, list(meta["losses"])


def _loop_settings(r: _Run, ckpt: Checkpointer) -> LoopSettings:
    return LoopSettings(r.cfg, r.start, r.last, r.main, r.prepared.held_out, r.origin.to_dict(),
                        agree=lambda values: _agree(values, r.group), checkpoint_dir=str(ckpt.directory),
                        stack=r.stack.to_dict(), micro_batches=r.prepared.step_plan.grad_accum,
                        durable_dir=r.cfg.offload.dir if r.prepared.step_plan.durable else None)


def _gather(values: list[int], group) -> list[list[int]]:
    """Every process's ``values`` (a few integers), in process order."""
    gathered = multihost_utils.process_allgather(np.asarray(values, np.int32))  # SYNC: every process
    return np.asarray(gathered).reshape(group.count, -1).tolist()


def _agree(values: list[int], group) -> list[int]:
    """The element-wise max of ``values`` over the job's processes (a few bytes; one process: itself)."""
    if group.count == 1:
        return values
    gathered = multihost_utils.process_allgather(np.asarray(values, np.int32))  # SYNC: every process
    return [int(v) for v in np.max(np.asarray(gathered).reshape(group.count, -1), axis=0)]


def _newest_checkpoint(directory: Path) -> str:
    steps = complete_steps(directory) if directory.exists() else []
    return f"checkpoint {steps[-1]} in {directory}" if steps else f"no checkpoint in {directory} (a fresh start)"


def _what_resumes(cfg: Config, plan: StepPlan, point) -> Callable[[], str]:
    """What the line of a second SIGINT names: the step the offload files hold (durable steps),
    else the newest complete checkpoint."""
    return (lambda: _newest_in_files(cfg)) if plan.durable else (lambda: _newest_checkpoint(point.directory))


def _newest_in_files(cfg: Config) -> str:
    """Durable steps: the step the offload files hold (what the same command resumes from)."""
    record = read_journal(cfg.offload.dir)
    step = record.held()[0] if record is not None else -1
    return f"step {step} held by the offload files in {cfg.offload.dir}" if step > 0 else \
        f"no step in the offload files in {cfg.offload.dir} (a fresh start)"


def _save_and_sample(r: _Run, engine: Engine, samples: Optional[SamplePrompts], reporter: Reporter) -> None:
    """The run's weights (``params.safetensors``, an export) and its answers to ``eval.sample_prompts``
    (``samples.json``, the terminal, and TensorBoard / W&B as text)."""
    cfg = r.cfg
    engine.end_training()  # the gradients' disk space is free for what is written next
    if cfg.export.save_params or cfg.export.enabled:  # fp32 master weights, one tensor at a time
        with engine.exported_weights() as weights:  # a job's other processes serve their slices
            if weights is not None:
                write_weights(cfg, r.out_dir, weights, r.origin, r.last)
    if samples is not None:  # the trained model answers eval.sample_prompts (on process 0)
        with engine.sampled_weights() as weights:  # a job's other processes serve their slices
            if weights is not None:
                results = samples.generate(r.origin.model_config, weights, r.prepared.tokenizer,
                                           stream_layers=engine.streams_layers)
                write_samples(results, r.out_dir)
                reporter.samples(results, r.last)

def _write_timeline(data: Optional[dict], out_dir: Path) -> None:
    """The last update's timeline (which thread did what, when): timeline.json, and timeline.png
    when matplotlib is installed."""
    if data is None:
        return
    (out_dir / "timeline.json").write_text(json.dumps(data, indent=1))
    if not write_timeline_png(data, out_dir / "timeline.png"):
        console.note("timeline.png not drawn: matplotlib is not installed (timeline.json has the events)")


def _ssd_per_step(r: TrainResult) -> str:
    """A step's SSD traffic: over this run's steps after its first (whose forward had no update
    beside it, and whose own update runs in the next step's) where there are more, else the first's."""
    read, written, steps, which = r.ssd_bytes_read, r.ssd_bytes_written, max(r.steps_this_run, 1), ""
    if r.steps_this_run > 1:
        read, written, steps = read - r.ssd_bytes_first_step[0], written - r.ssd_bytes_first_step[1], steps - 1
        which = "; this run's steps after its first"
    return (f"{format_bytes(read / steps)} / {format_bytes(written / steps)} "
            f"({(read + written) / steps / r.num_params:.1f} B/param, {r.state_dtype} moments{which})")


def _summary(r: TrainResult, report: EngineReport, rate: str, stack: str) -> str:
    processes, devices = report.data_parallel_processes, report.data_parallel_devices
    rows = [
        ("engine", r.engine + (f" (data parallel over {processes} processes"
                               + (f" x {devices // processes} devices" if devices > processes else "")
                               + "; figures of process 0)" if processes > 1
                               else f" (data parallel over {devices} devices)" if devices > 1 else "")),
        ("steps (skipped for overflow)", f"{r.steps} ({r.skipped_steps})"
                                         + (f", train.epochs {r.epochs['epochs']:g}" if r.epochs else "")
                                         + (f", stopped at train.stop_at_step {r.stop_at_step}" if r.stop_at_step else "")),
        ("parameters", f"{r.num_params:,}"),
        ("loss first -> last", f"{r.losses[0]:.4f} -> {r.losses[-1]:.4f}"),
        *([("held-out loss (perplexity)", f"{r.eval_loss:.4f} ({math.exp(min(r.eval_loss, 700.0)):.2f})")]
          if r.eval_loss is not None else []),
        ("tokens/s", rate),
        ("peak host memory (RSS)", f"{format_bytes(r.peak_rss_bytes)} ({r.peak_rss_bytes / r.num_params:.1f} B/param)"),
        ("peak page cache of offload files", format_bytes(r.peak_page_cache_bytes)),
        *([("peak device memory", format_bytes(r.peak_device_mem_bytes))] if r.peak_device_mem_bytes is not None
          else []),
    ]
    if r.engine == "offload":
        rows += [
            ("arena capacity / high-water", f"{format_bytes(r.arena_capacity_bytes)} / "
                                            f"{format_bytes(r.arena_high_water_bytes)}"),
            ("SSD read / written per step", _ssd_per_step(r)),
            ("SSD written this run (endurance)", format_bytes(r.ssd_bytes_written_run)),
            ("offload files", r.offload_files),
        ]
        if r.initial_write:  # the offload files' initial state (not written when resumed from them)
            w = r.initial_write
            rows.append(("initial state written", f"{format_bytes(w['bytes'])} in {w['seconds']:.1f} s "
                                                  f"({w['gbps']:.2f} GB/s)"))
    rows.append(("outputs", r.out_dir))
    rows.append(("made by", stack))
    return summary_table(rows)
