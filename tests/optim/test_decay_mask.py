"""Which parameters weight decay applies to: the rules against every family's parameter paths,
the path spelling of an nnx tree, and the per-leaf rows of the fused kernel's operand."""

import dataclasses

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from jaxascend.config import ConfigError, ModelConfig, OptimizerConfig
from jaxascend.hf import param_plan
from jaxascend.models import build_model
from jaxascend.optim import AdamHyperParams, AdamWSettings, check_decay_rule, decay_mask, leaf_decay
from jaxascend.optim.decay_mask import decays, param_path
from jaxascend.optim.fused_adam import WEIGHT_DECAY_SLOT

SMALL = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
FAMILIES = [dict(arch="llama"), dict(arch="llama", tie_word_embeddings=False), dict(arch="qwen2", attention_bias=True),
            dict(arch="mistral"), dict(arch="qwen3"), dict(arch="phi3"), dict(arch="gemma3"),
            dict(arch="gpt2", num_key_value_heads=4), dict(arch="gpt2", num_key_value_heads=4, tie_word_embeddings=False)]


def _plan(family):
    return param_plan(ModelConfig(**{**SMALL, **family}))


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: "-".join(str(v) for v in f.values()))
def test_default_leaves_out_exactly_the_biases_and_norm_weights(family):
    plan = _plan(family)
    undecayed = {m.dotted for m, d in zip(plan, leaf_decay("default", [m.dotted for m in plan])) if not d}
    # Per layer one-dimensional: the biases and the norms' weights, and nothing else.
    vectors = {m.dotted for m in plan if len(m.layer_shape) == 1}
    assert undecayed == vectors and undecayed
    assert all(p.rsplit(".", 1)[1] in ("bias", "scale") for p in undecayed)
    assert all("norm" in p or p.split(".")[-2].startswith("ln") or p.endswith(".bias") for p in undecayed)
    no_embed = {m.dotted for m, d in zip(plan, leaf_decay("default_no_embed", [m.dotted for m in plan])) if not d}
    assert no_embed == vectors | {m.dotted for m in plan if m.dotted.endswith(".embedding")}
    assert all(leaf_decay("all", [m.dotted for m in plan]))


def test_a_regex_selects_the_paths_that_decay():
    paths = [m.dotted for m in _plan(dict(arch="qwen2", attention_bias=True))]
    decayed = {p for p, d in zip(paths, leaf_decay(r"mlp\..*kernel$", paths)) if d}
    assert decayed == {"layers.mlp.down_proj.kernel", "layers.mlp.gate_proj.kernel", "layers.mlp.up_proj.kernel"}
    assert decays("kernel", "layers.self_attn.q_proj.kernel") and not decays("kernel", "norm.scale")


def test_a_regex_that_matches_nothing_is_refused_when_there_is_decay():
    paths = ["layers.mlp.up_proj.kernel", "norm.scale"]
    with pytest.raises(ConfigError, match=r"^optimizer\.weight_decay_mask: 'nothing' matches none of the model's "
                                          r"parameters \(layers\.mlp\.up_proj\.kernel, norm\.scale\)"):
        check_decay_rule("nothing", paths, 0.1)
    check_decay_rule("nothing", paths, 0.0)  # no decay: nothing to select
    check_decay_rule("default", paths, 0.1)


@pytest.mark.parametrize("rule, message", [
    ("(", r"^optimizer\.weight_decay_mask: '\(' is neither one of default, default_no_embed, all nor a regular "
          r"expression \(missing \), unterminated subpattern at position 0\)$"),
    ("", r"^optimizer\.weight_decay_mask: empty; expected one of default, default_no_embed, all"),
])
def test_a_bad_rule_is_one_line_naming_the_field(rule, message):
    with pytest.raises(ConfigError, match=message):
        OptimizerConfig(weight_decay_mask=rule)


def test_nnx_paths_are_the_checkpoint_names():
    # The in-memory engine's mask walks an nnx.State (each leaf inside a Variable's .value); the
    # offloaded engine and param_plan name leaves by the plain dict: the same dotted paths.
    cfg = ModelConfig(**{**SMALL, "arch": "gemma3"})
    _, params, _ = nnx.split(build_model(cfg, 100, rngs=nnx.Rngs(0)), nnx.Param, ...)
    paths = [param_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    assert paths == [m.dotted for m in param_plan(cfg)]
    mask = decay_mask("default", params)
    assert jax.tree.structure(mask) == jax.tree.structure(params)
    assert jax.tree.leaves(mask) == list(leaf_decay("default", paths))
    assert decay_mask("all", params) is None


def test_per_leaf_rows_zero_only_the_decay_of_leaves_left_out():
    settings = AdamWSettings(optax.constant_schedule(1e-2), 0.9, 0.95, 1e-8, 0.1, decay=(True, False, True))
    rows = settings.scalars(3, 0.5)
    base = np.asarray(AdamHyperParams(lr=1e-2, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, grad_scale=0.5,
                                      count=3).scalars())
    assert rows.shape == (3, 10) and rows.dtype == np.float32
    np.testing.assert_array_equal(rows[0], base)
    np.testing.assert_array_equal(rows[2], base)
    expected = base.copy()
    expected[WEIGHT_DECAY_SLOT] = 0
    np.testing.assert_array_equal(rows[1], expected)
    everywhere = dataclasses.replace(settings, decay=None).scalars(3, 0.5)
    np.testing.assert_array_equal(everywhere, base)
