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
from typing import Any, Optional

import jax
import numpy as np
import optax
import yaml
from flax import nnx

from jaxascend import console
from jaxascend.checkpoint import Checkpointer, check_resume_partition, resume_target
from jaxascend.config import Config, ConfigError, ModelConfig
from jaxascend.distributed import initialize as initialize_distributed
from jaxascend.distributed import job_errors, process_dir
from jaxascend.data import eval_batches, load_tokenizer, make_batch_stream, tokenizer_folder
from jaxascend.hf import (NO_TOKENIZER_NOTE, HFParamReader, build_model_lean, export_hf, lean_init_reader,
                          load_hf_model, model_config_from_hf, save_params)
from jaxascend.generation import SamplePrompts
from jaxascend.in_memory_engine import InMemoryEngine
from jaxascend.metrics import MetricsLog, Progress, Throughput, format_bytes, peak_rss_bytes, summary_table
from jaxascend.models import TokenBatch, count_params, token_batch
from jaxascend.offload import OffloadEngine, Partition, partition_refusal
from jaxascend.offload import resolve as plan_resolve
from jaxascend.offload.timeline import write_timeline_png
from jaxascend.optim import learning_rate_schedule
from jaxascend.ssd import MemorySampler

log = logging.getLogger(__name__)


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


def resolve_model_config(cfg: Config) -> ModelConfig:
    """``cfg.model``, or the architecture read from ``model.path``'s config.json with the run's
    numerics (dtype, param_dtype, remat) on top."""
    if cfg.model.path is None:
        return cfg.model
    model_cfg = model_config_from_hf(cfg.model.path, base=cfg.model)
    if cfg.data.seq_len > model_cfg.max_position_embeddings:
        raise ConfigError(f"data.seq_len: {cfg.data.seq_len} exceeds the model's max_position_embeddings="
                          f"{model_cfg.max_position_embeddings} ({cfg.model.path}/config.json)")
    return model_cfg


def vocabulary_size(cfg: Config, model_cfg: ModelConfig, tokenizer) -> int:
    """The embedding rows: the model's vocabulary (config.json or model.vocab_size), or the
    tokenizer's for a model from scratch; refuses a tokenizer whose ids do not fit the model."""
    vocab_size = model_cfg.vocab_size or tokenizer.vocab_size
    if vocab_size < tokenizer.vocab_size:
        where = f"{cfg.model.path}/config.json" if cfg.model.path else "model.vocab_size"
        raise ConfigError(f"data.tokenizer: {cfg.data.tokenizer!r} has {tokenizer.vocab_size} tokens but the model "
                          f"has {vocab_size} ({where}); its ids would not fit the embedding")
    return vocab_size


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


def held_out_batches(cfg: Config, tokenizer) -> list[TokenBatch]:
    """The evaluation's batches (``eval.paths`` read like ``data.paths``; ``eval.batches`` of
    them, or all), tokenized once, before anything is written: a malformed held-out record
    stops the run at the start. Empty without ``eval.paths``."""
    if not cfg.eval.paths:
        return []
    data = dataclasses.replace(cfg.data, paths=list(cfg.eval.paths), max_documents=None,
                               batch_size=cfg.eval.batch_size or cfg.data.batch_size)
    try:
        batches = [token_batch(*b) for b in eval_batches(data, tokenizer, cfg.eval.batches)]
    except ValueError as err:
        raise ValueError(f"eval.paths: {err}") from None
    if not batches or not any(b.weights.any() for b in batches):
        raise ValueError(f"eval.paths: {cfg.eval.paths} hold no token to evaluate on")
    return batches


def evaluate(engine, batches: list[TokenBatch]) -> dict[str, float]:
    """The held-out loss (per-token mean over the counted targets, as in training), its
    perplexity and the tokens it counted, on the engine's compute params."""
    started = time.perf_counter()
    loss_sum, count = engine.evaluate(batches)
    loss = loss_sum / max(count, 1)
    return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 700.0)), "eval_tokens": count,
            "eval_seconds": time.perf_counter() - started}


