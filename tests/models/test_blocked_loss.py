"""The blocked loss (models.blocked_loss): the LM head and the cross-entropy in blocks of tokens and
vocabulary equal the whole-logits loss and its gradient, alone and inside every model family, and
no whole logits array is ever held (training runs with it: tests/offload/test_blocked_loss_runs.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxascend.config import ConfigError, ModelConfig
from jaxascend.models import batch_loss, blocked_loss, build_model, chosen_loss, loss_sum_and_count, token_batch
from jaxascend.models.blocked_loss import blocked_token_losses, kernel_head, table_head
from tests._tolerances import assert_reordered_close, model_depth, model_reduction, reordering_atol, reordering_rtol


def dense_losses(x, head, targets):
    """The reference: the whole float32 logits, then optax's cross-entropy."""
    w = head.weights.astype(head.dtype).astype(jnp.float32)
    logits = jnp.einsum("BTD,VD->BTV" if head.tied else "BTD,DV->BTV", x.astype(head.dtype).astype(jnp.float32), w)
    if head.softcap is not None:
        logits = jnp.tanh(logits / head.softcap) * head.softcap
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets)


def relative(a, b) -> float:
    """``|a - b| / |b|`` over whole arrays (the norm of the difference against the reference's)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def assert_relative_within(label: str, got, want, rtol: float) -> None:
    error = relative(got, want)
    print(f"{label}: relative difference {error:.2e}, derived rtol {rtol:.2e}")
    assert error <= rtol, (label, error, rtol)


def _case(tied, vocab_size, width, batch, length, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(keys[0], (batch, length, width), jnp.float32)
    w = 0.1 * jax.random.normal(keys[1], (vocab_size, width) if tied else (width, vocab_size), jnp.float32)
    targets = jax.random.randint(keys[2], (batch, length), 0, vocab_size)
    weights = jax.random.uniform(keys[3], (batch, length), jnp.float32) / (batch * length)  # as token_batch's
    return x, w, targets, weights


@pytest.mark.parametrize("tied, vocab_size, blocks, length, softcap", [
    (True, 1000, 1, 64, None),     # one block; chunks divide the length
    (True, 1000, 4, 50, None),     # 4 blocks; 50 tokens in padded chunks
    (False, 1000, 4, 64, None),    # a separate kernel [D, V], sliced per block
    (False, 999, 1, 37, None),     # odd sizes, one block
    (True, 1200, 3, 41, 5.0),      # Gemma 3's soft-capping, small enough to bend the logits
    (False, 1024, 8, 128, 2.0),
])
def test_blocked_loss_equals_the_whole_logits_loss_and_its_gradient(tied, vocab_size, blocks, length, softcap):
    x, w, targets, weights = _case(tied, vocab_size, 48, 2, length)
    head = (table_head if tied else kernel_head)(w, jnp.float32, softcap=softcap)._replace(blocks=blocks)
    chunk = 2 * 16 * (vocab_size // blocks)  # 16 tokens a chunk: several chunks per block

    def loss(fn, x, w):
        return jnp.sum(fn(x, head._replace(weights=w), targets) * weights)

    blocked = jax.jit(jax.value_and_grad(lambda x, w: loss(
        lambda *a: blocked_token_losses(*a, chunk_elements=chunk), x, w), argnums=(0, 1)))
    dense = jax.jit(jax.value_and_grad(lambda x, w: loss(dense_losses, x, w), argnums=(0, 1)))
    (got, (gx, gw)), (want, (wx, ww)) = blocked(x, w), dense(x, w)
    # float32 sums in another order (tests/_tolerances.py). The loss: the logits' dot products over
    # the width, then the logsumexp (a sum of positive terms: its own error is relative to it). The
    # gradients: then the backward's dot products over the vocabulary (dx) and the tokens (dw).
    case = f"{'tied' if tied else 'untied'} {vocab_size} in {blocks}"
    assert_relative_within(f"{case} loss", got, want, reordering_rtol(reduction=48, depth=2))
    backward = reordering_rtol(reduction=max(48, vocab_size, 2 * length), depth=3)
    assert_relative_within(f"{case} dx", gx, wx, backward)
    assert_relative_within(f"{case} dw", gw, ww, backward)
    per_token = blocked_token_losses(x, head, targets, chunk_elements=chunk)
    assert per_token.shape == targets.shape
    want = dense_losses(x, head, targets)
    assert_reordered_close(per_token, want, reordering_atol(want, reduction=48, depth=2), f"{case} per token")


def test_sixteen_bit_weights_are_used_in_the_compute_dtype_and_their_gradient_rounded_once():
    x, w, targets, weights = _case(True, 512, 32, 1, 96)
    w16 = w.astype(jnp.bfloat16)
    head = table_head(w16, jnp.bfloat16)._replace(blocks=4)
    grad = jax.grad(lambda w: jnp.sum(blocked_token_losses(x, head._replace(weights=w), targets,
                                                           chunk_elements=32 * 128) * weights))(w16)
    ref = jax.grad(lambda w: jnp.sum(dense_losses(x, head._replace(weights=w), targets) * weights))(w16)
    assert grad.dtype == jnp.bfloat16
    # float32 sums in another order, each rounded to bfloat16 once: at most one bf16 ulp apart
    ulp = np.abs(np.asarray(ref, np.float32)) * 2.0 ** -7 + 1e-30
    assert np.all(np.abs(np.asarray(grad, np.float32) - np.asarray(ref, np.float32)) <= ulp)


def test_chunks_divide_the_length_when_they_can():
    assert blocked_loss.chunk_tokens(1, 16384, 9496, 1 << 23) == 512  # 883 fit; 512 divides 16384
    assert blocked_loss.chunk_tokens(1, 4096, 1024, 1 << 20) == 1024
    assert blocked_loss.chunk_tokens(1, 100, 1024, 1 << 20) == 100  # the whole row fits one chunk
    assert blocked_loss.chunk_tokens(2, 1000, 1000, 3000) == 8  # at least 8 tokens; 1000 % 8 == 0
    assert blocked_loss.chunk_tokens(1, 1001, 1000, 64 * 1000) == 64  # no divisor near 64: padded


def test_auto_blocks_from_the_measured_size_and_bad_names_are_refused():
    assert chosen_loss("auto", 1, 128, 259) == "dense"  # the bundled tiny runs
    assert chosen_loss("auto", 1, 1024, 151936) == "blocked"
    assert chosen_loss("dense", 4, 32768, 151936) == "dense"
    assert chosen_loss("blocked", 1, 8, 10) == "blocked"
    with pytest.raises(ValueError, match=r"^model.loss: 'fused' is not supported \(allowed: auto, blocked, dense\)"):
        chosen_loss("fused", 1, 8, 10)
    with pytest.raises(ConfigError, match=r"^model.loss: 'fused' is not supported"):
        ModelConfig(loss="fused")


FAMILIES = {
    "llama-tied": dict(arch="llama", tie_word_embeddings=True),
    "qwen2-untied": dict(arch="qwen2", attention_bias=True),
    "gemma3-softcap": dict(arch="gemma3", layer_types=["sliding_attention", "full_attention"], sliding_window=4,
                           query_pre_attn_scalar=8, final_logit_softcapping=3.0, tie_word_embeddings=True),
    "gpt2": dict(arch="gpt2", tie_word_embeddings=True, num_key_value_heads=4),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_trains_on_the_same_loss_and_gradient_blocked(family):
    extra = {"num_key_value_heads": 2, **FAMILIES[family]}
    base = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, dtype="float32",
                param_dtype="float32", max_position_embeddings=64, **extra)
    rng = np.random.default_rng(1)
    batch = token_batch(rng.integers(0, 300, (2, 25)), loss_mask=rng.random((2, 24)) < 0.8)

    def value_and_grad(loss):
        model = build_model(ModelConfig(loss=loss, **base), 300, rngs=nnx.Rngs(0))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        fn = jax.jit(jax.value_and_grad(lambda p: batch_loss(nnx.merge(graphdef, p, rest), batch)))
        evaluate = jax.jit(lambda p: loss_sum_and_count(nnx.merge(graphdef, p, rest), batch))
        return (*fn(params), evaluate(params))

    (got, grads, got_eval), (want, ref, want_eval) = value_and_grad("blocked"), value_and_grad("dense")
    # float32 sums in another order through the model (tests/_tolerances.py); the backward's dot
    # products also run over the vocabulary and the tokens
    cfg = ModelConfig(**base)
    forward_rtol = reordering_rtol(reduction=model_reduction(cfg, 24), depth=model_depth(cfg))
    assert_relative_within(f"{family} loss", got, want, forward_rtol)
    backward_rtol = reordering_rtol(reduction=max(model_reduction(cfg, 24), 300, 48),
                                    depth=model_depth(cfg, backward=True))
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref)):
        assert_relative_within(f"{family} {jax.tree_util.keystr(path)}", g, r, backward_rtol)
    assert_relative_within(f"{family} evaluation's sum", got_eval[0], want_eval[0], forward_rtol)
    assert int(got_eval[1]) == int(want_eval[1]) == int(np.sum(np.asarray(batch.weights) > 0))


def test_no_array_of_the_whole_logits_exists():
    # B x T x V = 1 x 4096 x 32000 float32 logits would be 500 MiB; the blocked gradient holds chunks.
    x, w, targets, weights = _case(True, 32000, 64, 1, 4096)
    head = table_head(w, jnp.float32)._replace(blocks=4)

    def temp_bytes(fn):
        grad = jax.jit(jax.grad(lambda x, w: jnp.sum(fn(x, head._replace(weights=w), targets) * weights),
                                argnums=(0, 1)))
        return grad.lower(x, w).compile().memory_analysis().temp_size_in_bytes

    logits_bytes = 4096 * 32000 * 4
    blocked = temp_bytes(blocked_token_losses)
    assert blocked < logits_bytes / 4
    assert temp_bytes(dense_losses) >= logits_bytes
