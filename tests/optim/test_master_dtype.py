"""The bfloat16 master in the fused AdamW kernel (jaxascend.optim.master_codes): bit for bit
against its numpy reference in every variant, moment format and rounding; what each master
rounding does where rounding to nearest would not move; NaN and infinity; aliasing; errors."""

import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxascend.native import extension as _native
from jaxascend.native import ffi_call
from jaxascend.optim import AdamHyperParams, MasterFormat, StateFormat, fused_adamw_update, fused_adamw_update_numpy
from jaxascend.optim import master_codes as mc
from jaxascend.optim import state_codes as sc
from jaxascend.optim.fused_adam import supported_isas

ISAS = supported_isas()
BF16 = np.dtype(ml_dtypes.bfloat16)
COMPENSATED, STOCHASTIC = MasterFormat("bfloat16", "compensated"), MasterFormat("bfloat16", "stochastic")
STATES = [StateFormat.of("float32"), StateFormat.of("bfloat16", rounding="nearest"),
          StateFormat.of("bfloat16", rounding="stochastic"), StateFormat.of("int8", 256, "nearest"),
          StateFormat.of("int8", 256, "stochastic"), StateFormat.of("int8", 2048, "stochastic")]
SEED, INDEX = sc.chunk_seed(11, 7, 2, 1), 2**32 - 1000  # the index wraps past 2**32 inside the arrays


