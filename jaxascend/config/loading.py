"""Loading a run config: YAML (safe loader), ``--set section.field=value`` overrides, typed
coercion with one-line errors, and the checks that need several sections at once."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from jaxascend.config.model import parse_hub_id
from jaxascend.config.sections import REPORT_BACKENDS, Config
from jaxascend.config.values import ConfigError, did_you_mean, type_text


def _coerce(value: Any, tp, name: str) -> Any:
    """Checks ``value`` against the annotation ``tp``; returns it (ints widen to floats)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        sections = [a for a in args if dataclasses.is_dataclass(a)]
        if len(sections) == 1 and isinstance(value, dict):  # a nested section: its own errors, by field
            return _build(sections[0], value, name)
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, name)
            except ConfigError:
                continue
        raise ConfigError(f"{name}: expected {type_text(tp)}, got {value!r}")
    if origin is Literal:
        if value in typing.get_args(tp) and not isinstance(value, bool):
            return value
        close = did_you_mean(value, [str(a) for a in typing.get_args(tp)]) if isinstance(value, str) else ""
        raise ConfigError(f"{name}: expected {type_text(tp)}, got {value!r}{close}")
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, str):  # a single path is a list of one
            value = [value]
        if not isinstance(value, list):
            raise ConfigError(f"{name}: expected {type_text(tp)}, got {value!r}")
        return [_coerce(v, item_tp, f"{name}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        # YAML 1.1 reads "1e-3" (no dot) as a string; accept plain numeric strings.
        if isinstance(value, str) and re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?", value.strip()):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is dict:
        if isinstance(value, dict):
            return value
    elif dataclasses.is_dataclass(tp):
        return _build(tp, value, name)
    raise ConfigError(f"{name}: expected {type_text(tp)}, got {value!r}")


def _build(cls, data: Any, prefix: str):
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping of fields, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            raise ConfigError(f"{full}: unknown key{did_you_mean(str(key), names)} (allowed: {', '.join(names)})")
        kwargs[key] = _coerce(value, hints[key], full)
    try:
        return cls(**kwargs)
    except TypeError as err:  # pragma: no cover - dataclass signature mismatch
        raise ConfigError(f"{prefix or 'config'}: {err}") from None


def _parse_scalar(text: str) -> Any:
    """Parses the value of a ``--set a.b=value`` override as YAML (so 1e-3, true, [a, b] work)."""
    try:
        return yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        stripped = text.strip()
        if stripped.startswith("[") and stripped.endswith("]"):  # [@stdlib, a.txt]: '@' is reserved in YAML
            return [_parse_scalar(part.strip()) for part in stripped[1:-1].split(",") if part.strip()]
        return text


def _section_type(tp) -> Any:
    """The section class an annotation holds (``SomeConfig`` or ``Optional[SomeConfig]``), or None."""
    if dataclasses.is_dataclass(tp):
        return tp
    inner = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
    return inner[0] if len(inner) == 1 else None


def _override_target(key: str) -> list[str]:
    """The parts of an override's dotted ``key`` (``section[.sub ...].field``), each checked against
    the section it names a field of: an unknown name, or a plain field with more parts after it,
    is refused."""
    parts = key.split(".")
    if len(parts) < 2 or not all(parts):
        raise ConfigError(f"--set {key!r}: expected section.field (e.g. train.steps or "
                          "train.distributed.num_processes)")
    cls, hints = Config, typing.get_type_hints(Config)
    for depth, part in enumerate(parts[:-1]):
        prefix, name = ".".join(parts[:depth]), ".".join(parts[:depth + 1])
        sections = [f.name for f in dataclasses.fields(cls) if _section_type(hints[f.name])]
        if part in hints and part not in sections:
            raise ConfigError(f"--set {key!r}: {name} is a field ({type_text(hints[part])}), not a section; "
                              f"set it with --set {name}=VALUE")
        if part not in hints:
            where = f" in {prefix}" if prefix else ""
            listing = f"allowed: {', '.join(sections)}" if sections else f"{prefix} has no nested section"
            raise ConfigError(f"{name}: unknown section{where}{did_you_mean(part, sections)} ({listing})")
        cls = _section_type(hints[part])
        hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    if parts[-1] not in names:
        raise ConfigError(f"{key}: unknown key{did_you_mean(parts[-1], names)} (allowed: {', '.join(names)})")
    return parts


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Applies ``section[.sub ...].field=value`` strings to a nested dict (in place) and returns it;
    a nested section (``train.distributed``) is reached through its own mapping."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected section.field=value")
        key, text = item.split("=", 1)
        parts = _override_target(key.strip())
        node = data
        for depth, part in enumerate(parts[:-1]):
            if node.get(part) is None:
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict):  # the YAML gave the section a plain value
                raise ConfigError(f"{'.'.join(parts[:depth + 1])}: expected a mapping of fields, got {node!r}")
        node[parts[-1]] = _parse_scalar(text)
    return data


def config_from_dict(data: dict, inputs: bool = True) -> Config:
    """Builds and validates a :class:`Config` from plain nested dicts; ``inputs`` False: the
    data, held-out data, chat template and tokenizer folders need not exist (the planner)."""
    cfg = _build(Config, data, "")
    _validate_cross_fields(cfg)
    if inputs:
        check_inputs_exist(cfg)
    return cfg


def check_report_backends(report_to: list[str]) -> None:
    """Refuses a ``train.report_to`` entry whose package is not installed (one line naming the pip command)."""
    for name in report_to:
        module, pip = REPORT_BACKENDS[name]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"train.report_to: {name!r} needs the {module} package, which is not installed: {pip}")


