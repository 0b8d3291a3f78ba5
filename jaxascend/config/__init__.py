"""Typed run configuration: one dataclass per subsystem, loaded from YAML with overrides.

    cfg = load_config("configs/tiny.yaml", overrides=["train.steps=20", "optimizer.learning_rate=1e-3"])

Every problem (unknown key, wrong type, out-of-range value, missing file) raises
:class:`ConfigError` whose message is one line naming the field and what is allowed.

* :mod:`~jaxascend.config.values` -- :class:`ConfigError`, byte sizes, range checks, dtype names;
* :mod:`~jaxascend.config.model` -- :class:`ModelConfig` and the RoPE scaling checks;
* :mod:`~jaxascend.config.sections` -- the other sections and :class:`Config`;
* :mod:`~jaxascend.config.loading` -- YAML, ``--set`` overrides, coercion, cross-section checks.
"""

from jaxascend.config.loading import apply_overrides, check_param_placement, config_from_dict, load_config
from jaxascend.config.model import GEMMA3_FIELDS, LAYER_TYPES, ROPE_TYPES, ModelConfig, validate_rope_scaling
from jaxascend.config.sections import (CheckpointConfig, Config, DataConfig, DistributedConfig, EvalConfig, ExportConfig,
                                       OffloadConfig,
                                       OptimizerConfig, TrainConfig, validate_resume)
from jaxascend.config.values import ConfigError, DType, HiddenAct, RematPolicy, parse_bytes

__all__ = [
    "GEMMA3_FIELDS", "LAYER_TYPES", "ROPE_TYPES", "CheckpointConfig", "Config", "ConfigError", "DType", "DataConfig",
    "DistributedConfig", "EvalConfig", "ExportConfig", "HiddenAct", "ModelConfig", "OffloadConfig", "OptimizerConfig", "RematPolicy", "TrainConfig",
    "apply_overrides", "check_param_placement", "config_from_dict", "load_config", "parse_bytes", "validate_resume",
    "validate_rope_scaling",
]
