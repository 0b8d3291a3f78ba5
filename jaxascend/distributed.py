"""The process group of a multi-process job, on JAX's own runtime (``jax.distributed``).

    group = initialize(cfg.train.distributed)     # ProcessGroup(index=0, count=1) for a single process
    if group.is_main: ...                          # logging, metrics, exports: process 0 only
    offload_dir = process_dir(cfg.offload.dir, group.index)   # "{process}" -> this process's number

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

import os
from dataclasses import dataclass
from typing import Optional

import jax

from jaxascend.config import DistributedConfig

JAX_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
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
    """Whether a multi-process job is asked for: by ``train.distributed``, the ``JAX_*``
    variables, SLURM (more than one task) or Open MPI (a world of more than one)."""
    if cfg is not None:
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
    settings = cfg or from_environment(os.environ)
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


def process_dir(template: str, index: int) -> str:
    """``template`` with ``{process}`` replaced by ``index``: each process's own directory."""
    return template.replace(PROCESS_FIELD, str(index))
