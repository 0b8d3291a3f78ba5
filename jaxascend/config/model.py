"""The ``model`` section: architecture and shape in Hugging Face's field names, numerics, remat,
and the RoPE scaling every type transformers defines (checked here, computed in
:mod:`jaxascend.models.rope`)."""

from __future__ import annotations

from dataclasses import dataclass
import re
import typing
from typing import Literal, NamedTuple, Optional

from jaxascend.config.values import AttentionImpl, ConfigError, LossImpl, DType, HiddenAct, RematPolicy, check_range

LAYER_TYPES = ("sliding_attention", "full_attention")  # Hugging Face's layer_types entries
GEMMA3_FIELDS = ("layer_types", "rope_local_theta", "query_pre_attn_scalar", "final_logit_softcapping")
INIT_MODES = ("pretrained", "random")  # model.init
ROPE_TYPES = (None, "default", "linear", "dynamic", "yarn", "longrope", "llama3")
# A Hugging Face hub id as model.path: org/name (hub's rules: letters, digits, "-", "_", ".", not at
# either end of a part, at most 96 characters each), then optionally @revision (a branch, tag or commit).
_HUB_PART = r"(?:\w|\w[\w.-]{0,94}\w)"
_HUB_ID = re.compile(rf"(?P<repo>{_HUB_PART}/{_HUB_PART})(?:@(?P<revision>[\w.-]+(?:/[\w.-]+)*))?")


class HubId(NamedTuple):
    """``model.path`` read as a Hugging Face hub id: ``org/name`` and the revision after ``@``."""

    repo_id: str  # org/name
    revision: Optional[str]  # None: the default branch (main)


def parse_hub_id(path: str) -> Optional[HubId]:
    """``path`` as a hub id (``Qwen/Qwen2.5-0.5B``, ``org/name@v1.0``), or None when it cannot be
    one (``./model``, ``/abs/path``, ``a/b/c``, ``a--b/c``); whether it names a folder is not asked."""
    found = _HUB_ID.fullmatch(path)
    if found is None or "--" in found["repo"] or ".." in found["repo"] or found["repo"].endswith(".git"):
        return None
    return HubId(found["repo"], found["revision"])


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


