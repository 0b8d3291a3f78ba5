"""The end of a run: its offload files go, a stopped run says how to go on, and a run found at its
last step writes what a kill left unwritten from that step's checkpoint.

    if point.step >= last:                     # nothing left to train
        return finish_from_checkpoint(prepared, point, last, main)

A run killed after its final checkpoint (before ``params.safetensors``, the export, the samples
or ``summary.json``) is complete in its checkpoint; the same command writes the missing outputs
from it, byte for byte those of an uninterrupted run (the fp32 master weights are the
checkpoint's), removes the offload files and writes ``summary.json``. With every output there it
says in one line that there is nothing to do.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
from pathlib import Path

from jaxascend import console
from jaxascend.checkpoint import open_weights, saves_at
from jaxascend.config import Config
from jaxascend.generation import SamplePrompts
from jaxascend.hf import param_plan
from jaxascend.metrics import peak_rss_bytes
from jaxascend.run_outputs import (OutputsDue, Provenance, TrainResult, last_record, outputs_due, write_samples,
                                   write_summary, write_weights)
from jaxascend.offload import JOURNAL_NAME
from jaxascend.ssd import LOCK_FILE

SHARD_GLOB = "shard-*.bin"  # the offload files of a store (ffi/ssd_shard_store_layout.cc)


def stopped_line(step: int, steps: int, checkpoints: Path) -> str:
    """What a run that stopped at ``train.stop_at_step`` says last."""
    return (f"stopped at step {step} (train.stop_at_step), before train.steps {steps}: checkpoint {step} is in "
            f"{checkpoints}; to go on, run the same command without train.stop_at_step (or with a later step)")


def remove_offload_files(cfg: Config, shard_files: list[str], step: int) -> str:
    """Removes the offload files once the checkpoint of ``step`` holds the state (a resume
    rebuilds them from it), unless ``offload.keep_files``; what became of them, for the summary."""
    if cfg.offload.keep_files:
        return f"kept in {cfg.offload.dir} (offload.keep_files)"
    directory = Path(cfg.offload.dir)
    (directory / JOURNAL_NAME).unlink(missing_ok=True)  # first: a journal never names files that are gone
    for path in shard_files:
        Path(path).unlink(missing_ok=True)
    (directory / LOCK_FILE).unlink(missing_ok=True)  # the store is closed: nothing holds it
    with contextlib.suppress(OSError):
        directory.rmdir()  # only when nothing else is in it
    if not saves_at(cfg.checkpoint, step, step, cfg.train.steps):  # checkpoint.final: false at the run's end
        return (f"removed from {cfg.offload.dir} (checkpoint.final: false: no checkpoint holds the state of step "
                f"{step}; the run's outputs hold its weights; offload.keep_files keeps them)")
    return (f"removed from {cfg.offload.dir} (the checkpoint of step {step} holds the state; "
            "offload.keep_files keeps them)")


def _left_offload_files(cfg: Config, step: int) -> str:
    """The offload files a killed run left: removed as the run would have, unless a live store
    holds their lock (another run on the same folder), which leaves them."""
    directory = Path(cfg.offload.dir)
    shards = sorted(str(p) for p in directory.glob(SHARD_GLOB)) if directory.is_dir() else []
    if not shards:
        return "none left" if not cfg.offload.keep_files else f"kept in {cfg.offload.dir} (offload.keep_files)"
    lock = directory / LOCK_FILE
    if lock.exists():
        fd = os.open(lock, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return f"left in {cfg.offload.dir} (another run holds them)"
        finally:
            os.close(fd)  # releases the probe's lock
    return remove_offload_files(cfg, shards, step)


def finish_from_checkpoint(prepared, point, last: int, main: bool, stack: dict) -> TrainResult:
    """A run at or past its last step (``point``, checked): the outputs a kill left unwritten
    are written from the checkpoint (on process 0; every process removes its offload files),
    or one line says there is nothing to do."""
    cfg: Config = prepared.cfg
    out_dir = Path(cfg.train.out_dir)
    stopped = last < cfg.train.steps
    due = (outputs_due(cfg, out_dir, point.step, stopped=stopped, saved_at=point.meta.get("saved_at"))
           if point.step == last else OutputsDue())
    if not due:
        if main:
            epochs = prepared.epochs.epochs if prepared.epochs is not None else None
            print(point.finished_line(last, cfg.train.steps, epochs), file=console.terminal(), flush=True)
        return _result(prepared, point, "untouched", stopped, stack)
    offload_files = _left_offload_files(cfg, point.step) if prepared.step_plan.engine == "offload" else "none"
    if not main:
        return _result(prepared, point, offload_files, stopped, stack)
    names = due.names(cfg, out_dir)
    console.note(f"the run reached step {point.step}, but {_listed(names)} {'was' if len(names) == 1 else 'were'} "
                 f"not written (it was stopped after its last checkpoint): writing "
                 f"{'it' if len(names) == 1 else 'them'} from checkpoint {point.step} in {point.directory}")
    if due.params or due.export or due.samples:
        _write_from(prepared, point, due)
    result = _result(prepared, point, offload_files, stopped, stack, written=names,
                     num_params=sum(math.prod(m.shape) for m in param_plan(prepared.sized)))
    write_summary(out_dir, result)  # last, as a run writes it
    if stopped:
        print(stopped_line(point.step, cfg.train.steps, point.directory), file=console.terminal(), flush=True)
    else:
        print(f"wrote {_listed(names)} from checkpoint {point.step}: the run is complete ({out_dir})",
              file=console.terminal(), flush=True)
    return result


def _write_from(prepared, point, due: OutputsDue) -> None:
    """The weights and samples of the checkpoint of ``point.step``, as the run writes them."""
    cfg = prepared.cfg
    out_dir = Path(cfg.train.out_dir)
    streamed = prepared.step_plan.engine == "offload" and prepared.step_plan.weights == "ssd"
    with open_weights(str(point.directory / str(point.step))) as weights:
        origin = Provenance(weights.model_config, weights.tokenizer, weights.model_source, weights.source_dtype)
        write_weights(cfg, out_dir, weights.read, origin, point.step, due)
        samples = SamplePrompts.from_config(cfg, prepared.tokenizer, prepared.sized) if due.samples else None
        if samples is not None:  # the compute dtype's weights, rounded from the masters as the run's are
            write_samples(samples.generate(origin.model_config, weights.read, prepared.tokenizer,
                                           stream_layers=streamed), out_dir)


def _listed(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _result(prepared, point, offload_files: str, stopped: bool, stack: dict,
            written: list[str] = (), num_params: int = 0) -> TrainResult:
    """The summary of a run this invocation trained no step of: the checkpoint's losses and the
    figures of its last logged step."""
    cfg: Config = prepared.cfg
    losses = list(point.meta.get("losses", []))
    record = last_record(Path(cfg.train.out_dir), point.step) if written else {}
    eval_loss = record.get("eval_loss")
    return TrainResult(steps=len(losses), losses=losses, num_params=num_params,
                       peak_rss_bytes=peak_rss_bytes(), peak_page_cache_bytes=0, tokens_per_s=None,
                       engine="offload" if cfg.offload.enabled else "in-memory",
                       skipped_steps=int(record.get("skipped_steps", 0)), arena_capacity_bytes=0,
                       arena_high_water_bytes=0, ssd_bytes_read=0, ssd_bytes_written=0, out_dir=cfg.train.out_dir,
                       eval_loss=eval_loss if isinstance(eval_loss, float) and math.isfinite(eval_loss) else None,
                       data={k[len("data_"):]: v for k, v in record.items() if k.startswith("data_") and k != "data_state"},
                       state_dtype=record.get("state_dtype", cfg.optimizer.state_dtype), offload_files=offload_files,
                       stop_at_step=point.step if stopped else None, written_from_checkpoint=list(written),
                       stack=stack, epochs=prepared.epochs.to_dict() if prepared.epochs else None)
