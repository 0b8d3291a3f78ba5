"""What the offloaded engine takes from a run's config, as typed values built once before it:
the AdamW settings, how its state on SSD is laid out and run, the loss scaling and the gradient
clip. The engine (:class:`~jaxascend.offload.engine.PlannedOffloadEngine`) reads no config: it is
built from its :class:`~jaxascend.offload.step_plan.StepPlan` and these settings.

    plan = StepPlan.resolve(cfg, model_cfg, job)
    settings = EngineSettings.of(cfg, model_cfg, model)
    engine = PlannedOffloadEngine(model, model_cfg, plan, settings, master=reader)

:class:`~jaxascend.offload.from_config.OffloadEngine` is that engine built from a config
(``OffloadEngine(cfg, model, model_cfg, plan)``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import jax
from flax import nnx

from jaxascend.config import Config, ModelConfig, OffloadConfig
from jaxascend.hf import tree_path_to_dotted
from jaxascend.offload.state_layout import state_format
from jaxascend.optim import AdamWSettings, LossScaling, StateFormat, leaf_decay


def param_paths(params) -> list[tuple[str, ...]]:
    """Our parameter path of every leaf of ``params`` (an ``nnx.State`` or a plain tree), in the
    SSD layout's leaf order."""
    tree = nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params
    return [tuple(tree_path_to_dotted(path).split(".")) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


@dataclass(frozen=True)
class StateOptions:
    """How the engine's state on SSD is laid out and run: the store's section (``offload.*``:
    its directory, arena, chunks, I/O, kernel threads), the format of m and v, and the seed of
    the stochastic rounding."""

    offload: OffloadConfig
    format: StateFormat
    rounding_seed: int


@dataclass(frozen=True)
class EngineSettings:
    """Everything but the plan that the engine takes from the run's config."""

    adamw: AdamWSettings  # with the weight decay per leaf (optimizer.weight_decay_mask)
    state: StateOptions
    loss_scaling: LossScaling
    grad_clip_norm: Optional[float]  # None: no clip

    @classmethod
    def of(cls, cfg: Config, model_cfg: ModelConfig, model: nnx.Module) -> "EngineSettings":
        """The settings of ``cfg`` for ``model`` (its parameters' paths choose the decay per leaf)."""
        rule = cfg.optimizer.weight_decay_mask  # weight decay per leaf, by its path
        decay = None if rule == "all" else \
            leaf_decay(rule, [".".join(path) for path in param_paths(nnx.state(model, nnx.Param))])
        return cls(AdamWSettings.from_config(cfg.optimizer, cfg.schedule_length(), decay),
                   StateOptions(cfg.offload, state_format(cfg), cfg.train.seed),
                   LossScaling.of(cfg.optimizer, model_cfg.dtype), cfg.optimizer.grad_clip_norm)
