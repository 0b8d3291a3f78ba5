"""The SSD-resident AdamW state: layout, init, gradients in (copied or sinked from the backward
pass), the streamed step against the kernel on whole arrays, skip, arena use, and errors."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax._src import dispatch

from jaxascend.config import OffloadConfig
from jaxascend.offload import OffloadLayout, OffloadedAdamState, offload_on_backward
from jaxascend.optim import AdamHyperParams, fused_adamw_update_numpy
from jaxascend.ssd import ArenaError, ArenaPlan, HostArena, SsdStore, StoreError, clear_faults, inject_fault

BLOCK = 4096
CHUNK_ELEMS = 2048  # chunk_bytes 8 KiB of fp32 = one block of 16-bit gradient
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
STACKED = {"emb": False, "big": False, "layers": {"w": True, "b": True}, "norm": False}


def _np(dtype):
    return np.dtype(ml_dtypes.bfloat16) if dtype == jnp.bfloat16 else np.dtype(dtype)


def offload_cfg(tmp_path, **overrides):
    fields = dict(dir=str(tmp_path / "offload"), block_bytes=BLOCK, chunk_bytes=2 * BLOCK,
                  staging_bytes=4 * BLOCK, shard_bytes=64 * BLOCK, io_threads=2, pin_memory=False)
    return OffloadConfig(**{**fields, **overrides})


def shapes():
    """Odd sizes that do not divide the chunk, a leaf of several chunks, stacked layers."""
    return {"emb": (37, 13), "big": (5000,), "layers": {"w": (3, 129, 31), "b": (3, 31)}, "norm": (5,)}


def spec(dtype):
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, dtype), shapes(), is_leaf=lambda x: isinstance(x, tuple))


def random_tree(seed, dtype=np.float32, scale=1.0):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: (rng.standard_normal(s) * scale).astype(_np(dtype)), shapes(),
                        is_leaf=lambda x: isinstance(x, tuple))


@pytest.fixture(autouse=True)
def _no_faults_left():
    yield
    clear_faults()


@pytest.fixture
def make_state(tmp_path):
    made = []

    def make(dtype=jnp.float32, **cfg_overrides):
        state = OffloadedAdamState.create(spec(dtype), offload_cfg(tmp_path, **cfg_overrides), stacked=STACKED)
        made.append(state)
        return state

    yield make
    for state in made:
        state.close()


def test_layout_chunks_odd_sizes_and_stacked_layers(tmp_path):
    layout = OffloadLayout.plan(spec(jnp.bfloat16), offload_cfg(tmp_path), stacked=STACKED)
    assert layout.chunk_elements == CHUNK_ELEMS
    by_path = {leaf.path: leaf for leaf in layout.leaves}
    w = by_path["layers/w"]
    assert (w.layers, w.layer_elements, w.grad_layer_bytes) == (3, 129 * 31, 129 * 31 * 2)
    assert len(w.state_regions) == 3 and by_path["big"].layers == 1
    chunks = [(c.leaf.path, c.layer, c.start, c.count) for c in layout.chunks()]
    assert [c for c in chunks if c[0] == "big"] == [("big", 0, 0, 2048), ("big", 0, 2048, 2048),
                                                     ("big", 0, 4096, 904)]
    assert [c for c in chunks if c[0] == "layers/w"][:2] == [("layers/w", 0, 0, 2048), ("layers/w", 0, 2048, 1951)]
    assert sum(c[3] for c in chunks) == layout.num_parameters
    requests = {r.shape_class: (r.nbytes, r.count) for r in layout.arena_requests()}
    assert requests == {"adam_state": (12 * CHUNK_ELEMS, 3), "adam_grad": (2 * CHUNK_ELEMS, 3)}
    # A chunk of 16-bit gradient must be whole blocks: chunk_bytes of one block rounds up.
    assert OffloadLayout.plan(spec(jnp.float16), offload_cfg(tmp_path, chunk_bytes=BLOCK)).chunk_elements == 2048
    assert OffloadLayout.plan(spec(jnp.float32), offload_cfg(tmp_path, chunk_bytes=BLOCK)).chunk_elements == 1024


@pytest.mark.parametrize("init_dtype", [np.float32, ml_dtypes.bfloat16])
def test_init_writes_master_and_zero_moments(make_state, init_dtype):
    state = make_state(jnp.bfloat16)
    params = random_tree(1, init_dtype)
    state.init(params)
    for leaf, x in zip(state.leaves, jax.tree.leaves(params)):
        np.testing.assert_array_equal(state.read_state(leaf, "master"), x.astype(np.float32))
        assert not state.read_state(leaf, "m").any() and not state.read_state(leaf, "v").any()
    assert state.updates_applied == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_streamed_step_equals_the_kernel_on_whole_arrays(make_state, dtype):
    """Chunking, interleaving and streaming change nothing: bit for bit the kernel's result."""
    state = make_state(dtype)
    params = random_tree(2)
    state.init(params)
    ref = {leaf.index: [x.reshape(-1).copy(), np.zeros(x.size, np.float32), np.zeros(x.size, np.float32)]
           for leaf, x in zip(state.leaves, jax.tree.leaves(params))}
    for count in range(3):
        grads = random_tree(10 + count, dtype, scale=0.1)
        state.write_grads(grads)
        hp = AdamHyperParams(lr=1e-2, weight_decay=0.1, grad_scale=0.5, count=count)
        new = state.step(hp)
        for leaf, g, p in zip(state.leaves, jax.tree.leaves(grads), jax.tree.leaves(new)):
            out = np.empty(leaf.size, _np(dtype))
            fused_adamw_update_numpy(*ref[leaf.index], g.reshape(-1), out, hp)
            assert isinstance(p, jax.Array) and p.dtype == dtype and p.shape == leaf.shape
            np.testing.assert_array_equal(np.asarray(p).reshape(-1).view(np.uint8), out.view(np.uint8))
    for leaf in state.leaves:
        for k, which in enumerate(("master", "m", "v")):
            np.testing.assert_array_equal(state.read_state(leaf, which).reshape(-1), ref[leaf.index][k])
    assert state.updates_applied == 3
    stats = state.last_step
    # Each step reads master/m/v and the gradient, and writes master/m/v back (whole 4 KiB pages).
    assert stats.bytes_read >= 12 * sum(leaf.size for leaf in state.leaves) and stats.bytes_written > 0
    assert stats.chunks == len(OffloadLayout.plan(spec(dtype), state.store.cfg, STACKED).chunks())


