"""Training runs with the blocked loss (``model.loss: blocked``) in combination with the modes it
meets: a large tied table whose head sends its gradient block by block through the offloaded
step (weights resident or streamed from SSD), vertical micro-batches, overlap, compressed state,
and evaluation. Each run's
losses and final weights equal the dense loss's run within float32 summation-order noise."""

import numpy as np
import pytest
from safetensors.numpy import load

from jaxascend.models import blocked_token_losses, losses, vocab
from tests.offload.test_streamed_params import corpus, train  # noqa: F401  (corpus: a fixture)

MODES = {  # remat full: each runs overlapped (the optimizer of step t beside step t+1)
    "resident": ["offload.params=resident"],
    "ssd": ["offload.params=ssd"],
    "ssd-micro-batches": ["offload.params=ssd", "train.grad_accum=2", "data.batch_size=1"],
    "bf16-state": ["offload.params=resident", "optimizer.state_dtype=bfloat16"],
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
    # bfloat16 moments: a gradient that differs in its last float32 bits can round a moment to the
    # neighbouring bfloat16 value, which moves that element's update by up to 2**-8 of itself.
    atol = 1e-5 if "state" in mode else 1e-6
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=atol, err_msg=name)
