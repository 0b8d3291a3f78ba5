"""Which Hugging Face tensor holds which of our parameters: names, shapes and transposes.

The tables in :mod:`jaxascend.models.llama` and :mod:`jaxascend.models.gpt2` are the reference;
here they are derived from the model's own (abstract) parameter tree with three rules:

* a stacked layer parameter ``layers.X`` (``h.X`` for GPT-2) of shape ``[L, ...]`` is the HF
  tensors ``model.layers.{i}.X`` (``transformer.h.{i}.X``), one per layer;
* the leaf names map ``kernel``/``scale``/``embedding`` -> ``weight`` and ``bias`` -> ``bias``;
* a Llama-family ``kernel`` is stored transposed by HF (``nn.Linear`` is ``[out, in]``); GPT-2's
  ``Conv1D`` kernels are not, but its separate ``lm_head`` is an ``nn.Linear``.

    plan = param_plan(model_cfg)                  # one ParamMapping per parameter of ours
    for m in plan: print(m.path, m.shape, m.hf_names[0], m.transpose)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from flax import nnx

from jaxascend.config import ModelConfig
from jaxascend.models import build_model

# Stacked-layer collection names and the HF base-model prefix, per architecture family.
_LAYER_COLLECTION = {"llama": "layers", "qwen2": "layers", "mistral": "layers", "gpt2": "h", "gemma3": "layers",
                     "qwen3": "layers", "phi3": "layers"}
HF_PREFIX = {"llama": "model.", "qwen2": "model.", "mistral": "model.", "gpt2": "transformer.",
             "gemma3": "model.", "qwen3": "model.", "phi3": "model."}
# HF tensors that hold several of our parameters as consecutive row blocks (HF [out, in]), per
# arch: fused module -> our modules, in row order. Phi-3: qkv_proj = [q; k; v], gate_up = [gate; up].
FUSED_MODULES = {"phi3": {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}}
# Prefixes tried before HF_PREFIX on load: the text model inside Gemma3ForConditionalGeneration,
# as the Hub files (and transformers 5's save_pretrained) name it, then transformers 5's
# in-memory names. "model.language_model." also starts with "model.", so order matters.
HF_TEXT_PART_PREFIXES = {"gemma3": ("language_model.model.", "model.language_model.")}
# The multimodal model's other tensors (SigLIP vision tower, projector), skipped on load.
_GEMMA3_NON_TEXT = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                    "model.multi_modal_projector.")
_LEAF_NAMES = {"kernel": "weight", "scale": "weight", "embedding": "weight", "bias": "bias"}


@dataclass(frozen=True)
class ParamMapping:
    """One parameter of ours and the Hugging Face tensor(s) it is made of."""

    path: tuple[str, ...]  # our parameter path, e.g. ("layers", "mlp", "up_proj", "kernel")
    shape: tuple[int, ...]  # our shape (stacked: leading layer axis)
    hf_names: tuple[str, ...]  # one per layer when stacked, else one; without the base prefix
    hf_shape: tuple[int, ...]  # shape of each HF tensor (the whole tensor when fused)
    transpose: bool  # HF tensor (our rows of it) is the transpose of our (per-layer) slice
    stacked: bool  # our parameter has a leading layer axis
    hf_rows: Optional[tuple[int, int]] = None  # fused: our [start, stop) rows of the HF tensor

    @property
    def dotted(self) -> str:
        return ".".join(self.path)

    @property
    def layer_shape(self) -> tuple[int, ...]:
        """Shape of one layer's slice (our layout)."""
        return self.shape[1:] if self.stacked else self.shape

    def hf_name(self, layer: Optional[int], prefix: str) -> str:
        """Full HF name of the tensor for ``layer`` (None when not stacked), given the prefix."""
        name = self.hf_names[layer if self.stacked else 0]
        return name if name.startswith("lm_head.") else prefix + name

    @property
    def hf_part_shape(self) -> tuple[int, ...]:
        """Shape of the part of each HF tensor that is ours (``hf_shape`` unless fused)."""
        if self.hf_rows is None:
            return self.hf_shape
        return (self.hf_rows[1] - self.hf_rows[0],) + self.hf_shape[1:]


