"""The step's strategy, resolved once: where the weights live, how gradients leave, how the update
runs, and how a job shares the work.

    job = JobShape(processes=group.count, index=group.index, local_devices=jax.local_device_count())
    plan = StepPlan.resolve(cfg, model_cfg, job, choices=run_plan.choices)   # ConfigError: refused
    for line in plan.notes: console.note(line)                                # every silent choice
    engine = OffloadEngine(cfg, model, model_cfg, plan)                       # composes its parts from it

Every refusal of a mode combination is decided here, and every choice the user did not ask for
(overlap off and why, the devices of one process left unused, ``offload.params: auto``'s choice) is
one line of :attr:`StepPlan.notes`. The engine branches on the plan's few fields once, when it
composes its parts: the weights the forward takes (:attr:`StepPlan.weight_source`), the gradient
routing (:attr:`StepPlan.gradients`) and the update runner (:attr:`StepPlan.overlap`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, Optional

from jaxascend.config import Config, ConfigError, ModelConfig
from jaxascend.native import host_callbacks
from jaxascend.offload.partition import Partition

Gradients = Literal["instant", "post_backward"]
WeightSource = Literal["arrays", "host", "ssd"]
GradStore = Literal["ssd", "host", "host_fp32"]  # where the gradients wait for the update


@dataclass(frozen=True)
class JobShape:
    """Where the step runs: this process's place in a ``jax.distributed`` job and its devices."""

    processes: int = 1
    index: int = 0
    local_devices: int = 1


@dataclass(frozen=True)
class StepPlan:
    """Every mode one run's step takes (see the module doc)."""

    engine: Literal["offload", "in-memory"]
    weights: Literal["resident", "ssd"]  # where the layer stack's compute weights live
    gradients: Gradients  # instant: each layer's gradient leaves in the backward (once per step, whatever A)
    grad_store: GradStore  # ssd: each layer's gradient a store region on SSD; host: those regions in RAM;
    # host_fp32: one fp32 host buffer (the ablation)
    grad_accum: int  # A: each layer runs the step's A micro-batches in turn (models.micro_batches)
    overlap: bool  # the optimizer of step t beside step t+1's forward/backward
    overlap_refused: Optional[str] = None  # why an asked-for overlap is off
    partition: Optional[Partition] = None  # None: one device; (0, 1): this process's devices; (i, P): a job
    local_devices: int = 1  # the devices of each process the rows are split over
    notes: tuple[str, ...] = ()  # the choices the user did not ask for, one line each
    host_callbacks: bool = False  # the native side through host callbacks (native.host_callbacks), not FFI targets
    durable: bool = False  # every step a resume point: the state's records in slot rings, a journal (offload.durable)

    @classmethod
    def resolve(cls, cfg: Config, model_cfg: ModelConfig, job: JobShape = JobShape(),
                choices: tuple[str, ...] = ()) -> "StepPlan":
        """The plan of ``cfg`` (``offload.params`` resolved: ``auto`` counts as resident) for
        ``model_cfg`` (with the run's vocabulary) in ``job``; ``choices``: notes of choices made
        before (the run planner's). Raises :class:`ConfigError` naming what a job cannot run."""
        refused = streaming_refusal(cfg) if cfg.offload.params == "ssd" else None
        if refused:
            raise ConfigError(refused)
        notes = list(choices)
        partition, local_devices = _partition(cfg, model_cfg, job, notes)
        weights = "ssd" if cfg.offload.enabled and cfg.offload.params == "ssd" else "resident"
        gradients: Gradients = "post_backward" if cfg.offload.post_backward_overflow_check else "instant"
        refused = None
        # Data parallel overlaps too: the source serves each process's slice of every layer (from
        # SSD, or from host buffers the update writes in place), fetched by each process's first
        # device and gathered in the step, so no collective runs off the trainer's thread.
        if cfg.offload.enabled and cfg.offload.overlap:
            refused = overlap_refusal(cfg)
            if refused:
                notes.append(f"offload.overlap is off, the optimizer step runs after the forward/backward: {refused}")
        durable = cfg.offload.enabled and cfg.offload.durable
        layers = cfg.offload.host_gradient_layers
        if layers is not None and layers > model_cfg.num_hidden_layers:
            raise ConfigError(f"offload.host_gradient_layers: {layers} is more than the model's "
                              f"{model_cfg.num_hidden_layers} layers (null keeps every gradient in RAM)")
        if durable and grad_store(cfg) == "host_fp32":
            raise ConfigError("offload.durable: an interrupted update is redone from the step's gradients, kept in "
                              "store regions (on SSD, or in RAM with a log on SSD); offload.fp32_grad_buffer keeps "
                              "them in one host buffer: set it false, or durable: false")
        return cls(engine="offload" if cfg.offload.enabled else "in-memory", weights=weights, gradients=gradients,
                   grad_store=grad_store(cfg),
                   grad_accum=cfg.train.grad_accum, overlap=cfg.offload.enabled and cfg.offload.overlap and not refused,
                   overlap_refused=refused, partition=partition, local_devices=local_devices, notes=tuple(notes),
                   host_callbacks=host_callbacks(), durable=durable)

    @property
    def partitioned(self) -> bool:
        """A job of processes: each owns its slice of every tensor's state."""
        return self.partition is not None and self.partition.count > 1

    @property
    def processes(self) -> int:
        return self.partition.count if self.partitioned else 1

    @property
    def weight_source(self) -> WeightSource:
        """What the forward takes the layer stack from: arrays (the step's inputs), host buffers
        the overlapped update writes in place (served layer by layer), or the SSD (streamed)."""
        if self.weights == "ssd":
            return "ssd"
        return "host" if self.overlap else "arrays"

    @property
    def table_per_use(self) -> bool:
        """Each use of the token table (the lookup and, tied, the head) sends its own gradient,
        block by block; the other routings differentiate the whole tree and send it at the end."""
        return self.gradients == "instant"

    def describe(self) -> dict:
        """The plan as JSON-able values (``plan.json``)."""
        out = dataclasses.asdict(self)
        out["partition"] = [self.partition.index, self.partition.count] if self.partition else None
        out["notes"] = list(self.notes)
        return out


