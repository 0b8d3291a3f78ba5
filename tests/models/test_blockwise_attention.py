"""Blockwise attention against the dense ``causal_attention``: outputs and q/k/v gradients in fp32
over every mask (causal, sliding window chosen by a traced flag, packed segments with padding),
GQA, scales and ragged lengths; the block ranges it visits; that no T x S array exists, forward
or backward; and ``model.attention`` from config to the models."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from jaxascend.config import ConfigError, ModelConfig, load_config
from jaxascend.models import blockwise_attention as bw
from jaxascend.models.layers import causal_attention, causal_mask
from tests._tolerances import model_depth, model_reduction, reordering_atol, reordering_rtol
from tests.models.test_gemma3 import gemma3_config
from tests.models.test_models import jitted_loss_and_grads, randomized_model, sample_ids, tiny_config


def random_qkv(batch, length, heads, kv_heads, head_dim=8, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(keys[0], (batch, length, heads, head_dim))
    k, v = (jax.random.normal(key, (batch, length, kv_heads, head_dim)) for key in keys[1:3])
    weights = jax.random.normal(keys[3], q.shape)  # the gradient is that of sum(out * weights)
    return q, k, v, weights


def outputs_and_grads(attend, q, k, v, weights, **kwargs):
    """``attend``'s output and the gradient of ``sum(out * weights)`` w.r.t. q, k, v, jitted
    (kwargs, e.g. the sliding flag, go in as traced arguments)."""

    def loss(q, k, v, kwargs):
        return jnp.sum(attend(q, k, v, **kwargs) * weights)

    out = jax.jit(lambda q, k, v, kwargs: attend(q, k, v, **kwargs))(q, k, v, kwargs)
    return out, jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, kwargs)


def assert_attends_like_dense(dense, other, shape) -> None:
    """(out, (dq, dk, dv)) of another attention against the dense one's, each within float32 sums
    in another order (tests/_tolerances.py): a dot product runs over at most the keys, a query's
    group of heads times the queries (dk, dv) or the head dim; the output is one level (scores, then
    the values), its gradients two more."""
    batch, length, heads, kv_heads = shape
    reduction = max(length * heads // kv_heads, 8)  # random_qkv's head_dim: 8
    (out_d, grads_d), (out_o, grads_o) = dense, other
    assert out_o.dtype == out_d.dtype and out_o.shape == out_d.shape
    for name, a, b, depth in zip(("out", "dq", "dk", "dv"), (out_d, *grads_d), (out_o, *grads_o), (1, 3, 3, 3)):
        error, atol = float(jnp.max(jnp.abs(a - b))), reordering_atol(a, reduction=reduction, depth=depth)
        print(f"{name} {shape}: max |difference| {error:.2e}, derived atol {atol:.2e}")
        assert error <= atol, (name, error, atol)


def assert_blocks_attend_like_dense(kwargs, blocks, static=None, shape=(2, 64, 4, 2)):
    """Blockwise attention against dense: outputs and q/k/v gradients."""
    static = static or {}
    q, k, v, weights = random_qkv(*shape)
    dense = outputs_and_grads(lambda *a, **kw: causal_attention(*a, **static, **kw), q, k, v, weights, **kwargs)
    blocked = outputs_and_grads(lambda *a, **kw: bw.blockwise_attention(*a, **static, **kw, **blocks),
                                q, k, v, weights, **kwargs)
    assert_attends_like_dense(dense, blocked, shape)


PACKED = np.array([[0] * 20 + [1] * 29 + [2] * 9 + [-1] * 6,  # three examples, then padding
                   [3] * 40 + [-1] * 24])

CASES = {
    "causal": ({}, {}),
    "window_always": ({}, {"sliding_window": 10}),
    "window_traced_on": ({"is_sliding": jnp.asarray(True)}, {"sliding_window": 10}),
    "window_traced_off": ({"is_sliding": jnp.asarray(False)}, {"sliding_window": 10}),
    "window_wider_than_row": ({"is_sliding": jnp.asarray(True)}, {"sliding_window": 100}),
    "packed_with_padding": ({"segment_ids": jnp.asarray(PACKED, jnp.int32)}, {}),
    "packed_and_window": ({"segment_ids": jnp.asarray(PACKED, jnp.int32), "is_sliding": jnp.asarray(True)},
                          {"sliding_window": 7}),
    "scale": ({}, {"scale": 0.3}),
}


BLOCKS = [dict(block_q=16, block_k=16), dict(block_q=32, block_k=16), dict(block_q=8, block_k=32)]


@pytest.mark.parametrize("index, case", list(enumerate(sorted(CASES))))
def test_matches_dense_on_every_mask(index, case):
    traced, static = CASES[case]
    blocks = BLOCKS[index % len(BLOCKS)]  # every mask with one block shape, every shape used
    assert_blocks_attend_like_dense(traced, blocks, static)


@pytest.mark.parametrize("length, heads, kv_heads", [(64, 4, 2), (50, 4, 4), (7, 3, 1), (17, 4, 2)])
def test_matches_dense_over_lengths_and_head_groups(length, heads, kv_heads):
    assert_blocks_attend_like_dense({"is_sliding": jnp.asarray(True)}, dict(block_q=16, block_k=16),
                                    {"sliding_window": 9}, shape=(2, length, heads, kv_heads))


def test_low_precision_inputs_give_their_dtype_and_stay_close():
    q, k, v, _ = random_qkv(1, 40, 4, 2)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    out = bw.blockwise_attention(q, k, v, block_q=16, block_k=16)
    assert out.dtype == jnp.bfloat16
    ref = causal_attention(*(x.astype(jnp.float32) for x in (q, k, v)))
    assert float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref))) < 3e-2


@pytest.mark.parametrize("window", [None, 1, 5, 16, 40])
@pytest.mark.parametrize("sliding", [True, False])
@pytest.mark.parametrize("block_q, block_k", [(8, 8), (16, 8), (8, 16)])
def test_block_ranges_are_exactly_the_blocks_with_a_visible_key(window, sliding, block_q, block_k):
    padded = 48
    plan = bw.BlockPlan(block_q, block_k, window, 1.0)
    mask = np.asarray(causal_mask(padded, window if sliding else None))
    # visible[i, j]: some query of block i sees some key of block j
    visible = mask.reshape(padded // block_q, block_q, padded // block_k, block_k).any(axis=(1, 3))
    flag = jnp.asarray(sliding)
    for i in range(padded // block_q):
        lo, hi = bw.key_block_range(plan, flag, i * block_q)
        assert np.flatnonzero(visible[i]).tolist() == list(range(int(lo), int(hi)))
    for j in range(padded // block_k):
        lo, hi = bw.query_block_range(plan, flag, j * block_k, padded // block_q)
        assert np.flatnonzero(visible[:, j]).tolist() == list(range(int(lo), int(hi)))


def largest_arrays(jaxpr) -> int:
    """Elements of the largest array any equation of ``jaxpr`` or its sub-jaxprs produces."""
    sizes = [math.prod(getattr(var.aval, "shape", ())) for eqn in jaxpr.eqns for var in eqn.outvars]
    sizes += [largest_arrays(sub) for sub in jax.extend.core.subjaxprs(jaxpr)]
    return max(sizes, default=0)


def forward_backward(attend, length, heads=2, head_dim=8):
    q, k, v, weights = random_qkv(1, length, heads, 1, head_dim)
    flag = jnp.asarray(True)
    fn = jax.jit(jax.value_and_grad(
        lambda q, k, v, flag: jnp.sum(attend(q, k, v, sliding_window=length // 2, is_sliding=flag) * weights),
        argnums=(0, 1, 2)))
    return fn, (q, k, v, flag)


def temp_bytes(fn, args) -> int:
    """XLA's temporary buffers of the compiled ``fn``: what it holds beyond inputs and outputs."""
    return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_no_length_squared_array_forward_or_backward():
    length, heads = 4096, 2
    scores_bytes = heads * length * length * 4  # one float32 [B, K, G, T, S] score array
    fn, args = forward_backward(bw.blockwise_attention, length, heads)
    largest = largest_arrays(jax.make_jaxpr(fn)(*args).jaxpr)
    assert largest <= heads * bw.BLOCK_Q * bw.BLOCK_K, largest
    temp, dense_temp = temp_bytes(fn, args), temp_bytes(*forward_backward(causal_attention, length, heads))
    double_temp = temp_bytes(*forward_backward(bw.blockwise_attention, 2 * length, heads))
    print(f"\nT={length}: blockwise temp {temp / 2**20:.1f} MiB (T={2 * length}: {double_temp / 2**20:.1f} MiB), "
          f"dense temp {dense_temp / 2**20:.1f} MiB, one T x S float32 scores array {scores_bytes / 2**20:.0f} MiB")
    assert dense_temp >= scores_bytes  # the measure sees the dense scores
    assert temp < scores_bytes / 8, temp  # a few blocks' scores, not T x S
    assert double_temp < 1.5 * temp, (temp, double_temp)  # twice the length, about the same working set


