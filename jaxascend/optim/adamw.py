"""AdamW: the in-memory optax baseline and the settings the fused SSD kernel takes.

The in-memory path is the baseline every JAX user has today (fp32 params and moments in RAM).
:class:`AdamWSettings` holds the same hyperparameters for the fused kernel
(:mod:`jaxascend.optim.fused_adam`), which the SSD-resident AdamW of
:mod:`jaxascend.offload.ssd_adamw` runs chunk by chunk.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxascend.config import OptimizerConfig
from jaxascend.optim.decay_mask import decay_mask
from jaxascend.optim.fused_adam import SCALAR_COUNT, WEIGHT_DECAY_SLOT, AdamHyperParams
from jaxascend.optim.schedules import learning_rate_schedule


def adamw_in_memory(cfg: OptimizerConfig, total_steps: int) -> optax.GradientTransformation:
    """``clip_by_global_norm`` (if configured) followed by ``optax.adamw`` on the schedule, its
    decay on the parameters ``cfg.weight_decay_mask`` selects (:mod:`~jaxascend.optim.decay_mask`)."""
    rule = cfg.weight_decay_mask
    mask = None if rule == "all" else functools.partial(decay_mask, rule)
    tx = optax.adamw(learning_rate_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                     weight_decay=cfg.weight_decay, mask=mask)
    if cfg.grad_clip_norm is not None:
        tx = optax.chain(optax.clip_by_global_norm(cfg.grad_clip_norm), tx)
    return tx


@dataclass(frozen=True)
class AdamWSettings:
    """AdamW's hyperparameters, as :func:`optax.adamw` takes them (``learning_rate`` a float
    or an optax schedule of the update count; ``decay``: per parameter leaf, in the SSD state's
    leaf order, whether ``weight_decay`` applies to it, as optax's ``mask``; None: to every leaf)."""

    learning_rate: Union[float, optax.Schedule]
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    decay: Optional[tuple[bool, ...]] = None

    @classmethod
    def from_config(cls, cfg: OptimizerConfig, total_steps: int,
                    decay: Optional[tuple[bool, ...]] = None) -> "AdamWSettings":
        """The settings of ``cfg`` with :func:`learning_rate_schedule` (clipping is the caller's);
        ``decay``: per leaf, from :func:`~jaxascend.optim.decay_mask.leaf_decay` of ``cfg.weight_decay_mask``."""
        return cls(learning_rate_schedule(cfg, total_steps), cfg.b1, cfg.b2, cfg.eps, cfg.weight_decay, decay)

    def hyperparams(self, count, grad_scale=1.0) -> AdamHyperParams:
        """The kernel's hyperparameters for the update after ``count`` updates (traceable)."""
        lr = self.learning_rate(count) if callable(self.learning_rate) else self.learning_rate
        return AdamHyperParams(lr=lr, b1=self.b1, b2=self.b2, eps=self.eps, weight_decay=self.weight_decay,
                               grad_scale=grad_scale, count=count)

    def per_leaf(self, scalars):
        """The kernel's operand per leaf: ``scalars`` (float32[10]) as rows ``[leaves, 10]``,
        ``weight_decay`` 0 in the rows of the leaves that do not decay; ``scalars`` itself when
        every leaf decays (``decay`` None). Traceable."""
        if self.decay is None:
            return scalars
        keep = jnp.asarray(self.decay)[:, None] | (jnp.arange(SCALAR_COUNT) != WEIGHT_DECAY_SLOT)[None, :]
        return jnp.where(keep, scalars[None, :], jnp.zeros((), scalars.dtype))

    @functools.cached_property
    def _jitted_scalars(self):
        # One compiled function per settings object: count and grad_scale are runtime values,
        # so a new step or a new clip factor never recompiles.
        return jax.jit(lambda count, grad_scale: self.per_leaf(self.hyperparams(count, grad_scale).scalars()))

    def scalars(self, count: int, grad_scale: float = 1.0) -> np.ndarray:
        """``per_leaf(hyperparams(count, grad_scale).scalars())`` on the host: float32[10], or
        float32[leaves, 10] with a decay mask; computed under jit (as optax computes them inside a
        jitted update)."""
        return np.asarray(self._jitted_scalars(jnp.int32(count), jnp.float32(grad_scale)))
