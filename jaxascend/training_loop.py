"""The training loop: a step per batch, the figures written every ``log_every`` steps, checkpoints
by step count and by the clock, and the stop on a signal at a step boundary.

    loop = TrainingLoop(LoopSettings(...), engine, ckpt, log, memory, devices, signals)
    throughput, final_eval = loop.train(stream, losses)     # raises RunStopped on a signal

Host<->device synchronisation happens only where marked ``# SYNC``. In a job the processes agree,
at every step boundary, on whether to stop (a signal may reach one process only) and whether a
checkpoint is due by the clock (process 0's): a max over a few integers, so every process saves
the same steps and stops after the same one.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from jaxascend.checkpoint import Checkpointer
from jaxascend.config import Config
from jaxascend.devices import DeviceMonitor
from jaxascend.engine_contract import Engine, StepResult
from jaxascend.kill_points import kill_point
from jaxascend.metrics import MetricsLog, Progress, Throughput, peak_rss_bytes
from jaxascend.models import TokenBatch, token_batch
from jaxascend.optim import learning_rate_schedule
from jaxascend.ssd import MemorySampler
from jaxascend.stopping import RunStopped, StopSignals


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


def tokens_per_step(cfg: Config, micro_batches: int) -> int:
    return micro_batches * cfg.data.batch_size * cfg.data.seq_len


@dataclass(frozen=True)
class LoopSettings:
    """What the loop needs of the run: its config, the steps it runs, who writes."""

    cfg: Config
    start: int  # the step resumed from (0: a fresh run)
    last: int  # the last step this invocation runs
    main: bool  # process 0: it logs and shows progress
    held_out: list  # the evaluation's batches (empty: none)
    origin: dict  # the run's provenance, saved with every checkpoint
    agree: Callable[[list[int]], list[int]]  # the max over the job's processes (identity for one)
    checkpoint_dir: str
    stack: dict  # what made the run (jaxascend.provenance): in its first record and every checkpoint
    micro_batches: int  # A, the step plan's grad_accum: the batches each step's layers run in turn
    durable_dir: Optional[str] = None  # durable steps: the offload files are the resume point (a stop saves nothing)


class TrainingLoop:
    """Runs the steps of one invocation (see the module doc)."""

    def __init__(self, settings: LoopSettings, engine: Engine, ckpt: Checkpointer, log: MetricsLog,
                 memory: MemorySampler, devices: DeviceMonitor, signals: StopSignals):
        self.s, self.engine, self.ckpt, self.log, self.memory, self.signals = (settings, engine, ckpt, log, memory,
                                                                               signals)
        self.devices = devices  # device memory in each record, where the backend reports it
        cfg = settings.cfg
        self.schedule = learning_rate_schedule(cfg.optimizer, cfg.schedule_length())
        self.every_seconds = cfg.checkpoint.every_minutes * 60.0
        self.last_save = time.monotonic()  # the clock of checkpoint.every_minutes counts training time
        self.logged = False  # this invocation has written a metrics record

    def train(self, stream, losses: list[float]) -> tuple[Throughput, Optional[dict]]:
        """The steps ``start + 1 .. last``; extends ``losses``. Raises :class:`RunStopped` after
        the checkpoint of the step a stop signal ended."""
        cfg, held_out = self.s.cfg, self.s.held_out
        pending: list[StepResult] = []
        throughput = Throughput()
        progress = Progress(cfg.train.steps, initial=self.s.start, enabled=cfg.train.progress and self.s.main)
        final_eval = None
        try:
            for step in range(self.s.start + 1, self.s.last + 1):
                batch = step_batch([next(stream) for _ in range(self.s.micro_batches)])
                self.engine.resume_state({"data_state": stream.state()})  # durable steps: where this step leaves the data
                pending.append(self.engine.step(batch))
                throughput.add(tokens_per_step(cfg, self.s.micro_batches))
                if step == self.s.start + 1:  # SYNC: this step compiled; the summary's tokens/s starts after it
                    pending[-1] = pending[-1].fetched()
                    throughput.compiled(step)
                kill_point("step_end")  # tests: a signal at the step boundary
                stopping, clock_due = self._boundary()
                evaluating = bool(held_out) and (step == self.s.last or (cfg.eval.every_steps > 0
                                                                         and step % cfg.eval.every_steps == 0))
                saving = self.ckpt.should_save(step, self.s.last, cfg.train.steps) or (stopping and not self.s.durable_dir) or clock_due
                if step % cfg.train.log_every and step != self.s.last and not saving and not evaluating:
                    progress.update(1)
                    continue
                fetched = [result.fetched() for result in pending]  # SYNC: the steps dispatched since the last log
                pending.clear()
                losses.extend(result.loss for result in fetched)
                throughput.mark(step)
                record = self._record(step, fetched[-1], throughput, stream)
                if not self.logged:  # this invocation's first record says what made it
                    record["stack"], self.logged = self.s.stack, True
                if evaluating:  # SYNC: the held-out loss on the weights after this step's update
                    final_eval = evaluate(self.engine, held_out)
                    throughput.exclude(final_eval["eval_seconds"])
                    record.update(final_eval)
                self.log.write(record)
                progress.update(1, record)
                if saving:
                    self._save(step, stream, losses)
                    stopping = stopping or self._boundary(clock=False)[0]  # a signal during the save
                if stopping and step < self.s.last:  # at the last step the run finishes as it would
                    if self.s.durable_dir and not saving:  # the update of this step completes on the way out
                        raise RunStopped(self.signals.requested, step, self.s.durable_dir, self.s.main, files=True)
                    raise RunStopped(self.signals.requested, step, self.s.checkpoint_dir, speaks=self.s.main)
        finally:
            progress.close()
        return throughput, final_eval

    def _boundary(self, clock: bool = True) -> tuple[bool, bool]:
        """(stop, checkpoint due by the clock), the same on every process of a job."""
        due = clock and self.every_seconds > 0 and self.s.main and time.monotonic() - self.last_save >= self.every_seconds
        signum, due = self.s.agree([self.signals.requested or 0, int(due)])
        if signum:
            self.signals.request(signum)  # a signal that reached another process of the job
        return bool(signum), bool(due)

    def _save(self, step: int, stream, losses: list[float]) -> None:
        """A checkpoint of ``step``; a second SIGINT meanwhile waits for it to complete."""
        with self.signals.protected():
            self.engine.save_checkpoint(self.ckpt, step, {"data_state": stream.state(), "losses": losses,
                                                          "origin": self.s.origin, "saved_at": time.time(),
                                                          "stack": self.s.stack})
            if self.signals.requested:
                self.ckpt.wait()  # SYNC: the run stops after this save; it must be complete
        self.last_save = time.monotonic()

    def _record(self, step: int, result: StepResult, throughput: Throughput, stream) -> dict[str, Any]:
        sample = self.memory.sample()
        report = self.engine.report()
        updates = step - 1 - report.skipped_steps
        return {
            "step": step,
            "loss": result.loss,
            "grad_norm": result.grad_norm,
            # The schedule is evaluated at the count used for this step's update (0-based).
            "learning_rate": float(self.schedule(updates)),
            "tokens_per_s": throughput.rate(),
            "elapsed_s": throughput.elapsed(),
            "rss_bytes": sample.rss,
            "peak_rss_bytes": peak_rss_bytes(),
            "page_cache_bytes": sample.page_cache,
            "peak_page_cache_bytes": self.memory.peak_page_cache,
            # device_mem_bytes / _peak_bytes / _capacity_bytes: absent where no device reports them
            **self.devices.record(),
            "data_state": stream.state(),
            # Epochs of the data consumed so far (whole documents or examples), like Trainer's "epoch".
            "epoch": round(stream.epochs_seen, 4),
            **{f"data_{k}": v for k, v in stream.stats().items()},
            **report.record(),
            **{k: v for k, v in result.record().items() if k not in ("loss", "grad_norm")},
        }