def _same(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def _start(rng, n, fmt, master_format, scale=0.05):
    """(master, m, v, m_scale, v_scale, comp) in the kernel's representation: a float32 master
    split (compensated) or rounded (stochastic), moments over five decades in ``fmt``."""
    x = (rng.normal(size=n) * scale).astype(np.float32)
    if master_format.compensated:
        master, comp = mc.split_master(x)
    else:
        master, comp = (x, None) if master_format.dtype == "float32" else (sc.bf16_round(x), None)
    m32 = (rng.normal(size=n) * 10.0 ** rng.uniform(-5, 0, n)).astype(np.float32)
    v32 = (m32.astype(np.float64) ** 2 * rng.uniform(1, 4, n)).astype(np.float32)
    if fmt.dtype == "bfloat16":
        return master, sc.bf16_round(m32), sc.bf16_round(v32), None, None, comp
    if fmt.dtype == "int8":
        (mq, ms), (vq, vs) = sc.quantize_m(m32, fmt.block), sc.quantize_v(v32, fmt.block)
        return master, mq, vq, ms, vs, comp
    return master, m32, v32, None, None, comp


def _kernel(start, grad, hp, fmt, master_format, alias=False, **kw):
    """The kernel on copies of ``start``; returns (master, m, v, m_scale, v_scale, comp, params)."""
    master, m, v, ms, vs, comp = (None if a is None else a.copy() for a in start)
    dtype = np.float32 if master_format.dtype == "float32" else BF16
    params = master.view(BF16) if alias else np.empty(master.size, dtype)
    fused_adamw_update_numpy(master, m, v, grad, params, hp, state=fmt, m_scale=ms, v_scale=vs,
                             master_format=master_format, comp=comp, seed=SEED, index=INDEX, **kw)
    return master, m, v, ms, vs, comp, params


def _reference(start, grad, hp, fmt, master_format):
    master, m, v, ms, vs, comp = start
    return mc.adamw_reference_master(master, m, v, np.asarray(grad, np.float32), hp, fmt, master_format, comp,
                                     ms, vs, SEED, INDEX)


def _assert_matches(got, want, where):
    master, m, v, ms, vs, comp, params = got
    assert _same(master, want[0]), (where, "master")
    assert _same(params.view(np.uint16), want[0]), (where, "params")
    assert _same(m, want[1]) and _same(v, want[2]), (where, "moments")
    assert (ms is None or _same(ms, want[3])) and (vs is None or _same(vs, want[4])), (where, "scales")
    assert (comp is None and want[5] is None) or _same(comp, want[5]), (where, "comp")


HP = np.asarray(AdamHyperParams(lr=1e-3, b2=0.95, weight_decay=0.1, grad_scale=0.5, count=7).scalars())
# (elements, threads, grad dtype): vector tails of 8 and 16, a partial int8 block, ranges split over
# 2 and 3 threads (32K elements at least each), every gradient dtype.
CASES = [(5, 1, np.float32), (1037, 1, BF16), (3 * 32768 + 2048 * 3 + 101, 2, np.float16),
         (3 * 32768 + 2048 * 5 + 7, 3, BF16)]


@pytest.mark.parametrize("fmt", STATES, ids=lambda f: f"{f.dtype}{f.block or ''}-{f.rounding}")
@pytest.mark.parametrize("master_format", [COMPENSATED, STOCHASTIC], ids=lambda f: f.rounding)
@pytest.mark.parametrize("isa", ISAS)
def test_kernel_matches_reference_bitwise(isa, master_format, fmt):
    """Every variant, master rounding, moment format and moment rounding against
    adamw_reference_master: master, params (its bits), moments, scales and comp equal bit for bit
    over sizes with vector and block tails, on 1, 2 and 3 threads, with weight decay."""
    rng = np.random.default_rng(zlib.crc32(repr((isa, master_format, fmt)).encode()))
    for n, threads, grad_dtype in CASES:
        if fmt.block and n == 1037:
            n = fmt.block + 13
        start = _start(rng, n, fmt, master_format)
        grad = (rng.normal(size=n) * 10.0 ** rng.uniform(-6, -1, n)).astype(grad_dtype)
        got = _kernel(start, grad, HP, fmt, master_format, isa=isa, threads=threads)
        _assert_matches(got, _reference(start, grad, HP, fmt, master_format), (n, threads))


@pytest.mark.parametrize("fmt", STATES[:3] + STATES[4:5], ids=lambda f: f"{f.dtype}-{f.rounding}")
def test_each_master_steps_from_the_float32_masters_update(fmt):
    """The bfloat16 masters run the float32 master's arithmetic: compensated's master and comp
    join into the float32 master's new value as split_master holds it (exact but at a tie that
    rounds down), and its master is the float32 master's compute weights, bit for bit;
    stochastic's new master is one of the two
    bfloat16 neighbours of it (from the widened master); the moments are the float32 master's.
    An explicit FLOAT32_MASTER is the default."""
    rng = np.random.default_rng(3)
    n = 4099
    grad = (rng.normal(size=n) * 1e-3).astype(np.float32)
    for master_format in (COMPENSATED, STOCHASTIC):
        start = _start(rng, n, fmt, master_format)
        x = mc.join_master(start[0], start[5]) if master_format.compensated else sc.bf16_widen(start[0])
        f32 = _kernel((x,) + start[1:5] + (None,), grad, HP, fmt, mc.FLOAT32_MASTER)
        got = _kernel(start, grad, HP, fmt, master_format)
        assert _same(got[1], f32[1]) and _same(got[2], f32[2])
        if master_format.compensated:
            assert _same(mc.join_master(got[0], got[5]), mc.join_master(*mc.split_master(f32[0])))
            assert _same(got[0], sc.bf16_round(f32[0]))  # the float32 master's bf16 compute weights
        else:
            down = (f32[0].view(np.uint32) >> 16).astype(np.uint16)
            assert np.all((got[0] == down) | (got[0] == down + 1))
    master, m, v, ms, vs = (None if a is None else a.copy() for a in (x,) + start[1:5])
    fused_adamw_update_numpy(master, m, v, grad, np.empty(n, np.float32), HP, state=fmt, m_scale=ms, v_scale=vs,
                             seed=SEED, index=INDEX)
    assert _same(master, f32[0]) and _same(m, f32[1]) and _same(v, f32[2])


def test_split_and_join_are_exact_but_at_a_tie_rounding_down():
    """The master half of split_master(x) is x to nearest with ties to even (bf16_round's) for
    every non-NaN float32 (infinities, zeros, subnormals, the largest finite); join_master of the
    split is x, but where a tie rounds down (low 17 bits 0x08000), there one ulp toward zero; a
    NaN stays a quiet NaN."""
    rng = np.random.default_rng(0)
    bits = np.concatenate([rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32),
                           np.array([0, 0x80000000, 1, 0x807FFFFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000,
                                     0x3F808000, 0x3F818000, 0xBF808000, 0x7F7F8000], np.uint32)])
    bits = np.concatenate([bits, (bits[:1000] & np.uint32(0xFFFF0000)) | np.uint32(0x8000)])  # ties
    x = bits.view(np.float32)
    master, comp = mc.split_master(x)
    nan = np.isnan(x)
    assert np.all(np.isnan(sc.bf16_widen(master[nan]))) and np.all(master[nan] & 0x40)
    assert np.array_equal(master[~nan], sc.bf16_round(x[~nan]))
    tie_down = ((bits & np.uint32(0x1FFFF)) == np.uint32(0x8000)).astype(np.uint32)
    assert 400 < tie_down[~nan].sum() < 600
    assert np.array_equal(mc.join_master(master, comp).view(np.uint32)[~nan], (bits - tie_down)[~nan])
    ties = np.array([0x3F808000, 0xBF808000, 0x3F818000, 0xBF818000], np.uint32).view(np.float32)
    master, comp = mc.split_master(ties)  # 1 + 2**-8 rounds to even 1, 1 + 3 * 2**-8 up to even 1 + 2**-6
    assert list(master) == [0x3F80, 0xBF80, 0x3F82, 0xBF82]
    assert list(mc.join_master(master, comp).view(np.uint32)) == [0x3F807FFF, 0xBF807FFF, 0x3F818000, 0xBF818000]


