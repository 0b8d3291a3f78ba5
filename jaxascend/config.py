"""Typed run configuration: one dataclass per subsystem, loaded from YAML with overrides.

    cfg = load_config("configs/tiny.yaml", overrides=["train.steps=20", "optimizer.learning_rate=1e-3"])

Every problem (unknown key, wrong type, out-of-range value, missing file) raises
:class:`ConfigError` whose message is one line naming the field and what is allowed.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml


class ConfigError(ValueError):
    """A configuration problem; the message names the field and what is allowed."""


DType = Literal["bfloat16", "float16", "float32"]
RematPolicy = Literal["none", "full", "dots", "dots_no_batch", "offload"]
HiddenAct = Literal["silu", "gelu_new", "gelu_pytorch_tanh", "gelu"]
LAYER_TYPES = ("sliding_attention", "full_attention")  # Hugging Face's layer_types entries
GEMMA3_FIELDS = ("layer_types", "rope_local_theta", "query_pre_attn_scalar", "final_logit_softcapping")
ROPE_TYPES = (None, "default", "linear", "dynamic", "yarn", "longrope", "llama3")
# rope_type -> keys transformers' modeling_rope_utils requires (numbers > 0 unless listed below).
_ROPE_REQUIRED = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
# Optional keys that must be a number > 0 when present and not null.
_ROPE_OPTIONAL = {
    "yarn": ("attention_factor",),
    "longrope": ("factor", "attention_factor"),
}

_BYTE_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


def parse_bytes(value: Any, name: str) -> int:
    """Parses ``1073741824``, ``"512MiB"`` or ``"2GB"`` into a byte count."""
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected a byte size like 4096 or '512MiB', got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
        if m and m.group(2).lower() in _BYTE_UNITS:
            return int(float(m.group(1)) * _BYTE_UNITS[m.group(2).lower()])
    raise ConfigError(f"{name}: expected a byte size like 4096 or '512MiB', got {value!r}")


def _check_range(name: str, value, *, lo=None, hi=None, lo_open=False, hi_open=False) -> None:
    if value is None:
        return
    bad = (lo is not None and (value <= lo if lo_open else value < lo)) or (
        hi is not None and (value >= hi if hi_open else value > hi)
    )
    if bad:
        lo_s = "" if lo is None else f"{'>' if lo_open else '>='} {lo}"
        hi_s = "" if hi is None else f"{'<' if hi_open else '<='} {hi}"
        allowed = " and ".join(s for s in (lo_s, hi_s) if s)
        raise ConfigError(f"{name}: must be {allowed}, got {value!r}")


@dataclass
class ModelConfig:
    """Architecture and numerics of the model. Field names follow Hugging Face's config.json."""

    path: Optional[str] = None  # Hugging Face folder (config.json + safetensors); overrides the shape fields
    arch: Literal["llama", "qwen2", "mistral", "gpt2", "gemma3", "qwen3", "phi3"] = "llama"
    vocab_size: int = 0  # 0: take it from the tokenizer
    hidden_size: int = 256
    intermediate_size: int = 688
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: Optional[int] = None  # None: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-5
    layer_norm_epsilon: float = 1e-5  # GPT-2's LayerNorm eps
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None  # HF rope_scaling, e.g. {rope_type: llama3, factor: 8.0, ...}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    attention_bias: bool = False  # q/k/v bias (Qwen2)
    sliding_window: Optional[int] = None  # Mistral: a query sees at most this many keys (itself included)
    # Gemma 3: per layer, "sliding_attention" (sliding_window applies) or "full_attention".
    # None: every layer alike (sliding_window, if set, on all of them).
    layer_types: Optional[list[str]] = None
    # Gemma 3: RoPE base of the sliding layers (None: 10000); rope_theta and rope_scaling are the
    # full layers'. Scores are scaled by query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5).
    rope_local_theta: Optional[float] = None
    query_pre_attn_scalar: Optional[int] = None  # an int, as transformers requires
    final_logit_softcapping: Optional[float] = None  # Gemma 3: logits = c * tanh(logits / c)
    # Phi-3 family: RoPE rotates the first int(head_dim * partial_rotary_factor) dims of each head.
    partial_rotary_factor: float = 1.0
    hidden_act: Optional[HiddenAct] = None  # None: the architecture's own (silu; gpt2: gelu_new)
    dtype: DType = "bfloat16"  # compute dtype of forward/backward
    param_dtype: DType = "float32"  # dtype the in-memory optimizer keeps parameters in
    remat: RematPolicy = "none"
    init_std: float = 0.02

    def __post_init__(self):
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "max_position_embeddings"):
            _check_range(f"model.{name}", getattr(self, name), lo=1)
        _check_range("model.vocab_size", self.vocab_size, lo=0)
        _check_range("model.head_dim", self.head_dim, lo=1)
        _check_range("model.rms_norm_eps", self.rms_norm_eps, lo=0, lo_open=True)
        _check_range("model.rope_theta", self.rope_theta, lo=0, lo_open=True)
        _check_range("model.layer_norm_epsilon", self.layer_norm_epsilon, lo=0, lo_open=True)
        _check_range("model.sliding_window", self.sliding_window, lo=1)
        self._check_gemma3_fields()
        self.rope_scaling = validate_rope_scaling(self.rope_scaling)
        self._check_rotary_fields()
        _check_range("model.init_std", self.init_std, lo=0, lo_open=True)
        if self.path is None:
            if self.head_dim is None and self.hidden_size % self.num_attention_heads:
                raise ConfigError(
                    f"model.hidden_size: {self.hidden_size} is not divisible by "
                    f"model.num_attention_heads={self.num_attention_heads}; set model.head_dim")
            if self.num_attention_heads % self.num_key_value_heads:
                raise ConfigError(
                    f"model.num_key_value_heads: {self.num_key_value_heads} must divide "
                    f"model.num_attention_heads={self.num_attention_heads}")

    def _check_rotary_fields(self) -> None:
        """partial_rotary_factor, and longrope's factor lists against the rotary width they
        scale (half of it: one factor per frequency), as transformers' Phi3Config checks."""
        _check_range("model.partial_rotary_factor", self.partial_rotary_factor, lo=0, hi=1, lo_open=True)
        longrope = self.rope_scaling is not None and self.rope_scaling["rope_type"] == "longrope"
        # gpt2 has learned position embeddings (its model refuses rope_scaling); a plain head_dim
        # is checked by the model when it is built (a base config's shape may be overridden).
        if self.arch == "gpt2" or (self.partial_rotary_factor == 1.0 and not longrope):
            return
        head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        dim = int(head_dim * self.partial_rotary_factor)
        if dim < 2 or dim % 2:
            raise ConfigError(f"model.partial_rotary_factor: head_dim {head_dim} x "
                              f"{self.partial_rotary_factor} = {dim} rotary dims; RoPE needs an even number >= 2")
        if longrope:
            for key in ("short_factor", "long_factor"):
                if len(self.rope_scaling[key]) != dim // 2:
                    raise ConfigError(f"model.rope_scaling.{key}: needs {dim // 2} numbers (rotary "
                                      f"dims {dim} / 2), got {len(self.rope_scaling[key])}")

    def _check_gemma3_fields(self) -> None:
        """The per-layer-type fields: only Gemma 3 reads them, so another arch must leave them
        unset rather than have them silently ignored."""
        for name in GEMMA3_FIELDS:
            if getattr(self, name) is not None and self.arch != "gemma3":
                raise ConfigError(f"model.{name}: only arch 'gemma3' uses it; must be null for "
                                  f"arch {self.arch!r}")
        for name in ("rope_local_theta", "query_pre_attn_scalar", "final_logit_softcapping"):
            _check_range(f"model.{name}", getattr(self, name), lo=0, lo_open=True)
        if self.layer_types is None:
            return
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(f"model.layer_types: {len(self.layer_types)} entries, but "
                              f"model.num_hidden_layers={self.num_hidden_layers}")
        for i, kind in enumerate(self.layer_types):
            if kind not in LAYER_TYPES:
                raise ConfigError(f"model.layer_types[{i}]: {kind!r} is not supported (allowed: "
                                  f"{', '.join(map(repr, LAYER_TYPES))})")
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ConfigError("model.sliding_window: must be set when model.layer_types has "
                              "'sliding_attention' layers")


