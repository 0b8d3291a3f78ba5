"""Where a run starts, said before anything is written: the checkpoint it resumes (and one line
that names it, when it was saved and the data position), whether it has anything left to do, and
the learning-rate schedule's length, which a resumed run keeps.

    point = resume_point(cfg, processes)        # step 0: a fresh start
    if point.step >= last_step: print(point.finished_line(last_step)); return
    cfg, notes = with_schedule(cfg, point)      # optimizer.decay_steps resolved (and recorded)
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from jaxascend.checkpoint import check_resume_partition, default_directory, read_meta, resume_target
from jaxascend.config import Config
from jaxascend.offload import read_journal
from jaxascend.optim import unfinished_warmup_note


@dataclass(frozen=True)
class ResumePoint:
    """The step a run starts after (0: a fresh start) and that checkpoint's record."""

    step: int
    directory: Path  # the checkpoint directory (from_files: the offload directory)
    record: Optional[dict] = None  # the step's meta record (read_meta): config, meta
    from_files: bool = False  # durable steps: the offload files hold the step (their journal's record)

    @property
    def meta(self) -> dict:
        return self.record["meta"] if self.record else {}

    def recorded_schedule(self) -> Optional[int]:
        """The schedule length the checkpointed run used: its ``optimizer.decay_steps``, or (a
        checkpoint from before the field) its ``train.steps``."""
        if not self.record:
            return None
        saved = self.record.get("config", {})
        return saved.get("optimizer", {}).get("decay_steps") or saved.get("train", {}).get("steps")

    def resume_line(self) -> str:
        """``resuming from checkpoint step 7 in runs/x/checkpoints (saved 2026-12-02 17:03:11, 12 min
        ago); data position: epoch 0, document 41, token 1024``."""
        saved_at = self.meta.get("saved_at")
        if saved_at is None:  # a checkpoint from before the field: the step directory's time
            step_dir = self.directory / str(self.step)
            saved_at = step_dir.stat().st_mtime if step_dir.exists() else None
        when = ""
        if saved_at is not None:
            ago = max(0.0, time.time() - float(saved_at))
            when = (f" (saved {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(float(saved_at)))}, "
                    f"{_duration(ago)} ago)")
        state = self.meta.get("data_state", {})
        position = ", ".join(f"{key} {state[key]}" for key in ("epoch", "document", "token", "example")
                             if key in state)
        what = "step {} held by the offload files" if self.from_files else "checkpoint step {}"
        return f"resuming from {what.format(self.step)} in {self.directory}{when}; data position: {position or 'start'}"

    def finished_line(self, last: int, steps: int, epochs: Optional[float] = None) -> str:
        """The line of a run with nothing left to do; ``epochs``: the run's length was train.epochs."""
        length = f"train.steps {steps}" if epochs is None else f"train.epochs {epochs:g} ({steps} steps)"
        raise_it = "train.steps" if epochs is None else "train.epochs"
        return (f"{self.directory}: the run is already at step {self.step}, at or past {length}; "
                f"nothing to do (raise {raise_it} to train further)" if last == steps else
                f"{self.directory}: the run is already at step {self.step}, at or past train.stop_at_step {last}; "
                f"nothing to do (to go on to train.steps {steps}, run the same command without train.stop_at_step "
                "or with a later step)")


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def resume_point(cfg: Config, processes: int) -> ResumePoint:
    """The checkpoint ``train.resume`` names, checked (it exists and is complete, its config is
    compatible, int8 state has the same number of processes), and its record."""
    directory = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else default_directory(cfg)
    start = resume_target(cfg.checkpoint, cfg, cfg.train.resume) or 0
    if not start:
        return ResumePoint(0, directory)
    check_resume_partition(cfg.checkpoint, cfg, start, processes)
    return ResumePoint(start, directory, read_meta(directory / str(start)))


def files_point(cfg: Config, checkpoint: ResumePoint, last: int,
                gather: Optional[Callable[[list[int]], list[list[int]]]] = None) -> ResumePoint:
    """With durable steps (``offload.durable``, ``train.resume: auto``): the step the offload files
    hold, where it is newer than ``checkpoint`` and before the run's ``last`` step (a run found at
    its end finishes from its checkpoint); else ``checkpoint``. An update the journal names in
    flight is counted done: the engine rolls it forward from its gradients. ``gather`` (a job):
    every process's values of a list; the job resumes at the latest step every process's files
    reach (``JournalRecord.reach``), the same for all of them."""
    if not (cfg.offload.enabled and cfg.offload.durable and cfg.train.resume == "auto"):
        return checkpoint
    folder = Path(cfg.offload.dir or "")
    record = read_journal(folder)
    reach = list(record.reach()) if record is not None else [-1, -1]
    reaches = gather(reach) if gather is not None else [reach]  # SYNC: every process of a job
    step = min(hi for _, hi in reaches)
    if not checkpoint.step < step < last:
        return checkpoint
    if any(lo > step for lo, _ in reaches):
        held = ", ".join(f"process {i}: steps {lo} to {hi}" for i, (lo, hi) in enumerate(reaches))
        raise ValueError(f"durable steps: the job's offload files hold no step in common ({held}); resume from a "
                         f"checkpoint (train.resume: <step>) or remove offload.dir {cfg.offload.dir}")
    return ResumePoint(step, folder, {"meta": record.trainer_at(step)}, from_files=True)


def with_schedule(cfg: Config, point: ResumePoint) -> tuple[Config, tuple[str, ...]]:
    """``cfg`` with ``optimizer.decay_steps`` resolved: as set, else the resumed run's recorded
    length, else (a fresh start) ``train.steps``; and the note a resumed run's changed length
    gets, and the note of a warmup longer than the schedule (the rate never reaches its peak)."""
    asked, recorded = cfg.optimizer.decay_steps, point.recorded_schedule()
    note = None
    if asked is not None:
        length = asked
        if recorded is not None and asked != recorded:
            note = f"optimizer.decay_steps: {asked} replaces the learning-rate schedule's recorded length of {recorded}"
    elif recorded is not None:
        length = recorded
        if cfg.train.steps != recorded:
            note = (f"train.steps is {cfg.train.steps}, but the learning-rate schedule keeps its recorded length of "
                    f"{recorded} steps (set optimizer.decay_steps to change it)")
    else:
        length = cfg.train.steps
    optimizer = dataclasses.replace(cfg.optimizer, decay_steps=length)
    notes = tuple(line for line in (note, unfinished_warmup_note(optimizer, length)) if line)
    return dataclasses.replace(cfg, optimizer=optimizer), notes