def check_inputs_exist(cfg: Config) -> None:
    """Refuses data, held-out data, a chat template or a tokenizer folder that is not on disk, and
    a ``train.report_to`` whose package is not installed."""
    check_report_backends(cfg.train.report_to)
    for p in cfg.data.paths:
        if p != "@stdlib" and not os.path.exists(os.path.expanduser(p)):
            raise ConfigError(f"data.paths: {p!r} does not exist")
    for p in cfg.eval.paths:
        if p != "@stdlib" and not os.path.exists(os.path.expanduser(p)):
            raise ConfigError(f"eval.paths: {p!r} does not exist")
    if cfg.data.chat_template is not None and not os.path.isfile(os.path.expanduser(cfg.data.chat_template)):
        raise ConfigError(f"data.chat_template: {cfg.data.chat_template!r} is not a file")
    tok = cfg.data.tokenizer
    if tok not in ("auto", "byte", "model") and not os.path.isdir(os.path.expanduser(tok)):
        raise ConfigError(f"data.tokenizer: expected 'auto', 'byte', 'model' or a tokenizer folder, got {tok!r}")


def _validate_cross_fields(cfg: Config) -> None:
    if cfg.offload.dir is None:
        cfg.offload.dir = os.path.join(cfg.train.out_dir, "offload")
    if not cfg.data.paths:
        raise ConfigError("data.paths: missing; give at least one .txt/.jsonl file or directory")
    if cfg.data.tokenizer == "model" and cfg.model.path is None:
        raise ConfigError("data.tokenizer: 'model' needs model.path to be set")
    # A hub id (org/name) is looked up in the Hugging Face cache when the run reads its inputs
    # (jaxascend.hf.hub); a folder of that name wins.
    if cfg.model.path is not None and not os.path.isdir(os.path.expanduser(cfg.model.path)) \
            and parse_hub_id(cfg.model.path) is None:
        raise ConfigError(f"model.path: {cfg.model.path!r} is not a directory")
    if cfg.optimizer.state_dtype != "float32" and not cfg.offload.enabled:
        raise ConfigError(f"optimizer.state_dtype: {cfg.optimizer.state_dtype!r} needs offload.enabled: true (the "
                          "in-memory engine keeps optax's float32 moments)")
    if cfg.offload.gradients != "auto" and not cfg.offload.enabled:
        raise ConfigError(f"offload.gradients: {cfg.offload.gradients!r} needs offload.enabled: true (the in-memory "
                          "engine keeps its gradients on the device)")
    if cfg.offload.host_gradient_layers is not None and cfg.offload.gradients != "host":
        raise ConfigError(f"offload.host_gradient_layers: {cfg.offload.host_gradient_layers} needs offload.gradients: "
                          f"host, got {cfg.offload.gradients!r} (auto chooses how many layers itself)")
    if cfg.offload.durable and not cfg.offload.enabled:
        raise ConfigError("offload.durable: true needs offload.enabled: true (the in-memory engine's state is in RAM: "
                          "its resume points are its checkpoints, checkpoint.every_steps)")
    if cfg.offload.gradients != "auto" and cfg.offload.fp32_grad_buffer:
        raise ConfigError(f"offload.gradients: {cfg.offload.gradients!r} cannot be combined with "
                          "offload.fp32_grad_buffer (the ablation keeps its own float32 host buffer); leave it auto")
    if cfg.optimizer.master_dtype == "bfloat16" and not cfg.offload.enabled:
        raise ConfigError("optimizer.master_dtype: 'bfloat16' needs offload.enabled: true (the in-memory engine "
                          "keeps optax's float32 weights)")
    if cfg.optimizer.master_dtype == "bfloat16" and cfg.model.dtype != "bfloat16":
        raise ConfigError(f"optimizer.master_dtype: 'bfloat16' needs model.dtype: bfloat16 (the compute weights are "
                          f"the master), got {cfg.model.dtype!r}")
    # With model.path, config.json's limit applies: checked once it is read
    # (jaxascend.preparation.resolve_model_config); the section's own is a default then.
    if cfg.model.path is None and cfg.data.seq_len > cfg.model.max_position_embeddings:
        raise ConfigError(
            f"data.seq_len: {cfg.data.seq_len} exceeds model.max_position_embeddings="
            f"{cfg.model.max_position_embeddings}")


def load_config(path: str | os.PathLike | None, overrides: list[str] | None = None, inputs: bool = True) -> Config:
    """Reads a YAML config (safe loader), applies ``--set`` overrides and validates; ``inputs``
    False: without checking that the data and tokenizer are on disk (the planner plans without them)."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"--config: file {str(p)!r} not found")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as err:
            first = str(err).splitlines()[0] if str(err) else "parse error"
            raise ConfigError(f"{p}: invalid YAML ({first})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{p}: expected a mapping of sections at the top level")
    file_train = dict(data["train"]) if isinstance(data.get("train"), dict) else {}
    apply_overrides(data, overrides or [])
    check_length_sources(file_train, data, overrides or [])
    return config_from_dict(data, inputs)


def check_length_sources(file_train: dict, data: dict, overrides: list[str]) -> None:
    """A ``--set`` of ``train.steps`` or ``train.epochs`` over a config file that gives the other
    (``file_train``: the file's train section) wins over the file's, in one ``note:``; both given
    in one place is TrainConfig's own refusal."""
    train = data.get("train")
    if not isinstance(train, dict) or train.get("steps") is None or train.get("epochs") is None:
        return
    keys = {item.split("=", 1)[0].strip() for item in overrides}
    for asked, other in (("steps", "epochs"), ("epochs", "steps")):
        if f"train.{asked}" in keys and f"train.{other}" not in keys and file_train.get(other) is not None:
            from jaxascend import console

            train[other] = None
            console.note(f"train.{asked}: --set train.{asked}={train[asked]} replaces the config file's "
                         f"train.{other}: {file_train[other]} (the two are exclusive)")
