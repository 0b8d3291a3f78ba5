"""Dynamic loss scaling for fp16 training: a small NamedTuple state, updated by the run's settings.

The scaled loss ``loss * scale`` keeps small fp16 gradients representable. After each step:
an overflow (any inf/NaN in the gradients, known from the gradient sink's statistics before the
optimizer runs) skips the step and multiplies the scale by ``backoff``; ``growth_interval``
finite steps in a row multiply it by ``growth``. bf16 and fp32 need no scaling (scale stays 1).

    scaling = LossScaling.of(cfg.optimizer, compute_dtype)   # the settings, once
    state = scaling.initial()
    state, skip = scaling.update(state, overflow)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from jaxascend.config import OptimizerConfig


class LossScaleState(NamedTuple):
    scale: float  # current loss scale (1.0 when scaling is off)
    good_steps: int  # finite steps since the last change of scale
    skipped_steps: int  # steps skipped for overflow so far

    @classmethod
    def initial(cls, cfg: OptimizerConfig, compute_dtype: str) -> "LossScaleState":
        return LossScaling.of(cfg, compute_dtype).initial()

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
    return LossScaling.of(cfg, compute_dtype).update(state, overflow)


@dataclass(frozen=True)
class LossScaling:
    """The loss-scale settings of a run (``optimizer.loss_scale*``, for its compute dtype)."""

    scaled: bool  # whether the loss is scaled at all (:func:`uses_loss_scaling`)
    init: float
    growth: float
    backoff: float
    growth_interval: int
    min: float
    max: float

    @classmethod
    def of(cls, cfg: OptimizerConfig, compute_dtype: str) -> "LossScaling":
        return cls(uses_loss_scaling(cfg, compute_dtype), cfg.loss_scale_init, cfg.loss_scale_growth,
                   cfg.loss_scale_backoff, cfg.loss_scale_growth_interval, cfg.loss_scale_min, cfg.loss_scale_max)

    def initial(self) -> LossScaleState:
        return LossScaleState(scale=float(self.init) if self.scaled else 1.0, good_steps=0, skipped_steps=0)

    def update(self, state: LossScaleState, overflow: bool) -> tuple[LossScaleState, bool]:
        """The next state and whether this step must be skipped."""
        if not overflow:
            good = state.good_steps + 1
            scale = state.scale
            if self.scaled and good >= self.growth_interval:
                scale, good = min(scale * self.growth, self.max), 0
            return LossScaleState(scale, good, state.skipped_steps), False
        scale = state.scale
        if self.scaled:
            scale = max(scale * self.backoff, self.min)
        return LossScaleState(scale, 0, state.skipped_steps + 1), True