@pytest.mark.parametrize("field, value", [("block_q", 0), ("block_k", True)])
def test_bad_block_sizes_name_the_argument(field, value):
    q, k, v, _ = random_qkv(1, 8, 2, 1)
    with pytest.raises(ValueError, match=f"blockwise_attention.{field}: must be an integer >= 1"):
        bw.blockwise_attention(q, k, v, **{field: value})
    with pytest.raises(ValueError, match="must divide one another"):
        bw.blockwise_attention(q, k, v, block_q=24, block_k=16)


# ----------------------------------------------------------------------------- model.attention

def test_bad_attention_value_is_a_one_line_config_error(tmp_path):
    data = f"data.paths={tmp_path}"
    with pytest.raises(ConfigError, match=r"^model\.attention: 'flash' is not supported \(allowed: 'auto', "
                                          r"'blockwise', 'dense'\)$"):
        ModelConfig(attention="flash")
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides=[data, "model.attention=flash"], inputs=False)
    assert str(err.value).startswith("model.attention:") and "\n" not in str(err.value)
    assert load_config(None, overrides=[data, "model.attention=blockwise"], inputs=False).model.attention == "blockwise"


def test_auto_is_dense_below_the_threshold_and_blockwise_from_it():
    assert ModelConfig().attention == "auto"
    assert bw.chosen_implementation("auto", bw.BLOCKWISE_FROM - 1) == "dense"
    assert bw.chosen_implementation("auto", bw.BLOCKWISE_FROM) == "blockwise"
    for name in ("dense", "blockwise"):
        assert bw.chosen_implementation(name, 16) == name == bw.chosen_implementation(name, 10 ** 6)
    with pytest.raises(ValueError, match="^model.attention: 'flash'"):
        bw.chosen_implementation("flash", 16)