def validate_rope_scaling(rope_scaling: Optional[dict], name: str = "model.rope_scaling") -> Optional[dict]:
    """Checks a Hugging Face ``rope_scaling`` mapping and returns it with ``rope_type`` filled in.

    Accepted, with the keys transformers' ``modeling_rope_utils`` requires: ``None``;
    ``{rope_type: default}``; ``linear`` and ``dynamic`` (``factor``); ``yarn`` (``factor``,
    ``original_max_position_embeddings``; optional ``attention_factor``, ``beta_fast``,
    ``beta_slow``, ``mscale``, ``mscale_all_dim``, ``truncate``); ``longrope`` (``short_factor``,
    ``long_factor``, ``original_max_position_embeddings``; optional ``factor``,
    ``attention_factor``); ``llama3`` (``factor``, ``low_freq_factor``, ``high_freq_factor``,
    ``original_max_position_embeddings``). Older configs spell ``rope_type`` as ``type``. Other
    keys are kept and ignored, as transformers does. The length of longrope's factor lists
    depends on the head dimension and is checked by :class:`ModelConfig`.
    """
    if rope_scaling is None:
        return None
    if not isinstance(rope_scaling, dict):
        raise ConfigError(f"{name}: expected a mapping or null, got {rope_scaling!r}")
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if rope_type not in ROPE_TYPES:
        allowed = ", ".join("null" if t is None else repr(t) for t in ROPE_TYPES)
        raise ConfigError(f"{name}.rope_type: {rope_type!r} is not supported (allowed: {allowed})")

    def positive(value) -> bool:
        return not isinstance(value, bool) and isinstance(value, (int, float)) and value > 0

    for key in _ROPE_REQUIRED.get(rope_type, ()):
        value = rope_scaling.get(key)
        if key.endswith("_factor") and rope_type == "longrope":
            if not isinstance(value, (list, tuple)) or not value or not all(map(positive, value)):
                raise ConfigError(f"{name}.{key}: rope_type 'longrope' needs a non-empty list of "
                                  f"numbers > 0, got {value!r}")
        elif not positive(value):
            raise ConfigError(f"{name}.{key}: rope_type {rope_type!r} needs a number > 0, got {value!r}")
    for key in _ROPE_OPTIONAL.get(rope_type, ()):
        value = rope_scaling.get(key)
        if value is not None and not positive(value):
            raise ConfigError(f"{name}.{key}: rope_type {rope_type!r} needs a number > 0 or null, "
                              f"got {value!r}")
    if rope_type == "yarn":
        for key in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim"):  # 0 means unset, as null
            value = rope_scaling.get(key)
            if value is not None and not (positive(value) or value == 0):
                raise ConfigError(f"{name}.{key}: rope_type 'yarn' needs a number >= 0 or null, "
                                  f"got {value!r}")
        if not isinstance(rope_scaling.get("truncate", True), bool):
            raise ConfigError(f"{name}.truncate: rope_type 'yarn' needs true or false, "
                              f"got {rope_scaling['truncate']!r}")
    if rope_type == "llama3":
        if rope_scaling["high_freq_factor"] <= rope_scaling["low_freq_factor"]:
            raise ConfigError(
                f"{name}.high_freq_factor: must be > low_freq_factor={rope_scaling['low_freq_factor']}, "
                f"got {rope_scaling['high_freq_factor']!r}")
    return {**rope_scaling, "rope_type": rope_type or "default"}


