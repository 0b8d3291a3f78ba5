"""A run's first phase, shared by the trainer and the planner CLI: everything the run reads
(``config.json``, the weights' safetensors headers, the tokenizer, the data, the held-out data)
and the plans made from it, before anything is written.

    prepared = prepare_run(cfg, JobShape(...))
    prepared.resources.check()                # host memory, disk, arena: PlanError naming the part
    for line in prepared.notes + prepared.step_plan.notes: console.note(line)

The trainer reads every input (:func:`read_inputs`, the default). The planner CLI plans from what
is there (:func:`read_available_inputs`): ``config.json`` alone is enough. Without the tokenizer
the vocabulary is config.json's; without the data the runtime part is estimated; each such
assumption is one line of ``prepared.assumed``. Both read the first record of every data file
first, with no tokenizer (:func:`resolve_data`): ``data.format: auto`` is resolved into
``prepared.cfg`` there, and a wrong field is the same error from both. With ``model.init: random``
neither reads the folder's weights (:func:`with_random_init`: the model starts from a random
initialization of config.json's shape, and the tokenizer is the byte one when the folder has none).
"""

from __future__ import annotations

import dataclasses
import glob
import os
from dataclasses import dataclass
from typing import Any, Optional

from jaxascend import console
from jaxascend.config import Config, ConfigError, DataConfig, ModelConfig
from jaxascend.data import (EpochCount, eval_batches, has_tokenizer_files, load_tokenizer, make_batch_stream,
                            missing_paths, read_data_format, tokenizer_folder, with_epoch_steps)
from jaxascend.hf import CONFIG_FILE, ModelSource, check_hf_weights, locate_model, model_config_from_hf, param_plan
from jaxascend.models import TokenBatch, token_batch
from jaxascend.offload import JobShape, StepPlan, read_journal
from jaxascend.planning import ResourcePlan, plan_resources
from jaxascend.optim import check_decay_rule


def resolve_model_config(cfg: Config) -> ModelConfig:
    """``cfg.model``, or the architecture read from ``model.path``'s config.json with the run's
    numerics (dtype, param_dtype, remat) on top."""
    if cfg.model.path is None:
        return cfg.model
    model_cfg = model_config_from_hf(cfg.model.path, base=cfg.model)
    if cfg.data.seq_len > model_cfg.max_position_embeddings:
        raise ConfigError(f"data.seq_len: {cfg.data.seq_len} exceeds the model's max_position_embeddings="
                          f"{model_cfg.max_position_embeddings} ({cfg.model.path}/config.json)")
    return model_cfg


def with_model_folder(cfg: Config, weights: bool = True) -> Config:
    """``cfg`` with ``model.path`` the folder it is read from: itself, or a hub id's snapshot in
    the Hugging Face cache (downloaded there when missing and the hub is online; ``weights``
    False: config.json and the tokenizer only). The run's own config keeps what the user wrote."""
    if cfg.model.path is None:
        return cfg
    folder = locate_model(cfg.model.path, weights).folder
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=folder))


def model_notes(asked: ModelConfig, resolved: ModelConfig) -> tuple[str, ...]:
    """The ``note:`` lines of ``model.path`` (none for a model from scratch): the snapshot a hub
    id is read from, and the model section's fields config.json replaced."""
    if asked.path is None:
        return ()
    lines = (ModelSource.of(asked.path, resolved.path).note(), replaced_fields_note(asked, resolved))
    return tuple(line for line in lines if line)


def master_notes(cfg: Config, weights_dtype: str) -> tuple[str, ...]:
    """The ``note:`` of a bfloat16 master rounded once from ``model.path``'s wider weights
    (``weights_dtype``): a stochastic (or nearest) one starts from their bfloat16 rounding; a
    compensated one holds them (float32 ones exactly but for a tie that rounds down, one ulp),
    and a bfloat16 checkpoint is the master as it is."""
    o = cfg.optimizer
    if o.master_dtype != "bfloat16" or o.master_rounding == "compensated" or weights_dtype == "bfloat16":
        return ()
    return (f"optimizer.master_dtype: bfloat16 ({o.master_rounding}): the {weights_dtype} weights of "
            f"{cfg.model.path} are rounded once to bfloat16 (to nearest) where the master starts from them",)


def replaced_fields_note(asked: ModelConfig, resolved: ModelConfig) -> Optional[str]:
    """The ``note:`` for the model section's architecture fields that ``model.path``'s config.json
    replaced: set to a value other than the default, and not the model's (None when none was)."""
    default = ModelConfig()
    replaced = [f.name for f in dataclasses.fields(ModelConfig) if f.name != "path"
                and getattr(asked, f.name) != getattr(default, f.name)
                and getattr(asked, f.name) != getattr(resolved, f.name)]
    if not replaced:
        return None
    pairs = ", ".join(f"{name} {getattr(asked, name)!r} -> {getattr(resolved, name)!r}" for name in replaced)
    return (f"model: {pairs}: {resolved.path}/config.json decides the architecture (with model.path, the model "
            "section sets only dtype, param_dtype, remat, attention, loss, init_std and init)")


