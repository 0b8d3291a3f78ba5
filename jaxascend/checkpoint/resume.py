"""Which step a run resumes from, and whether it may: checked before the run writes anything.

:func:`default_directory` is where a run keeps its checkpoints and :func:`complete_steps` lists
the steps there; :func:`resume_target` turns ``train.resume`` into a complete step (it exists,
its meta is intact, its config is compatible: :func:`check_compatible` over
:data:`COMPATIBILITY_FIELDS`); :func:`check_resume_partition` refuses int8 state saved by another
number of processes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

from jaxascend.checkpoint.errors import (CheckpointError, CheckpointNotFoundError, CorruptCheckpointError,
                                         IncompatibleCheckpointError)
from jaxascend.checkpoint.offloaded_item import saved_processes
from jaxascend.checkpoint.step_meta import OFFLOADED, as_dict, read_meta
from jaxascend.config import CheckpointConfig, Config

# Config fields that decide the shapes and dtypes of what a checkpoint holds. Anything else
# (learning rate, steps, data paths, checkpoint and offload tuning) may change on resume.
COMPATIBILITY_FIELDS = (
    "model.arch", "model.vocab_size", "model.hidden_size", "model.intermediate_size", "model.num_hidden_layers",
    "model.num_attention_heads", "model.num_key_value_heads", "model.head_dim", "model.tie_word_embeddings",
    "model.attention_bias", "model.dtype", "model.param_dtype", "offload.enabled", "offload.params",
    "optimizer.state_dtype", "optimizer.state_block", "optimizer.master_dtype", "optimizer.master_rounding",
)

# What a checkpoint made before a field existed was made with.
_MISSING_MEANS = {"optimizer.state_dtype": "float32", "optimizer.master_dtype": "float32"}


def default_directory(run_config: Union[Config, dict]) -> Path:
    """``checkpoint.dir``, or ``<train.out_dir>/checkpoints`` when unset."""
    cfg = as_dict(run_config)
    return Path(cfg["checkpoint"].get("dir") or Path(cfg["train"]["out_dir"]) / "checkpoints")


def check_compatible(saved: dict, current: dict, where: Union[str, Path]) -> None:
    """Raises :class:`IncompatibleCheckpointError` naming every field of
    :data:`COMPATIBILITY_FIELDS` whose value differs (fields missing on either side are skipped,
    unless :data:`_MISSING_MEANS` says what their absence meant; ``optimizer.state_block``
    counts only where both sides keep int8 state)."""
    def value(cfg: dict, name: str):
        section, field = name.split(".")
        return cfg.get(section, {}).get(field, _MISSING_MEANS.get(name))

    diffs = []
    for name in COMPATIBILITY_FIELDS:
        a, b = value(saved, name), value(current, name)
        if name == "optimizer.state_block" and not value(saved, "optimizer.state_dtype") == \
                value(current, "optimizer.state_dtype") == "int8":
            continue
        if name == "optimizer.master_rounding" and not value(saved, "optimizer.master_dtype") == \
                value(current, "optimizer.master_dtype") == "bfloat16":
            continue  # a float32 master is not rounded
        if a is not None and b is not None and a != b:
            diffs.append(f"{name}: checkpoint has {a!r}, this run has {b!r}")
    if diffs:
        raise IncompatibleCheckpointError(f"checkpoint {where} was made with an incompatible config: "
                                          + "; ".join(diffs))


def complete_steps(directory: Union[str, Path]) -> list[int]:
    """Steps of the complete checkpoints in ``directory`` (ascending), read without creating or
    cleaning anything: Orbax renames a step directory to its bare number only once it is
    complete, so half-written saves (``<step>.orbax-checkpoint-tmp-*``) never count."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and p.is_dir())


def resume_target(cfg: CheckpointConfig, run_config: Union[Config, dict], resume: Union[str, int]) -> Optional[int]:
    """The step ``train.resume`` will restore (None: a fresh start), checked before a run writes
    anything: the step exists, its meta is intact and its config is compatible with this run.

    A corrupt newest checkpoint under ``resume: auto`` is refused with the way out in the
    message: an explicit earlier ``train.resume: <step>``, whose later steps are then replaced.
    """
    run_config = as_dict(run_config)
    directory = Path(cfg.dir or default_directory(run_config)).absolute()
    steps = complete_steps(directory)
    if resume == "none":
        if steps:  # a fresh start would fail when it reaches one of them, and mix two runs
            raise CheckpointError(f"train.resume=none: {directory} holds checkpoints of an earlier run (steps "
                                  f"{steps}); resume from them (train.resume=auto), or give this run another "
                                  f"train.out_dir or checkpoint.dir")
        return None
    step = requested_step(directory, directory.is_dir(), steps, resume)
    if step is None:
        return None
    try:
        record = read_meta(directory / str(step))
    except CorruptCheckpointError as err:
        earlier = [s for s in steps if s < step]
        if resume == "auto" and earlier:
            raise CorruptCheckpointError(f"{err}; to resume from the newest earlier checkpoint instead, set "
                                         f"train.resume={earlier[-1]} (steps after it are then replaced)") from None
        raise
    check_compatible(record["config"], run_config, directory / str(step))
    return step


def check_resume_partition(cfg: CheckpointConfig, run_config: Union[Config, dict], step: int, processes: int) -> None:
    """Refuses, before a run writes anything, to resume int8 optimizer state saved by another
    number of processes: its codes are scaled per block of each process's slices, so they cannot
    be re-split (float32 and bfloat16 state re-partition on restore)."""
    run_config = as_dict(run_config)
    if run_config.get("optimizer", {}).get("state_dtype") != "int8":
        return
    item = Path(cfg.dir or default_directory(run_config)).absolute() / str(step) / OFFLOADED
    saved = saved_processes(item) if item.is_dir() else processes
    if saved != processes:
        raise IncompatibleCheckpointError(
            f"checkpoint {item.parent} was saved by {saved} process(es), this run has {processes}: int8 optimizer "
            f"state is coded in blocks of each process's slices and cannot be re-split; resume with {saved} "
            f"process(es)")


def requested_step(directory: Path, existed: bool, steps: list[int], resume: Union[str, int]) -> Optional[int]:
    """``train.resume`` against the complete ``steps`` of ``directory`` (``existed``: before this
    run opened it): ``"none"`` -> None,
    ``"auto"`` -> the newest (None if there is none), a number -> that step, or
    :class:`CheckpointNotFoundError` naming the directory and the steps it holds."""
    if resume == "none":
        return None
    if resume == "auto":
        return steps[-1] if steps else None
    step = int(resume)
    if not existed:
        raise CheckpointNotFoundError(f"train.resume={step}: checkpoint directory {directory} does not exist")
    if step not in steps:
        raise CheckpointNotFoundError(f"train.resume={step}: no complete checkpoint for step {step} in "
                                      f"{directory} (available steps: {steps or 'none'})")
    return step
