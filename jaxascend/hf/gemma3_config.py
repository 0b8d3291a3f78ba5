"""Gemma 3 (text) ``config.json`` <-> :class:`ModelConfig`, used by :mod:`jaxascend.hf.config_map`.

Read: ``Gemma3ForCausalLM`` (``model_type: gemma3_text``) and the text part of the multimodal
``Gemma3ForConditionalGeneration`` (``model_type: gemma3``, whose text fields sit, sparsely, under
``text_config``). Absent fields take ``Gemma3TextConfig``'s defaults, as transformers does.

RoPE comes in two spellings. transformers 4.50+ writes top-level ``rope_theta`` (full layers),
``rope_local_base_freq`` (sliding layers) and ``rope_scaling`` (full layers only); transformers 5
writes ``rope_parameters`` nested per layer type, ``{"full_attention": {...}, "sliding_attention":
{...}}``. Both are read in transformers 5's order: the nested dicts, then a legacy ``rope_scaling``
merged into the full layers' entry, then the top-level bases for keys still unset.

``layer_types`` wins over ``sliding_window_pattern`` (layer ``i`` slides unless ``(i + 1) %
pattern == 0``; default 6), as in transformers.

Written: a text-only ``Gemma3ForCausalLM`` with both spellings (transformers 5's nested
``rope_parameters`` plus the 4.5x keys, which 5 merges to the same values) and
``sliding_window_pattern`` where ``layer_types`` follows one, so 4.50-4.52 read it too.
"""

from __future__ import annotations

from typing import Any, Optional

from jaxascend.config import LAYER_TYPES, ModelConfig, validate_rope_scaling
from jaxascend.hf.errors import HFCheckpointError, UnsupportedModelError

SLIDING, FULL = LAYER_TYPES
HF_ACTS = ("silu", "gelu_new", "gelu_pytorch_tanh", "gelu")

# Gemma3TextConfig's defaults (transformers 5.24, configuration_gemma3.py).
DEFAULTS = dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=131072,
                rms_norm_eps=1e-6, query_pre_attn_scalar=256, sliding_window=4096, rope_theta=1_000_000.0,
                rope_local_base_freq=10_000.0, sliding_window_pattern=6, hidden_activation="gelu_pytorch_tanh")


def pattern_layer_types(pattern: int, num_layers: int) -> list[str]:
    """transformers' layer_types for ``sliding_window_pattern``: every ``pattern``-th layer is full."""
    return [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]


def _text_config(hf: dict, source: str) -> dict:
    """The text model's fields: ``text_config`` of a multimodal config, else the config itself."""
    if hf.get("model_type") != "gemma3" and "text_config" not in hf:
        return hf
    text = hf.get("text_config") or {}
    if not isinstance(text, dict):
        raise HFCheckpointError(f"{source}: text_config must be an object, got {text!r}")
    return text


def _rope(src: dict, source: str) -> tuple[float, Optional[dict], float]:
    """``(rope_theta, rope_scaling, rope_local_theta)`` from either spelling."""
    params = src.get("rope_parameters") or {}
    if not isinstance(params, dict) or not set(params) <= {FULL, SLIDING}:
        raise UnsupportedModelError(f"{source}: gemma3 rope_parameters must be nested per layer type "
                                    f"({FULL!r}, {SLIDING!r}), got {params!r}")
    full, local = dict(params.get(FULL) or {}), dict(params.get(SLIDING) or {})
    legacy = src.get("rope_scaling")
    if legacy:
        if not isinstance(legacy, dict) or "rope_type" not in legacy:
            # transformers 5.24 silently runs default RoPE for a legacy {"type": ...} here.
            raise UnsupportedModelError(f"{source}: gemma3 rope_scaling needs a 'rope_type' key "
                                        f"(transformers ignores a bare 'type'), got {legacy!r}")
        full.update(legacy)
    theta = float(full.pop("rope_theta", src.get("rope_theta") or DEFAULTS["rope_theta"]))
    local_theta = float(local.pop("rope_theta", src.get("rope_local_base_freq") or DEFAULTS["rope_local_base_freq"]))
    for name, rope in ((FULL, full), (SLIDING, local)):
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise UnsupportedModelError(f"{source}: rope_parameters.{name}.partial_rotary_factor != 1 "
                                        "is not supported for gemma3")
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise UnsupportedModelError(f"{source}: rope_parameters.{SLIDING}: rope type "
                                    f"{local.get('rope_type', local.get('type'))!r} is not supported "
                                    "(sliding layers: default only)")
    full.pop("partial_rotary_factor", None)
    if full.get("rope_type", full.get("type", "default")) == "default":
        return theta, None, local_theta
    return theta, validate_rope_scaling(full, f"{source}: rope_parameters.{FULL}"), local_theta


