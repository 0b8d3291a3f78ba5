"""Loss masks through both engines (exact gradient accumulation) and the held-out evaluation,
which reads the compute params only: no gradient sent, no optimizer state read or written."""

from __future__ import annotations

import hashlib

import jax
import numpy as np
import pytest
from flax import nnx

from jaxascend.config import load_config
from jaxascend.in_memory_engine import InMemoryEngine
from jaxascend.models import build_model, forward, token_batch, token_losses
from jaxascend.offload import OffloadEngine
from tests._corpus import write_word_corpus

VOCAB = 259
SMALL = [
    "model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=2",
    "model.num_attention_heads=4", "model.num_key_value_heads=2", "data.seq_len=32",
    "train.progress=false", "optimizer.warmup_steps=0", "optimizer.learning_rate=3e-3",
    "model.dtype=float32", "model.param_dtype=float32", "offload.chunk_bytes=1MiB", "offload.staging_bytes=1MiB",
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_word_corpus(tmp_path_factory.mktemp("corpus"), docs=2, words_per_doc=50)


def _cfg(tmp_path, corpus, name, *extra):
    return load_config("configs/tiny.yaml", SMALL + [
        f"data.paths=[{corpus}]", "data.include=['*.txt']", f"train.out_dir={tmp_path / name}",
        f"offload.dir={tmp_path / name / 'offload'}", *extra])


def _engine(cfg):
    model = build_model(cfg.model, VOCAB, rngs=nnx.Rngs(0))
    if cfg.offload.enabled:
        return OffloadEngine(cfg, model, cfg.model)
    return InMemoryEngine(cfg, model)


def _packed(rng, rows, length=32):
    """Rows of two examples each (segment ids 1, 2; positions restarting), a random loss mask
    that counts very different numbers of targets in different rows."""
    tokens = rng.integers(0, VOCAB, (rows, length + 1)).astype(np.int32)
    cut = rng.integers(5, length - 5, rows)
    seg = np.where(np.arange(length)[None] < cut[:, None], 1, 2).astype(np.int32)
    pos = np.where(seg == 1, np.arange(length)[None], np.arange(length)[None] - cut[:, None]).astype(np.int32)
    keep = rng.random((rows, 1)) * 0.9 + 0.05  # each row its own density
    mask = (rng.random((rows, length)) < keep) & (np.roll(seg, -1, axis=1) == seg)
    return tokens, mask, seg, pos


def _params(engine):
    return [np.asarray(x).copy() for x in jax.tree.leaves(engine.params)]


@pytest.mark.parametrize("offload", [False, True], ids=["in-memory", "offload"])
def test_grad_accum_2_equals_one_batch_of_twice_the_size(tmp_path, corpus, offload):
    rng = np.random.default_rng(0)
    steps = [_packed(rng, 4) for _ in range(2)]
    # Adam's first steps are ~lr * sign(g): eps 1e-4 keeps a gradient element near 0 from
    # turning a rounding difference of the summation order into a visible step.
    common = [f"offload.enabled={str(offload).lower()}", "optimizer.eps=1e-4"]
    double = _engine(_cfg(tmp_path, corpus, "double", *common, "data.batch_size=4", "train.grad_accum=1"))
    accum = _engine(_cfg(tmp_path, corpus, "accum", *common, "data.batch_size=2", "train.grad_accum=2"))
    with double, accum:
        for tokens, mask, seg, pos in steps:
            halves = [x.reshape((2, 2) + x.shape[1:]) for x in (tokens, mask, seg, pos)]
            assert halves[1][0].sum() != halves[1][1].sum()  # a per-micro-batch mean would weigh them alike
            a = double.step(token_batch(tokens[None], mask[None], seg[None], pos[None])).fetched()
            b = accum.step(token_batch(*halves)).fetched()
            np.testing.assert_allclose(b.loss, a.loss, rtol=2e-6)
            np.testing.assert_allclose(b.grad_norm, a.grad_norm, rtol=2e-5)
        for x, y in zip(_params(accum), _params(double)):
            np.testing.assert_allclose(x, y, rtol=0, atol=2e-6)


def test_the_loss_is_the_per_token_mean_over_the_counted_targets(tmp_path, corpus):
    rng = np.random.default_rng(1)
    tokens, mask, seg, pos = _packed(rng, 4)
    mask[:, -1] = False
    engine = _engine(_cfg(tmp_path, corpus, "mem", "offload.enabled=false", "data.batch_size=4"))
    with engine:
        batch = token_batch(tokens, mask, seg, pos)
        total, count = engine.evaluate([batch])
        model = nnx.merge(engine.graphdef, engine.params, engine.rest)
        per_token = np.asarray(token_losses(forward(model, batch), batch.tokens))
        # The last token of each row is only ever a target, and it is not counted: changing it changes nothing.
        other = tokens.copy()
        other[:, -1] = (other[:, -1] + 7) % VOCAB
        total2, _ = engine.evaluate([token_batch(other, mask, seg, pos)])
        loss = engine.step(token_batch(tokens[None], mask[None], seg[None], pos[None])).fetched().loss
    assert count == int(mask.sum())
    np.testing.assert_allclose(total, per_token[mask].sum(), rtol=1e-6)
    assert total2 == total
    np.testing.assert_allclose(loss, per_token[mask].mean(), rtol=1e-6)  # training: the same masked mean


def _shard_digest(engine) -> str:
    h = hashlib.sha256()
    for path in engine.shard_files():
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()


OFFLOAD_CASES = {
    "resident": ["offload.params=resident", "offload.overlap=false"],
    "resident-overlap": ["offload.params=resident", "offload.overlap=true", "model.remat=full"],
    "ssd": ["offload.params=ssd", "offload.overlap=false", "model.remat=full"],
    "ssd-overlap": ["offload.params=ssd", "offload.overlap=true", "model.remat=full"],
}


@pytest.mark.parametrize("case", ["resident", "ssd-overlap"])  # the simplest mode, and all at once
def test_eval_touches_no_optimizer_state_and_does_not_change_training(tmp_path, corpus, case):
    rng = np.random.default_rng(2)
    train = [_packed(rng, 2) for _ in range(3)]
    held_out = [token_batch(*_packed(rng, 2)) for _ in range(2)]
    common = ["offload.enabled=true", "data.batch_size=2", "model.dtype=bfloat16", *OFFLOAD_CASES[case]]
    with _engine(_cfg(tmp_path, corpus, "plain", *common)) as plain, \
            _engine(_cfg(tmp_path, corpus, "evald", *common)) as evald:
        losses_plain, losses_evald, evals = [], [], []
        for tokens, mask, seg, pos in train:
            batch = token_batch(tokens[None], mask[None], seg[None], pos[None])
            losses_plain.append(plain.step(batch).loss)
            losses_evald.append(evald.step(batch).loss)
            evald.finish_update()
            before, applied = _shard_digest(evald), evald.state.updates_applied
            evals.append(evald.evaluate(held_out))
            assert _shard_digest(evald) == before  # master, m, v, gradients, streamed weights: untouched
            assert evald.state.updates_applied == applied
        plain.finish_update()
        # Evaluating between the steps changed nothing about training.
        assert losses_evald == losses_plain
        for x, y in zip(_params(evald), _params(plain)):
            if x.size:
                np.testing.assert_array_equal(x, y)
        final = evald.evaluate(held_out)
    # The held-out loss is that of the weights after each update, so it moves.
    assert len({round(e[0], 6) for e in evals}) == len(evals)
    assert final == evals[-1]


def test_eval_agrees_across_engines_and_placements(tmp_path, corpus):
    """Streamed and resident weights, and the in-memory engine, give the same held-out loss."""
    rng = np.random.default_rng(3)
    held_out = [token_batch(*_packed(rng, 2)) for _ in range(2)]
    results = {}
    for name, extra in {"memory": ["offload.enabled=false"],
                        **{k: ["offload.enabled=true", *v] for k, v in OFFLOAD_CASES.items()}}.items():
        with _engine(_cfg(tmp_path, corpus, name, "data.batch_size=2", *extra)) as engine:
            results[name] = engine.evaluate(held_out)
    counts = {c for _, c in results.values()}
    assert counts == {int(sum(b.weights.astype(bool).sum() for b in held_out))}
    for name, (total, _) in results.items():
        np.testing.assert_allclose(total, results["memory"][0], rtol=1e-5, err_msg=name)