@dataclass
class DataConfig:
    """Where text comes from, how it is tokenized and packed into batches."""

    # Files or directories of .txt / .jsonl (and, for the tiny default, .py) files.
    # "@stdlib" stands for the running Python's standard library folder.
    paths: list[str] = field(default_factory=list)
    include: list[str] = field(default_factory=lambda: ["*.txt", "*.jsonl"])  # globs inside directories
    text_field: str = "text"  # JSONL field holding the text
    # "auto": the model folder's tokenizer when model.path is set, else "byte"; "byte"; "model"
    # (model.path's); or a local Hugging Face tokenizer folder.
    tokenizer: str = "auto"
    seq_len: int = 256
    batch_size: int = 8
    seed: int = 0
    max_documents: Optional[int] = None  # cap on documents read (None: all)

    def __post_init__(self):
        _check_range("data.seq_len", self.seq_len, lo=2)
        _check_range("data.batch_size", self.batch_size, lo=1)
        _check_range("data.max_documents", self.max_documents, lo=1)
        if not self.text_field:
            raise ConfigError("data.text_field: must be a non-empty field name")


@dataclass
class OptimizerConfig:
    """AdamW with an optional warmup + decay schedule and global-norm clipping."""

    learning_rate: float = 3e-4
    schedule: Literal["constant", "cosine", "linear"] = "cosine"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1  # final lr = learning_rate * min_lr_ratio for cosine/linear
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip_norm: Optional[float] = 1.0  # None: no clipping
    # Loss scaling: "dynamic" scales fp16 compute only (bf16/fp32 need none), "always" scales any
    # dtype, "none" never. Overflowing steps are skipped and the scale multiplied by backoff.
    loss_scale: Literal["dynamic", "always", "none"] = "dynamic"
    loss_scale_init: float = 2.0**15
    loss_scale_growth: float = 2.0
    loss_scale_backoff: float = 0.5
    loss_scale_growth_interval: int = 2000  # finite steps in a row before the scale grows
    loss_scale_min: float = 1.0
    loss_scale_max: float = 2.0**24

    def __post_init__(self):
        _check_range("optimizer.learning_rate", self.learning_rate, lo=0)
        _check_range("optimizer.warmup_steps", self.warmup_steps, lo=0)
        _check_range("optimizer.min_lr_ratio", self.min_lr_ratio, lo=0, hi=1)
        _check_range("optimizer.b1", self.b1, lo=0, hi=1, hi_open=True)
        _check_range("optimizer.b2", self.b2, lo=0, hi=1, hi_open=True)
        _check_range("optimizer.eps", self.eps, lo=0, lo_open=True)
        _check_range("optimizer.weight_decay", self.weight_decay, lo=0)
        _check_range("optimizer.grad_clip_norm", self.grad_clip_norm, lo=0, lo_open=True)
        _check_range("optimizer.loss_scale_init", self.loss_scale_init, lo=0, lo_open=True)
        _check_range("optimizer.loss_scale_growth", self.loss_scale_growth, lo=1)
        _check_range("optimizer.loss_scale_backoff", self.loss_scale_backoff, lo=0, hi=1, lo_open=True, hi_open=True)
        _check_range("optimizer.loss_scale_growth_interval", self.loss_scale_growth_interval, lo=1)
        _check_range("optimizer.loss_scale_min", self.loss_scale_min, lo=0, lo_open=True)
        if self.loss_scale_max < self.loss_scale_min:
            raise ConfigError(f"optimizer.loss_scale_max: {self.loss_scale_max} is below "
                              f"optimizer.loss_scale_min={self.loss_scale_min}")