@pytest.mark.parametrize("isa", ISAS)
def test_the_kernel_splits_ties_to_even(isa):
    """Masters in [1, 2) one float32 ulp above a tie (low half 0x8001), updated by about one ulp
    (lr 2**-23, an update of 1 - 1e-5): every new master is a tie, its high half odd or even, and
    the kernel splits it as split_master does, to even, a tie that rounds down held one ulp toward
    zero, in every variant, vector lanes and tail."""
    rng = np.random.default_rng(6)
    n = 16 * 64 + 5
    high = rng.integers(0x3F80, 0x3FFF, n).astype(np.uint32)  # the tie's high half
    start = ((high + 1).astype(np.uint16), *_steady(n, 1e-3), None, None, np.full(n, 0x8001, np.uint16))
    x = mc.join_master(start[0], start[5])
    assert np.array_equal(x.view(np.uint32), (high << 16) | 0x8001)
    hp = np.asarray(AdamHyperParams(lr=2.0**-23, weight_decay=0.0, count=10**6).scalars())
    grad = np.full(n, 1e-3, np.float32)
    got = _kernel(start, grad, hp, StateFormat(), COMPENSATED, isa=isa)
    _assert_matches(got, _reference(start, grad, hp, StateFormat(), COMPENSATED), isa)
    y = (high << 16) | np.uint32(0x8000)
    assert _same(got[0], sc.bf16_round(y.view(np.float32)))  # to even
    down = (high & 1) == 0
    assert 0.4 < down.mean() < 0.6
    assert np.array_equal(mc.join_master(got[0], got[5]).view(np.uint32), y - down)


def _steady(n, g):
    """Moments at their steady state for a constant gradient ``g``: the update is g / (|g| + eps)."""
    return np.full(n, g, np.float32), np.full(n, np.float32(g) * np.float32(g), np.float32)


def test_tiny_updates_move_where_nearest_would_not():
    """lr 1e-6, weights in [0.5, 1) (half a bfloat16 ulp: 2**-9), update 1 per step: a master
    rounded to nearest never moves (each step rounds back), and neither would Kahan summation
    with a bfloat16-valued companion (it stalls at |comp| = 2**-11). Over 2500 steps the
    compensated master follows the float32 master exactly and moves one ulp on every weight; the
    stochastic one moves its expected distance, within 5 standard deviations fixed before the
    run (variance per weight <= drift * ulp)."""
    n, steps, lr, g = 4096, 2500, 1e-6, 1e-2
    hp = np.asarray(AdamHyperParams(lr=lr, weight_decay=0.0, count=10**6).scalars())
    x0 = sc.bf16_round(np.random.default_rng(1).uniform(0.5, 1.0, n).astype(np.float32))
    grad = np.full(n, g, np.float32)
    one = _kernel((sc.bf16_widen(x0),) + _steady(n, g) + (None, None, None), grad, hp, StateFormat(), mc.FLOAT32_MASTER)
    assert _same(sc.bf16_round(one[0]), x0)  # nearest: a fixed point

    x32, comp_master, sr_master = sc.bf16_widen(x0).copy(), x0.copy(), x0.copy()
    comp = np.zeros(n, np.uint16)
    moments = [_steady(n, g) for _ in range(3)]
    for step in range(steps):
        for master, fmt, c, (m, v) in ((x32, mc.FLOAT32_MASTER, None, moments[0]),
                                      (comp_master, COMPENSATED, comp, moments[1]),
                                      (sr_master, STOCHASTIC, None, moments[2])):
            params = np.empty(n, np.float32 if fmt.dtype == "float32" else BF16)
            fused_adamw_update_numpy(master, m, v, grad, params, hp, master_format=fmt, comp=c, seed=step)
    drift = x32.astype(np.float64) - sc.bf16_widen(x0)
    assert np.all(np.abs(drift + steps * lr) < 0.05 * steps * lr)
    assert _same(mc.join_master(comp_master, comp), x32)
    assert np.array_equal(comp_master, x0 - 1)  # every weight one ulp down (positive weights)
    ulp = 2.0**-8
    error = sc.bf16_widen(sr_master).astype(np.float64) - x32
    assert abs(error.mean()) <= 5 * np.sqrt(np.abs(drift).mean() * ulp / n)
    assert (sr_master != x0).mean() > 0.3

    kahan_master, kahan_comp = x0.copy(), np.zeros(n, np.uint16)
    for _ in range(steps):  # optimi's Kahan summation with a bfloat16 companion, in numpy
        x = sc.bf16_widen(kahan_master)
        step = sc.bf16_widen(kahan_comp) - np.float32(lr)
        kahan_master = sc.bf16_round(x + step)
        kahan_comp = sc.bf16_round(step - (sc.bf16_widen(kahan_master) - x))
    assert np.array_equal(kahan_master, x0) and np.abs(sc.bf16_widen(kahan_comp)).max() <= 2.0**-11


