"""The settings that would make a run fit, each with what it saves: the plan made again with it.

    levers = host_levers(cfg, model_cfg, plan, replan)   # offload.params: ssd, model.remat: full, ...
    levers = disk_levers(cfg, model_cfg, plan, fs, replan)  # optimizer.state_dtype: int8, ...
    levers = device_levers(cfg, model_cfg, plan, replan)  # model.remat: full, offload.params: ssd, ...

``replan(cfg, model_cfg)`` is the planner itself (without levers); a lever is listed only where
it saves something (at least 1% of the shortfall), largest saving first.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from jaxascend.config import Config, ModelConfig
from jaxascend.planning.disk_plan import FilesystemUse
from jaxascend.planning.step_memory import REMAT

Replan = Callable[[Config, ModelConfig], Any]  # -> ResourcePlan, without levers
CHEAPER_STATES = {"float32": ("int8", "bfloat16"), "bfloat16": ("int8",), "int8": ()}


@dataclass(frozen=True)
class Lever:
    """One setting and what the part that does not fit needs with it."""

    setting: str  # e.g. "optimizer.state_dtype: int8"
    saves: int  # bytes
    needs: int  # what the part needs then


def _section(cfg: Config, name: str, **changes) -> Config:
    section = {"offload": cfg.offload, "data": cfg.data, "train": cfg.train, "optimizer": cfg.optimizer,
               "checkpoint": cfg.checkpoint, "export": cfg.export}[name]
    return dataclasses.replace(cfg, **{name: dataclasses.replace(section, **changes)})


def _kept(levers: list[Lever], short: int) -> tuple[Lever, ...]:
    useful = [lever for lever in levers if lever.saves > 0 and lever.saves >= 0.01 * short]
    return tuple(sorted(useful, key=lambda lever: -lever.saves))


def host_levers(cfg: Config, model_cfg: ModelConfig, plan, replan: Replan) -> tuple[Lever, ...]:
    """What each host-memory setting would save: the offloaded engine (for an in-memory run), the
    weights on SSD, the gradients on SSD, remat, a smaller batch or sequence, fewer micro-batches per step, an arena of
    exactly the plan's size."""
    variants = []
    if not cfg.offload.enabled:  # the in-memory engine: the whole AdamW state and the gradients in RAM
        variants.append(("offload.enabled: true", _section(cfg, "offload", enabled=True), model_cfg))
    if plan.params == "resident" and plan.streamable:
        variants.append(("offload.params: ssd", _section(cfg, "offload", params="ssd"), model_cfg))
    if plan.gradients == "host":
        variants.append(("offload.gradients: ssd", _section(cfg, "offload", gradients="ssd", host_gradient_layers=None),
                         model_cfg))
    if model_cfg.remat != "full":
        variants.append(("model.remat: full", dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, remat="full")),
                         dataclasses.replace(model_cfg, remat="full")))
    data = cfg.data
    if data.batch_size > 1:
        variants.append((f"data.batch_size: {data.batch_size // 2}", _section(cfg, "data", batch_size=data.batch_size // 2),
                         model_cfg))
    if data.seq_len > 1:
        variants.append((f"data.seq_len: {data.seq_len // 2}", _section(cfg, "data", seq_len=data.seq_len // 2), model_cfg))
    if cfg.train.grad_accum > 1:
        half = cfg.train.grad_accum // 2
        variants.append((f"train.grad_accum: {half}", _section(cfg, "train", grad_accum=half), model_cfg))
    if cfg.offload.arena_bytes is not None:
        variants.append(("offload.arena_bytes unset (the arena plan's own size)",
                         _section(cfg, "offload", arena_bytes=None), model_cfg))
    levers = []
    for setting, variant, variant_model in variants:
        planned = replan(variant, variant_model)
        levers.append(Lever(setting, plan.host_peak - planned.host_peak, planned.host_peak))
    return _kept(levers, plan.host_peak - (plan.host_limit or 0))


def device_levers(cfg: Config, model_cfg: ModelConfig, plan, replan: Replan) -> tuple[Lever, ...]:
    """What each setting would save of one device's memory: the offloaded engine (for an
    in-memory run), the weights on SSD, every other remat policy (its activations and
    temporaries by the step's estimator, step_memory), half the batch in twice the micro-batches
    (the same rows per step: only a layer's working set shrinks)."""
    variants = []
    if not cfg.offload.enabled:  # the in-memory engine: the AdamW state and the gradients on the device
        variants.append(("offload.enabled: true", _section(cfg, "offload", enabled=True), model_cfg))
    if plan.params == "resident" and plan.streamable:
        variants.append(("offload.params: ssd", _section(cfg, "offload", params="ssd"), model_cfg))
    for policy in REMAT:  # the estimator's policies; offload.params: ssd needs some remat
        if policy != model_cfg.remat and not (policy == "none" and plan.params == "ssd"):
            variants.append((f"model.remat: {policy}", dataclasses.replace(cfg, model=dataclasses.replace(
                cfg.model, remat=policy)), dataclasses.replace(model_cfg, remat=policy)))
    data, accum = cfg.data, cfg.train.grad_accum
    if data.batch_size % 2 == 0:
        half = _section(_section(cfg, "data", batch_size=data.batch_size // 2), "train", grad_accum=2 * accum)
        variants.append((f"data.batch_size: {data.batch_size // 2} with train.grad_accum: {2 * accum}", half,
                         model_cfg))
    levers = []
    for setting, variant, variant_model in variants:
        planned = replan(variant, variant_model)
        levers.append(Lever(setting, plan.device_peak - planned.device_peak, planned.device_peak))
    return _kept(levers, plan.device_peak - plan.device_limit.nbytes)


def _need_on(plan, folder: str) -> int:
    """What ``plan`` puts on the filesystem probed at ``folder``."""
    return sum(fs.need for fs in plan.disk if fs.folder == folder)


def disk_levers(cfg: Config, model_cfg: ModelConfig, plan, fs: FilesystemUse, replan: Replan) -> tuple[Lever, ...]:
    """What each disk setting would save on ``fs``: cheaper optimizer state (moments, a bfloat16
    master), the gradients in RAM, fewer checkpoints kept, no ``params.safetensors``."""
    variants = [(f"optimizer.state_dtype: {dtype}", _section(cfg, "optimizer", state_dtype=dtype))
                for dtype in CHEAPER_STATES[cfg.optimizer.state_dtype]]
    if cfg.optimizer.master_dtype == "float32" and cfg.model.dtype == "bfloat16" and cfg.offload.enabled:
        variants.append(("optimizer.master_dtype: bfloat16", _section(cfg, "optimizer", master_dtype="bfloat16")))
    if plan.gradients == "ssd" or plan.host_gradient_layers is not None:  # (some of them on SSD)
        variants.append(("offload.gradients: host", _section(cfg, "offload", gradients="host", host_gradient_layers=None)))
    fields = {part.field for part in fs.parts}
    if "checkpoint.dir" in fields and cfg.checkpoint.keep_last > 1:
        variants.append(("checkpoint.keep_last: 1", _section(cfg, "checkpoint", keep_last=1)))
    if "train.out_dir" in fields:
        variants.append(("export.save_params: false", _section(cfg, "export", save_params=False)))
    levers = []
    for setting, variant in variants:
        need = _need_on(replan(variant, model_cfg), fs.folder)
        levers.append(Lever(setting, fs.need - need, need))
    return _kept(levers, fs.short)
