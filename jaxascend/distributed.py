"""The process group of a multi-process job, on JAX's own runtime (``jax.distributed``).

    group = initialize(cfg.train.distributed)     # ProcessGroup(index=0, count=1) for a single process
    if group.is_main: ...                          # logging, metrics, exports: process 0 only
    offload_dir = process_dir(cfg.offload.dir, group)   # "{process}" -> this process's number

A job is requested by ``train.distributed`` (coordinator, number of processes, process id) or by
the environment ``jax.distributed.initialize()`` reads by itself: ``JAX_COORDINATOR_ADDRESS`` /
``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID`` (what ``python -m jaxascend.launch`` sets), SLURM's
``srun`` or Open MPI's ``mpirun``. Without either this is one process and nothing is initialized.
On CPU the cross-process collectives run over gloo (``jax_cpu_collectives_implementation``).

A process that cannot reach the coordinator, or whose peer dies, is ended by JAX's runtime
itself (a fatal error after ``initialization_timeout_seconds`` / ``heartbeat_timeout_seconds``);
the launcher reports which process ended and why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass
from typing import Callable, Optional

import jax

from jaxascend.config import DistributedConfig

PROCESS_FIELD = "{process}"  # in offload.dir: replaced by the process number


@dataclass(frozen=True)
class ProcessGroup:
    """This process's place in the job: ``index`` of ``count`` processes."""

    index: int = 0
    count: int = 1

    @property
    def is_main(self) -> bool:
        """Process 0: the one that logs, shows progress, writes metrics and exports."""
        return self.index == 0


def requested(cfg: Optional[DistributedConfig], environ=os.environ) -> bool:
    """Whether a multi-process job is asked for: by ``train.distributed.coordinator``, the ``JAX_*``
    variables, SLURM (more than one task) or Open MPI (a world of more than one)."""
    if cfg is not None and cfg.coordinator is not None:
        return True
    if environ.get("JAX_COORDINATOR_ADDRESS"):
        return True
    for name in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        value = environ.get(name, "")
        if value.isdigit() and int(value) > 1:
            return True
    return False


def from_environment(environ) -> DistributedConfig:
    """The job the ``JAX_*`` variables describe (this JAX reads only the address itself), or an
    empty section that lets ``jax.distributed.initialize()`` detect SLURM / Open MPI."""
    if not environ.get("JAX_COORDINATOR_ADDRESS"):
        return DistributedConfig()
    values = {}
    for name, field in (("JAX_NUM_PROCESSES", "num_processes"), ("JAX_PROCESS_ID", "process_id")):
        text = environ.get(name, "")
        if not text.strip().isdigit():
            raise ValueError(f"{name}: expected a number beside JAX_COORDINATOR_ADDRESS, got {text!r}")
        values[field] = int(text)
    try:
        return DistributedConfig(coordinator=environ["JAX_COORDINATOR_ADDRESS"], **values)
    except ValueError as err:  # ConfigError: name the variables, not the config fields
        raise ValueError(f"the JAX_* variables: {err}") from None


def initialize(cfg: Optional[DistributedConfig]) -> ProcessGroup:
    """Joins the job ``cfg`` or the environment describes (see the module doc) and returns this
    process's place in it; a single process when none is requested. Idempotent: a second call
    returns the group already joined. A coordinator that cannot be reached within
    ``initialization_timeout_seconds`` is one ``ValueError`` naming it."""
    if jax.distributed.is_initialized():
        return ProcessGroup(jax.process_index(), jax.process_count())
    if not requested(cfg):
        return ProcessGroup()
    settings = cfg or DistributedConfig()
    if settings.coordinator is None:  # the environment's job, with the section's timeouts
        found = from_environment(os.environ)
        settings = dataclasses.replace(settings, coordinator=found.coordinator, num_processes=found.num_processes,
                                       process_id=found.process_id)
    # Must precede the backend's creation; GPU backends use NCCL and ignore it.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    where = settings.coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS") or "the coordinator the environment names"
    try:
        jax.distributed.initialize(coordinator_address=settings.coordinator, num_processes=settings.num_processes,
                                   process_id=settings.process_id,
                                   initialization_timeout=settings.initialization_timeout_seconds,
                                   heartbeat_timeout_seconds=settings.heartbeat_timeout_seconds,
                                   shutdown_timeout_seconds=settings.shutdown_timeout_seconds)
    except (RuntimeError, ValueError) as err:  # XlaRuntimeError is a RuntimeError
        text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"train.distributed: could not join the job at {where}: {text}") from None
    return ProcessGroup(jax.process_index(), jax.process_count())


BARRIER_TIMEOUT_SECONDS = 24 * 3600  # a peer that is gone is noticed by the heartbeat long before


def job_barrier(group: ProcessGroup) -> Callable[[str], None]:
    """``barrier(name)``: returns once every process of the job has called it with ``name`` (each
    name once). It goes through the coordination service that ``jax.distributed`` started, not
    through a collective, so it may be called from any thread while collectives run on another
    (a gloo collective off the trainer's thread could mix its messages with theirs:
    ``offload.collective_order``). A single process: returns at once."""
    if group.count == 1:
        return lambda name: None
    from jax._src import distributed as jax_distributed  # the client jax.distributed.initialize made

    client = jax_distributed.global_state.client

    def barrier(name: str) -> None:
        try:
            client.wait_at_barrier(name, BARRIER_TIMEOUT_SECONDS * 1000)
        except Exception as err:  # XlaRuntimeError: a peer gone, or the coordinator
            text = " ".join(str(err).split())[:300]
            raise JobLostError(f"train.distributed: process {group.index} of {group.count} lost the job at the "
                               f"barrier {name!r} (another process ended; its log, or the launcher's, says why): "
                               f"{text}") from None

    return barrier


class JobLostError(RuntimeError):
    """A collective of the job failed because another process is gone (killed, crashed, its
    machine down): this process stops too; the job resumes from its last complete checkpoint (or, with
    durable steps, the step its offload files hold)."""


_PEER_FAILURE = ("gloo", "connection reset", "connection refused", "broken pipe", "coordination service",
                 "heartbeat", "socket closed")


@contextlib.contextmanager
def job_errors(group: ProcessGroup):
    """In a job, a collective that fails because a peer is gone becomes one
    :class:`JobLostError` line naming this process and what failed (JAX's runtime, or the
    launcher, names the process that ended; a peer that hangs instead is noticed by the
    heartbeat, ``train.distributed.heartbeat_timeout_seconds``)."""
    try:
        yield
    except Exception as err:  # XlaRuntimeError, or the error a sink or source made of it
        text = " ".join(str(err).split())
        if group.count == 1 or isinstance(err, JobLostError) or not any(k in text.lower() for k in _PEER_FAILURE):
            raise
        raise JobLostError(f"train.distributed: process {group.index} of {group.count} lost the job (another process "
                           f"ended; its log, or the launcher's, says why); the same command resumes the job from its "
                           f"last complete checkpoint, or with offload.durable from the step its offload files hold "
                           f"(train.resume: auto). The failed collective: {text[:300]}") from None


def process_dir(template: str, group: ProcessGroup) -> str:
    """Each process's own directory: ``template`` with ``{process}`` replaced by its number, or,
    in a job whose template has none, ``<template>/process<i>`` (processes of one machine would
    otherwise share it); the template itself for a single process."""
    if PROCESS_FIELD in template:
        return template.replace(PROCESS_FIELD, str(group.index))
    return template if group.count == 1 else f"{template.rstrip('/')}/process{group.index}"
