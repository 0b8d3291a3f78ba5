"""Segment masking: examples packed into one row (segment ids, positions restarting per example)
give each example the logits and losses it gets alone, for every architecture family."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxascend.models import build_model, token_batch, token_losses, forward
from tests._tolerances import assert_reordered_close, model_depth, model_reduction, reordering_atol
from tests.models.test_models import VOCAB, tiny_config

ARCHS = ["llama", "qwen3", "mistral", "gpt2"]


def model_cfg(arch, **overrides):
    return tiny_config(arch, **overrides)


def _model(arch, **overrides):
    return build_model(model_cfg(arch, **overrides), VOCAB, rngs=nnx.Rngs(0))


def losses_atol(cfg, alone, length) -> float:
    """Per-token losses of a packed row against the example's alone: float32 sums in another
    order through the model (tests/_tolerances.py), the logsumexp one level more."""
    return reordering_atol(alone, reduction=model_reduction(cfg, length), depth=model_depth(cfg) + 1)


def _packed_row(examples, length):
    """tokens [1, length+1], segment ids and positions [1, length] of examples packed in order, then padding."""
    tokens = np.zeros(length + 1, np.int32)
    seg = np.zeros(length, np.int32)
    pos = np.zeros(length, np.int32)
    at = 0
    for number, ex in enumerate(examples, start=1):
        tokens[at:at + len(ex)] = ex
        seg[at:at + len(ex)] = number
        pos[at:at + len(ex)] = np.arange(len(ex))
        at += len(ex)
    return tokens[None], seg[None], pos[None], at


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_examples_get_the_losses_they_get_alone(arch):
    model = _model(arch)
    rng = np.random.default_rng(1)
    examples = [rng.integers(0, VOCAB, n).astype(np.int32) for n in (6, 9, 4)]
    tokens, seg, pos, used = _packed_row(examples, 24)
    packed = token_batch(tokens, segment_ids=seg, positions=pos)
    losses = np.asarray(token_losses(forward(model, packed), jnp.asarray(tokens)))[0]
    at = 0
    for ex in examples:
        alone = token_batch(ex[None])
        expect = np.asarray(token_losses(forward(model, alone), jnp.asarray(ex[None])))[0]
        # Targets inside the example (the last token's target belongs to the next example).
        assert_reordered_close(losses[at:at + len(ex) - 1], expect, losses_atol(model_cfg(arch), expect, 24),
                               f"{arch} example of {len(ex)}")
        at += len(ex)


def test_without_segment_ids_the_examples_see_each_other():
    """The check above can fail: without segment ids the second example attends to the first."""
    model = _model("llama")
    rng = np.random.default_rng(1)
    examples = [rng.integers(0, VOCAB, n).astype(np.int32) for n in (6, 9)]
    tokens, seg, pos, _ = _packed_row(examples, 16)
    leaky = np.asarray(token_losses(forward(model, token_batch(tokens, positions=pos)), jnp.asarray(tokens)))[0]
    alone = np.asarray(token_losses(forward(model, token_batch(examples[1][None])), jnp.asarray(examples[1][None])))[0]
    moved, atol = np.abs(leaky[6:6 + 8] - alone).max(), losses_atol(model_cfg("llama"), alone, 16)
    print(f"without segment ids: {moved:.2e} = {moved / atol:.0f} x atol {atol:.2e}")
    assert moved > 100 * atol


def test_sliding_window_and_segments_combine():
    """Mistral's window (5) counts within an example: a long example alone vs packed after another."""
    model = _model("mistral", sliding_window=3)
    rng = np.random.default_rng(2)
    examples = [rng.integers(0, VOCAB, n).astype(np.int32) for n in (4, 10)]
    tokens, seg, pos, _ = _packed_row(examples, 16)
    packed = np.asarray(token_losses(forward(model, token_batch(tokens, segment_ids=seg, positions=pos)),
                                     jnp.asarray(tokens)))[0]
    alone = np.asarray(token_losses(forward(model, token_batch(examples[1][None])), jnp.asarray(examples[1][None])))[0]
    assert_reordered_close(packed[4:4 + 9], alone, losses_atol(model_cfg("mistral", sliding_window=3), alone, 16),
                           "mistral window 3")


def test_gemma3_sliding_and_global_layers_with_segments():
    from tests.models.test_gemma3 import gemma3_config

    cfg = gemma3_config()
    model = build_model(cfg, VOCAB, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(3)
    examples = [rng.integers(0, VOCAB, n).astype(np.int32) for n in (5, 8)]
    tokens, seg, pos, _ = _packed_row(examples, 16)
    packed = np.asarray(token_losses(forward(model, token_batch(tokens, segment_ids=seg, positions=pos)),
                                     jnp.asarray(tokens)))[0]
    for start, ex in ((0, examples[0]), (5, examples[1])):
        alone = np.asarray(token_losses(forward(model, token_batch(ex[None])), jnp.asarray(ex[None])))[0]
        assert_reordered_close(packed[start:start + len(ex) - 1], alone, losses_atol(cfg, alone, 16),
                               f"gemma3 example at {start}")


def test_token_batch_weights_are_a_per_token_mean_over_the_step():
    tokens = np.zeros((2, 3, 5), np.int32)
    mask = np.zeros((2, 3, 4), bool)
    mask[0, 0, :3] = True
    mask[1, 2, 1] = True
    b = token_batch(tokens, mask)
    assert b.weights.dtype == np.float32 and b.weights.shape == (2, 3, 4)
    np.testing.assert_allclose(b.weights.sum(), 1.0)
    assert np.all(b.weights[mask] == np.float32(0.25)) and np.all(b.weights[~mask] == 0)
    with pytest.raises(ValueError, match=r"loss_mask: expected shape \[2, 3, 4\]"):
        token_batch(tokens, mask[:, :, :3])
    with pytest.raises(ValueError, match="segment_ids: expected shape"):
        token_batch(tokens, mask, segment_ids=np.zeros((2, 3), np.int32))
