"""What the trainer asks of an engine: the :class:`Engine` protocol that the offloaded engine
(:class:`jaxascend.offload.OffloadEngine`) and the in-memory baseline
(:class:`jaxascend.in_memory_engine.InMemoryEngine`) implement, the :class:`StepResult` of one
step and the :class:`EngineReport` of the run so far.

    with build_engine(...) as engine:                 # an Engine
        result = engine.step(batch)                   # a StepResult (device scalars, or host ones)
        record = {**result.fetched().record(), **engine.report().record()}   # one metrics.jsonl line

Both records are flat dicts of the fields that apply (a field left None is not written), so
``metrics.jsonl`` keeps one key per figure.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Protocol

import numpy as np

if TYPE_CHECKING:
    from jaxascend.checkpoint import Checkpointer
    from jaxascend.models import TokenBatch


def _record(obj) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if getattr(obj, f.name) is not None}


@dataclass(frozen=True)
class StepResult:
    """One optimizer step. ``loss`` and ``grad_norm`` may still be device scalars (the in-memory
    engine dispatches asynchronously); :meth:`fetched` brings them to the host. The timing and
    traffic fields are the offloaded engine's (None: not measured in this step). Overlapped, the
    optimizer's figures are the previous step's update's."""

    loss: Any
    grad_norm: Any
    skipped: Optional[bool] = None  # overflowed (fp16): the state was not touched
    loss_scale: Optional[float] = None
    fwd_bwd_seconds: Optional[float] = None
    grad_flush_seconds: Optional[float] = None  # the update waiting for the backward's gradient writes
    optimizer_seconds: Optional[float] = None
    optimizer_bytes: Optional[int] = None
    ssd_gbps: Optional[float] = None
    stream_gbps: Optional[float] = None
    overlap_fraction: Optional[float] = None  # of the update's wall time beside the next forward/backward
    param_wait_seconds: Optional[float] = None  # the forward/backward waiting for streamed weights
    optimizer_wait_seconds: Optional[float] = None  # the forward/backward waiting for the update
    ssd_read_bytes: Optional[int] = None  # the offload files' traffic from the last step's end to this one's
    ssd_written_bytes: Optional[int] = None

    def fetched(self) -> "StepResult":
        """With ``loss`` and ``grad_norm`` as host floats (a sync for device scalars)."""
        return dataclasses.replace(self, loss=float(np.asarray(self.loss)), grad_norm=float(np.asarray(self.grad_norm)))

    def record(self) -> dict[str, Any]:
        return _record(self)


@dataclass(frozen=True)
class EngineReport:
    """An engine's figures (of the last finished update; a running one is not waited for). The
    offloaded engine fills every field; the in-memory one only the first two."""

    engine: str  # "offload" or "in-memory"
    skipped_steps: int = 0  # overflowed steps (fp16), state untouched
    loss_scale: Optional[float] = None
    arena_capacity_bytes: Optional[int] = None
    arena_high_water_bytes: Optional[int] = None
    arena_locked: Optional[bool] = None
    arena_pinned: Optional[bool] = None
    direct_io: Optional[bool] = None
    io_engine: Optional[str] = None
    host_grad_buffer_bytes: Optional[int] = None  # the fp32_grad_buffer ablation's host copy (0 without it)
    ssd_read_bytes_step: Optional[int] = None  # the last optimizer step's
    ssd_write_bytes_step: Optional[int] = None
    ssd_gbps_step: Optional[float] = None
    optimizer_seconds_step: Optional[float] = None
    ssd_read_bytes_steps: Optional[int] = None  # every step's traffic so far (checkpoints, evaluations left out)
    ssd_written_bytes_steps: Optional[int] = None
    ssd_bytes_first_step: Optional[tuple] = None  # (read, written) of this run's first step, in the sums above
    ssd_read_bytes_run: Optional[int] = None  # since the engine opened the files: init, restore, steps, saves
    ssd_written_bytes_run: Optional[int] = None
    state_dtype: Optional[str] = None
    state_rounding: Optional[str] = None  # "nearest" for float32
    state_bytes: Optional[int] = None
    resident_param_bytes: Optional[int] = None
    streamed_param_bytes: Optional[int] = None
    params: Optional[str] = None  # "resident" or "ssd"
    gradients: Optional[str] = None  # where they wait: "ssd", "host" (RAM), "host_fp32" (the ablation)
    grad_bytes: Optional[int] = None  # one step's gradient regions, this process's (on SSD or in RAM)
    host_grad_bytes: Optional[int] = None  # of those, in RAM (offload.gradients host; host_gradient_layers: some)
    overlap: Optional[bool] = None
    overlap_refused: Optional[str] = None
    data_parallel_processes: int = 1
    data_parallel_devices: int = 1
    early_gradient_arrivals: Optional[int] = None
    initial_write: Optional[dict] = None  # the initial state's write: bytes, seconds, GB/s (None: not written)
    param_source_fetches: Optional[int] = None  # the parameter source's counters, when it runs
    param_source_misses: Optional[int] = None
    param_source_bytes_read: Optional[int] = None
    param_source_wait_seconds: Optional[float] = None
    param_source_optimizer_wait_seconds: Optional[float] = None
    param_source_bytes_copied: Optional[int] = None
    param_source_handovers: Optional[int] = None
    param_source_bytes_handed: Optional[int] = None
    param_source_handover_skips: Optional[int] = None
    param_source_handover_wait_seconds: Optional[float] = None  # the update waiting for the forward to take a layer

    def record(self) -> dict[str, Any]:
        return _record(self)


class Engine(Protocol):
    """What :func:`jaxascend.trainer.run` uses of an engine; a context manager that closes what
    it owns on exit."""

    name: str
    streams_layers: bool  # sampled_weights() reads the layer stack layer by layer (the sampler streams it)

    def step(self, batch: "TokenBatch", optimizer: bool = True) -> StepResult:
        """One optimizer step over the micro-batches ``[A, ...]`` of ``batch``."""

    def resume_state(self, trainer: dict) -> None:
        """What the run needs to go on once the next step is complete (its data position), for an
        engine whose files are a resume point after every step (durable steps); others ignore it."""

    def end_training(self) -> int:
        """The run trains no more step: disk that only the steps needed (the offloaded gradients)
        is freed for the outputs written next; returns the bytes freed."""

    def evaluate(self, batches: Iterable["TokenBatch"]) -> tuple[float, int]:
        """``(sum of the counted targets' losses, their count)``, forward only."""

    def save_checkpoint(self, ckpt: "Checkpointer", step: int, meta: dict) -> None: ...

    def restore_checkpoint(self, ckpt: "Checkpointer", step: int) -> dict:
        """Restores ``step``; returns the checkpoint's meta."""

    def sampled_weights(self) -> contextlib.AbstractContextManager[Optional[Any]]:
        """The compute weights to sample from (None on a job's other processes)."""

    def exported_weights(self) -> contextlib.AbstractContextManager[Optional[Callable]]:
        """The weights to save or export (None on a job's other processes)."""

    def report(self) -> EngineReport: ...

    def shard_files(self) -> list[str]:
        """The offload files (empty for the in-memory engine)."""

    def timeline(self) -> Optional[dict]:
        """The last update's timeline (which thread did what, when), or None."""

    def __enter__(self) -> "Engine": ...

    def __exit__(self, *exc) -> None: ...
