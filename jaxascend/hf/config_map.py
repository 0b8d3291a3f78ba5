"""Hugging Face ``config.json`` <-> :class:`ModelConfig`, with architecture detection.

    cfg = model_config_from_hf("/models/Qwen2.5-0.5B", base=run_cfg.model)   # shape from config.json,
                                                                              # dtype/remat from base
    hf = hf_config_dict(cfg, dtype="bfloat16", token_ids={"bos_token_id": 0, "eos_token_id": 1})

Supported: ``LlamaForCausalLM`` (Llama 2/3/3.1/3.2, ``rope_scaling`` type ``llama3``),
``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``, ``MistralForCausalLM``, ``Phi3ForCausalLM`` (Phi-3 and
Phi-3.5 mini, LongRoPE, transformers 4's ``su``/``yarn`` names for it), ``GPT2LMHeadModel``, and
``Gemma3ForCausalLM`` plus the text model of ``Gemma3ForConditionalGeneration`` (see
:mod:`jaxascend.hf.gemma3_config`, exported as ``Gemma3ForCausalLM``). Both spellings of the RoPE
settings are read: transformers 4's ``rope_theta`` + ``rope_scaling`` and transformers 5's
``rope_parameters``, with every RoPE type of :mod:`jaxascend.models.rope` (default, linear,
dynamic, yarn, longrope, llama3). Features our models do not implement (bias on Llama's
``o_proj``, per-layer sliding windows, dropout in Phi-3) are refused with
:class:`UnsupportedModelError` rather than loaded into a silently different model.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

from jaxascend.config import ROPE_TYPES, ConfigError, ModelConfig, validate_rope_scaling
from jaxascend.hf.errors import HFCheckpointError, UnsupportedModelError, one_line
from jaxascend.hf.gemma3_config import gemma3_config_dict, gemma3_fields

CONFIG_FILE = "config.json"

# HF class name -> (our arch, HF model_type).
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", "llama"),
    "Qwen2ForCausalLM": ("qwen2", "qwen2"),
    "MistralForCausalLM": ("mistral", "mistral"),
    "GPT2LMHeadModel": ("gpt2", "gpt2"),
    "Gemma3ForCausalLM": ("gemma3", "gemma3_text"),
    "Qwen3ForCausalLM": ("qwen3", "qwen3"),
    "Phi3ForCausalLM": ("phi3", "phi3"),
}
HF_CLASS = {arch: cls for cls, (arch, _) in ARCHITECTURES.items()}
MODEL_TYPE = {arch: model_type for arch, model_type in ARCHITECTURES.values()}
# Read for their text model only (their other tensors are skipped); exported as the text class.
TEXT_PART_ARCHITECTURES = {"Gemma3ForConditionalGeneration": ("gemma3", "gemma3")}
_READABLE = {**ARCHITECTURES, **TEXT_PART_ARCHITECTURES}
_SUPPORTED = ", ".join(_READABLE)
_HF_ACTS = ("silu", "gelu_new", "gelu_pytorch_tanh", "gelu")
DEFAULT_ROPE_THETA = 10000.0

# ModelConfig fields that describe numerics and training, not the architecture: they come from
# the user's config even when the shape comes from config.json.
RUN_FIELDS = ("dtype", "param_dtype", "remat", "attention", "loss", "init_std", "init")


def read_hf_config(folder: str | os.PathLike) -> dict:
    """Reads ``<folder>/config.json`` into a dict; HFCheckpointError naming the file otherwise."""
    path = os.path.join(os.path.expanduser(str(folder)), CONFIG_FILE)
    if not os.path.isdir(os.path.dirname(path)):
        raise HFCheckpointError(f"{folder}: model folder does not exist")
    if not os.path.isfile(path):
        raise HFCheckpointError(f"{path}: not found (a Hugging Face model folder needs config.json)")
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise HFCheckpointError(f"{path}: cannot be read as JSON ({one_line(err)})") from None
    if not isinstance(data, dict):
        raise HFCheckpointError(f"{path}: expected a JSON object")
    return data


def detect_arch(hf: dict, source: str = CONFIG_FILE) -> str:
    """Our arch name for a config.json dict, from ``architectures`` (else ``model_type``)."""
    names = hf.get("architectures") or []
    if isinstance(names, str):
        names = [names]
    for name in names:
        if name in _READABLE:
            return _READABLE[name][0]
    if not names:
        for arch, model_type in _READABLE.values():
            if hf.get("model_type") == model_type:
                return arch
    found = f"architectures={names}" if names else f"model_type={hf.get('model_type')!r}"
    raise UnsupportedModelError(f"{source}: {found} is not supported (supported: {_SUPPORTED})")


def model_config_from_hf(folder: str | os.PathLike, base: Optional[ModelConfig] = None) -> ModelConfig:
    """The :class:`ModelConfig` of the Hugging Face model in ``folder``.

    Architecture fields (sizes, RoPE, norms, tying, vocab_size) come from ``config.json``; the run
    fields ``dtype``, ``param_dtype``, ``remat``, ``attention``, ``loss``, ``init_std`` and ``init`` come from ``base``
    (defaults when None). ``path`` is set to ``folder``.
    """
    hf = read_hf_config(folder)
    return model_config_from_hf_dict(hf, base, path=str(folder),
                                     source=os.path.join(str(folder), CONFIG_FILE))


def model_config_from_hf_dict(hf: dict, base: Optional[ModelConfig] = None, *,
                              path: Optional[str] = None, source: str = CONFIG_FILE) -> ModelConfig:
    """Like :func:`model_config_from_hf` for an already-parsed config dict."""
    arch = detect_arch(hf, source)
    try:
        if arch == "gemma3":
            fields = gemma3_fields(hf, source)
        else:
            fields = _gpt2_fields(hf, source) if arch == "gpt2" else _llama_fields(hf, arch, source)
    except KeyError as err:
        raise HFCheckpointError(f"{source}: required field {err.args[0]!r} is missing") from None
    base = base or ModelConfig()
    fields.update({name: getattr(base, name) for name in RUN_FIELDS})
    fields.update(arch=arch, path=path)
    for name, value in fields.items():
        if name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "vocab_size", "max_position_embeddings"):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise HFCheckpointError(f"{source}: {name} must be an integer >= 1, got {value!r}")
    try:  # with a path, ModelConfig leaves how the shape fits together to us: it is config.json's
        cfg = ModelConfig(**fields)
        cfg.check_shape()
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None
    return cfg


def _rope_fields(hf: dict, arch: str, source: str) -> tuple[float, Optional[dict], float]:
    """``(rope_theta, rope_scaling, partial_rotary_factor)`` from either spelling, as transformers
    5 reads them: ``rope_scaling`` wins over ``rope_parameters``, top-level ``rope_theta`` and
    ``partial_rotary_factor`` fill what the dict lacks, ``type`` spells ``rope_type``, and
    llama3/yarn/longrope get ``original_max_position_embeddings`` (Phi-3: always the top-level
    one, default 4096; others: max_position_embeddings when absent). Phi-3's transformers 4
    aliases ``su`` and ``yarn`` mean longrope (transformers 5.24 crashes on them; we read them)."""
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise HFCheckpointError(f"{source}: rope_scaling/rope_parameters must be an object, got {params!r}")
    if any(isinstance(v, dict) for v in params.values()):
        raise UnsupportedModelError(f"{source}: per-layer-type rope_parameters are not supported")
    theta = float(params.get("rope_theta", hf.get("rope_theta", DEFAULT_ROPE_THETA)))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor", "type")}
    scaling["rope_type"] = params.get("rope_type", params.get("type", "default"))
    if scaling["rope_type"] not in ROPE_TYPES + ("su",):
        raise UnsupportedModelError(f"{source}: rope type {scaling['rope_type']!r} is not supported "
                                    f"(supported: {', '.join(t for t in ROPE_TYPES if t)})")
    if arch == "phi3":
        if scaling["rope_type"] in ("su", "yarn"):
            scaling["rope_type"] = "longrope"
        if scaling["rope_type"] not in ("default", "longrope"):
            raise UnsupportedModelError(f"{source}: rope type {scaling['rope_type']!r} is not supported "
                                        "for Phi3ForCausalLM (supported: default, longrope)")
    if scaling["rope_type"] == "default":
        return theta, None, partial
    if scaling["rope_type"] in ("llama3", "yarn", "longrope"):
        if arch == "phi3":
            scaling["original_max_position_embeddings"] = hf.get("original_max_position_embeddings", 4096)
        else:
            scaling.setdefault("original_max_position_embeddings", _max_positions(hf, arch))
    if scaling["rope_type"] == "yarn" and scaling.get("factor", 0) is None:
        # transformers: an explicit null factor is max_position_embeddings / original
        scaling["factor"] = _max_positions(hf, arch) / scaling["original_max_position_embeddings"]
    return theta, validate_rope_scaling(scaling, f"{source}: rope_scaling"), partial


# transformers' config defaults where they differ per architecture (absent keys).
_MAX_POSITIONS = {"qwen3": 32768, "phi3": 4096}
_RMS_NORM_EPS = {"phi3": 1e-5}


def _max_positions(hf: dict, arch: str) -> int:
    return hf.get("max_position_embeddings", _MAX_POSITIONS.get(arch, 2048))


def _llama_fields(hf: dict, arch: str, source: str) -> dict[str, Any]:
    heads = hf["num_attention_heads"]
    hidden = hf["hidden_size"]
    # Qwen3Config's head_dim defaults to 128, not hidden / heads.
    head_dim = hf.get("head_dim") or (128 if arch == "qwen3" else None)
    if arch == "phi3":
        _check_phi3(hf, head_dim, source)
    if head_dim is not None and isinstance(heads, int) and heads and head_dim * heads == hidden:
        head_dim = None  # the default; keeps the config minimal
    act = hf.get("hidden_act", "silu")
    if act not in _HF_ACTS:
        raise UnsupportedModelError(f"{source}: hidden_act {act!r} is not supported "
                                    f"(supported: {', '.join(_HF_ACTS)})")
    if arch == "llama" and hf.get("attention_bias"):
        raise UnsupportedModelError(f"{source}: attention_bias=true (bias on q/k/v and o_proj) is not "
                                    "supported for LlamaForCausalLM")
    if hf.get("mlp_bias"):
        raise UnsupportedModelError(f"{source}: mlp_bias=true is not supported")
    theta, scaling, partial = _rope_fields(hf, arch, source)
    return dict(
        vocab_size=hf["vocab_size"], hidden_size=hidden, intermediate_size=hf["intermediate_size"],
        num_hidden_layers=hf["num_hidden_layers"], num_attention_heads=heads,
        num_key_value_heads=hf.get("num_key_value_heads") or heads, head_dim=head_dim,
        rms_norm_eps=float(hf.get("rms_norm_eps", _RMS_NORM_EPS.get(arch, 1e-6))), rope_theta=theta,
        rope_scaling=scaling, partial_rotary_factor=float(partial),
        max_position_embeddings=_max_positions(hf, arch),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v bias, Mistral and Phi-3 never; Qwen3's (q/k/v/o) is optional.
        attention_bias=arch == "qwen2" or (arch == "qwen3" and bool(hf.get("attention_bias", False))),
        sliding_window=_sliding_window(hf, arch, source), hidden_act=act)


def _check_phi3(hf: dict, head_dim: Optional[int], source: str) -> None:
    """Phi3Config has no head_dim (it is hidden / heads) and trains with dropout when asked;
    we have no dropout, so a config that needs it is refused rather than trained differently."""
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    if head_dim is not None and head_dim * heads != hidden:
        raise UnsupportedModelError(f"{source}: head_dim {head_dim} != hidden_size / num_attention_heads "
                                    f"= {hidden / heads:g}; Phi3ForCausalLM derives it")
    for key in ("attention_dropout", "resid_pdrop", "embd_pdrop"):
        if hf.get(key):
            raise UnsupportedModelError(f"{source}: {key}={hf[key]} is not supported (no dropout; "
                                        "must be 0)")


def _sliding_window(hf: dict, arch: str, source: str) -> Optional[int]:
    """One window for every layer, or None. Qwen2/Qwen3 slide only on layers >= max_window_layers
    (transformers 5 spells it out in ``layer_types``); a mix of both kinds is refused."""
    if arch == "llama":
        return None
    window = hf.get("sliding_window")
    if arch in ("mistral", "phi3"):
        return window
    layers = hf["num_hidden_layers"]
    layer_types = hf.get("layer_types")
    if layer_types is None:
        if not hf.get("use_sliding_window", False) or window is None:
            return None
        first = hf.get("max_window_layers", 28)
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    kinds = set(layer_types)
    if not kinds <= {"full_attention", "sliding_attention"}:
        raise UnsupportedModelError(f"{source}: layer_types {sorted(kinds)} are not supported")
    if kinds == {"sliding_attention"} and window is not None:
        return window
    if "sliding_attention" in kinds and window is not None:
        raise UnsupportedModelError(f"{source}: sliding-window attention on only some layers "
                                    "(use_sliding_window with max_window_layers) is not supported")
    return None


def _gpt2_fields(hf: dict, source: str) -> dict[str, Any]:
    hidden, heads = hf["n_embd"], hf["n_head"]
    act = hf.get("activation_function", "gelu_new")
    if act not in _HF_ACTS:
        raise UnsupportedModelError(f"{source}: activation_function {act!r} is not supported "
                                    f"(supported: {', '.join(_HF_ACTS)})")
    for key, unsupported in (("scale_attn_by_inverse_layer_idx", True), ("scale_attn_weights", False),
                             ("add_cross_attention", True)):
        if hf.get(key, not unsupported) == unsupported:
            raise UnsupportedModelError(f"{source}: {key}={str(unsupported).lower()} is not supported")
    inner = hf.get("n_inner")
    return dict(
        vocab_size=hf["vocab_size"], hidden_size=hidden,
        intermediate_size=inner if inner is not None else 4 * hidden,
        num_hidden_layers=hf["n_layer"], num_attention_heads=heads, num_key_value_heads=heads,
        head_dim=None, max_position_embeddings=hf.get("n_positions", 1024),
        layer_norm_epsilon=float(hf.get("layer_norm_epsilon", 1e-5)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)), hidden_act=act,
        rope_scaling=None, sliding_window=None, attention_bias=False)


# ----------------------------------------------------------------------------- export

def hf_config_dict(cfg: ModelConfig, *, dtype: str = "bfloat16", vocab_size: Optional[int] = None,
                   token_ids: Optional[dict[str, Any]] = None) -> dict:
    """The ``config.json`` dict transformers expects for ``cfg``.

    RoPE settings are written in both spellings (``rope_theta`` + ``rope_scaling`` for
    transformers 4, ``rope_parameters`` for 5), and the dtype as both ``dtype`` and
    ``torch_dtype``, so either major version reads the same model. ``token_ids`` may hold
    ``bos_token_id``/``eos_token_id``/``pad_token_id``.
    """
    vocab = vocab_size or cfg.vocab_size
    if not vocab:
        raise ValueError("hf_config_dict: vocab_size is 0; pass the model's vocabulary size")
    if cfg.arch not in HF_CLASS:
        raise UnsupportedModelError(f"model.arch: {cfg.arch!r} cannot be exported "
                                    f"(supported: {', '.join(HF_CLASS)})")
    out: dict[str, Any] = {"architectures": [HF_CLASS[cfg.arch]], "model_type": MODEL_TYPE[cfg.arch]}
    if cfg.arch == "gpt2":
        out.update(
            vocab_size=vocab, n_embd=cfg.hidden_size, n_layer=cfg.num_hidden_layers,
            n_head=cfg.num_attention_heads, n_inner=cfg.intermediate_size,
            n_positions=cfg.max_position_embeddings, n_ctx=cfg.max_position_embeddings,
            layer_norm_epsilon=cfg.layer_norm_epsilon,
            activation_function=cfg.hidden_act or "gelu_new",
            scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False,
            reorder_and_upcast_attn=False)
    elif cfg.arch == "gemma3":
        out.update(gemma3_config_dict(cfg, vocab))
    else:
        out.update(_llama_config_dict(cfg, vocab))
    out.update(tie_word_embeddings=cfg.tie_word_embeddings, initializer_range=cfg.init_std,
               use_cache=True, dtype=dtype, torch_dtype=dtype)
    for key, value in (token_ids or {}).items():
        if value is not None:
            out[key] = value
    return out


def _llama_config_dict(cfg: ModelConfig, vocab: int) -> dict[str, Any]:
    """The Llama family's fields of :func:`hf_config_dict`."""
    head_dim = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
    scaling = None if cfg.rope_scaling is None or cfg.rope_scaling["rope_type"] == "default" \
        else dict(cfg.rope_scaling)
    rope_parameters = {"rope_type": "default", **(scaling or {}), "rope_theta": cfg.rope_theta}
    if cfg.partial_rotary_factor != 1.0:
        rope_parameters["partial_rotary_factor"] = cfg.partial_rotary_factor
    out = dict(
        vocab_size=vocab, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=head_dim,
        hidden_act=cfg.hidden_act or "silu", max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta, rope_scaling=scaling,
        rope_parameters=rope_parameters)
    if cfg.arch == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    elif cfg.arch in ("qwen2", "qwen3"):
        if cfg.arch == "qwen2" and not cfg.attention_bias:
            raise UnsupportedModelError("model.attention_bias: Qwen2ForCausalLM always has q/k/v "
                                        "bias; a qwen2 model without it cannot be exported")
        window = cfg.sliding_window
        out.update(use_sliding_window=window is not None, sliding_window=window,
                   max_window_layers=0 if window is not None else cfg.num_hidden_layers)
        if cfg.arch == "qwen3":
            out.update(attention_bias=cfg.attention_bias)
    elif cfg.arch == "phi3":
        del out["head_dim"]  # Phi3Config has none: hidden_size / num_attention_heads
        out.update(_phi3_rope_fields(cfg, scaling), sliding_window=cfg.sliding_window,
                   partial_rotary_factor=cfg.partial_rotary_factor, attention_dropout=0.0,
                   resid_pdrop=0.0, embd_pdrop=0.0)
    else:
        out.update(sliding_window=cfg.sliding_window)
    if cfg.arch not in ("qwen2", "qwen3") and cfg.attention_bias:
        raise UnsupportedModelError(f"model.attention_bias: {HF_CLASS[cfg.arch]} has no q/k/v-only "
                                    "bias; export it as qwen2 or train without attention_bias")
    return out


_PHI3_V4_ROPE_KEYS = {"rope_type", "short_factor", "long_factor", "original_max_position_embeddings"}


def _phi3_rope_fields(cfg: ModelConfig, scaling: Optional[dict]) -> dict[str, Any]:
    """transformers 4's Phi3Config accepts a rope_scaling of exactly ``{type, short_factor,
    long_factor}`` with ``original_max_position_embeddings`` at the top level (5 reads that too),
    so longrope is written that way unless it carries more keys (factor, attention_factor)."""
    if scaling is None:
        return dict(original_max_position_embeddings=cfg.max_position_embeddings)
    original = scaling["original_max_position_embeddings"]
    if set(scaling) <= _PHI3_V4_ROPE_KEYS:
        scaling = {"type": "longrope", "short_factor": scaling["short_factor"],
                   "long_factor": scaling["long_factor"]}
    return dict(original_max_position_embeddings=original, rope_scaling=scaling)
