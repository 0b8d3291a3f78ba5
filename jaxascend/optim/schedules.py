"""Learning-rate schedules: linear warmup, then constant, cosine or linear decay (an optax schedule)."""

from __future__ import annotations

from typing import Optional

import optax

from jaxascend.config import OptimizerConfig


def learning_rate_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup to ``cfg.learning_rate`` then constant, cosine or linear decay to
    ``cfg.learning_rate * cfg.min_lr_ratio`` at ``total_steps``. A warmup as long as the
    schedule or longer is a ramp that the run never finishes (as in transformers' Trainer): the
    rate climbs by ``1 / warmup_steps`` of its peak each update and never reaches it."""
    peak = cfg.learning_rate
    warmup = cfg.warmup_steps
    if warmup >= total_steps:
        return optax.linear_schedule(0.0, peak, warmup)
    decay_steps = max(total_steps - warmup, 1)
    end = peak * cfg.min_lr_ratio
    if cfg.schedule == "constant":
        main = optax.constant_schedule(peak)
    elif cfg.schedule == "cosine":
        main = optax.cosine_decay_schedule(peak, decay_steps, alpha=cfg.min_lr_ratio)
    else:
        main = optax.linear_schedule(peak, end, decay_steps)
    if warmup == 0:
        return main
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), main], [warmup])


def unfinished_warmup_note(cfg: OptimizerConfig, total_steps: int) -> Optional[str]:
    """The ``note:`` for a warmup the schedule never leaves (None when it ends inside it): how
    high the learning rate gets, read off the schedule at the last update (count
    ``total_steps - 1``; the first update's count is 0)."""
    if not cfg.warmup_steps or cfg.warmup_steps < total_steps or cfg.learning_rate <= 0:
        return None
    reached = float(learning_rate_schedule(cfg, total_steps)(total_steps - 1)) / cfg.learning_rate
    return (f"optimizer.warmup_steps: the warmup ({cfg.warmup_steps} steps) is longer than the schedule "
            f"({total_steps} steps): the learning rate ramps to {reached:.0%} of its peak {cfg.learning_rate:g} "
            "and never reaches it")
