"""``optimizer.weight_decay_mask`` applied exactly, in both engines: after one step at lr x wd, a norm
weight and a bias carry no decay term while a matrix does, against a numpy AdamW reference."""

import jax
import numpy as np
import pytest
from flax import nnx

from jaxascend.config import load_config
from jaxascend.in_memory_engine import InMemoryEngine
from jaxascend.models import as_token_batch, batch_loss, build_model
from jaxascend.offload import OffloadEngine
from jaxascend.optim import param_path

LR, WD = 1e-2, 0.5  # a decay term of lr * wd * p = 0.005 p against Adam's first step of about lr
SMALL = [
    "model.arch=qwen2", "model.attention_bias=true", "model.hidden_size=32", "model.intermediate_size=64",
    "model.num_hidden_layers=2", "model.num_attention_heads=4", "model.num_key_value_heads=2",
    "model.dtype=float32", "model.param_dtype=float32", "data.seq_len=16", "data.batch_size=2",
    "optimizer.schedule=constant", "optimizer.warmup_steps=0", f"optimizer.learning_rate={LR}",
    f"optimizer.weight_decay={WD}", "optimizer.grad_clip_norm=null", "offload.chunk_bytes=1MiB",
    "offload.staging_bytes=1MiB", "train.progress=false",
]


def _config(tmp_path, *extra):
    (tmp_path / "d.txt").write_text("some text " * 50)
    return load_config("configs/tiny.yaml", SMALL + [f"data.paths=[{tmp_path / 'd.txt'}]",
                                                     f"train.out_dir={tmp_path / 'run'}", *extra])


def _reference(p0, g, cfg, decays: bool):
    """optax.adamw's first step in numpy (count 0: bias corrections 1 - b)."""
    o = cfg.optimizer
    m, v = (1 - o.b1) * g, (1 - o.b2) * g * g
    update = (m / (1 - o.b1)) / (np.sqrt(v / (1 - o.b2)) + o.eps) + (o.weight_decay * p0 if decays else 0)
    return p0 - o.learning_rate * update


def _check(paths, p0, grads, p1, cfg, rule_decays, exact_grads=True):
    """Each leaf against the numpy reference; the decay term present (lr * wd * p) or absent.
    ``exact_grads`` False: the elements whose gradient is within 1000 eps of 0 are left out (Adam's
    first step, g / (|g| + eps), follows the last bits of such a gradient)."""
    kinds = set()
    for path, before, g, after in zip(paths, p0, grads, p1):
        decays = rule_decays(path)
        keep = np.ones(g.shape, bool) if exact_grads else np.abs(g) > 1000 * cfg.optimizer.eps
        if not keep.any():  # the key bias: its gradient is 0 but for rounding (softmax ignores it)
            continue
        want = _reference(before, g, cfg, decays)
        np.testing.assert_allclose(after[keep], want[keep], rtol=1e-6, atol=1e-6, err_msg=path)
        term = np.abs(after - _reference(before, g, cfg, False))[keep].max()
        big = LR * WD * np.abs(before).max()
        assert (term > 0.5 * big) if decays else (term < 0.1 * big), (path, term, big)
        kinds.add((path.rsplit(".", 1)[1], decays))
    return kinds


def _model(cfg):
    """The model with its biases at 0.05 instead of 0, so that a decay term would show on them."""
    model = build_model(cfg.model, 259, rngs=nnx.Rngs(0))
    _, params, _ = nnx.split(model, nnx.Param, ...)
    nnx.update(model, jax.tree_util.tree_map_with_path(
        lambda path, x: x + 0.05 if param_path(path).endswith(".bias") else x, params))
    return model


TOKENS = np.random.default_rng(0).integers(0, 259, (1, 2, 17)).astype(np.int32)


def _in_memory_step(cfg):
    engine = InMemoryEngine(cfg, _model(cfg))
    p0 = jax.tree.map(np.asarray, engine.params)
    engine.step(TOKENS)
    return engine, p0, [np.asarray(x) for x in jax.tree.leaves(engine.params)]


def test_in_memory_engine_decays_exactly_the_masked_leaves(tmp_path):
    cfg = _config(tmp_path, "offload.enabled=false")
    engine, p0, p1 = _in_memory_step(cfg)
    graphdef, rest = engine.graphdef, engine.rest
    # The gradients again, outside the step: equal to its own up to XLA's fusion, which moves Adam's
    # first step g / (|g| + eps) only where |g| is near eps (those elements are left out).
    grads = jax.grad(lambda p: batch_loss(nnx.merge(graphdef, p, rest),
                                          jax.tree.map(lambda x: x[0], as_token_batch(TOKENS))))(p0)
    paths = [param_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(p0)[0]]
    default = lambda path: path.rsplit(".", 1)[1] not in ("bias", "scale")  # noqa: E731
    kinds = _check(paths, jax.tree.leaves(p0), [np.asarray(g) for g in jax.tree.leaves(grads)], p1, cfg, default,
                   exact_grads=False)
    assert kinds == {("kernel", True), ("embedding", True), ("scale", False), ("bias", False)}
    # Exactly: against the same step without decay, a leaf left out is bit-identical and a decayed
    # one is lr * wd * p lower.
    _, _, plain = _in_memory_step(_config(tmp_path, "offload.enabled=false", "optimizer.weight_decay=0"))
    for path, before, got, without in zip(paths, jax.tree.leaves(p0), p1, plain):
        if default(path):
            np.testing.assert_allclose(without - got, LR * WD * before, rtol=1e-3, atol=1e-8, err_msg=path)
        else:
            np.testing.assert_array_equal(got, without, err_msg=path)


@pytest.mark.parametrize("rule, decays", [
    ("default", lambda path: path.rsplit(".", 1)[1] not in ("bias", "scale")),
    ("default_no_embed", lambda path: path.endswith(".kernel")),
    (r"mlp\.", lambda path: ".mlp." in path),
], ids=["default", "default_no_embed", "regex"])
@pytest.mark.parametrize("state_dtype", ["float32", "int8"])
def test_ssd_engine_decays_exactly_the_masked_leaves(tmp_path, rule, decays, state_dtype):
    cfg = _config(tmp_path, "offload.enabled=true", f"optimizer.weight_decay_mask={rule}",
                  f"optimizer.state_dtype={state_dtype}", f"offload.dir={tmp_path / 'offload'}")
    engine = OffloadEngine(cfg, _model(cfg), cfg.model)
    with engine:
        leaves = engine.state.leaves
        p0 = [engine.state.read_state(leaf, "master") for leaf in leaves]
        engine.step(TOKENS)
        engine.finish_update()
        # The gradients exactly as the backward pass wrote them to SSD (they stay after the step).
        grads = [engine.state.read_grad(leaf).astype(np.float32) for leaf in leaves]
        p1 = [engine.state.read_state(leaf, "master") for leaf in leaves]
    paths = [param_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(engine.params))[0]]
    assert len(paths) == len(leaves)
    kinds = _check(paths, p0, grads, p1, cfg, decays)
    assert ("scale", False) in kinds and ("bias", False) in kinds and ("kernel", True) in kinds