@dataclass
class OffloadConfig:
    """Optimizer state and gradients on SSD, streamed through a preallocated host arena.

    Sizes accept integers or strings like ``"64MiB"``. The SSD engine needs
    ``block_bytes`` to be a multiple of 4096 and ``chunk_bytes``, ``shard_bytes`` and
    ``staging_bytes`` to be multiples of ``block_bytes`` (I/O addresses whole blocks).
    """

    enabled: bool = False
    dir: Optional[str] = None  # shard files live here (locked while a run uses it); None: <train.out_dir>/offload
    arena_bytes: Optional[Any] = None  # e.g. "2GiB"; None: exactly what the arena plan needs
    host_memory_budget: Optional[Any] = None  # e.g. "16GiB"; the arena must fit in it
    chunk_bytes: Any = "64MiB"  # streaming granularity of the optimizer step
    io_threads: int = 8  # pread/pwrite workers = requests in flight
    direct_io: bool = True  # O_DIRECT; falls back to buffered + fadvise where refused
    block_bytes: Any = "1MiB"  # checksum block = I/O request size
    shard_bytes: Any = "1GiB"  # largest shard file
    staging_bytes: Any = "8MiB"  # each arena staging slot (copies in/out, gradient writes)
    staging_slots: int = 2  # staging slots: copy one while another is written
    stream_depth: int = 3  # pipeline stages: 1 in use, depth-2 read ahead, 1 written behind
    lock_memory: bool = True  # mlock the arena (warns and continues unlocked if refused)
    pin_memory: bool = True  # cudaHostRegister the arena when a CUDA device is present
    preallocate: bool = True  # fallocate shard space up front, so a full disk fails early
    kernel_threads: int = 1  # threads of the fused AdamW kernel per chunk (the step is I/O bound)
    # Buffered I/O only (direct_io false, or the O_DIRECT fallback): drop each block from the
    # page cache after it is read or written. False is ZeRO-Infinity's page-cache I/O: the kernel
    # keeps (and writes back, when it likes) every page it has seen, up to 14 B/param.
    drop_page_cache: bool = True
    # Ablation switches: each brings back one host-memory habit of a ZeRO-Infinity-style
    # offload, so its cost can be measured (docs/architecture.md, "Ablation switches"). All
    # false is jaxascend; all true (with direct_io and drop_page_cache false) is the baseline.
    # None changes the arithmetic: the losses and the SSD state stay the same.
    pow2_buffers: bool = False  # every arena buffer rounded up to a power of two bytes
    single_pool: bool = False  # one pool of step buffers, each sized for the largest tensor
    fp32_grad_buffer: bool = False  # gradients land in a full fp32 host buffer (4 B/param)
    post_backward_overflow_check: bool = False  # full gradient tree, then a scan with temporaries

    def __post_init__(self):
        if self.arena_bytes is not None:
            self.arena_bytes = parse_bytes(self.arena_bytes, "offload.arena_bytes")
            _check_range("offload.arena_bytes", self.arena_bytes, lo=4096)
        if self.host_memory_budget is not None:
            self.host_memory_budget = parse_bytes(self.host_memory_budget, "offload.host_memory_budget")
            _check_range("offload.host_memory_budget", self.host_memory_budget, lo=4096)
        _check_range("offload.io_threads", self.io_threads, lo=1, hi=64)
        _check_range("offload.staging_slots", self.staging_slots, lo=1, hi=64)
        _check_range("offload.stream_depth", self.stream_depth, lo=2, hi=64)
        _check_range("offload.kernel_threads", self.kernel_threads, lo=1, hi=256)
        self.block_bytes = parse_bytes(self.block_bytes, "offload.block_bytes")
        _check_range("offload.block_bytes", self.block_bytes, lo=4096)
        if self.block_bytes % 4096:
            raise ConfigError(f"offload.block_bytes: must be a multiple of 4096, got {self.block_bytes}")
        for name in ("chunk_bytes", "shard_bytes", "staging_bytes"):
            value = parse_bytes(getattr(self, name), f"offload.{name}")
            _check_range(f"offload.{name}", value, lo=self.block_bytes)
            if value % self.block_bytes:
                raise ConfigError(f"offload.{name}: must be a multiple of offload.block_bytes="
                                  f"{self.block_bytes}, got {value}")
            setattr(self, name, value)