@dataclass
class ModelConfig:
    """Architecture and numerics of the model. Field names follow Hugging Face's config.json."""

    # A Hugging Face model folder (config.json + safetensors; its config.json sets the shape fields), or
    # a hub id org/name[@revision]: its snapshot in the Hugging Face cache (HF_HUB_CACHE), downloaded
    # there first when missing and the hub is online. A folder of that name wins.
    path: Optional[str] = None
    # The model family (jaxascend.models): llama also serves Qwen2, Mistral, Qwen3 and Phi-3 through switches.
    arch: Literal["llama", "qwen2", "mistral", "gpt2", "gemma3", "qwen3", "phi3"] = "llama"
    vocab_size: int = 0  # 0: take it from the tokenizer
    hidden_size: int = 256  # width of the residual stream
    intermediate_size: int = 688  # width of the MLP's hidden layer
    num_hidden_layers: int = 4  # decoder layers (stacked along one axis, run under lax.scan)
    num_attention_heads: int = 8  # query heads
    num_key_value_heads: int = 4  # key/value heads (grouped-query attention); must divide the query heads
    head_dim: Optional[int] = None  # None: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-5  # RMSNorm eps (every family but GPT-2)
    layer_norm_epsilon: float = 1e-5  # GPT-2's LayerNorm eps
    rope_theta: float = 10000.0  # RoPE base
    rope_scaling: Optional[dict] = None  # HF rope_scaling, e.g. {rope_type: llama3, factor: 8.0, ...}
    max_position_embeddings: int = 2048  # longest sequence the model takes (data.seq_len must fit)
    tie_word_embeddings: bool = True  # the LM head is the token table (no separate lm_head.kernel)
    attention_bias: bool = False  # q/k/v bias (Qwen2)
    sliding_window: Optional[int] = None  # Mistral: a query sees at most this many keys (itself included)
    # Gemma 3: per layer, "sliding_attention" (sliding_window applies) or "full_attention".
    # None: every layer alike (sliding_window, if set, on all of them).
    layer_types: Optional[list[str]] = None
    # Gemma 3: RoPE base of the sliding layers (None: 10000); rope_theta and rope_scaling are the
    # full layers'. Scores are scaled by query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5).
    rope_local_theta: Optional[float] = None
    query_pre_attn_scalar: Optional[int] = None  # Gemma 3 (see above); an int, as transformers requires
    final_logit_softcapping: Optional[float] = None  # Gemma 3: logits = c * tanh(logits / c)
    # Phi-3 family: RoPE rotates the first int(head_dim * partial_rotary_factor) dims of each head.
    partial_rotary_factor: float = 1.0
    hidden_act: Optional[HiddenAct] = None  # None: the architecture's own (silu; gpt2: gelu_new)
    dtype: DType = "bfloat16"  # compute dtype of forward/backward
    param_dtype: DType = "float32"  # dtype the in-memory optimizer keeps parameters in
    # Recomputation in the backward: none, full (each layer recomputed), dots / dots_no_batch (matmul
    # outputs kept), offload (activations to pinned host memory on a GPU).
    remat: RematPolicy = "none"
    # "auto": blockwise attention (memory linear in the row length) for long rows, dense below.
    attention: AttentionImpl = "auto"
    # "auto": the head and loss in blocks (the logits never whole) for large batch x length x vocabulary.
    loss: LossImpl = "auto"
    # With model.path, where the weights start: "pretrained", the folder's safetensors; "random", a random
    # init of its config.json's shape (init_std, train.seed), like transformers' from_config: the folder may
    # hold config.json alone (any safetensors there are not read), and data.tokenizer auto is the byte
    # tokenizer when it holds no tokenizer files. Without model.path the model starts random either way.
    init: Literal["pretrained", "random"] = "pretrained"
    init_std: float = 0.02  # standard deviation of the random init (runs from scratch, model.init: random)

    def __post_init__(self):
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "max_position_embeddings"):
            check_range(f"model.{name}", getattr(self, name), lo=1)
        check_range("model.vocab_size", self.vocab_size, lo=0)
        check_range("model.head_dim", self.head_dim, lo=1)
        check_range("model.rms_norm_eps", self.rms_norm_eps, lo=0, lo_open=True)
        check_range("model.rope_theta", self.rope_theta, lo=0, lo_open=True)
        check_range("model.layer_norm_epsilon", self.layer_norm_epsilon, lo=0, lo_open=True)
        check_range("model.sliding_window", self.sliding_window, lo=1)
        for name in ("rope_local_theta", "query_pre_attn_scalar", "final_logit_softcapping"):
            check_range(f"model.{name}", getattr(self, name), lo=0, lo_open=True)
        for i, kind in enumerate(self.layer_types or ()):
            if kind not in LAYER_TYPES:
                raise ConfigError(f"model.layer_types[{i}]: {kind!r} is not supported (allowed: "
                                  f"{', '.join(map(repr, LAYER_TYPES))})")
        self.rope_scaling = validate_rope_scaling(self.rope_scaling)
        check_range("model.partial_rotary_factor", self.partial_rotary_factor, lo=0, hi=1, lo_open=True)
        check_range("model.init_std", self.init_std, lo=0, lo_open=True)
        if self.init not in INIT_MODES:
            raise ConfigError(f"model.init: {self.init!r} is not supported (allowed: {', '.join(map(repr, INIT_MODES))})")
        if self.attention not in typing.get_args(AttentionImpl):
            allowed = ", ".join(map(repr, typing.get_args(AttentionImpl)))
            raise ConfigError(f"model.attention: {self.attention!r} is not supported (allowed: {allowed})")
        if self.loss not in typing.get_args(LossImpl):
            allowed = ", ".join(map(repr, typing.get_args(LossImpl)))
            raise ConfigError(f"model.loss: {self.loss!r} is not supported (allowed: {allowed})")
        # With model.path the architecture fields are config.json's, which replace these when it
        # is read (jaxascend.hf.model_config_from_hf checks the shape it reads): how the section's
        # own fields fit together does not matter then.
        if self.path is None:
            self.check_shape()

    def check_shape(self) -> None:
        """How the architecture fields fit together: heads, the per-layer-type fields, the rotary
        width. Run at construction for a model from scratch; for one read from config.json by
        :func:`jaxascend.hf.model_config_from_hf`, on what config.json says."""
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"model.hidden_size: {self.hidden_size} is not divisible by "
                f"model.num_attention_heads={self.num_attention_heads}; set model.head_dim")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"model.num_key_value_heads: {self.num_key_value_heads} must divide "
                f"model.num_attention_heads={self.num_attention_heads}")
        self._check_gemma3_fields()
        self._check_rotary_fields()

    def _check_rotary_fields(self) -> None:
        """partial_rotary_factor and longrope's factor lists against the rotary width they
        scale (half of it: one factor per frequency), as transformers' Phi3Config checks."""
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
        if self.layer_types is None:
            return
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(f"model.layer_types: {len(self.layer_types)} entries, but "
                              f"model.num_hidden_layers={self.num_hidden_layers}")
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
