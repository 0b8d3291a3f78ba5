"""The offloaded engine built from a run's config, for callers that hold one (tests, benchmark
scripts): ``OffloadEngine(cfg, model, model_cfg, plan)`` resolves the plan (default: one device,
one process) and the typed settings (:class:`~jaxascend.offload.engine_settings.EngineSettings`)
and builds :class:`~jaxascend.offload.engine.PlannedOffloadEngine`, which reads no config."""

from __future__ import annotations

from typing import Optional

from flax import nnx

from jaxascend.config import Config, ModelConfig
from jaxascend.offload.engine import MasterReader, PlannedOffloadEngine
from jaxascend.offload.engine_settings import EngineSettings
from jaxascend.offload.step_plan import StepPlan


class OffloadEngine(PlannedOffloadEngine):
    """:class:`PlannedOffloadEngine` built from a run's config: ``plan`` the step's strategy
    (:meth:`StepPlan.resolve`; default: one device, one process), the settings
    :meth:`EngineSettings.of` ``cfg``. ``cfg.offload.params`` must be resolved ("auto" is taken
    as "resident"; the trainer resolves it with the run planner)."""

    def __init__(self, cfg: Config, model: nnx.Module, model_cfg: ModelConfig, plan: Optional[StepPlan] = None,
                 master: Optional[MasterReader] = None):
        plan = plan or StepPlan.resolve(cfg, model_cfg)
        super().__init__(model, model_cfg, plan, EngineSettings.of(cfg, model_cfg, model), master=master)
