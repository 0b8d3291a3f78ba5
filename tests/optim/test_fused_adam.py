"""The fused host AdamW kernel (ffi/optim_adam.cc) against optax.adamw, across its two entry points
and its ISA variants."""

import os
import select
import signal
import warnings

import ml_dtypes
import numpy as np
import optax
import pytest

import jax
import jax.numpy as jnp
from jaxascend.native import extension as _native
from jaxascend.native import ffi_call
from jaxascend.optim import AdamHyperParams, adamw_reference, default_isa, fused_adamw_update, fused_adamw_update_numpy
from jaxascend.optim.fused_adam import supported_isas

SIZES = [1, 7, 1000, 4099, 65536 + 13]
GRAD_DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
PARAM_DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
STEPS = 100
SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 1e-2, warmup_steps=10, decay_steps=STEPS)
WEIGHT_DECAY = 0.1
GRAD_SCALE = 0.5  # what clipping (or loss-scale unscaling) multiplies the gradient by


def _np_dtype(dtype):
    return np.dtype(ml_dtypes.bfloat16) if dtype == jnp.bfloat16 else np.dtype(dtype)


def _gradients(n, dtype, steps, seed):
    """Gradients of varying magnitude, rounded to `dtype` once and shared by both sides."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        scale = np.float32(10.0 ** rng.uniform(-4, 1))
        yield (rng.standard_normal(n).astype(np.float32) * scale).astype(_np_dtype(dtype))


@jax.jit
def _step_scalars(count):
    hp = AdamHyperParams(lr=SCHEDULE(count), b1=0.9, b2=0.999, eps=1e-8,
                         weight_decay=WEIGHT_DECAY, grad_scale=GRAD_SCALE, count=count)
    return hp.scalars()


def _assert_close_to(ours, ref, rtol=1e-6):
    """Relative agreement; elements near zero are compared against the array's scale."""
    ours, ref = np.asarray(ours), np.asarray(ref)
    np.testing.assert_allclose(ours, ref, rtol=rtol, atol=rtol * np.abs(ref).max())


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint32 if x.dtype.itemsize == 4 else np.uint16)


@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_matches_optax_adamw_over_100_steps(grad_dtype, n):
    """Schedule, weight decay and a gradient scale; the FFI and numpy entries run side by side."""
    tx = optax.chain(optax.scale(GRAD_SCALE),
                     optax.adamw(SCHEDULE, b1=0.9, b2=0.999, eps=1e-8, weight_decay=WEIGHT_DECAY))

    @jax.jit
    def optax_step(params, state, grad):
        updates, state = tx.update(grad.astype(jnp.float32), state, params)
        return optax.apply_updates(params, updates), state

    # The FFI path splits over two pool threads where n allows; numpy runs on one thread.
    fused_step = jax.jit(lambda *a: fused_adamw_update(*a, param_dtype=grad_dtype, threads=2))

    init = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    params, state = jnp.asarray(init), tx.init(jnp.asarray(init))
    master, m, v = jnp.asarray(init), jnp.zeros(n), jnp.zeros(n)
    np_master, np_m, np_v = init.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)
    np_params = np.zeros(n, _np_dtype(grad_dtype))
    for count, grad in enumerate(_gradients(n, grad_dtype, STEPS, seed=n)):
        params, state = optax_step(params, state, jnp.asarray(grad))
        scalars = _step_scalars(jnp.int32(count))
        master, m, v, new_params = fused_step(master, m, v, jnp.asarray(grad), scalars)
        fused_adamw_update_numpy(np_master, np_m, np_v, grad, np_params, np.asarray(scalars))

    _assert_close_to(master, params)
    # Both entry points run the same kernel: bit for bit.
    for ours, theirs in ((master, np_master), (m, np_m), (v, np_v), (new_params, np_params)):
        np.testing.assert_array_equal(_bits(ours), _bits(theirs))
    # The compute params are the master weights rounded to nearest even.
    np.testing.assert_array_equal(_bits(new_params), _bits(master.astype(grad_dtype)))


