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
import time
from pathlib import Path
from typing import Any, Callable, Optional

import jax
import numpy as np
import optax
import yaml
from flax import nnx

from jaxascend import console
from jaxascend.checkpoint import Checkpointer, check_resume_partition, resume_target
from jaxascend.config import Config, ModelConfig
from jaxascend.distributed import initialize as initialize_distributed
from jaxascend.distributed import job_errors, process_dir
from jaxascend.data import make_batch_stream, tokenizer_folder
from jaxascend.engine_contract import Engine, EngineReport, StepResult
from jaxascend.hf import (NO_TOKENIZER_NOTE, HFParamReader, build_model_lean, export_hf, lean_init_reader,
                          load_hf_model, save_params)
from jaxascend.generation import SamplePrompts
from jaxascend.in_memory_engine import InMemoryEngine
from jaxascend.metrics import MetricsLog, Progress, Throughput, format_bytes, peak_rss_bytes, summary_table
from jaxascend.models import TokenBatch, count_params, token_batch
from jaxascend.offload import JobShape, OffloadEngine, StepPlan, write_timeline_png
from jaxascend.optim import learning_rate_schedule
from jaxascend.preparation import PreparedRun, prepare_run
from jaxascend.ssd import MemorySampler

log = logging.getLogger(__name__)

MasterReader = Callable[[tuple, Optional[int]], np.ndarray]


@dataclasses.dataclass
class TrainResult:
    """What a finished run hands back (also written to ``<out_dir>/summary.json``)."""

    steps: int
    losses: list[float]  # one per optimizer step
    num_params: int
    peak_rss_bytes: int
    peak_page_cache_bytes: int  # page cache held by the offload files (buffered I/O hides memory there)
    tokens_per_s: float
    engine: str  # "in-memory" or "offload"
    skipped_steps: int  # overflowed steps (fp16), state untouched
    arena_capacity_bytes: int
    arena_high_water_bytes: int
    ssd_bytes_read: int
    ssd_bytes_written: int
    out_dir: str
    eval_loss: Optional[float] = None  # the held-out loss at the end (None: no eval.paths)
    data: dict = dataclasses.field(default_factory=dict)  # examples seen / truncated / dropped
    updates_this_run: int = 0  # updates applied by this invocation (a resumed run counts from its checkpoint)
    # Everything this invocation wrote to the offload files (init or restore, every step, the
    # gradients included): the SSD endurance cost of the run. 0 for the in-memory engine.
    ssd_bytes_written_run: int = 0
    steps_this_run: int = 0  # steps this invocation ran (skipped ones included)
    state_dtype: str = "float32"  # how the optimizer's moments were stored (optimizer.state_dtype)


@dataclasses.dataclass(frozen=True)
class Provenance:
    """Where a run's weights came from: what an export (now or from a checkpoint later) needs
    beyond the weights. Saved with every checkpoint and in ``params.safetensors``."""

    model_config: ModelConfig  # resolved, vocab_size filled in
    tokenizer: str | None  # the tokenizer folder (None: the byte tokenizer)
    model_source: str | None  # the Hugging Face folder the run fine-tunes (None: from scratch)
    source_dtype: str  # that checkpoint's dtype, or model.param_dtype from scratch

    def export_dtype(self, dtype: str) -> str:
        """``export.dtype`` with ``"source"`` resolved."""
        return self.source_dtype if dtype == "source" else dtype

    def to_dict(self) -> dict:
        return {"model_config": dataclasses.asdict(self.model_config), "tokenizer": self.tokenizer,
                "model_source": self.model_source, "source_dtype": self.source_dtype}