def data_parallel_partition(cfg: Config, model_cfg: ModelConfig, group) -> Optional[Partition]:
    """This process's share of a data-parallel offloaded run: its partition of the state in a
    job of processes (:func:`check_job` has refused what it cannot run), ``Partition(0, 1)`` for
    one process with several devices (they share the rows; the process owns the whole state),
    None for one device, or when the run is one the devices cannot share (noted)."""
    if not cfg.offload.enabled:
        return None
    if group.count > 1:
        return Partition(group.index, group.count)
    devices = jax.local_device_count()
    if devices == 1:
        return None
    why = partition_refusal(cfg, model_cfg, one_process=True) or _rows_refusal(cfg, devices, f"the {devices} devices")
    if why:
        log.warning("data parallel over this process's %d devices is off, the step runs on the first: %s", devices, why)
        return None
    return Partition(0, 1)


def _rows_refusal(cfg: Config, shards: int, what: str) -> Optional[str]:
    for name, rows in (("data.batch_size", cfg.data.batch_size), ("eval.batch_size", cfg.eval.batch_size)):
        if rows and rows % shards:
            return f"{name}: {rows} rows do not split evenly over {what}"
    return None


def build_engine(cfg: Config, model: nnx.Module, model_cfg: ModelConfig, master=None, partition=None):
    """The offloaded engine (state on SSD) or the in-memory baseline, per ``offload.enabled``;
    ``master`` reads the checkpoint's own values for the offloaded fp32 master weights;
    ``partition``: data parallel (:func:`data_parallel_partition`)."""
    if cfg.offload.enabled:
        return OffloadEngine(cfg, model, model_cfg, master=master, partition=partition)
    return InMemoryEngine(cfg, model)