def test_many_steps_track_the_float32_master():
    """300 steps of a small update (lr 1e-4, weight decay, gradients of one sign, noisy): the
    compensated master's compute weights are the float32 master's at every step, and its master
    is the float32 master but where a tie rounded down (about one weight in 2**17 a step): there
    one or two float32 ulps toward zero, never more; the stochastic master's mean error
    over the weights stays within 5 standard deviations of 0, the variance bounded before the
    run by the path length times the ulp, while rounding to nearest would lag by the drift."""
    n, steps = 2048, 300
    rng = np.random.default_rng(2)
    x0 = (rng.uniform(0.5, 1.0, n)).astype(np.float32)
    grads = (1e-3 * (1 + 0.5 * rng.normal(size=(steps, n)))).astype(np.float32)
    comp_master, comp = mc.split_master(x0)
    sr_master = sc.bf16_round(x0)
    x32 = sc.bf16_widen(sr_master).copy()  # the stochastic run starts there; compensated from x0 itself
    x32_exact = x0.copy()
    states = [(np.zeros(n, np.float32), np.zeros(n, np.float32)) for _ in range(4)]
    path = np.zeros(n)
    for k in range(steps):
        hp = np.asarray(AdamHyperParams(lr=1e-4, weight_decay=0.1, count=k).scalars())
        before = x32.astype(np.float64)
        for master, fmt, c, (m, v) in ((x32, mc.FLOAT32_MASTER, None, states[0]),
                                      (x32_exact, mc.FLOAT32_MASTER, None, states[1]),
                                      (comp_master, COMPENSATED, comp, states[2]),
                                      (sr_master, STOCHASTIC, None, states[3])):
            params = np.empty(n, np.float32 if fmt.dtype == "float32" else BF16)
            fused_adamw_update_numpy(master, m, v, grads[k], params, hp, master_format=fmt, comp=c, seed=k)
        path += np.abs(x32 - before)
        assert np.array_equal(comp_master, sc.bf16_round(x32_exact)), k
        ulps = x32_exact.view(np.int32) - mc.join_master(comp_master, comp).view(np.int32)  # weights > 0
        assert ulps.min() >= 0 and ulps.max() <= 2 and np.count_nonzero(ulps) <= 8, (k, ulps.max())
    assert np.count_nonzero(ulps) > 0  # ties did round down here: 614,400 weight-steps
    ulp = 2.0**-8
    error = sc.bf16_widen(sr_master).astype(np.float64) - x32
    tolerance = 5 * np.sqrt(path.mean() * ulp / n)
    drift = np.abs(x32.astype(np.float64) - sc.bf16_widen(sc.bf16_round(x0))).mean()
    assert abs(error.mean()) <= tolerance < drift / 5