def model_loss_and_grads(cfg: ModelConfig, implementation: str, ids):
    model = randomized_model(dataclasses.replace(cfg, attention=implementation))
    (loss, grads), _, _ = jitted_loss_and_grads(model, ids)
    return loss, grads


def assert_trains_like_dense(cfg: ModelConfig, length: int, dense, other) -> None:
    """The loss and every gradient (relative to its norm) of a model with another attention,
    against the dense one's, within float32 sums in another order through the model's layers,
    forward and backward (tests/_tolerances.py)."""
    (loss_d, grads_d), (loss_o, grads_o) = dense, other
    reduction = model_reduction(cfg, length)
    rtol = reordering_rtol(reduction=reduction, depth=model_depth(cfg))
    error = abs(float(loss_o) - float(loss_d)) / abs(float(loss_d))
    print(f"{cfg.arch} loss: relative difference {error:.2e}, derived rtol {rtol:.2e}")
    assert error <= rtol, (error, rtol)
    rtol = reordering_rtol(reduction=reduction, depth=model_depth(cfg, backward=True))
    errors = {jax.tree_util.keystr(path): float(jnp.linalg.norm(g_o - g_d) / jnp.linalg.norm(g_d))
              for (path, g_d), g_o in zip(jax.tree_util.tree_leaves_with_path(grads_d), jax.tree.leaves(grads_o))}
    worst = max(errors, key=errors.get)
    print(f"{cfg.arch} gradients: largest relative difference {errors[worst]:.2e} ({worst}), derived rtol {rtol:.2e}")
    assert errors[worst] <= rtol, (worst, errors[worst], rtol)


MODEL_CASES = {
    "gemma3": lambda: gemma3_config(num_hidden_layers=4),  # sliding and full layers in one scan
    "mistral": lambda: tiny_config("mistral"),  # a sliding window on every layer, one kv head
    "llama": lambda: tiny_config("llama", remat="full"),
    "gpt2": lambda: tiny_config("gpt2"),
}


@pytest.mark.parametrize("arch", sorted(MODEL_CASES))
def test_models_train_alike_with_blockwise_and_dense_attention(arch, monkeypatch):
    # Blocks of 4 over 16 tokens: several blocks per row, and the window of 5 skips some.
    monkeypatch.setattr(bw, "BLOCK_Q", 4)
    monkeypatch.setattr(bw, "BLOCK_K", 4)
    cfg, ids = MODEL_CASES[arch](), sample_ids(2, 17)
    assert_trains_like_dense(cfg, 17, model_loss_and_grads(cfg, "dense", ids), model_loss_and_grads(cfg, "blockwise", ids))


def test_auto_leaves_short_rows_bit_identical_to_dense():
    cfg, ids = gemma3_config(), sample_ids(2, 17)
    loss_d, grads_d = model_loss_and_grads(cfg, "dense", ids)
    loss_a, grads_a = model_loss_and_grads(cfg, "auto", ids)
    assert float(loss_a) == float(loss_d)
    assert all(bool(jnp.array_equal(a, d)) for a, d in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_d)))