@dataclass
class CheckpointConfig:
    """Orbax checkpoints of the whole training state (see :mod:`jaxascend.checkpoint.manager`)."""

    dir: Optional[str] = None  # None: <train.out_dir>/checkpoints
    every_steps: int = 0  # 0: only at the end
    keep_last: int = 2
    async_save: bool = True  # small items (params, meta) are written in the background
    compression: Literal["none", "zstd"] = "none"  # of the streamed optimizer-state arrays
    cleanup_partial: bool = True  # remove half-written saves (Orbax tmp dirs) when opening dir

    def __post_init__(self):
        _check_range("checkpoint.every_steps", self.every_steps, lo=0)
        _check_range("checkpoint.keep_last", self.keep_last, lo=1)
        if self.compression not in ("none", "zstd"):
            raise ConfigError(f"checkpoint.compression: expected one of 'none', 'zstd', got {self.compression!r}")


@dataclass
class ExportConfig:
    """Hugging Face export of the trained weights (later: ``python -m jaxascend.export``)."""

    enabled: bool = False  # write a Hugging Face folder at the end of the run
    dir: Optional[str] = None  # None: <train.out_dir>/hf
    # dtype the exported weights are stored in; "source": that of the checkpoint the run started
    # from (model.path), or model.param_dtype for a run from scratch.
    dtype: Union[Literal["source"], DType] = "source"
    shard_bytes: Any = "5GB"  # largest safetensors shard (transformers' default)
    save_params: bool = True  # write <train.out_dir>/params.safetensors so a run can be exported later

    def __post_init__(self):
        self.shard_bytes = parse_bytes(self.shard_bytes, "export.shard_bytes")
        _check_range("export.shard_bytes", self.shard_bytes, lo=1)


@dataclass
class TrainConfig:
    """The loop: how long, how often to log, where outputs go."""

    steps: int = 100
    seed: int = 0
    grad_accum: int = 1  # micro-batches per optimizer step
    log_every: int = 10
    out_dir: str = "runs/default"  # metrics.jsonl and checkpoints go here
    progress: bool = True  # show a progress bar
    # "auto": newest complete checkpoint in checkpoint.dir (fresh start if none); "none": fresh
    # start; an integer: that step's checkpoint (an error if it is missing).
    resume: Union[Literal["auto", "none"], int] = "auto"
    # Stop after this step (saving a checkpoint there) as if interrupted: a time-boxed job that a
    # later run with the same config resumes. None: run to train.steps.
    stop_at_step: Optional[int] = None

    def __post_init__(self):
        self.resume = validate_resume(self.resume)
        _check_range("train.steps", self.steps, lo=1)
        _check_range("train.stop_at_step", self.stop_at_step, lo=1, hi=self.steps)
        _check_range("train.grad_accum", self.grad_accum, lo=1)
        _check_range("train.log_every", self.log_every, lo=1)


