"""ssd_adamw (optax interface) and ssd_adamw_step (the trainer's fast path) against optax.adamw
with fp32 params on the same gradients, over 100 steps."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

from jaxascend.config import OffloadConfig
from jaxascend.offload import OffloadedAdamState, ssd_adamw
from jaxascend.offload.ssd_adamw import SsdAdamWState, ssd_adamw_state, ssd_adamw_step
from jaxascend.optim import AdamWSettings

STEPS = 100
SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 1e-2, warmup_steps=10, decay_steps=STEPS)
WEIGHT_DECAY = 0.1
MAX_NORM = 3.0
SHAPES = {"emb": (37, 13), "big": (5000,), "layers": {"w": (3, 129, 31)}, "norm": (5,)}
STACKED = {"emb": False, "big": False, "layers": {"w": True}, "norm": False}
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def _np(dtype):
    return np.dtype(ml_dtypes.bfloat16) if dtype == jnp.bfloat16 else np.dtype(dtype)


def _map_shapes(fn):
    return jax.tree.map(fn, SHAPES, is_leaf=lambda x: isinstance(x, tuple))


def _init_params():
    rng = np.random.default_rng(0)
    return _map_shapes(lambda s: rng.standard_normal(s).astype(np.float32))


def _gradients(dtype, steps=STEPS):
    """Gradients of varying magnitude (clipping active on some steps), rounded to `dtype` once."""
    rng = np.random.default_rng(1)
    for _ in range(steps):
        scale = np.float32(10.0 ** rng.uniform(-3, 0.5))
        yield _map_shapes(lambda s: (rng.standard_normal(s).astype(np.float32) * scale).astype(_np(dtype)))


def _assert_close_to(ours, ref, rtol=1e-6):
    """Relative agreement; elements near zero are compared against the array's scale."""
    ours, ref = np.asarray(ours), np.asarray(ref)
    np.testing.assert_allclose(ours, ref, rtol=rtol, atol=rtol * np.abs(ref).max())


@pytest.fixture
def make_state(tmp_path):
    made = []

    def make(dtype):
        cfg = OffloadConfig(dir=str(tmp_path / f"offload{len(made)}"), block_bytes=4096, chunk_bytes=8192,
                            staging_bytes=16384, shard_bytes=1 << 20, io_threads=2, pin_memory=False)
        spec = _map_shapes(lambda s: jax.ShapeDtypeStruct(s, dtype))
        made.append(OffloadedAdamState.create(spec, cfg, stacked=STACKED))
        return made[-1]

    yield make
    for state in made:
        state.close()