def _safetensors_in(folder: str) -> list[str]:
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(os.path.expanduser(folder), "*.safetensors")))


def pretrained_weights(folder: str, model_cfg: ModelConfig) -> str:
    """:func:`check_hf_weights` of ``model.path``'s folder (the checkpoint's dtype); a folder that
    holds no safetensors file is refused in one line that names ``model.init: random``."""
    try:
        return check_hf_weights(folder, model_cfg)
    except ValueError as err:
        if _safetensors_in(folder):
            raise
        raise ConfigError(f"model.path: {console.first_line(err)}; set model.init: random to train from its "
                          f"{CONFIG_FILE} alone (a random initialization)") from None


def random_init_note(cfg: Config, model_cfg: ModelConfig) -> str:
    """The ``note:`` of ``model.init: random`` with ``model.path``: where the weights start, and
    that the folder's safetensors (if any) are not read."""
    found = _safetensors_in(model_cfg.path)
    unread = (f"the folder's {', '.join(found[:2])}{' ...' if len(found) > 2 else ''} "
              f"{'is' if len(found) == 1 else 'are'} not read") if found else "no safetensors are read"
    return (f"model.init: random: the weights start from a random initialization (std {model_cfg.init_std:g}, "
            f"train.seed {cfg.train.seed}) of {os.path.join(model_cfg.path, CONFIG_FILE)}'s shape; {unread}")


def with_random_init(cfg: Config, model_cfg: ModelConfig) -> tuple[Config, tuple[str, ...]]:
    """``cfg`` and its notes for ``model.init: random`` with ``model.path`` (none otherwise): where
    the weights start (:func:`random_init_note`); from a folder that holds no tokenizer files,
    ``data.tokenizer: auto`` is the byte tokenizer (a note; the vocabulary stays config.json's) and
    ``model`` is refused."""
    folder = cfg.model.path
    if folder is None or cfg.model.init != "random":
        return cfg, ()
    notes = (random_init_note(cfg, model_cfg),)
    if has_tokenizer_files(folder) or cfg.data.tokenizer not in ("auto", "model"):
        return cfg, notes
    if cfg.data.tokenizer == "model":
        raise ConfigError(f"data.tokenizer: 'model': {folder} holds no tokenizer files (model.init: random reads "
                          "its config.json alone); set data.tokenizer to auto or byte (the byte tokenizer), or a "
                          "tokenizer folder")
    notes += (f"data.tokenizer: auto is the byte tokenizer: {folder} holds no tokenizer files (model.init: random); "
              f"the vocabulary stays {CONFIG_FILE}'s ({model_cfg.vocab_size})",)
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer="byte")), notes


def vocabulary_size(cfg: Config, model_cfg: ModelConfig, tokenizer) -> int:
    """The embedding rows: the model's vocabulary (config.json or model.vocab_size), or the
    tokenizer's for a model from scratch; refuses a tokenizer whose ids do not fit the model.
    ``tokenizer`` None (not read): the model's own."""
    if tokenizer is None:
        if not model_cfg.vocab_size:
            raise ConfigError(f"data.tokenizer: no tokenizer files in {tokenizer_folder(cfg.data.tokenizer, model_cfg.path)}"
                              " and no vocabulary in the model's config (model.vocab_size: 0); the plan needs one")
        return model_cfg.vocab_size
    vocab_size = model_cfg.vocab_size or tokenizer.vocab_size
    if vocab_size < tokenizer.vocab_size:
        where = f"{model_cfg.path}/config.json" if model_cfg.path else "model.vocab_size"
        raise ConfigError(f"data.tokenizer: {cfg.data.tokenizer!r} has {tokenizer.vocab_size} tokens but the model "
                          f"has {vocab_size} ({where}); its ids would not fit the embedding")
    return vocab_size


def held_out_batches(cfg: Config, tokenizer) -> list[TokenBatch]:
    """The evaluation's batches (``eval.paths`` read like ``data.paths``; ``eval.batches`` of
    them, or all), tokenized once, before anything is written: a malformed held-out record
    stops the run at the start. Empty without ``eval.paths``."""
    if not cfg.eval.paths:
        return []
    data = dataclasses.replace(cfg.data, paths=list(cfg.eval.paths), max_documents=None,
                               batch_size=cfg.eval.batch_size or cfg.data.batch_size)
    try:
        batches = [token_batch(*b) for b in eval_batches(data, tokenizer, cfg.eval.batches)]
    except ValueError as err:
        raise ValueError(f"eval.paths: {err}") from None
    if not batches or not any(b.weights.any() for b in batches):
        raise ValueError(f"eval.paths: {cfg.eval.paths} hold no token to evaluate on")
    return batches