def save_outputs(cfg: Config, out_dir: Path, params, origin: Provenance, step: int) -> None:
    """The run's weights after ``step``: ``params.safetensors`` (exportable later) and, if asked,
    a HF folder."""
    if cfg.export.save_params:
        save_params(out_dir / "params.safetensors", params, origin.model_config, tokenizer=origin.tokenizer,
                    model_source=origin.model_source, source_dtype=origin.source_dtype, step=step)
    if cfg.export.enabled:
        export_hf(params, origin.model_config, cfg.export.dir or out_dir / "hf", tokenizer_src=origin.tokenizer,
                  dtype=origin.export_dtype(cfg.export.dtype), shard_bytes=cfg.export.shard_bytes,
                  model_src=origin.model_source)
        if origin.tokenizer is None:
            console.note(NO_TOKENIZER_NOTE)


def step_batch(micro_batches: list) -> TokenBatch:
    """One optimizer step's :class:`TokenBatch` ``[A, ...]`` from its ``A`` micro-batches: plain
    token rows (``data.format: text``, every target counts) or packed examples (loss mask,
    segment ids, positions). The weights are the step's per-token mean (models.losses)."""
    if isinstance(micro_batches[0], np.ndarray):
        return token_batch(np.stack(micro_batches))
    return token_batch(*(np.stack(parts) for parts in zip(*micro_batches)))


def evaluate(engine: Engine, batches: list[TokenBatch]) -> dict[str, float]:
    """The held-out loss (per-token mean over the counted targets, as in training), its
    perplexity and the tokens it counted, on the engine's compute params."""
    started = time.perf_counter()
    loss_sum, count = engine.evaluate(batches)
    loss = loss_sum / max(count, 1)
    return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 700.0)), "eval_tokens": count,
            "eval_seconds": time.perf_counter() - started}


def build_engine(cfg: Config, model: nnx.Module, model_cfg: ModelConfig, plan: StepPlan,
                 master: Optional[MasterReader] = None) -> Engine:
    """The offloaded engine (state on SSD) or the in-memory baseline, per ``plan.engine``;
    ``master`` reads the checkpoint's own values for the offloaded fp32 master weights."""
    if plan.engine == "offload":
        return OffloadEngine(cfg, model, model_cfg, plan, master=master)
    return InMemoryEngine(cfg, model)


@dataclasses.dataclass
class _Run:
    """One invocation's decisions, shared by its phases."""

    cfg: Config
    prepared: PreparedRun
    out_dir: Path
    main: bool  # process 0: it writes the run's outputs
    start: int  # the step resumed from (0: a fresh run)
    origin: Optional[Provenance] = None
    num_params: int = 0

    @property
    def streamed(self) -> bool:
        return self.prepared.step.engine == "offload" and self.prepared.step.weights == "ssd"

    @property
    def last(self) -> int:
        return self.cfg.train.stop_at_step or self.cfg.train.steps


def run(cfg: Config) -> TrainResult:
    """Trains ``cfg.train.steps`` optimizer steps and writes metrics and a summary to ``out_dir``."""
    # Join the job (train.distributed, or the JAX_* / SLURM / Open MPI environment): one process
    # unless either asks for more. Every process reads its rows of each global batch and owns
    # 1/P of the SSD state in its own offload directory; process 0 alone writes the run's
    # outputs (metrics, plan, exports). A process that loses its peers stops (JobLostError).
    group = initialize_distributed(cfg.train.distributed)
    with job_errors(group):
        return _run(cfg, group)