def grad_store(cfg: Config) -> GradStore:
    """Where the gradients wait for the update: the store's regions on SSD or in RAM
    (``offload.gradients``; ``auto`` not yet resolved by the run planner counts as ssd), or
    (``offload.fp32_grad_buffer``, ZeRO-Infinity's way) one float32 host buffer. The run planner
    lays out with it too."""
    if cfg.offload.fp32_grad_buffer:
        return "host_fp32"
    return "host" if cfg.offload.gradients == "host" else "ssd"


def streaming_refusal(cfg: Config) -> Optional[str]:
    """What ``offload.params: ssd`` (the layer stack's weights streamed through the layer scan)
    cannot serve in ``cfg``, by name (None: it can). The run planner asks it of ``auto``."""
    if not cfg.offload.enabled:
        return "offload.params: 'ssd' needs offload.enabled: true (the weights live beside the optimizer state on SSD)"
    if cfg.model.remat == "none":
        return ("offload.params: 'ssd' needs model.remat other than 'none' (without recomputation the backward pass "
                "would keep every layer's weights in memory); use remat: full")
    if cfg.offload.post_backward_overflow_check:
        return ("offload.params: 'ssd' cannot be combined with offload.post_backward_overflow_check (that ablation "
                "materializes the whole gradient tree)")
    return None


def overlap_refusal(cfg: Config) -> Optional[str]:
    """Why a run with ``offload.overlap`` runs its steps one after the other (None: it overlaps)."""
    if cfg.offload.post_backward_overflow_check:
        return "offload.post_backward_overflow_check (the ablation differentiates the whole tree)"
    if cfg.offload.fp32_grad_buffer:
        return "offload.fp32_grad_buffer (the ablation's host buffer has no receipts to order the arrivals)"
    if cfg.model.remat == "none" and cfg.offload.params != "ssd":
        return ("model.remat: none (the layer scan would keep every layer it fetched for the backward: 2 B/param "
                "more; remat dots recomputes only the fetch and the element-wise work)")
    return None


def partition_refusal(cfg: Config, model_cfg: ModelConfig) -> Optional[str]:
    """What data parallelism cannot run (None: it can), over the processes of a job or the
    devices of one process."""
    if cfg.offload.post_backward_overflow_check or cfg.offload.fp32_grad_buffer:
        return "the ablation switches (post_backward_overflow_check, fp32_grad_buffer) are single-process"
    return None


def rows_refusal(cfg: Config, shards: int, what: str) -> Optional[str]:
    """Why the batches' rows cannot be split over ``shards`` (None: they can)."""
    for name, rows in (("data.batch_size", cfg.data.batch_size), ("eval.batch_size", cfg.eval.batch_size)):
        if rows and rows % shards:
            return f"{name}: {rows} rows do not split evenly over {what}"
    return None


def _partition(cfg: Config, model_cfg: ModelConfig, job: JobShape,
               notes: list[str]) -> tuple[Optional[Partition], int]:
    """(this process's share of a data-parallel run, the devices of each process it uses): its
    slice of the state in a job (what a job cannot run is refused) over a mesh of the job's
    processes x their devices, ``Partition(0, 1)`` when this process's devices share the rows,
    None for one device or when the devices cannot share the run (noted)."""
    devices = job.local_devices
    if job.processes > 1:
        where = f"train.distributed: this job has {job.processes} processes"
        if not cfg.offload.enabled:
            raise ConfigError(f"{where}; data parallelism partitions the SSD state (offload.enabled: true), the "
                              "in-memory engine runs one process")
        refused = rows_refusal(cfg, job.processes, f"the job's {job.processes} processes")
        if refused:
            raise ConfigError(refused)
        refused = partition_refusal(cfg, model_cfg)
        if refused:
            raise ConfigError(f"{where}; {refused}")
        if devices > 1:
            why = rows_refusal(cfg, job.processes * devices, f"the job's {job.processes} x {devices} devices")
            if why:
                notes.append(f"data parallel over each process's {devices} devices is off, each process runs on "
                             f"its first: {why}")
                devices = 1
        return Partition(job.index, job.processes), devices
    if devices == 1:
        return None, 1
    what = f"the {devices} devices"
    why = ("the in-memory engine runs on one device" if not cfg.offload.enabled else
           partition_refusal(cfg, model_cfg) or rows_refusal(cfg, devices, what))
    if why:
        notes.append(f"data parallel over this process's {devices} devices is off, the step runs on "
                     f"the first: {why}")
        return None, 1
    return Partition(0, 1), devices
