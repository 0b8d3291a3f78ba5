"""Learning-rate schedules: linear warmup, then constant, cosine or linear decay (an optax schedule)."""

from __future__ import annotations

import optax

from jaxascend.config import OptimizerConfig


def learning_rate_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup to ``cfg.learning_rate`` then constant, cosine or linear decay to
    ``cfg.learning_rate * cfg.min_lr_ratio`` at ``total_steps``."""
    peak = cfg.learning_rate
    warmup = min(cfg.warmup_steps, total_steps)
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
