"""The derived tolerances of tests/_tolerances.py: bugs of the kinds the model tests guard
against (a position off by one at a block boundary, a missing layer, a mask one key too wide)
move the test models' logits by far more than the tolerance, and float32 sums in another order
land inside it."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests._tolerances import logits_atol, reordering_atol, reordering_rtol
from tests.models.test_decode import config
from tests.models.test_models import forward, randomized_model, sample_ids

MARGIN = 100  # each bug must move the logits by 100 tolerances at least (measured: > 5000)


def test_the_tolerance_is_eps_times_reduction_depth_and_scale():
    eps = float(np.finfo(np.float32).eps)
    assert reordering_rtol(reduction=96, depth=5) == eps * 96 * 5
    assert reordering_atol(np.array([-3.0, 1.0]), reduction=96, depth=5) == eps * 96 * 5 * 3
    assert reordering_atol(np.zeros(2), reduction=8, scale=2.0) == eps * 8 * 2
    assert reordering_rtol(reduction=8, dtype=jnp.bfloat16) == 2.0 ** -7 * 8
    with pytest.raises(ValueError, match="reduction and depth must be >= 1, got 0 and 1"):
        reordering_rtol(reduction=0)


def test_sums_in_another_order_land_inside():
    rng = np.random.default_rng(0)
    for n in (16, 96, 1000):
        x = rng.standard_normal((200, n)).astype(np.float32)
        sequential = np.zeros(200, np.float32)
        for i in range(n):
            sequential += x[:, i]
        pairwise = x.sum(axis=1)  # numpy: pairwise, 8 lanes at a time
        scale = np.max(np.abs(np.cumsum(x.astype(np.float64), axis=1)))  # the partial sums
        assert np.max(np.abs(sequential - pairwise)) <= reordering_atol(None, reduction=n, scale=scale)


def _without_last_layer(model):
    """The model with its last layer's output projections zeroed: the layer adds nothing (a
    layer the scan skipped)."""
    graphdef, state = nnx.split(model)

    def zero(path, leaf):
        name = jax.tree_util.keystr(path)
        last = "layers" in name and any(k in name for k in ("o_proj", "down_proj"))
        return leaf.at[-1].set(0) if last else leaf

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(zero, state))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_bug_moves_the_logits_far_past_the_tolerance(arch):
    """The prefill test's models (tests/test_blocked_prefill.py) over prompts of 9 and 21."""
    cfg = dataclasses.replace(config(arch), max_position_embeddings=32)
    model = randomized_model(cfg, seed=2)
    for length in (9, 21):
        ids = sample_ids(batch=1, length=length, seed=length)
        whole = forward(model, ids)[0, -1]
        atol = logits_atol(cfg, whole, 32)
        late = np.arange(length)
        late[8:] += 1  # the second block one position late (RoPE is blind to a shift of all)
        bugs = {"position off by one at a block boundary": forward(model, ids, jnp.asarray(late)[None])[0, -1],
                "last layer missing": forward(_without_last_layer(model), ids)[0, -1]}
        if cfg.sliding_window:
            wider = randomized_model(dataclasses.replace(cfg, sliding_window=cfg.sliding_window + 1), seed=2)
            bugs["sliding window one key wider"] = forward(wider, ids)[0, -1]
        for bug, logits in bugs.items():
            moved = float(np.max(np.abs(logits - whole)))
            print(f"{arch} prompt {length}, {bug}: {moved:.2e} = {moved / atol:.0f} x atol {atol:.2e}")
            assert moved > MARGIN * atol, (bug, moved, atol)