def _layer_types(src: dict, num_layers: int, source: str) -> list[str]:
    kinds = src.get("layer_types")
    if kinds is None:
        pattern = src.get("sliding_window_pattern", DEFAULTS["sliding_window_pattern"])
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise HFCheckpointError(f"{source}: sliding_window_pattern must be an integer >= 1, got {pattern!r}")
        return pattern_layer_types(pattern, num_layers)
    if not isinstance(kinds, list) or len(kinds) != num_layers:
        raise HFCheckpointError(f"{source}: layer_types must be a list of num_hidden_layers={num_layers} "
                                f"entries, got {kinds!r}")
    for i, kind in enumerate(kinds):
        if kind not in LAYER_TYPES:
            raise UnsupportedModelError(f"{source}: layer_types[{i}] {kind!r} is not supported "
                                        f"(supported: {', '.join(LAYER_TYPES)})")
    return list(kinds)


def gemma3_fields(hf: dict, source: str) -> dict[str, Any]:
    """The architecture fields of :class:`ModelConfig` for a Gemma 3 config.json dict."""
    src = _text_config(hf, source)
    for key in ("attention_bias", "use_bidirectional_attention"):
        if src.get(key):
            raise UnsupportedModelError(f"{source}: {key}=true is not supported for gemma3")
    if src.get("attn_logit_softcapping") is not None:
        raise UnsupportedModelError(
            f"{source}: attn_logit_softcapping={src['attn_logit_softcapping']!r} is not supported "
            "(transformers 5.24 does not apply it to Gemma 3 either); set it to null")
    act = src.get("hidden_activation") or DEFAULTS["hidden_activation"]  # HF ignores hidden_act here
    if act not in HF_ACTS:
        raise UnsupportedModelError(f"{source}: hidden_activation {act!r} is not supported "
                                    f"(supported: {', '.join(HF_ACTS)})")
    fields = {name: src.get(name, DEFAULTS[name]) for name in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "head_dim", "max_position_embeddings", "sliding_window")}
    theta, scaling, local_theta = _rope(src, source)
    softcap = src.get("final_logit_softcapping")
    return dict(
        fields, num_key_value_heads=src.get("num_key_value_heads") or DEFAULTS["num_key_value_heads"],
        rms_norm_eps=float(src.get("rms_norm_eps", DEFAULTS["rms_norm_eps"])),
        rope_theta=theta, rope_scaling=scaling, rope_local_theta=local_theta,
        layer_types=_layer_types(src, fields["num_hidden_layers"], source),
        query_pre_attn_scalar=src.get("query_pre_attn_scalar", DEFAULTS["query_pre_attn_scalar"]),
        final_logit_softcapping=None if softcap is None else float(softcap),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", src.get("tie_word_embeddings", True))),
        attention_bias=False, hidden_act=act)


def gemma3_config_dict(cfg: ModelConfig, vocab_size: int) -> dict[str, Any]:
    """The architecture fields of a ``Gemma3ForCausalLM`` config.json for ``cfg``."""
    head_dim = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
    kinds = list(cfg.layer_types or [SLIDING if cfg.sliding_window else FULL] * cfg.num_hidden_layers)
    local_theta = cfg.rope_local_theta or DEFAULTS["rope_local_base_freq"]
    scaling = None if cfg.rope_scaling is None or cfg.rope_scaling["rope_type"] == "default" \
        else dict(cfg.rope_scaling)
    out = dict(
        vocab_size=vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=head_dim,
        hidden_activation=cfg.hidden_act or DEFAULTS["hidden_activation"],
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        query_pre_attn_scalar=cfg.query_pre_attn_scalar or head_dim,
        sliding_window=cfg.sliding_window, layer_types=kinds,
        rope_theta=cfg.rope_theta, rope_local_base_freq=local_theta, rope_scaling=scaling,
        rope_parameters={FULL: {"rope_type": "default", **(scaling or {}), "rope_theta": cfg.rope_theta},
                         SLIDING: {"rope_type": "default", "rope_theta": local_theta}},
        final_logit_softcapping=cfg.final_logit_softcapping, attn_logit_softcapping=None,
        attention_bias=False, use_bidirectional_attention=False)
    if FULL in kinds and kinds == pattern_layer_types(kinds.index(FULL) + 1, len(kinds)):
        out["sliding_window_pattern"] = kinds.index(FULL) + 1  # what transformers 4.50-4.52 read
    return out