def validate_resume(value: Any, name: str = "train.resume") -> Union[str, int]:
    """``"auto"``, ``"none"`` or a step number >= 0 (a string of digits is read as one)."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, bool) or not (value in ("auto", "none") or isinstance(value, int)):
        raise ConfigError(f"{name}: expected 'auto', 'none' or a step number, got {value!r}")
    if isinstance(value, int) and value < 0:
        raise ConfigError(f"{name}: a step number must be >= 0, got {value!r}")
    return value


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------- loading

def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any value"
    return {int: "an integer", float: "a number", str: "a string", bool: "true/false",
            dict: "a mapping"}.get(tp, getattr(tp, "__name__", str(tp)))


def _coerce(value: Any, tp, name: str) -> Any:
    """Checks ``value`` against the annotation ``tp``; returns it (ints widen to floats)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, name)
            except ConfigError:
                continue
        raise ConfigError(f"{name}: expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        if value in typing.get_args(tp) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{name}: expected {_type_name(tp)}, got {value!r}")
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, str):  # a single path is a list of one
            value = [value]
        if not isinstance(value, list):
            raise ConfigError(f"{name}: expected {_type_name(tp)}, got {value!r}")
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
    raise ConfigError(f"{name}: expected {_type_name(tp)}, got {value!r}")


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
            raise ConfigError(f"{full}: unknown key (allowed: {', '.join(names)})")
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
        return text


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Applies ``section.field=value`` strings to a nested dict (in place) and returns it."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected section.field=value")
        key, text = item.split("=", 1)
        parts = key.strip().split(".")
        if len(parts) != 2 or not all(parts):
            raise ConfigError(f"--set {key!r}: expected section.field (e.g. train.steps)")
        section, fld = parts
        if section not in {f.name for f in dataclasses.fields(Config)}:
            allowed = ", ".join(f.name for f in dataclasses.fields(Config))
            raise ConfigError(f"{section}: unknown section (allowed: {allowed})")
        data.setdefault(section, {})
        if data[section] is None:
            data[section] = {}
        data[section][fld] = _parse_scalar(text)
    return data


def config_from_dict(data: dict) -> Config:
    """Builds and validates a :class:`Config` from plain nested dicts."""
    cfg = _build(Config, data, "")
    _validate_cross_fields(cfg)
    return cfg


def _validate_cross_fields(cfg: Config) -> None:
    if cfg.offload.dir is None:
        cfg.offload.dir = os.path.join(cfg.train.out_dir, "offload")
    if not cfg.data.paths:
        raise ConfigError("data.paths: missing; give at least one .txt/.jsonl file or directory")
    for p in cfg.data.paths:
        if p != "@stdlib" and not os.path.exists(os.path.expanduser(p)):
            raise ConfigError(f"data.paths: {p!r} does not exist")
    tok = cfg.data.tokenizer
    if tok == "model" and cfg.model.path is None:
        raise ConfigError("data.tokenizer: 'model' needs model.path to be set")
    if tok not in ("auto", "byte", "model") and not os.path.isdir(os.path.expanduser(tok)):
        raise ConfigError(f"data.tokenizer: expected 'auto', 'byte', 'model' or a tokenizer folder, got {tok!r}")
    if cfg.model.path is not None and not os.path.isdir(os.path.expanduser(cfg.model.path)):
        raise ConfigError(f"model.path: {cfg.model.path!r} is not a directory")
    if cfg.data.seq_len > cfg.model.max_position_embeddings:
        raise ConfigError(
            f"data.seq_len: {cfg.data.seq_len} exceeds model.max_position_embeddings="
            f"{cfg.model.max_position_embeddings}")


def load_config(path: str | os.PathLike | None, overrides: list[str] | None = None) -> Config:
    """Reads a YAML config (safe loader), applies ``--set`` overrides and validates."""
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
    apply_overrides(data, overrides or [])
    return config_from_dict(data)