@pytest.mark.parametrize("isa", ISAS)
def test_nan_and_inf_gradients_as_in_the_float32_path(isa):
    """NaN and infinite gradients leave NaN masters (and params) exactly where the float32 master
    gets them, and the moments the float32 path's, in both roundings; the kernel still equals
    the reference bit for bit."""
    n = 100
    grad = np.full(n, 1e-3, np.float32)
    grad[[3, 50]], grad[7], grad[99] = np.nan, np.inf, -np.inf
    rng = np.random.default_rng(4)
    for fmt in (StateFormat(), StateFormat.of("bfloat16", rounding="stochastic"), StateFormat.of("int8", 256)):
        for master_format in (COMPENSATED, STOCHASTIC):
            start = _start(rng, n, fmt, master_format)
            x = mc.join_master(start[0], start[5]) if master_format.compensated else sc.bf16_widen(start[0])
            f32 = _kernel((x,) + start[1:5] + (None,), grad, HP, fmt, mc.FLOAT32_MASTER, isa=isa)
            got = _kernel(start, grad, HP, fmt, master_format, isa=isa)
            for array in (got[0], got[6]):
                np.testing.assert_array_equal(np.isnan(sc.bf16_widen(array.view(np.uint16))), np.isnan(f32[0]))
            assert _same(got[1], f32[1]) and _same(got[2], f32[2])
            with np.errstate(invalid="ignore"):
                _assert_matches(got, _reference(start, grad, HP, fmt, master_format), (fmt, master_format))


@pytest.mark.parametrize("isa", ISAS)
def test_params_out_may_be_the_master(isa):
    """params_out aliasing the master (one buffer, as bfloat16) gives the same bits as apart."""
    rng = np.random.default_rng(5)
    n = 3 * 32768 + 77
    fmt = StateFormat.of("bfloat16", rounding="stochastic")
    grad = (rng.normal(size=n) * 1e-3).astype(BF16)
    for master_format in (COMPENSATED, STOCHASTIC):
        start = _start(rng, n, fmt, master_format)
        got = _kernel(start, grad, HP, fmt, master_format, alias=True, isa=isa, threads=2)
        assert np.shares_memory(got[0], got[6])
        _assert_matches(got, _reference(start, grad, HP, fmt, master_format), master_format)
    master = start[0].view(BF16).copy()  # an ml_dtypes.bfloat16 master that is its own params_out
    fused_adamw_update_numpy(master, *(a.copy() for a in start[1:3]), grad, master, HP, state=fmt,
                             master_format=STOCHASTIC, seed=SEED, index=INDEX)
    assert _same(master.view(np.uint16), _reference(start, grad, HP, fmt, STOCHASTIC)[0])


def test_master_format():
    assert mc.FLOAT32_MASTER == MasterFormat() == MasterFormat("float32", "stochastic")
    assert MasterFormat().rounding == "nearest" and MasterFormat("bfloat16").rounding == "compensated"
    assert (MasterFormat().itemsize, MasterFormat().companion_itemsize) == (4, 0)
    assert (COMPENSATED.itemsize, COMPENSATED.companion_itemsize) == (2, 2)
    assert (STOCHASTIC.itemsize, STOCHASTIC.companion_itemsize) == (2, 0)
    assert MasterFormat().describe() == {"master_dtype": "float32"}
    assert STOCHASTIC.describe() == {"master_dtype": "bfloat16", "master_rounding": "stochastic"}
    assert COMPENSATED.describe()["master_rounding"] == "compensated" and "comp" in COMPENSATED.describe()
    assert COMPENSATED.numpy_dtype() == BF16 and MasterFormat().numpy_dtype() == np.float32
    assert mc.MASTER_DTYPES == ("float32", "bfloat16") and mc.MASTER_ROUNDINGS == ("compensated", "stochastic")
    with pytest.raises(ValueError, match="master dtype 'float16' is not one of float32, bfloat16"):
        MasterFormat("float16")
    with pytest.raises(ValueError, match="master rounding 'nearest' is not one of compensated, stochastic"):
        MasterFormat("bfloat16", "nearest")
    with pytest.raises(ValueError, match="master rounding 'up' is not one of"):
        MasterFormat("float32", "up")
    with pytest.raises(ValueError, match="adamw: a compensated bfloat16 master needs comp"):
        mc.adamw_reference_master(np.zeros(2, np.uint16), *np.zeros((3, 2), np.float32), HP, StateFormat(),
                                  COMPENSATED)


def _args(n=8, master_format=COMPENSATED):
    """master, m, v, grad, params_out for a bfloat16 master (float32 moments), and its comp."""
    comp = np.zeros(n, np.uint16) if master_format.compensated else None
    return [np.zeros(n, np.uint16), np.zeros(n, np.float32), np.zeros(n, np.float32), np.zeros(n, np.float32),
            np.zeros(n, BF16)], comp


