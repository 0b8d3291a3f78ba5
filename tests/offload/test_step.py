"""Instant gradient offload on the real models: what the sink receives equals jax.grad bitwise,
the probes carry the overflow/norm statistics, and the step outputs only those few bytes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxascend.config import ModelConfig
from jaxascend.models import build_model, next_token_loss
from jaxascend.native import HOST_CALLBACKS_ENV
from jaxascend.offload.grad_sink import MemorySink, register_memory_sink, unregister_sink
from jaxascend.offload.step import LeafRoutes, make_offload_step, total_stats

VOCAB = 50


def loss_fn(model, tokens, hook):
    return next_token_loss(model(tokens[:, :-1], layer_hook=hook), tokens)


def _setup(arch, dtype, remat):
    heads = dict(num_attention_heads=4, num_key_value_heads=4 if arch == "gpt2" else 2)
    # gemma3: sliding and full layers in one scan, the window shorter than the 8 input tokens.
    extra = dict(layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                 sliding_window=3, query_pre_attn_scalar=6) if arch == "gemma3" else {}
    if arch == "phi3":  # longrope with the long factors (8 tokens > 4), partial rotary, a window
        extra = dict(partial_rotary_factor=0.5, sliding_window=3, rope_scaling={
            "rope_type": "longrope", "original_max_position_embeddings": 4,
            "short_factor": [1.0, 1.5], "long_factor": [2.0, 3.0]})
    cfg = ModelConfig(arch=arch, hidden_size=32, intermediate_size=64, num_hidden_layers=3, dtype=dtype,
                      param_dtype=dtype, remat=remat, tie_word_embeddings=arch == "gpt2", **heads, **extra)
    model = build_model(cfg, VOCAB, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    routing = LeafRoutes.for_params(params, "h" if arch == "gpt2" else "layers")
    sink, buffers = MemorySink(), {}
    for r in routing.routes:
        nbytes = int(np.prod(r.shape)) * jnp.dtype(r.dtype).itemsize
        buffers[r.key] = np.zeros(nbytes, np.uint8)
        sink.add_tensor(r.tensor, buffers[r.key], nbytes // max(r.layers, 1))
    return graphdef, params, rest, routing, sink, buffers


@pytest.mark.parametrize("arch, dtype, remat", [
    ("llama", "bfloat16", "none"), ("llama", "float32", "full"), ("llama", "float16", "dots"), ("gpt2", "bfloat16", "none"),
    ("gemma3", "bfloat16", "none"), ("gemma3", "float32", "full"),
    ("qwen3", "bfloat16", "full"), ("phi3", "float32", "dots"),
])
def test_sink_gets_exact_gradients(arch, dtype, remat):
    _assert_sink_gets_exact_gradients(arch, dtype, remat)


def test_sink_gets_exact_gradients_through_host_callbacks(monkeypatch):
    # The path a GPU runs (an io_callback per gradient, the stack not as raw bits), forced on the CPU.
    monkeypatch.setenv(HOST_CALLBACKS_ENV, "1")
    _assert_sink_gets_exact_gradients("llama", "float16", "dots")


def _assert_sink_gets_exact_gradients(arch, dtype, remat):
    graphdef, params, rest, routing, sink, buffers = _setup(arch, dtype, remat)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (2, 9)), jnp.int32)
    handle = register_memory_sink(sink)
    try:
        step = make_offload_step(graphdef, rest, routing, handle, loss_fn)
        loss, stats = jax.block_until_ready(step(params, tokens, jnp.float32(1.0)))
    finally:
        unregister_sink(handle)
    ref_loss, ref = jax.jit(jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p, rest), tokens, None)))(params)
    assert float(loss) == float(ref_loss)
    flat = jax.tree_util.tree_leaves(ref)
    for g, r in zip(flat, routing.routes):
        got = buffers[r.key].view(g.dtype).reshape(g.shape)
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(g).view(np.uint8), err_msg=r.key)
        assert sink.writes(r.tensor) == max(r.layers, 1)
    sumsq, nonfinite = total_stats(stats)
    ref_sumsq = sum(float(jnp.sum(jnp.square(g.astype(jnp.float32)))) for g in flat)
    np.testing.assert_allclose(float(sumsq), ref_sumsq, rtol=1e-5)
    assert float(nonfinite) == 0


def test_loss_scale_scales_gradients_and_step_outputs_are_small():
    graphdef, params, rest, routing, sink, buffers = _setup("llama", "float16", "none")
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, (2, 9)), jnp.int32)
    handle = register_memory_sink(sink)
    try:
        step = make_offload_step(graphdef, rest, routing, handle, loss_fn)
        _, stats1 = jax.block_until_ready(step(params, tokens, jnp.float32(1.0)))
        _, stats8 = jax.block_until_ready(step(params, tokens, jnp.float32(8.0)))
        compiled = step.lower(params, tokens, jnp.float32(1.0)).compile()
    finally:
        unregister_sink(handle)
    np.testing.assert_allclose(float(total_stats(stats8)[0]), 64 * float(total_stats(stats1)[0]), rtol=1e-2)
    out_bytes = sum(int(np.prod(o.shape)) * o.dtype.itemsize for o in jax.tree.leaves(compiled.out_info))
    n_probe_values = sum(2 * max(r.layers, 1) for r in routing.routes)
    assert out_bytes == 4 * (1 + n_probe_values)


def test_overflow_is_detected_on_the_fly():
    graphdef, params, rest, routing, sink, buffers = _setup("llama", "float16", "none")
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, VOCAB, (2, 9)), jnp.int32)
    handle = register_memory_sink(sink)
    try:
        step = make_offload_step(graphdef, rest, routing, handle, loss_fn)
        _, stats = jax.block_until_ready(step(params, tokens, jnp.float32(2.0**30)))  # fp16 grads overflow
    finally:
        unregister_sink(handle)
    assert float(total_stats(stats)[1]) > 0


def test_routing_needs_a_layer_stack():
    _, params, _, _, _, _ = _setup("llama", "float32", "none")
    with pytest.raises(ValueError, match="model parameters have no layer stack under 'blocks'"):
        LeafRoutes.for_params(params, "blocks")