@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
def test_bitwise_equal_to_optax_run_op_by_op(grad_dtype):
    """Un-jitted optax runs each jnp op on its own (no FMA fusion): the kernel, which rounds
    every operation separately and multiplies by 1/bc as XLA does, must match it exactly."""
    n = 4099
    tx = optax.chain(optax.scale(GRAD_SCALE), optax.adamw(3e-3, weight_decay=WEIGHT_DECAY))
    init = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    params, state = jnp.asarray(init), tx.init(jnp.asarray(init))
    master, m, v = init.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)
    out = np.zeros(n, np.float32)
    for count, grad in enumerate(_gradients(n, grad_dtype, 12, seed=1)):
        updates, state = tx.update(jnp.asarray(grad).astype(jnp.float32), state, params)
        params = optax.apply_updates(params, updates)
        hp = AdamHyperParams(lr=3e-3, weight_decay=WEIGHT_DECAY, grad_scale=GRAD_SCALE,
                             count=count)
        fused_adamw_update_numpy(master, m, v, grad, out, hp)
        np.testing.assert_array_equal(_bits(master), _bits(params))
    adam_state = state[1][0]
    np.testing.assert_array_equal(_bits(m), _bits(adam_state.mu))
    np.testing.assert_array_equal(_bits(v), _bits(adam_state.nu))


def _special_inputs(n, grad_dtype, seed=0):
    """Random state plus zeros, subnormal and huge gradients, and masters that round to ties,
    subnormals and overflow in 16-bit types."""
    rng = np.random.default_rng(seed)
    master = rng.standard_normal(n).astype(np.float32) * np.float32(100.0)
    master[:8] = [0.0, -0.0, 65520.0, 1e-6, 6e-8, 1 + 2**-8, 1 + 3 * 2**-8, 3e38]
    grad = rng.standard_normal(n).astype(np.float32)
    grad[8:16] = [0.0, 1e-40, 6e-8, 65504.0, -3e4, 1e-20, 1e30, -0.0]
    m = rng.standard_normal(n).astype(np.float32) * np.float32(0.1)
    v = np.abs(rng.standard_normal(n).astype(np.float32)) * np.float32(0.01)
    with np.errstate(over="ignore"):  # 1e30 becomes inf in 16-bit types, on purpose
        return master, m, v, grad.astype(_np_dtype(grad_dtype))


def _run_numpy(inputs, param_dtype, hp, **kwargs):
    master, m, v, grad = (x.copy() for x in inputs)
    params = np.zeros(master.shape, _np_dtype(param_dtype))
    fused_adamw_update_numpy(master, m, v, grad, params, hp, **kwargs)
    return master, m, v, params


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
@pytest.mark.parametrize("param_dtype", PARAM_DTYPES)
def test_isa_variants_bitwise_equal_to_scalar(isa, grad_dtype, param_dtype):
    if isa not in supported_isas():
        pytest.skip(f"this CPU cannot run the {isa} variant")
    inputs = _special_inputs(65536 + 13, grad_dtype)
    hp = np.asarray(AdamHyperParams(lr=1e-3, weight_decay=0.01, grad_scale=0.25,
                                    count=3).scalars())
    expected = _run_numpy(inputs, param_dtype, hp, isa="scalar")
    for threads in (1, 2):
        got = _run_numpy(inputs, param_dtype, hp, isa=isa, threads=threads)
        for a, b in zip(expected, got):
            np.testing.assert_array_equal(_bits(a), _bits(b))


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("param_dtype", [jnp.bfloat16, jnp.float16])
def test_params_round_like_astype(isa, param_dtype):
    """With lr=0 master is unchanged, so params must be exactly master.astype(dtype): ties to
    even, subnormals, overflow to inf and NaN, for every variant."""
    if isa not in supported_isas():
        pytest.skip(f"this CPU cannot run the {isa} variant")
    rng = np.random.default_rng(5)
    master = np.concatenate([
        (rng.standard_normal(4000) * 10.0 ** rng.integers(-9, 6, 4000)).astype(np.float32),
        np.float32(1.0) + np.arange(64, dtype=np.float32) * np.float32(2**-9),  # bf16 ties
        np.float32(1.0) + np.arange(64, dtype=np.float32) * np.float32(2**-11),  # fp16 ties
        np.array([65519.0, 65520.0, 1e-8, 3e-8, 2**-24, 2**-25, np.inf, -np.inf, 1e-39],
                 np.float32),
    ])
    n = master.size
    params = np.zeros(n, _np_dtype(param_dtype))
    hp = AdamHyperParams(lr=0.0, weight_decay=0.0)
    fused_adamw_update_numpy(master, np.zeros(n, np.float32), np.zeros(n, np.float32),
                             np.zeros(n, np.float32), params, hp, isa=isa)
    with np.errstate(over="ignore"):  # 65520 rounds to inf in float16, on purpose
        expected = master.astype(_np_dtype(param_dtype))
    np.testing.assert_array_equal(_bits(params), _bits(expected))


