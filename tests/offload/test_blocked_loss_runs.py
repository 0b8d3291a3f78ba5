"""Training runs with the blocked loss (``model.loss: blocked``) in combination with the modes it
meets: a large tied table whose head sends its gradient block by block through the offloaded
step (weights resident or streamed from SSD), gradient accumulation, and evaluation. Each run's
losses and final weights equal the dense loss's run within float32 summation-order noise."""

import numpy as np
import pytest
from safetensors.numpy import load

from jaxascend.models import losses, vocab
from jaxascend.models.blocked_loss import blocked_token_losses
from tests.offload.test_streamed_params import corpus, train  # noqa: F401  (corpus: a fixture)

MODES = {
    "resident": ["offload.params=resident"],
    "ssd": ["offload.params=ssd"],
    "accumulate": ["offload.params=resident", "train.grad_accum=2", "model.remat=none"],
}


@pytest.mark.parametrize("mode", list(MODES))
def test_a_blocked_loss_run_trains_like_the_dense_one(tmp_path, corpus, monkeypatch, mode):
    # A tied table over the block threshold: 5 blocks of 64 rows, handed to the step as raw bits.
    monkeypatch.setattr(vocab, "LARGE_TABLE_ELEMENTS", 1024)
    monkeypatch.setattr(vocab, "MAX_BLOCK_ROWS", 64)
    assert vocab.table_blocks(320, 32) == 5
    common = ["model.vocab_size=320", "model.dtype=float32", "model.param_dtype=float32", f"eval.paths=[{corpus}]",
              "eval.batches=1", *MODES[mode]]
    traced = []  # the blocked loss's traces: the training step's and the evaluation's
    monkeypatch.setattr(losses, "blocked_token_losses",
                        lambda *a, **k: traced.append(a[1].blocks) or blocked_token_losses(*a, **k))
    runs, traces = {}, {}
    for loss in ("blocked", "dense"):
        before = len(traced)
        runs[loss] = train(tmp_path / loss, corpus, f"model.loss={loss}", *common)
        traces[loss] = len(traced) - before
    assert traces["blocked"] >= 2 and traces["dense"] == 0 and set(traced) == {5}  # 5 blocks of the table
    (blocked, b_records, b_params), (dense, d_records, d_params) = runs["blocked"], runs["dense"]
    np.testing.assert_allclose(blocked.losses, dense.losses, rtol=2e-6)
    evals = [[r["eval_loss"] for r in records if "eval_loss" in r] for records in (b_records, d_records)]
    assert evals[0] and np.allclose(evals[0], evals[1], rtol=2e-6)
    a, b = load(b_params), load(d_params)
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-6, err_msg=name)