def test_numpy_errors():
    hp = AdamHyperParams(lr=1e-3)

    def call(args, comp, master_format=COMPENSATED, **kw):
        fused_adamw_update_numpy(*args, hp, master_format=master_format, comp=comp, **kw)

    args, comp = _args()
    cases = [
        (lambda: call(args[:4] + [np.zeros(8, np.float16)], comp), ValueError,
         "adamw: a bfloat16 master needs bfloat16 params_out, got float16"),
        (lambda: call([np.zeros(8, np.float32)] + args[1:], comp), ValueError,
         "adamw: a bfloat16 master must be bfloat16 or its uint16 bits, got float32"),
        (lambda: call(args, comp, mc.FLOAT32_MASTER), ValueError, "adamw: master must be float32, got uint16"),
        (lambda: call(args, None), ValueError, "adamw: a compensated bfloat16 master needs comp"),
        (lambda: call(args, comp, STOCHASTIC), ValueError, "adamw: comp is only for a compensated bfloat16 master"),
        (lambda: call(args, np.zeros(7, np.uint16)), ValueError, "adamw: comp has 7 elements but master has 8"),
        (lambda: call(args, np.zeros(8, np.float32)), ValueError, "adamw: comp must be uint16"),
        (lambda: call(args, [0] * 8), TypeError, "adamw: comp must be a numpy array, got list"),
        (lambda: call(args, comp, "bfloat16"), TypeError, "adamw: master_format must be a MasterFormat, got str"),
    ]
    for run, error, message in cases:
        with pytest.raises(error, match=message):
            run()
    frozen = comp.copy()
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="adamw: comp is read-only"):
        call(args, frozen)
    buffer = np.zeros(9, np.uint16)  # master and params_out one element apart: not the same buffer
    with pytest.raises(ValueError, match="adamw: master and params_out overlap in memory"):
        call([buffer[:8]] + args[1:4] + [buffer[1:].view(BF16)], comp)
    with pytest.raises(ValueError, match="adamw: master and comp overlap in memory"):
        call(args, args[0])
    empty, _ = _args(0, STOCHASTIC)
    call(empty, None, STOCHASTIC)  # no elements: nothing to do, no error


def test_native_binding_errors():
    args, comp = _args()
    raw = args[:4] + [args[4].view(np.uint16)]
    scalars = np.zeros(10, np.float32)
    kw = dict(grad_dtype="float32", param_dtype="bfloat16", master_dtype="bfloat16")
    cases = [
        (dict(kw, master_dtype="float16"), comp, "adamw: master_dtype 'float16' is not one of float32, bfloat16"),
        (dict(kw, master_rounding="nearest"), comp, "adamw: master_rounding 'nearest' is not one of compensated"),
        (dict(kw, master_rounding="compensated"), None, "adamw: a compensated bfloat16 master needs comp"),
        (dict(kw, master_rounding="stochastic"), comp, "adamw: comp is only for a compensated bfloat16 master"),
        (dict(kw, master_rounding="stochastic", param_dtype="float16"), None,
         "adamw: a bfloat16 master needs bfloat16 params_out, got float16"),
    ]
    for kwargs, c, message in cases:
        with pytest.raises(ValueError, match=message):
            _native.adamw_update(*raw, scalars, comp=c, **kwargs)
    with pytest.raises(ValueError, match="adamw: master must hold 2-byte elements, got a 4-byte dtype"):
        _native.adamw_update(np.zeros(8, np.float32), *raw[1:], scalars, master_rounding="stochastic", **kw)


def test_ffi_target_keeps_a_float32_master():
    """The XLA FFI target is float32-master only, and says so for a bfloat16 master."""
    z = jnp.zeros(8)
    with pytest.raises(ValueError, match=r"adamw: master dtype bfloat16 is not supported \(float32\)"):
        fused_adamw_update(z.astype(jnp.bfloat16), z, z, z, AdamHyperParams(lr=1e-3), param_dtype=jnp.bfloat16)
    out = (jax.ShapeDtypeStruct((8,), jnp.bfloat16),) + (jax.ShapeDtypeStruct((8,), jnp.float32),) * 2 + (
        jax.ShapeDtypeStruct((8,), jnp.bfloat16),)
    with pytest.raises(jax.errors.JaxRuntimeError, match="adamw: master must be float32, got bfloat16"):
        jax.block_until_ready(ffi_call("jaxascend_adamw", out)(z.astype(jnp.bfloat16), z, z, z, jnp.zeros(10),
                                                               threads=np.int64(1)))