def test_nan_gradient_propagates_in_every_variant():
    n = 100
    grad = np.ones(n, np.float16)
    grad[[3, 50, 99]] = np.nan
    for isa in supported_isas():
        master, m, v, params = _run_numpy(
            (np.ones(n, np.float32), np.zeros(n, np.float32), np.zeros(n, np.float32), grad),
            jnp.bfloat16, AdamHyperParams(lr=1e-3), isa=isa)
        for x in (master, m, v, params.astype(np.float32)):
            np.testing.assert_array_equal(np.isnan(x), np.isnan(grad))


def test_empty_arrays_are_a_no_op():
    empty = [np.zeros(0, np.float32) for _ in range(3)]
    fused_adamw_update_numpy(*empty, np.zeros(0, np.float16), np.zeros(0, np.float16),
                             AdamHyperParams(lr=1e-3), threads=2)
    out = fused_adamw_update(*(jnp.zeros(0) for _ in range(4)), AdamHyperParams(lr=1e-3),
                             param_dtype=jnp.bfloat16)
    assert [x.shape for x in out] == [(0,)] * 4


def test_jitted_ffi_does_not_recompile_when_lr_changes():
    traces = []

    @jax.jit
    def step(master, m, v, grad, lr, count):
        traces.append(1)
        hp = AdamHyperParams(lr=lr, weight_decay=0.01, count=count)
        return fused_adamw_update(master, m, v, grad, hp, param_dtype=jnp.bfloat16)

    n = 1000
    state = (jnp.ones(n), jnp.zeros(n), jnp.zeros(n))
    grad = jnp.full(n, 0.5, jnp.float16)
    masters = []
    for count, lr in enumerate([1e-3, 2e-3, 5e-2]):
        masters.append(step(*state, grad, jnp.float32(lr), jnp.int32(count))[0])
    assert len(traces) == 1 and step._cache_size() == 1
    assert len({float(x[0]) for x in masters}) == 3  # the new lr was used each time


def test_donated_state_is_updated_in_place():
    n = 4099
    step = jax.jit(lambda *a: fused_adamw_update(*a, param_dtype=jnp.float16),
                   donate_argnums=(0, 1, 2))
    master, m, v = jnp.ones(n), jnp.zeros(n), jnp.zeros(n)
    pointers = [x.unsafe_buffer_pointer() for x in (master, m, v)]
    out = step(master, m, v, jnp.ones(n, jnp.float16), AdamHyperParams(lr=1e-3).scalars())
    assert [x.unsafe_buffer_pointer() for x in out[:3]] == pointers


@pytest.mark.parametrize("param_dtype", PARAM_DTYPES)
def test_reference_matches_kernel(param_dtype):
    n = 4099
    inputs = _special_inputs(n, jnp.float16, seed=2)
    inputs = (inputs[0] / 1e3, inputs[1], inputs[2], np.clip(inputs[3], -10, 10))
    hp = AdamHyperParams(lr=1e-3, weight_decay=0.01, grad_scale=0.5, count=7)
    ours = _run_numpy(inputs, param_dtype, hp)
    ref = jax.jit(lambda *a: adamw_reference(*a, hp, param_dtype=param_dtype))(*inputs)
    for a, b in zip(ours[:3], ref[:3]):
        _assert_close_to(a, b)