def resolve_data(cfg: Config) -> tuple[Config, tuple[str, ...]]:
    """``cfg`` with ``data.format`` resolved (auto -> what the data's first records hold) and the
    first record of every ``data.paths`` and ``eval.paths`` file (those on disk) checked against
    it, with no tokenizer: a wrong field or a mixed format is the same one line from the planner
    as from the trainer. The notes: what auto chose (one line), or none."""
    missing = set(missing_paths(list(cfg.eval.paths)))
    eval_paths = [p for p in cfg.eval.paths if p not in missing]
    choice = read_data_format(cfg.data, eval_paths)
    return dataclasses.replace(cfg, data=choice.data), (choice.note,) if choice.note else ()


@dataclass
class RunInputs:
    """What a run reads before it plans."""

    model_cfg: ModelConfig  # config.json's architecture (or the config's) with the run's numerics
    tokenizer: Any  # None: not read (the plan CLI without tokenizer files)
    stream: Any  # the training batches, from the start; None: not read
    held_out: list[TokenBatch]
    assumed: tuple[str, ...] = ()  # what the plan assumed for what was not read, one line each
    data: Optional[DataConfig] = None  # the data section, data.format resolved; None: the data is not there
    notes: tuple[str, ...] = ()  # the choices made reading them (what data.format: auto found)

    @property
    def complete(self) -> bool:
        return self.tokenizer is not None and self.stream is not None


def read_inputs(cfg: Config) -> RunInputs:
    """Every input of the run (the trainer's): config.json, the weights' safetensors headers
    (checked against the model, no tensor data read), the tokenizer, the data index, the held-out
    data. Raises ``ValueError``/``OSError`` naming what is missing or malformed."""
    # A hub id: its snapshot in the Hugging Face cache, from here on (model.init: random: no weights).
    cfg = with_model_folder(cfg, weights=cfg.model.init == "pretrained")
    model_cfg = resolve_model_config(cfg)
    cfg, notes = with_random_init(cfg, model_cfg)  # model.init: random: no weights; the tokenizer it reads
    cfg, format_notes = resolve_data(cfg)  # before the weights and the tokenizer, as the planner reads it
    notes += format_notes
    if cfg.model.path is not None and cfg.model.init == "pretrained":
        # a folder without safetensors, a truncated file or a missing tensor stops the run here
        notes += master_notes(cfg, pretrained_weights(cfg.model.path, model_cfg))
    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.model.path)
    return RunInputs(model_cfg, tokenizer, make_batch_stream(cfg.data, tokenizer), held_out_batches(cfg, tokenizer),
                     data=cfg.data, notes=notes)


def read_available_inputs(cfg: Config) -> RunInputs:
    """The inputs that are there (the plan CLI's): config.json (or the config's model) is needed;
    the tokenizer, the data and the held-out data are read when present, else assumed."""
    cfg = with_model_folder(cfg, weights=False)  # a hub id: config.json and the tokenizer from the cache
    model_cfg = resolve_model_config(cfg)
    cfg, notes = with_random_init(cfg, model_cfg)  # model.init: random: the tokenizer the trainer reads
    missing = missing_paths(list(cfg.data.paths))
    if not missing:  # the format and the first records, checked as the trainer checks them
        cfg, format_notes = resolve_data(cfg)
        notes += format_notes
    data = None if missing else cfg.data
    folder = tokenizer_folder(cfg.data.tokenizer, cfg.model.path)
    if folder is not None and not has_tokenizer_files(folder):
        read = "no data read" if missing else "the data's first records checked, nothing tokenized"
        return RunInputs(model_cfg, None, None, [], (
            f"no tokenizer in {folder}: vocabulary from config.json ({model_cfg.vocab_size}); {read}: "
            "runtime part estimated",), data, notes)
    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.model.path)
    if missing:
        return RunInputs(model_cfg, tokenizer, None, [], (
            f"no data read (data.paths: {', '.join(missing)} not found): runtime part estimated",), notes=notes)
    stream = make_batch_stream(cfg.data, tokenizer)
    missing = missing_paths(list(cfg.eval.paths or []))
    if missing:
        return RunInputs(model_cfg, tokenizer, stream, [], (f"eval.paths: {', '.join(missing)} not found: not read",),
                         data, notes)
    return RunInputs(model_cfg, tokenizer, stream, held_out_batches(cfg, tokenizer), data=data, notes=notes)


