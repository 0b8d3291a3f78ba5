"""Instant gradient offload: the sink receives exactly jax.grad's gradients, layer by layer,
and the probes receive their statistics, while the step itself outputs only a few bytes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import dispatch


@pytest.fixture
def forget_failed_effects():
    """A failed side-effecting call leaves an error in JAX's runtime tokens, re-raised at exit;
    the error tests below expect that failure, so they drop the tokens afterwards."""
    yield
    dispatch.runtime_tokens.clear()

from jaxascend.native import HOST_CALLBACKS_ENV
from jaxascend.offload import offload_on_backward
from jaxascend.offload.grad_sink import MemorySink, register_memory_sink, unregister_sink

L, D = 3, 16


def _net(w, emb, x, hook):
    """A scanned toy network: emb -> L tanh layers; `hook(w_l, i)` wraps each layer's weights."""
    h = x @ hook(emb, None)

    def body(h, xs):
        wl, i = xs
        return jnp.tanh(h @ hook(wl, i)), None

    h, _ = jax.lax.scan(body, h, (w, jnp.arange(w.shape[0])))
    return jnp.sum(h.astype(jnp.float32) ** 2)


@pytest.fixture
def params():
    w = jax.random.normal(jax.random.key(0), (L, D, D), jnp.float32) * 0.3
    emb = jax.random.normal(jax.random.key(1), (8, D), jnp.float32) * 0.3
    x = jax.random.normal(jax.random.key(2), (4, 8), jnp.float32)
    return w, emb, x


def _sinked_step(dtype, handle):
    def loss(probes, w, emb, x):
        w_probes, emb_probe = probes

        def hook(p, i):
            if i is None:
                return offload_on_backward(p, emb_probe, sink=handle, tensor=1)
            return offload_on_backward(p, w_probes[i], sink=handle, tensor=0, layer=i)

        return _net(w.astype(dtype), emb.astype(dtype), x.astype(dtype), hook)

    return jax.jit(jax.value_and_grad(loss))


@pytest.mark.parametrize("via_host", [False, True], ids=["ffi", "host-callback"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_sink_receives_exact_gradients(params, dtype, via_host, monkeypatch):
    # via_host: the io_callback path that GPU backends take, forced here on the CPU.
    monkeypatch.setenv(HOST_CALLBACKS_ENV, "1" if via_host else "0")
    w, emb, x = params
    ref_w, ref_emb = jax.jit(jax.grad(
        lambda w, e: _net(w.astype(dtype), e.astype(dtype), x.astype(dtype), lambda p, i: p),
        argnums=(0, 1)))(w, emb)
    itemsize = jnp.dtype(dtype).itemsize
    w_buf = np.zeros(L * D * D * itemsize, np.uint8)
    emb_buf = np.zeros(8 * D * itemsize, np.uint8)
    sink = MemorySink()
    sink.add_tensor(0, w_buf, D * D * itemsize)
    sink.add_tensor(1, emb_buf, 8 * D * itemsize)
    handle = register_memory_sink(sink)
    try:
        step = _sinked_step(dtype, handle)
        probes = (jnp.zeros((L, 2), jnp.float32), jnp.zeros((2,), jnp.float32))
        loss, (w_stats, emb_stats) = jax.block_until_ready(step(probes, w, emb, x))
    finally:
        unregister_sink(handle)
    # The cotangents are cast back to the parameter dtype before they reach the sink.
    ref_w = np.asarray(ref_w.astype(jnp.float32)).astype(jnp.dtype(dtype))
    got_w = w_buf.view(jnp.dtype(dtype)).reshape(L, D, D)
    np.testing.assert_array_equal(got_w.view(np.uint8), ref_w.view(np.uint8))
    got_emb = emb_buf.view(jnp.dtype(dtype)).reshape(8, D)
    np.testing.assert_array_equal(got_emb.astype(np.float32), np.asarray(ref_emb.astype(jnp.float32)))
    assert sink.writes(0) == L and sink.writes(1) == 1
    for i in range(L):
        np.testing.assert_allclose(float(w_stats[i, 0]), np.sum(got_w[i].astype(np.float64) ** 2), rtol=1e-6)
    assert float(jnp.sum(w_stats[:, 1])) == 0.0 and float(emb_stats[1]) == 0.0


def test_step_outputs_only_statistics(params):
    w, emb, x = params
    sink = MemorySink()
    sink.add_tensor(0, np.zeros(L * D * D * 4, np.uint8), D * D * 4)
    sink.add_tensor(1, np.zeros(8 * D * 4, np.uint8), 8 * D * 4)
    handle = register_memory_sink(sink)
    try:
        probes = (jnp.zeros((L, 2)), jnp.zeros((2,)))
        compiled = _sinked_step(jnp.float32, handle).lower(probes, w, emb, x).compile()
    finally:
        unregister_sink(handle)
    out_bytes = sum(np.prod(o.shape) * o.dtype.itemsize for o in jax.tree.leaves(compiled.out_info))
    assert out_bytes == 4 * (1 + L * 2 + 2)  # loss + probes' stats; no gradient leaves the step


def test_nonfinite_gradients_are_counted(params):
    w, emb, x = params
    x = x.at[0, 0].set(jnp.inf)
    sink = MemorySink()
    sink.add_tensor(0, np.zeros(L * D * D * 4, np.uint8), D * D * 4)
    sink.add_tensor(1, np.zeros(8 * D * 4, np.uint8), 8 * D * 4)
    handle = register_memory_sink(sink)
    try:
        probes = (jnp.zeros((L, 2)), jnp.zeros((2,)))
        # Block before unregistering: the step runs asynchronously and calls the sink late.
        _, (w_stats, emb_stats) = jax.block_until_ready(_sinked_step(jnp.float32, handle)(probes, w, emb, x))
    finally:
        unregister_sink(handle)
    assert float(emb_stats[1]) > 0


def test_unknown_sink_is_an_error(params, forget_failed_effects):
    w, emb, x = params
    sink = MemorySink()
    handle = register_memory_sink(sink)
    unregister_sink(handle)
    probes = (jnp.zeros((L, 2)), jnp.zeros((2,)))
    with pytest.raises(Exception, match=f"no open gradient sink with handle {handle}"):
        jax.block_until_ready(_sinked_step(jnp.float32, handle)(probes, w, emb, x))


def test_wrong_layer_size_is_an_error(params, forget_failed_effects):
    w, emb, x = params
    sink = MemorySink()
    sink.add_tensor(0, np.zeros(L * 8 * 4, np.uint8), 8 * 4)  # too small per layer
    sink.add_tensor(1, np.zeros(8 * D * 4, np.uint8), 8 * D * 4)
    handle = register_memory_sink(sink)
    try:
        probes = (jnp.zeros((L, 2)), jnp.zeros((2,)))
        with pytest.raises(Exception, match="tensor 0 expects 32 bytes per layer, got 1024"):
            jax.block_until_ready(_sinked_step(jnp.float32, handle)(probes, w, emb, x))
    finally:
        unregister_sink(handle)


def test_add_tensor_checks_layer_size():
    with pytest.raises(ValueError, match="not a whole number of layers of 7 bytes"):
        MemorySink().add_tensor(0, np.zeros(16, np.uint8), 7)