def _run(cfg: Config, group) -> TrainResult:
    if not group.is_main:
        logging.getLogger("jaxascend").setLevel(logging.ERROR)  # process 0 speaks for the job
    cfg = dataclasses.replace(cfg, offload=dataclasses.replace(cfg.offload, dir=process_dir(cfg.offload.dir, group)))
    # Check: everything the run reads (config.json, tokenizer, data, the weights' names and
    # shapes, the checkpoint to resume from), and plan: host memory, disk, the step's modes.
    # A run that cannot fit or run stops here, naming the part; nothing is written before.
    prepared = prepare_run(cfg, JobShape(group.count, group.index, jax.local_device_count()))
    prepared.plan.check()
    cfg = prepared.cfg
    samples = SamplePrompts.from_config(cfg, prepared.tokenizer, prepared.sized)
    start = resume_target(cfg.checkpoint, cfg, cfg.train.resume) or 0
    if start:
        check_resume_partition(cfg.checkpoint, cfg, start, group.count)
    r = _Run(cfg, prepared, Path(cfg.train.out_dir), group.is_main, start)
    if r.main:
        for line in prepared.step.notes:  # every choice the user did not ask for
            console.note(line)
    engine = _build(r)
    with engine, Checkpointer(cfg.checkpoint, run_config=cfg) as ckpt, \
            MetricsLog(r.out_dir, resumed_from=start, enabled=r.main) as log, \
            MemorySampler(engine.shard_files, interval=0.2) as memory:
        if r.main:
            (r.out_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        stream, losses = _restore(r, engine, ckpt)
        skipped_before = engine.report().skipped_steps
        throughput, final_eval = _train(r, engine, ckpt, log, memory, stream, losses)
        ckpt.wait()  # SYNC: the last (asynchronous) save is complete before the run reports success
        _save_and_sample(r, engine, samples)
        report = engine.report()
        if r.main:
            _write_timeline(engine.timeline(), r.out_dir)
    tokens = (r.last - start) * _tokens_per_step(cfg)
    result = TrainResult(steps=len(losses), losses=losses, num_params=r.num_params,
                         peak_rss_bytes=peak_rss_bytes(), peak_page_cache_bytes=memory.peak_page_cache,
                         tokens_per_s=tokens / max(throughput.elapsed(), 1e-9), engine=engine.name,
                         skipped_steps=report.skipped_steps,
                         arena_capacity_bytes=report.arena_capacity_bytes or 0,
                         arena_high_water_bytes=report.arena_high_water_bytes or 0,
                         ssd_bytes_read=report.ssd_read_bytes_steps or 0,
                         ssd_bytes_written=report.ssd_written_bytes_steps or 0,
                         out_dir=str(r.out_dir), eval_loss=final_eval["eval_loss"] if final_eval else None,
                         data=stream.stats(), updates_this_run=r.last - start - (report.skipped_steps - skipped_before),
                         ssd_bytes_written_run=report.ssd_written_bytes_run or 0,
                         state_dtype=report.state_dtype or "float32", steps_this_run=r.last - start)
    if r.main:
        (r.out_dir / "summary.json").write_text(json.dumps(dataclasses.asdict(result), indent=1))
        print(_summary(result, report))
    return result


def _tokens_per_step(cfg: Config) -> int:
    return cfg.train.grad_accum * cfg.data.batch_size * cfg.data.seq_len


def _build(r: _Run) -> Engine:
    """The model, loaded tensor by tensor (or initialised lean), and the engine around it;
    creates the output directory and writes ``plan.json``."""
    cfg, prepared = r.cfg, r.prepared
    model_cfg = prepared.model_cfg
    # The checkpoint's tensors (names, shapes, dtypes) are checked when the reader opens.
    with HFParamReader(cfg.model.path, model_cfg) if cfg.model.path else contextlib.nullcontext() as source:
        r.origin = Provenance(prepared.sized, tokenizer_folder(cfg.data.tokenizer, cfg.model.path), cfg.model.path,
                              source.source_dtype if source else model_cfg.param_dtype)
        r.out_dir.mkdir(parents=True, exist_ok=True)
        if r.main:
            (r.out_dir / "plan.json").write_text(json.dumps({**prepared.plan.to_dict(),
                                                             "step": prepared.step.describe()}, indent=1))
        # Streamed weights (offload.params: ssd): the layer stack is never loaded whole; the
        # engine reads it layer by layer into the SSD regions (with the master weights).
        if source is not None:
            model = load_hf_model(cfg.model.path, model_cfg, layer_stack=not r.streamed)  # tensor by tensor
        else:
            model = build_model_lean(model_cfg, prepared.sized.vocab_size, cfg.train.seed, layer_stack=not r.streamed)
        r.num_params = count_params(model)
        # fp32 master weights from the checkpoint's own values, not from the rounded compute copy.
        master = source.read if source else (lean_init_reader(r.origin.model_config, cfg.train.seed)
                                             if r.streamed else None)
        # The engine holds what it needs (compute params; master weights on SSD).
        return build_engine(cfg, model, model_cfg, prepared.step, master=master)


def _restore(r: _Run, engine: Engine, ckpt: Checkpointer) -> tuple[Any, list[float]]:
    """The batch stream and the losses so far: from the checkpoint checked at the start
    (``train.resume: auto`` picks the newest), or from the beginning."""
    if not r.start:
        return r.prepared.stream, []
    meta = engine.restore_checkpoint(ckpt, r.start)
    stream = make_batch_stream(r.cfg.data, r.prepared.tokenizer, state=meta["data_state"])
    if r.cfg.train.resume != "auto":
        ckpt.discard_after(r.start)  # an explicit earlier step replaces the later ones
    return stream, list(meta["losses"])


def _train(r: _Run, engine: Engine, ckpt: Checkpointer, log: MetricsLog, memory: MemorySampler, stream,
           losses: list[float]) -> tuple[Throughput, Optional[dict]]:
    """The loop: a step per batch; every ``log_every`` steps (and at an evaluation or a
    checkpoint) the steps' figures come to the host and are written. Extends ``losses``."""
    cfg, held_out = r.cfg, r.prepared.held_out
    schedule = learning_rate_schedule(cfg.optimizer, cfg.train.steps)
    pending: list[StepResult] = []
    throughput = Throughput()
    progress = Progress(cfg.train.steps, initial=r.start, enabled=cfg.train.progress and r.main)
    final_eval = None
    for step in range(r.start + 1, r.last + 1):
        batch = step_batch([next(stream) for _ in range(cfg.train.grad_accum)])
        pending.append(engine.step(batch))
        throughput.add(_tokens_per_step(cfg))
        evaluating = bool(held_out) and (step == r.last or (cfg.eval.every_steps > 0
                                                            and step % cfg.eval.every_steps == 0))
        saving = ckpt.should_save(step, r.last)
        if step % cfg.train.log_every and step != r.last and not saving and not evaluating:
            progress.update(1)
            continue
        fetched = [result.fetched() for result in pending]  # SYNC: waits for the steps dispatched since the last log
        pending.clear()
        losses.extend(result.loss for result in fetched)
        record = _log_record(step, fetched[-1], schedule, throughput, stream, engine, memory)
        if evaluating:  # SYNC: the held-out loss on the weights after this step's update
            final_eval = evaluate(engine, held_out)
            record.update(final_eval)
        log.write(record)
        progress.update(1, record)
        if saving:
            engine.save_checkpoint(ckpt, step, {"data_state": stream.state(), "losses": losses,
                                                "origin": r.origin.to_dict()})
    progress.close()
    return throughput, final_eval


def _save_and_sample(r: _Run, engine: Engine, samples: Optional[SamplePrompts]) -> None:
    """The run's weights (``params.safetensors``, an export) and its answers to ``eval.sample_prompts``."""
    cfg = r.cfg
    if cfg.export.save_params or cfg.export.enabled:  # fp32 master weights, one tensor at a time
        with engine.exported_weights() as weights:  # a job's other processes serve their slices
            if weights is not None:
                save_outputs(cfg, r.out_dir, weights, r.origin, r.last)
    if samples is not None:  # the trained model answers eval.sample_prompts (on process 0)
        with engine.sampled_weights() as weights:  # a job's other processes serve their slices
            if weights is not None:
                _write_samples(samples.generate(r.origin.model_config, weights, r.prepared.tokenizer,
                                                stream_layers=r.streamed), r.out_dir)

def _write_timeline(data: Optional[dict], out_dir: Path) -> None:
    """The last update's timeline (which thread did what, when): timeline.json, and timeline.png
    when matplotlib is installed."""
    if data is None:
        return
    (out_dir / "timeline.json").write_text(json.dumps(data, indent=1))
    if not write_timeline_png(data, out_dir / "timeline.png"):
        console.note("timeline.png not drawn: matplotlib is not installed (timeline.json has the events)")


def _write_samples(results: list[dict], out_dir: Path) -> None:
    """``samples.json``, and each prompt with its answer on the terminal."""
    (out_dir / "samples.json").write_text(json.dumps(results, indent=1, ensure_ascii=False))
    for r in results:
        print(f"> {r['prompt']}\n{r['completion']}")


def _log_record(step: int, result: StepResult, schedule: optax.Schedule, throughput: Throughput,
                stream, engine: Engine, memory: MemorySampler) -> dict[str, Any]:
    sample = memory.sample()
    report = engine.report()
    updates = step - 1 - report.skipped_steps
    return {
        "step": step,
        "loss": result.loss,
        "grad_norm": result.grad_norm,
        # The schedule is evaluated at the count used for this step's update (0-based).
        "learning_rate": float(schedule(updates)),
        "tokens_per_s": throughput.rate(),
        "elapsed_s": throughput.elapsed(),
        "rss_bytes": sample.rss,
        "peak_rss_bytes": peak_rss_bytes(),
        "page_cache_bytes": sample.page_cache,
        "peak_page_cache_bytes": memory.peak_page_cache,
        "data_state": stream.state(),
        **{f"data_{k}": v for k, v in stream.stats().items()},
        **report.record(),
        **{k: v for k, v in result.record().items() if k not in ("loss", "grad_norm")},
    }


def _summary(r: TrainResult, report: EngineReport) -> str:
    processes, devices = report.data_parallel_processes, report.data_parallel_devices
    rows = [
        ("engine", r.engine + (f" (data parallel over {processes} processes; figures of process 0)" if processes > 1
                               else f" (data parallel over {devices} devices)" if devices > 1 else "")),
        ("steps (skipped for overflow)", f"{r.steps} ({r.skipped_steps})"),
        ("parameters", f"{r.num_params:,}"),
        ("loss first -> last", f"{r.losses[0]:.4f} -> {r.losses[-1]:.4f}"),
        *([("held-out loss (perplexity)", f"{r.eval_loss:.4f} ({math.exp(min(r.eval_loss, 700.0)):.2f})")]
          if r.eval_loss is not None else []),
        ("tokens/s", f"{r.tokens_per_s:,.0f}"),
        ("peak host memory (RSS)", f"{format_bytes(r.peak_rss_bytes)} ({r.peak_rss_bytes / r.num_params:.1f} B/param)"),
        ("peak page cache of offload files", format_bytes(r.peak_page_cache_bytes)),
    ]
    if r.engine == "offload":
        rows += [
            ("arena capacity / high-water", f"{format_bytes(r.arena_capacity_bytes)} / "
                                            f"{format_bytes(r.arena_high_water_bytes)}"),
            ("SSD read / written per step", f"{format_bytes(r.ssd_bytes_read / max(r.steps_this_run, 1))} / "
                                            f"{format_bytes(r.ssd_bytes_written / max(r.steps_this_run, 1))} "
                                            f"({(r.ssd_bytes_read + r.ssd_bytes_written) / max(r.steps_this_run, 1) / r.num_params:.1f} "
                                            f"B/param, {r.state_dtype} moments)"),
            ("SSD written this run (endurance)", format_bytes(r.ssd_bytes_written_run)),
        ]
    rows.append(("outputs", r.out_dir))
    return summary_table(rows)
