"""Typed run configuration: one dataclass per subsystem, loaded from YAML with overrides.

    cfg = load_config("configs/tiny.yaml", overrides=["train.steps=20", "optimizer.learning_rate=1e-3"])

Every problem (unknown key, wrong type, out-of-range value, missing file) raises
:class:`ConfigError` whose message is one line naming the field and what is allowed.

* :mod:`~jaxascend.config.values` -- :class:`ConfigError`, byte sizes, range checks, dtype names;
* :mod:`~jaxascend.config.model` -- :class:`ModelConfig`, the RoPE scaling checks, hub ids as ``model.path``;
* :mod:`~jaxascend.config.sections` -- the other sections and :class:`Config`;
* :mod:`~jaxascend.config.loading` -- YAML, ``--set`` overrides, coercion, cross-section checks;
* :mod:`~jaxascend.config.field_docs` -- every field's type, default and meaning, from the source
  (``python -m jaxascend.config`` prints them).
"""

from jaxascend.config.field_docs import sections_help
from jaxascend.config.loading import check_report_backends, load_config
from jaxascend.config.model import LAYER_TYPES, HubId, ModelConfig, ROPE_TYPES, parse_hub_id, validate_rope_scaling
from jaxascend.config.sections import (CheckpointConfig, Config, DataConfig, DistributedConfig, OffloadConfig,
                                       OptimizerConfig, TrainConfig)
from jaxascend.config.values import ConfigError, DType, did_you_mean, parse_bytes

__all__ = [
    "CheckpointConfig", "Config", "ConfigError", "DType", "DataConfig", "DistributedConfig", "HubId", "LAYER_TYPES",
    "ModelConfig", "OffloadConfig", "OptimizerConfig", "ROPE_TYPES", "TrainConfig",
    "check_report_backends", "did_you_mean", "load_config", "parse_bytes", "parse_hub_id", "sections_help",
    "validate_rope_scaling",
]