def test_thread_pool_is_created_once():
    inputs = _special_inputs(1 << 17, jnp.float16)
    _run_numpy(inputs, jnp.bfloat16, AdamHyperParams(lr=1e-3), threads=3)
    workers = _native.compute_pool_workers()
    assert workers >= 2
    for _ in range(3):
        _run_numpy(inputs, jnp.bfloat16, AdamHyperParams(lr=1e-3), threads=3)
    assert _native.compute_pool_workers() == workers


def test_thread_pool_works_in_a_forked_child():
    """A child forked after the pool started has no workers; it must build its own rather
    than wait forever on the parent's."""
    inputs = _special_inputs(1 << 17, jnp.float16)
    expected = _run_numpy(inputs, jnp.bfloat16, AdamHyperParams(lr=1e-3), threads=2)
    read_end, write_end = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # JAX warns about fork; the child uses numpy only
        pid = os.fork()
    if pid == 0:  # child
        got = _run_numpy(inputs, jnp.bfloat16, AdamHyperParams(lr=1e-3), threads=2)
        same = all(np.array_equal(_bits(a), _bits(b)) for a, b in zip(expected, got))
        os.write(write_end, b"same" if same else b"diff")
        os._exit(0)
    os.close(write_end)
    ready, _, _ = select.select([read_end], [], [], 20.0)
    if not ready:
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    answer = os.read(read_end, 4) if ready else b"hung"
    os.close(read_end)
    assert answer == b"same"


def test_isa_environment_variable(monkeypatch):
    monkeypatch.setenv("JAXASCEND_ADAM_ISA", "scalar")
    assert default_isa() == "scalar"
    monkeypatch.setenv("JAXASCEND_ADAM_ISA", "sse9")
    with pytest.raises(ValueError, match="JAXASCEND_ADAM_ISA='sse9' is not one of"):
        default_isa()
    monkeypatch.delenv("JAXASCEND_ADAM_ISA")
    assert default_isa() == supported_isas()[-1]


# ------------------------------------------------------------------------------------------
# Error messages.

def _numpy_args(n=8, grad_dtype=np.float16):
    f32 = lambda: np.zeros(n, np.float32)  # noqa: E731
    return [f32(), f32(), f32(), np.zeros(n, grad_dtype), np.zeros(n, np.float16)]


def test_numpy_errors_name_the_argument():
    hp = AdamHyperParams(lr=1e-3)
    args = _numpy_args()
    args[2] = np.zeros(9, np.float32)
    with pytest.raises(ValueError, match="adamw: v has 9 elements but master has 8"):
        fused_adamw_update_numpy(*args, hp)
    with pytest.raises(ValueError, match="adamw: grad dtype int32 is not supported"):
        fused_adamw_update_numpy(*_numpy_args(grad_dtype=np.int32), hp)
    args = _numpy_args()
    args[0].flags.writeable = False
    with pytest.raises(ValueError, match="adamw: master is read-only"):
        fused_adamw_update_numpy(*args, hp)
    args = _numpy_args()
    args[1] = args[0]
    with pytest.raises(ValueError, match="adamw: master and m overlap in memory"):
        fused_adamw_update_numpy(*args, hp)
    args = _numpy_args(16)
    args[0] = args[0][::2]
    args[1:] = [a[:8] for a in args[1:]]
    with pytest.raises(ValueError, match="adamw: master must be C-contiguous"):
        fused_adamw_update_numpy(*args, hp)
    with pytest.raises(ValueError, match=r"adamw: threads=0 must be in \[1, 256\]"):
        fused_adamw_update_numpy(*_numpy_args(), hp, threads=0)
    with pytest.raises(ValueError, match="adamw: isa 'neon' is not one of"):
        fused_adamw_update_numpy(*_numpy_args(), hp, isa="neon")
    with pytest.raises(ValueError, match=r"hparams must be an AdamHyperParams or its float32\[10\]"):
        fused_adamw_update_numpy(*_numpy_args(), np.zeros(8, np.float32))


