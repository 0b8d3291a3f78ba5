"""The native grad_stats kernel against its pure-jnp reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxascend.optim import grad_stats, tree_grad_stats
from jaxascend.optim.grad_stats import grad_stats_reference
from tests._tolerances import reordering_rtol

DTYPES = [jnp.float16, jnp.bfloat16, jnp.float32]
SIZES = [1, 7, 8, 1000, 4099]


def _random(n, dtype, seed=0, scale=3.0):
    x = np.random.default_rng(seed).standard_normal(n).astype(np.float32) * scale
    return jnp.asarray(x).astype(dtype)


def _exact_sumsq(x):
    x64 = np.asarray(jnp.asarray(x).astype(jnp.float32)).astype(np.float64)
    return np.sum(np.where(np.isfinite(x64), x64 * x64, 0.0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_matches_reference(dtype, n):
    x = _random(n, dtype, seed=n)
    s, bad = jax.jit(grad_stats)(x)
    s_ref, bad_ref = grad_stats_reference(x)
    assert s.dtype == jnp.float32 and bad.dtype == jnp.int32
    assert int(bad) == int(bad_ref) == 0
    # The reference sums in float32, in XLA's order (tests/_tolerances.py) ...
    np.testing.assert_allclose(float(s), float(s_ref), rtol=reordering_rtol(reduction=n))
    # ... while the kernel accumulates in float64: it is within float32 rounding of the exact sum.
    np.testing.assert_allclose(float(s), _exact_sumsq(x), rtol=1e-7)


@pytest.mark.parametrize("dtype", DTYPES)
def test_counts_inf_and_nan(dtype):
    x = np.array(_random(1031, jnp.float32, seed=3))
    x[[0, 17, 500, 1030]] = [np.inf, -np.inf, np.nan, np.nan]
    xd = jnp.asarray(x).astype(dtype)
    s, bad = grad_stats(xd)
    s_ref, bad_ref = grad_stats_reference(xd)
    assert int(bad) == int(bad_ref) == 4
    assert np.isfinite(float(s))
    np.testing.assert_allclose(float(s), float(s_ref), rtol=reordering_rtol(reduction=x.size))
    np.testing.assert_allclose(float(s), _exact_sumsq(xd), rtol=1e-7)


def test_fp16_overflow_values_are_counted():
    # 70000 overflows float16 to inf: exactly what the overflow check must catch.
    x = jnp.asarray(np.array([1.0, 70000.0, -70000.0, 2.0], np.float32)).astype(jnp.float16)
    s, bad = grad_stats(x)
    assert int(bad) == 2
    assert float(s) == 5.0


def test_fp16_subnormals_are_exact():
    x = jnp.asarray(np.array([2.0**-24, -(2.0**-20), 6.0e-5], np.float32)).astype(jnp.float16)
    s, _ = grad_stats(x)
    np.testing.assert_allclose(float(s), _exact_sumsq(x), rtol=1e-6)


def test_any_shape_and_empty():
    x = _random(60, jnp.bfloat16).reshape(3, 4, 5)
    s, bad = grad_stats(x)
    np.testing.assert_allclose(float(s), float(grad_stats_reference(x)[0]), rtol=reordering_rtol(reduction=x.size))
    np.testing.assert_allclose(float(s), _exact_sumsq(x), rtol=1e-7)
    s0, bad0 = grad_stats(jnp.zeros((0,), jnp.float32))
    assert float(s0) == 0.0 and int(bad0) == 0


def test_tree_sums_leaves():
    tree = {"a": _random(10, jnp.float16, 1), "b": [_random(33, jnp.bfloat16, 2), _random(5, jnp.float32, 3)]}
    s, bad = jax.jit(tree_grad_stats)(tree)
    expected = sum(_exact_sumsq(leaf) for leaf in jax.tree_util.tree_leaves(tree))
    np.testing.assert_allclose(float(s), expected, rtol=1e-6)
    assert int(bad) == 0


def test_rejects_unsupported_dtype():
    with pytest.raises(TypeError, match="grad_stats: dtype int32 is not supported"):
        grad_stats(jnp.arange(4, dtype=jnp.int32))
