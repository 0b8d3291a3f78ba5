"""Which parameters weight decay applies to (``optimizer.weight_decay_mask``), by parameter path.

A parameter's path is its place in the model's tree, dotted: ``layers.mlp.up_proj.kernel``,
``layers.input_layernorm.scale``, ``h.attn.c_attn.bias``, ``embed_tokens.embedding`` (the names
:func:`jaxascend.hf.param_plan` lists; a stacked layer parameter has one path for all its layers).
The rules:

* ``default``: every parameter but the biases and the norm weights. In all seven families
  (llama, qwen2, mistral, qwen3, phi3, gemma3, gpt2) those are exactly the parameters named
  ``bias`` (Qwen2's q/k/v, GPT-2's) and ``scale`` (every RMSNorm and LayerNorm weight: the layers'
  norms, Qwen3's and Gemma 3's q/k norms, the final norm), and exactly those whose per-layer
  shape is one-dimensional (``tests/optim/test_decay_mask.py`` checks both on every family), as
  transformers' Trainer, torchtune and axolotl leave them out;
* ``default_no_embed``: also not the embeddings (``*.embedding``: the token table, tied to the
  head or not, and GPT-2's position table);
* ``all``: every parameter (optax's ``adamw`` without a mask);
* anything else is a regular expression searched in each path (:func:`re.search`): the
  parameters it matches decay, the others do not (``kernel$``: the matrices only).

    mask = decay_mask("default", params)          # a pytree of bools for optax.adamw(mask=...)
    flags = leaf_decay("default", ["layers.mlp.up_proj.kernel", "norm.scale"])   # (True, False)
"""

from __future__ import annotations

import re
from typing import Optional, Sequence

import jax

from jaxascend.config import ConfigError
from jaxascend.hf import tree_path_to_dotted

NO_DECAY_NAMES = ("bias", "scale")  # Flax's bias, and every norm's weight
EMBEDDING_NAMES = ("embedding",)


def decays(rule: str, path: str) -> bool:
    """Whether the parameter at dotted ``path`` gets weight decay under ``rule``."""
    name = path.rsplit(".", 1)[-1]
    if rule == "all":
        return True
    if rule == "default":
        return name not in NO_DECAY_NAMES
    if rule == "default_no_embed":
        return name not in NO_DECAY_NAMES + EMBEDDING_NAMES
    return re.search(rule, path) is not None


def param_path(key_path) -> str:
    """A ``jax.tree_util`` key path as a dotted parameter path; an ``nnx.Variable``'s own
    ``.value`` at the end is left out."""
    if key_path and isinstance(key_path[-1], jax.tree_util.GetAttrKey) and key_path[-1].name == "value":
        key_path = key_path[:-1]
    return tree_path_to_dotted(key_path)


def leaf_decay(rule: str, paths: Sequence[str]) -> tuple[bool, ...]:
    """Per parameter path, whether it decays under ``rule`` (see :func:`check_decay_rule`)."""
    return tuple(decays(rule, path) for path in paths)


def check_decay_rule(rule: str, paths: Sequence[str], weight_decay: float) -> None:
    """Refuses a regular expression that matches none of the model's ``paths`` while
    ``weight_decay`` > 0 (a ConfigError naming the field and the paths)."""
    if weight_decay == 0 or any(leaf_decay(rule, paths)) or not paths:
        return
    shown = ", ".join(paths[:12]) + (", ..." if len(paths) > 12 else "")
    raise ConfigError(f"optimizer.weight_decay_mask: {rule!r} matches none of the model's parameters ({shown}); "
                      "set optimizer.weight_decay: 0 for no decay")


def decay_mask(rule: str, params) -> Optional[object]:
    """``params``'s pytree of bools (True: decays) under ``rule``, for ``optax.adamw(mask=...)``;
    None for ``all`` (no mask: optax decays every leaf)."""
    if rule == "all":
        return None
    return jax.tree_util.tree_map_with_path(lambda path, _: decays(rule, param_path(path)), params)
