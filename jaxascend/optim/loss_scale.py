"""Dynamic loss scaling for fp16 training, as a pure function on a small NamedTuple.

The scaled loss ``loss * scale`` keeps small fp16 gradients representable. After each step:
an overflow (any inf/NaN in the gradients, known from the gradient sink's statistics before the
optimizer runs) skips the step and multiplies the scale by ``backoff``; ``growth_interval``
finite steps in a row multiply it by ``growth``. bf16 and fp32 need no scaling (scale stays 1).

    state = LossScaleState.initial(cfg)
    state, skip = update_loss_scale(state, overflow, cfg)
"""

from __future__ import annotations

from typing import NamedTuple

from jaxascend.config import OptimizerConfig


class LossScaleState(NamedTuple):
    scale: float  # current loss scale (1.0 when scaling is off)
    good_steps: int  # finite steps since the last change of scale
    skipped_steps: int  # steps skipped for overflow so far

    @classmethod
    def initial(cls, cfg: OptimizerConfig, compute_dtype: str) -> "LossScaleState":
        return cls(scale=float(cfg.loss_scale_init) if uses_loss_scaling(cfg, compute_dtype) else 1.0,
                   good_steps=0, skipped_steps=0)

    def to_dict(self) -> dict:
        return self._asdict()

    @classmethod
    def from_dict(cls, d: dict) -> "LossScaleState":
        return cls(scale=float(d["scale"]), good_steps=int(d["good_steps"]), skipped_steps=int(d["skipped_steps"]))


def uses_loss_scaling(cfg: OptimizerConfig, compute_dtype: str) -> bool:
    """``loss_scale: dynamic`` scales fp16 only; ``always`` scales any dtype; ``none`` never."""
    if cfg.loss_scale == "dynamic":
        return compute_dtype == "float16"
    return cfg.loss_scale == "always"


def update_loss_scale(state: LossScaleState, overflow: bool, cfg: OptimizerConfig,
                      compute_dtype: str) -> tuple[LossScaleState, bool]:
    """Returns the next state and whether this step must be skipped."""
    if not overflow:
        good = state.good_steps + 1
        scale = state.scale
        if uses_loss_scaling(cfg, compute_dtype) and good >= cfg.loss_scale_growth_interval:
            scale, good = min(scale * cfg.loss_scale_growth, cfg.loss_scale_max), 0
        return LossScaleState(scale, good, state.skipped_steps), False
    scale = state.scale
    if uses_loss_scaling(cfg, compute_dtype):
        scale = max(scale * cfg.loss_scale_backoff, cfg.loss_scale_min)
    return LossScaleState(scale, 0, state.skipped_steps + 1), True