def abstract_params(cfg: ModelConfig, vocab_size: Optional[int] = None) -> tuple[nnx.GraphDef, nnx.State]:
    """``(graphdef, state)`` of ``cfg``'s model with ShapeDtypeStruct leaves (nothing allocated)."""
    vocab = vocab_size or cfg.vocab_size
    if not vocab:
        raise ValueError("model.vocab_size: 0 (unknown); set it or load it from config.json")
    abstract = nnx.eval_shape(lambda: build_model(cfg, vocab, rngs=nnx.Rngs(0)))
    return nnx.split(abstract)


def param_plan(cfg: ModelConfig, vocab_size: Optional[int] = None) -> list[ParamMapping]:
    """One :class:`ParamMapping` per parameter of ``cfg``'s model, in the model's tree order."""
    _, state = abstract_params(cfg, vocab_size)
    collection = _LAYER_COLLECTION[cfg.arch]
    plan = []
    for path, variable in nnx.to_flat_state(state):
        path = tuple(str(p) for p in path)
        shape = tuple(variable.get_value().shape)
        stacked = path[0] == collection
        leaf = _LEAF_NAMES[path[-1]]
        transpose = path[-1] == "kernel" and (cfg.arch != "gpt2" or path[0] == "lm_head")
        layer_shape = shape[1:] if stacked else shape
        hf_shape = tuple(reversed(layer_shape)) if transpose else layer_shape
        stem = ".".join(path[1:-1] if stacked else path[:-1])
        if stacked:
            names = tuple(f"{collection}.{i}.{stem}.{leaf}" for i in range(cfg.num_hidden_layers))
        else:
            names = (f"{stem}.{leaf}",)
        plan.append(ParamMapping(path, shape, names, hf_shape, transpose, stacked))
    return _fuse(plan, FUSED_MODULES.get(cfg.arch, {}))


def _fuse(plan: list[ParamMapping], fused: dict[str, tuple[str, ...]]) -> list[ParamMapping]:
    """Points the members of each fused HF module at their row block of its tensor: member ``j``
    of ``self_attn.qkv_proj`` (``k_proj``) is rows ``[q_out, q_out + k_out)`` of
    ``layers.{i}.self_attn.qkv_proj.weight``."""
    by_stem = {".".join(m.path[1:-1]): m for m in plan if m.stacked}
    replaced: dict[tuple[str, ...], ParamMapping] = {}
    for target, members in fused.items():
        parts = [by_stem[member] for member in members]
        total = sum(m.hf_shape[0] for m in parts)
        start = 0
        for m in parts:
            names = tuple(name.replace(f".{'.'.join(m.path[1:-1])}.", f".{target}.") for name in m.hf_names)
            stop = start + m.hf_shape[0]
            replaced[m.path] = dataclasses.replace(m, hf_names=names, hf_shape=(total,) + m.hf_shape[1:],
                                                   hf_rows=(start, stop))
            start = stop
    return [replaced.get(m.path, m) for m in plan]


def is_ignored_hf_tensor(name: str, arch: str) -> bool:
    """Buffers some checkpoints carry that are not parameters: RoPE ``inv_freq`` (Llama family)
    and GPT-2's causal-mask ``attn.bias`` / ``attn.masked_bias``; and the vision tower and
    projector of a multimodal Gemma 3, whose text model is all we load."""
    if arch == "gpt2":
        return name.endswith((".attn.bias", ".attn.masked_bias"))
    if arch == "gemma3" and name.startswith(_GEMMA3_NON_TEXT):
        return True
    return name.endswith("rotary_emb.inv_freq")


def tree_path_to_dotted(path) -> str:
    """A ``jax.tree_util`` key path or tuple of names as ``"layers.mlp.up_proj.kernel"``."""
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                key = getattr(key, attr)
                break
        parts.append(str(key))
    return ".".join(parts)


__all__ = ["HF_PREFIX", "HF_TEXT_PART_PREFIXES", "ParamMapping", "abstract_params", "is_ignored_hf_tensor", "param_plan",
           "tree_path_to_dotted"]