def test_skip_leaves_the_state_bit_identical(make_state):
    state = make_state(jnp.bfloat16)
    state.init(random_tree(3))
    state.write_grads(random_tree(4, ml_dtypes.bfloat16))
    state.step(AdamHyperParams(lr=1e-2, count=0))
    before = [state.read_state(leaf, w).copy() for leaf in state.leaves for w in ("master", "m", "v")]
    state.write_grads(random_tree(5, ml_dtypes.bfloat16))
    io_before = state.store.stats()
    assert state.step(AdamHyperParams(lr=1e-2, count=1), skip=True) is None
    io_after = state.store.stats()
    assert (io_after["bytes_read"], io_after["bytes_written"]) == (io_before["bytes_read"], io_before["bytes_written"])
    after = [state.read_state(leaf, w) for leaf in state.leaves for w in ("master", "m", "v")]
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
    assert state.updates_applied == 1
    with pytest.raises(ValueError, match="no gradients since the last step"):
        state.step(AdamHyperParams(lr=1e-2, count=1))  # skipping forgot the gradients


def test_arena_high_water_mark_is_constant_over_steps(make_state):
    state = make_state(jnp.float16)
    state.init(random_tree(6))
    arena = state.store.arena
    staging = arena.in_use_bytes
    marks = []
    for count in range(4):
        state.write_grads(random_tree(20 + count, np.float16, scale=0.1))
        state.step(AdamHyperParams(lr=1e-3, count=count))
        marks.append(arena.high_water_bytes)
        assert arena.in_use_bytes == staging  # every stream slot went back
    assert len(set(marks)) == 1


def _scanned_loss(w, emb, x, hook):
    """emb -> one tanh layer per slice of the stacked w (lax.scan)."""
    h = x @ hook(emb, "emb", None)

    def body(h, xs):
        wl, i = xs
        return jnp.tanh(h @ hook(wl, "w", i)), None

    h, _ = jax.lax.scan(body, h, (w, jnp.arange(w.shape[0])))
    return jnp.sum(h.astype(jnp.float32) ** 2)


def _sinked_setup(tmp_path, dtype, n_layers=3, d=16):
    rng = np.random.default_rng(7)
    w = jnp.asarray(rng.standard_normal((n_layers, d, d)) * 0.3, dtype)
    emb = jnp.asarray(rng.standard_normal((8, d)) * 0.3, dtype)
    x = jnp.asarray(rng.standard_normal((4, 8)), dtype)
    params = {"emb": emb, "w": w}
    state = OffloadedAdamState.create(params, offload_cfg(tmp_path), stacked={"emb": False, "w": True})
    return state, params, x


def _sinked_grad_step(state, n_layers):
    sink, ids = state.gradient_sink(), state.tensor_ids()

    def loss(probes, params, x):
        def hook(p, name, i):
            if i is None:
                return offload_on_backward(p, probes[name], sink=sink.handle, tensor=ids[name])
            return offload_on_backward(p, probes[name][i], sink=sink.handle, tensor=ids[name], layer=i)
        return _scanned_loss(params["w"], params["emb"], x, hook)

    probes = {"emb": jnp.zeros((2,)), "w": jnp.zeros((n_layers, 2))}
    return jax.jit(jax.value_and_grad(loss)), probes