def test_native_binding_errors():
    args = _numpy_args()
    scalars = np.zeros(10, np.float32)
    args[4] = np.zeros(5, np.uint16)
    with pytest.raises(ValueError, match="adamw: params_out has 5 elements but master has 8"):
        _native.adamw_update(*args, scalars, grad_dtype="float16", param_dtype="float16")
    with pytest.raises(ValueError, match="adamw: grad must hold float32 elements, got a 2-byte"):
        _native.adamw_update(*_numpy_args(), scalars, grad_dtype="float32",
                             param_dtype="float16")
    with pytest.raises(ValueError, match=r"adamw: scalars must be float32\[10\], got 3"):
        _native.adamw_update(*_numpy_args(), np.zeros(3, np.float32), grad_dtype="float16",
                             param_dtype="float16")
    with pytest.raises(ValueError, match="adamw: param_dtype 'int8' is not supported"):
        _native.adamw_update(*_numpy_args(), scalars, grad_dtype="float16", param_dtype="int8")
    missing = [isa for isa in ("avx2", "avx512") if isa not in supported_isas()]
    for isa in missing:
        with pytest.raises(ValueError, match=f"ISA '{isa}' is not supported by this CPU"):
            _native.adamw_update(*_numpy_args(), scalars, grad_dtype="float16",
                                 param_dtype="float16", isa=isa)


def test_ffi_wrapper_errors():
    n = 8
    hp = AdamHyperParams(lr=1e-3)
    with pytest.raises(ValueError, match="adamw: grad has 9 elements but master has 8"):
        fused_adamw_update(jnp.zeros(n), jnp.zeros(n), jnp.zeros(n), jnp.zeros(9), hp,
                           param_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="adamw: param dtype int8 is not supported"):
        fused_adamw_update(jnp.zeros(n), jnp.zeros(n), jnp.zeros(n), jnp.zeros(n), hp,
                           param_dtype=jnp.int8)
    with pytest.raises(ValueError, match="adamw: m dtype float16 is not supported"):
        fused_adamw_update(jnp.zeros(n), jnp.zeros(n, jnp.float16), jnp.zeros(n), jnp.zeros(n),
                           hp, param_dtype=jnp.bfloat16)


def _raw_ffi(master, m, v, grad, scalars, param_dtype, threads=1):
    out = (jax.ShapeDtypeStruct(master.shape, master.dtype),) * 3 + (
        jax.ShapeDtypeStruct(master.shape, param_dtype),)
    return ffi_call("jaxascend_adamw", out)(master, m, v, grad, scalars,
                                           threads=np.int64(threads))


def test_ffi_handler_errors():
    """The handler's own checks, reached by calling the target without the Python wrapper."""
    n = 8
    z, s = jnp.zeros(n), jnp.zeros(10)
    cases = [
        ((z, z, jnp.zeros(7), z, s, jnp.float16), "adamw: v has 7 elements but master has 8"),
        ((z, z, z, jnp.zeros(9, jnp.bfloat16), s, jnp.float16),
         "adamw: grad has 9 elements but master has 8"),
        ((z, z, z, jnp.zeros(n, jnp.int32), s, jnp.float16),
         "adamw: grad dtype int32 is not supported"),
        ((z, z, z, z, jnp.zeros(4), jnp.float16),
         r"adamw: scalars must be float32\[10\], got float32 with 4 elements"),
        ((z, jnp.zeros(n, jnp.float16), z, z, s, jnp.float16),
         "adamw: m must be float32, got float16"),
        ((z, z, z, z, s, jnp.int32), "adamw: params dtype int32 is not supported"),
    ]
    for args, message in cases:
        with pytest.raises(jax.errors.JaxRuntimeError, match=message):
            jax.block_until_ready(_raw_ffi(*args))
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"adamw: threads=0 must be in \[1, 256\]"):
        jax.block_until_ready(_raw_ffi(z, z, z, z, s, jnp.float16, threads=0))