def check_job(cfg: Config, model_cfg: ModelConfig, count: int) -> None:
    """Refuses, before anything is written, what a job of ``count`` processes cannot run: the
    in-memory engine, a batch whose rows do not split evenly, what the data-parallel engine
    does not support yet (:func:`~jaxascend.offload.engine.partition_refusal`)."""
    if count == 1:
        return
    where = f"train.distributed: this job has {count} processes"
    if not cfg.offload.enabled:
        raise ConfigError(f"{where}; data parallelism partitions the SSD state (offload.enabled: true), the "
                          "in-memory engine runs one process")
    uneven = _rows_refusal(cfg, count, f"the job's {count} processes")
    if uneven:
        raise ConfigError(uneven)
    refused = partition_refusal(cfg, model_cfg)
    if refused:
        raise ConfigError(f"{where}; {refused}")


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
    main = group.is_main
    if not main:
        logging.getLogger("jaxascend").setLevel(logging.ERROR)  # process 0 speaks for the job
    cfg = dataclasses.replace(cfg, offload=dataclasses.replace(cfg.offload, dir=process_dir(cfg.offload.dir, group)))
    out_dir = Path(cfg.train.out_dir)

    # Check: everything the run reads (config.json, tokenizer, data, the weights' names and
    # shapes, the checkpoint to resume from), before anything is written.
    model_cfg = resolve_model_config(cfg)
    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.model.path)
    stream = make_batch_stream(cfg.data, tokenizer)
    held_out = held_out_batches(cfg, tokenizer)
    vocab_size = vocabulary_size(cfg, model_cfg, tokenizer)
    # Plan: host memory, disk; offload.params auto -> resident or ssd. A run that cannot fit
    # the budget or the disk stops here, naming the part and by how much.
    sized = dataclasses.replace(model_cfg, vocab_size=vocab_size)
    cfg, plan = plan_resolve(cfg, sized)
    plan.check()
    check_job(cfg, sized, group.count)
    partition = data_parallel_partition(cfg, sized, group)
    samples = SamplePrompts.from_config(cfg, tokenizer, sized)
    streamed = cfg.offload.enabled and cfg.offload.params == "ssd"
    start = resume_target(cfg.checkpoint, cfg, cfg.train.resume) or 0
    if start:
        check_resume_partition(cfg.checkpoint, cfg, start, group.count)
    # The checkpoint's tensors (names, shapes, dtypes) are checked when the reader opens.
    with HFParamReader(cfg.model.path, model_cfg) if cfg.model.path else contextlib.nullcontext() as source:
        origin = Provenance(sized,
                            tokenizer_folder(cfg.data.tokenizer, cfg.model.path), cfg.model.path,
                            source.source_dtype if source else model_cfg.param_dtype)

        # Build: model, engine (optimizer state in RAM or on SSD).
        out_dir.mkdir(parents=True, exist_ok=True)
        if main:
            (out_dir / "plan.json").write_text(json.dumps(plan.to_dict(), indent=1))
        # Streamed weights (offload.params: ssd): the layer stack is never loaded whole; the
        # engine reads it layer by layer into the SSD regions (with the master weights).
        if source is not None:
            model = load_hf_model(cfg.model.path, model_cfg, layer_stack=not streamed)  # tensor by tensor
        else:
            model = build_model_lean(model_cfg, vocab_size, cfg.train.seed, layer_stack=not streamed)
        num_params = count_params(model)
        # fp32 master weights from the checkpoint's own values, not from the rounded compute copy.
        master = source.read if source else (lean_init_reader(origin.model_config, cfg.train.seed)
                                             if streamed else None)
        engine = build_engine(cfg, model, model_cfg, master=master, partition=partition)
        del model  # the engine holds what it needs (compute params; master weights on SSD)
    schedule = learning_rate_schedule(cfg.optimizer, cfg.train.steps)
    tokens_per_step = cfg.train.grad_accum * cfg.data.batch_size * cfg.data.seq_len

    with engine, Checkpointer(cfg.checkpoint, run_config=cfg) as ckpt, \
            MetricsLog(out_dir, resumed_from=start, enabled=main) as log, \
            MemorySampler(getattr(engine, "shard_files", list), interval=0.2) as memory:
        if main:
            (out_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        # Restore: the checkpoint checked above (train.resume: auto picks the newest).
        if start:
            meta = engine.restore_checkpoint(ckpt, start)
            stream = make_batch_stream(cfg.data, tokenizer, state=meta["data_state"])
            losses = list(meta["losses"])
            if cfg.train.resume != "auto":
                ckpt.discard_after(start)  # an explicit earlier step replaces the later ones
        else:
            losses = []
        skipped_before = int(engine.report().get("skipped_steps", 0))

        # Loop.
        pending: list[dict[str, Any]] = []
        throughput = Throughput()
        progress = Progress(cfg.train.steps, initial=start, enabled=cfg.train.progress and main)
        last = cfg.train.stop_at_step or cfg.train.steps
        final_eval = None
        for step in range(start + 1, last + 1):
            batch = step_batch([next(stream) for _ in range(cfg.train.grad_accum)])
            pending.append(engine.step(batch))
            throughput.add(tokens_per_step)
            evaluating = bool(held_out) and (step == last or (cfg.eval.every_steps > 0
                                                              and step % cfg.eval.every_steps == 0))
            if step % cfg.train.log_every and step != last and not ckpt.should_save(step, last) \
                    and not evaluating:
                progress.update(1)
                continue
            fetched = jax.device_get(pending)  # SYNC: waits for the steps dispatched since the last log
            pending.clear()
            losses.extend(float(s["loss"]) for s in fetched)
            record = _log_record(step, fetched[-1], schedule, throughput, stream, engine, memory)
            if evaluating:  # SYNC: the held-out loss on the weights after this step's update
                final_eval = evaluate(engine, held_out)
                record.update(final_eval)
            log.write(record)
            progress.update(1, record)
            if ckpt.should_save(step, last):
                engine.save_checkpoint(ckpt, step, {"data_state": stream.state(), "losses": losses,
                                                    "origin": origin.to_dict()})
        progress.close()
        ckpt.wait()  # SYNC: the last (asynchronous) save is complete before the run reports success
        if cfg.export.save_params or cfg.export.enabled:  # fp32 master weights, one tensor at a time
            with engine.exported_weights() as weights:  # a job's other processes serve their slices
                if weights is not None:
                    save_outputs(cfg, out_dir, weights, origin, last)
        if samples is not None:  # the trained model answers eval.sample_prompts (on process 0)
            with engine.sampled_weights() as weights:  # a job's other processes serve their slices
                if weights is not None:
                    _write_samples(samples.generate(origin.model_config, weights, tokenizer, stream_layers=streamed),
                                   out_dir)
        report = engine.report()
        if main:
            _write_timeline(engine, out_dir)

    result = TrainResult(steps=len(losses), losses=losses, num_params=num_params,
                         peak_rss_bytes=peak_rss_bytes(), peak_page_cache_bytes=memory.peak_page_cache,
                         tokens_per_s=(last - start) * tokens_per_step / max(throughput.elapsed(), 1e-9),
                         engine=engine.name, skipped_steps=int(report.get("skipped_steps", 0)),
                         arena_capacity_bytes=int(report.get("arena_capacity_bytes", 0)),
                         arena_high_water_bytes=int(report.get("arena_high_water_bytes", 0)),
                         ssd_bytes_read=int(getattr(engine, "ssd_bytes_read", 0)),
                         ssd_bytes_written=int(getattr(engine, "ssd_bytes_written", 0)),
                         out_dir=str(out_dir), eval_loss=final_eval["eval_loss"] if final_eval else None,
                         data=stream.stats(),
                         updates_this_run=last - start - (int(report.get("skipped_steps", 0)) - skipped_before),
                         ssd_bytes_written_run=int(report.get("ssd_written_bytes_run", 0)),
                         state_dtype=str(report.get("state_dtype", "float32")), steps_this_run=last - start)
    if main:
        (out_dir / "summary.json").write_text(json.dumps(dataclasses.asdict(result), indent=1))
        print(_summary(result, report))
    return result


def _write_timeline(engine, out_dir: Path) -> None:
    """The last step's timeline (which thread did what, when): timeline.json, and timeline.png
    when matplotlib is installed."""
    timeline = getattr(engine, "last_timeline", None)
    if timeline is None:
        return
    data = timeline.to_dict()
    (out_dir / "timeline.json").write_text(json.dumps(data, indent=1))
    if not write_timeline_png(data, out_dir / "timeline.png"):
        console.note("timeline.png not drawn: matplotlib is not installed (timeline.json has the events)")


def _write_samples(results: list[dict], out_dir: Path) -> None:
    """``samples.json``, and each prompt with its answer on the terminal."""
    (out_dir / "samples.json").write_text(json.dumps(results, indent=1, ensure_ascii=False))
    for r in results:
        print(f"> {r['prompt']}\n{r['completion']}")


def _log_record(step: int, stats: dict[str, Any], schedule: optax.Schedule, throughput: Throughput,
                stream, engine, memory: MemorySampler) -> dict[str, Any]:
    sample = memory.sample()
    report = engine.report()
    updates = step - 1 - int(report.get("skipped_steps", 0))
    return {
        "step": step,
        "loss": float(stats["loss"]),
        "grad_norm": float(stats["grad_norm"]),
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
        **report,
        **{k: v for k, v in stats.items() if k not in ("loss", "grad_norm")},
    }


def _summary(r: TrainResult, report: Optional[dict] = None) -> str:
    report = report or {}
    processes, devices = report.get("data_parallel_processes", 1), report.get("data_parallel_devices", 1)
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