def _reference(clip: bool):
    """optax.adamw on fp32 params; with ``clip``, clip_by_global_norm runs first on the gradients
    in their own dtype (as it does in a chain fed 16-bit gradients), then they become fp32."""
    tx = optax.adamw(SCHEDULE, b1=0.9, b2=0.999, eps=1e-8, weight_decay=WEIGHT_DECAY)
    clipper = optax.clip_by_global_norm(MAX_NORM)

    @jax.jit
    def step(params, opt_state, grads):
        if clip:
            grads, _ = clipper.update(grads, clipper.init(grads))
        updates, opt_state = tx.update(jax.tree.map(lambda g: g.astype(jnp.float32), grads), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return tx, step


def _clip_then_adamw_reference():
    """optax's clip_by_global_norm then adamw, all in fp32 (the fast path's reference)."""
    tx = optax.chain(optax.clip_by_global_norm(MAX_NORM),
                     optax.adamw(SCHEDULE, b1=0.9, b2=0.999, eps=1e-8, weight_decay=WEIGHT_DECAY))

    @jax.jit
    def step(params, opt_state, grads):
        updates, opt_state = tx.update(jax.tree.map(lambda g: g.astype(jnp.float32), grads), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return tx, step


def _assert_masters_match(state, ref_params):
    for leaf, ref in zip(state.leaves, jax.tree.leaves(ref_params)):
        _assert_close_to(state.read_state(leaf, "master"), ref)


@pytest.mark.parametrize("clip", [False, True], ids=["plain", "clip_by_global_norm"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_optax_interface_matches_optax_adamw(make_state, dtype, clip):
    """Params in the compute dtype, jitted update + apply_updates, as any optax user writes it."""
    state = make_state(dtype)
    tx = ssd_adamw(SCHEDULE, b1=0.9, b2=0.999, eps=1e-8, weight_decay=WEIGHT_DECAY, state=state)
    if clip:  # the incoming grads are clipped by optax before ssd_adamw sees them
        tx = optax.chain(optax.clip_by_global_norm(MAX_NORM), tx)
    ref_tx, ref_step = _reference(clip)

    @jax.jit
    def step(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    init = _init_params()
    ref_params, ref_state = init, ref_tx.init(init)
    params = jax.tree.map(lambda x: jnp.asarray(x, dtype), init)
    opt_state = tx.init(init)  # fp32 init params: the master weights start exact
    for grads in _gradients(dtype):
        ref_params, ref_state = ref_step(ref_params, ref_state, grads)
        params, opt_state = step(params, opt_state, grads)
    jax.block_until_ready((params, opt_state))  # the last SSD step runs in a host callback, async

    assert state.updates_applied == STEPS
    _assert_masters_match(state, ref_params)
    # apply_updates lands on the master weights rounded to the compute dtype.
    for leaf, p in zip(state.leaves, jax.tree.leaves(params)):
        expected = state.read_state(leaf, "master").astype(_np(dtype))
        np.testing.assert_array_equal(np.asarray(p).view(np.uint8), expected.view(np.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fast_path_with_grad_scale_matches_clipped_optax(make_state, dtype):
    """Gradients go to SSD as they are (16-bit); the clip factor reaches the kernel as grad_scale."""
    state = make_state(dtype)
    settings = AdamWSettings(SCHEDULE, b1=0.9, b2=0.999, eps=1e-8, weight_decay=WEIGHT_DECAY)
    tx = ssd_adamw(SCHEDULE, b1=0.9, b2=0.999, eps=1e-8, weight_decay=WEIGHT_DECAY, state=state)
    ref_tx, ref_step = _clip_then_adamw_reference()
    global_norm = jax.jit(lambda g: optax.tree.norm(jax.tree.map(lambda x: x.astype(jnp.float32), g)))

    init = _init_params()
    ref_params, ref_state = init, ref_tx.init(init)
    opt_state = tx.init(jax.tree.map(lambda x: jnp.asarray(x, dtype), init))  # compute params, upcast
    if dtype != jnp.float32:  # the reference starts from the same (rounded) master weights
        ref_params = jax.tree.map(lambda x: np.asarray(x.astype(_np(dtype)), np.float32), init)
    for grads in _gradients(dtype):
        ref_params, ref_state = ref_step(ref_params, ref_state, grads)
        state.write_grads(grads)  # in the trainer: the backward pass through state.gradient_sink()
        norm = float(global_norm(grads))
        params, opt_state = ssd_adamw_step(settings, opt_state, state,
                                           grad_scale=1.0 if norm < MAX_NORM else MAX_NORM / norm)
    assert int(opt_state.count) == STEPS
    _assert_masters_match(state, ref_params)
    for leaf, p in zip(state.leaves, jax.tree.leaves(params)):
        assert p.dtype == dtype
        np.testing.assert_array_equal(np.asarray(p).view(np.uint8),
                                      state.read_state(leaf, "master").astype(_np(dtype)).view(np.uint8))


def test_fast_path_skip_keeps_count_and_state(make_state):
    state = make_state(jnp.bfloat16)
    settings = AdamWSettings(1e-3)
    opt_state = ssd_adamw(1e-3, state=state).init(_init_params())
    grads = next(_gradients(jnp.bfloat16, 1))
    state.write_grads(grads)
    params, opt_state = ssd_adamw_step(settings, opt_state, state)
    master = state.read_state("big").copy()
    state.write_grads(grads)
    skipped, same_state = ssd_adamw_step(settings, opt_state, state, skip=True)
    assert skipped is None and int(same_state.count) == 1 == state.updates_applied
    np.testing.assert_array_equal(state.read_state("big").view(np.uint32), master.view(np.uint32))


def test_state_is_two_scalars_and_init_works_under_jit(make_state):
    state = make_state(jnp.float32)
    tx = ssd_adamw(1e-3, state=state)
    opt_state = jax.jit(tx.init)(_init_params())
    assert isinstance(opt_state, SsdAdamWState)
    assert all(x.shape == () and x.dtype == jnp.int32 for x in opt_state)
    np.testing.assert_array_equal(state.read_state("big"), _init_params()["big"])


def test_misuse_is_an_error_with_a_message(make_state):
    state, other = make_state(jnp.float32), make_state(jnp.float32)
    tx = ssd_adamw(1e-3, state=state)
    params = _init_params()
    opt_state = tx.init(params)
    grads = next(_gradients(jnp.float32, 1))
    with pytest.raises(ValueError, match="needs params"):
        tx.update(grads, opt_state)
    updates, new_state = tx.update(grads, opt_state, params)
    # optax states are values, but the SSD state is not: replaying the old one is refused.
    with pytest.raises(Exception, match="count is 0 but the SSD-resident state has had 1 updates"):
        jax.block_until_ready(tx.update(grads, opt_state, params))
    with pytest.raises(Exception, match=f"names SSD state {state.state_id}, but this transformation owns "
                                        f"SSD state {other.state_id}"):
        jax.block_until_ready(ssd_adamw(1e-3, state=other).update(grads, new_state, params))
    with pytest.raises(ValueError, match=r"gradients leaf 0 \('big'\) has shape \(4,\), expected \(5000,\)"):
        tx.update({**grads, "big": np.zeros(4, np.float32)}, new_state, params)


def test_optax_state_rebuilt_after_a_restore(make_state):
    """A checkpoint restore fills the regions and declares the update count; ssd_adamw_state
    then gives the optax state that goes with it."""
    state = make_state(jnp.float32)
    ssd_adamw(1e-3, state=state).init(_init_params())
    state.restored(updates_applied=7)
    opt_state = ssd_adamw_state(state)
    assert int(opt_state.count) == 7 and int(opt_state.state_id) == state.state_id
    state.write_grads(next(_gradients(jnp.float32, 1)))
    _, opt_state = ssd_adamw_step(AdamWSettings(1e-3), opt_state, state)
    assert int(opt_state.count) == 8 == state.updates_applied