@pytest.mark.parametrize("dtype", DTYPES)
def test_sink_writes_exactly_jax_grad_to_ssd(tmp_path, dtype):
    state, params, x = _sinked_setup(tmp_path, dtype)
    with state:
        state.init(params)
        ref = jax.jit(jax.grad(lambda p: _scanned_loss(p["w"], p["emb"], x, lambda q, n, i: q)))(params)
        step, probes = _sinked_grad_step(state, 3)
        # Block before reading: the jitted step calls the sink while it runs, asynchronously.
        loss, stats = jax.block_until_ready(step(probes, params, x))
        state.store.flush()
        for name in ("emb", "w"):
            got = state.read_grad(name)
            assert got.dtype == _np(dtype)
            np.testing.assert_array_equal(got.view(np.uint8), np.asarray(ref[name]).view(np.uint8))
        assert state.gradient_sink().received(state.leaf("w").index) == [1, 1, 1]
        new = state.step(AdamHyperParams(lr=1e-2, count=0))  # the sinked gradients are complete
        assert new["w"].dtype == dtype and state.gradient_sink().received(state.leaf("w").index) == [0, 0, 0]


def test_step_refuses_gradients_that_did_not_all_arrive(tmp_path):
    state, params, x = _sinked_setup(tmp_path, jnp.bfloat16)
    with state:
        state.init(params)
        sink, ids = state.gradient_sink(), state.tensor_ids()

        def loss(probe, params, x):  # only emb goes through the sink; w's layers never arrive
            hook = lambda p, n, i: offload_on_backward(p, probe, sink=sink.handle, tensor=ids["emb"]) \
                if n == "emb" else p  # noqa: E731
            return _scanned_loss(params["w"], params["emb"], x, hook)

        jax.block_until_ready(jax.jit(jax.grad(loss))(jnp.zeros((2,)), params, x))
        with pytest.raises(ValueError, match=r"'w' \(tensor 1\) never arrived for layers \[0, 1, 2\].*"
                                             r"block_until_ready"):
            state.step(AdamHyperParams(lr=1e-2, count=0))


@pytest.fixture
def forget_failed_effects():
    """A failed side-effecting call leaves its error in JAX's runtime tokens; drop it after."""
    yield
    dispatch.runtime_tokens.clear()


def test_sink_errors_name_the_tensor(tmp_path, forget_failed_effects):
    state, params, x = _sinked_setup(tmp_path, jnp.bfloat16)
    with state:
        step, probes = _sinked_grad_step(state, 3)
        with pytest.raises(Exception, match="tensor 1 stores bfloat16 gradients, got float16"):
            jax.block_until_ready(step(probes, jax.tree.map(lambda p: p.astype(jnp.float16), params),
                                       x.astype(jnp.float16)))
        with pytest.raises(Exception, match="tensor 0 expects 256 bytes per layer, got 128"):
            smaller = {"emb": params["emb"][:4], "w": params["w"]}  # 4 input features instead of 8
            jax.block_until_ready(step(probes, smaller, x[:, :4]))
        with pytest.raises(ValueError, match="region 'adam/1/w/L0/grad' holds 512 bytes, but one layer of the gradient is 100"):
            from jaxascend.offload.store_sink import SinkTarget, register_store_sink
            register_store_sink(state.store, [SinkTarget(0, state.leaf("w").grad_regions, 100, jnp.bfloat16)])


def test_errors_have_messages(tmp_path, make_state):
    cfg = offload_cfg(tmp_path)
    small = ArenaPlan().extend(SsdStore.arena_requests(cfg)).add("adam_state", 4096, 3).add("adam_grad", 4096, 3)
    with HostArena(small, cfg) as arena, SsdStore(cfg, arena) as store:
        with pytest.raises(ArenaError, match=r"3 arena slots of class 'adam_state' of 24576 bytes \(0.02 MiB\)"):
            OffloadedAdamState(store, spec(jnp.bfloat16), stacked=STACKED)
    state = make_state(jnp.bfloat16)
    with pytest.raises(ValueError, match="call init"):
        state.step(AdamHyperParams(lr=1e-3, count=0))
    with pytest.raises(ValueError, match=r"'big' has dtype float16; expected float32 or the compute dtype bfloat16"):
        state.init(random_tree(0, np.float16))
    bad = random_tree(0)
    bad["big"] = bad["big"][:10]
    with pytest.raises(ValueError, match=r"leaf 0 \('big'\) has shape \(10,\), expected \(5000,\)"):
        state.init(bad)
    with pytest.raises(ValueError, match="'s' is marked stacked but is a scalar"):
        OffloadLayout.plan({"s": jnp.zeros(())}, cfg, stacked=True)
    with pytest.raises(ValueError, match="compute dtype must be one of"):
        OffloadLayout.plan({"i": jnp.zeros(3, jnp.int32)}, cfg)


def test_a_failed_step_poisons_the_state_until_init(make_state):
    state = make_state(jnp.bfloat16)
    state.init(random_tree(0))
    state.write_grads(random_tree(1, ml_dtypes.bfloat16))
    inject_fault("read:3:EIO")
    with pytest.raises(StoreError, match="EIO"):
        state.step(AdamHyperParams(lr=1e-3, count=0))
    with pytest.raises(RuntimeError, match="a step failed midway"):
        state.step(AdamHyperParams(lr=1e-3, count=0))
    state.init(random_tree(0))  # a fresh init (or a checkpoint restore) makes it usable again
    state.write_grads(random_tree(1, ml_dtypes.bfloat16))
    state.step(AdamHyperParams(lr=1e-3, count=0))