@dataclass
class PreparedRun:
    """What a run has read and decided before it writes anything."""

    # offload.params resolved (auto -> resident or ssd), data.format too (auto -> what the data holds),
    # train.steps from train.epochs (which is then None)
    cfg: Config
    model_cfg: ModelConfig  # config.json's architecture (or the config's) with the run's numerics
    sized: ModelConfig  # the same with the run's vocabulary
    tokenizer: Any  # None only from read_available_inputs
    stream: Any  # the training batches, from the start (None only from read_available_inputs)
    held_out: list[TokenBatch]
    resources: ResourcePlan  # what the run needs of host memory, device memory, disk and SSD traffic
    step_plan: StepPlan  # the step's modes, refusals and notes
    assumed: tuple[str, ...] = ()  # what the plan assumed for inputs it did not read
    notes: tuple[str, ...] = ()  # the model section's fields config.json replaced (a note line, or none)
    epochs: Optional[EpochCount] = None  # what train.epochs came to (its steps are cfg.train.steps)

    @property
    def model_folder(self) -> Optional[str]:
        """The folder the model is read from (a hub id's snapshot in the cache); None: from scratch."""
        return self.model_cfg.path

    @property
    def weights_folder(self) -> Optional[str]:
        """The folder whose safetensors start the weights; None: a random init (from scratch, or
        ``model.init: random``, which reads the model folder's config.json and tokenizer alone)."""
        return self.model_cfg.path if self.model_cfg.init == "pretrained" else None

    @property
    def source(self) -> Optional[ModelSource]:
        """``model.path`` as written and the folder it is read from (None: a model from scratch)."""
        return ModelSource.of(self.cfg.model.path, self.model_cfg.path) if self.cfg.model.path else None


def prepare_run(cfg: Config, job: JobShape, disk_gbps: Optional[float] = None,
                inputs: Optional[RunInputs] = None) -> PreparedRun:
    """Reads and checks the run's inputs (``inputs``: already read; default :func:`read_inputs`)
    and makes its plans (nothing is written). Raises ``ValueError``/``OSError`` (a
    :class:`ConfigError` for the config) naming the problem."""
    inputs = read_inputs(cfg) if inputs is None else inputs
    if inputs.data is not None:  # data.format: auto resolved from the data's first records
        cfg = dataclasses.replace(cfg, data=inputs.data)
    model_cfg = inputs.model_cfg
    sized = dataclasses.replace(model_cfg, vocab_size=vocabulary_size(cfg, model_cfg, inputs.tokenizer))
    opt = cfg.optimizer  # a weight_decay_mask regex that matches no parameter is refused here
    check_decay_rule(opt.weight_decay_mask, [m.dotted for m in param_plan(sized)], opt.weight_decay)
    # offload.params auto -> resident or ssd; host memory and disk by part (the runtime part
    # measured here, after the tokenizer and the data index; estimated for those not read).
    # train.epochs -> train.steps, counted on the data index (the disk plan counts the checkpoints by them).
    cfg, epochs, epoch_lines = with_epoch_steps(cfg, inputs.stream)
    cfg, kept = _gradients_of_the_files(cfg)
    cfg, resources = plan_resources(cfg, sized, disk_gbps=disk_gbps, inputs_read=inputs.complete,
                                    processes=job.processes)
    step_plan = StepPlan.resolve(cfg, sized, job, choices=resources.choices)
    model_lines = model_notes(cfg.model, model_cfg)
    return PreparedRun(cfg, model_cfg, sized, inputs.tokenizer, inputs.stream, inputs.held_out, resources, step_plan,
                       inputs.assumed, inputs.notes + model_lines + epoch_lines + kept, epochs)


def _gradients_of_the_files(cfg: Config) -> tuple[Config, tuple[str, ...]]:
    """Durable steps resumed from the offload files (``train.resume: auto``): ``offload.gradients:
    auto`` keeps where the files' journal says the gradients were (their layout includes them),
    with a note, instead of choosing anew on this machine's memory."""
    off = cfg.offload
    if not (off.enabled and off.durable and off.gradients == "auto" and cfg.train.resume == "auto"):
        return cfg, ()  # set by hand: a resume from the files under another layout is refused, naming it
    record = read_journal(off.dir or "")
    if record is None or record.step < 0:
        return cfg, ()
    layers = (record.written_under or {}).get("offload.host_gradient_layers")
    layers = layers if isinstance(layers, int) and record.gradients == "host" else None
    cfg = dataclasses.replace(cfg, offload=dataclasses.replace(off, gradients=record.gradients,
                                                               host_gradient_layers=layers))
    first = "first layer" if layers == 1 else f"first {layers} layers"
    where = record.gradients + (f" for the stack's {first}" if layers else "")
    return cfg, (f"offload.gradients: auto keeps {where}, as the offload files in {off.dir} were written "
                 f"(they hold step {record.held()[0]})",)
