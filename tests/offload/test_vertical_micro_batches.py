"""Vertical micro-batches (``train.grad_accum: A``): each layer runs the step's ``A`` micro-batches
in turn, so a step is one batch of ``A x B`` rows to within float32 summation order, in every
mode it composes with: weights resident or on SSD, overlap, compressed state, a job, a kill."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from jaxascend.models import norm_scale_init, token_batch
from tests._corpus import write_word_corpus
from tests.offload.test_masked_loss_and_eval import _cfg, _engine, _packed
from tests.offload.test_streamed_params import TINY

ARCHS = {
    "llama": [],
    "gpt2": ["model.arch=gpt2", "model.hidden_act=gelu_new", "model.num_key_value_heads=4"],
    # Gemma 3's mixed stack: a sliding-window layer and a full one in one scan
    "gemma3": ["model.arch=gemma3", "model.sliding_window=8", "model.query_pre_attn_scalar=8",
               "model.layer_types=[sliding_attention,full_attention]", "model.final_logit_softcapping=30.0"],
}
ROWS = 4  # rows per step: A micro-batches of ROWS // A rows against one batch of ROWS


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_word_corpus(tmp_path_factory.mktemp("corpus"), docs=4, words_per_doc=400)


def _relative(a, b):
    """The relative error of a tensor: ||a - b|| / ||b|| (Frobenius)."""
    return float(np.linalg.norm((a - b).ravel()) / max(float(np.linalg.norm(b.ravel())), 1e-30))


@pytest.fixture(scope="module")
def packed_steps():
    rng = np.random.default_rng(1)
    return [_packed(rng, ROWS) for _ in range(3)]


def _run_engine(tmp_path, corpus, name, steps, micro_batches, *extra):
    rows = ROWS // micro_batches
    cfg = _cfg(tmp_path, corpus, name, "model.remat=full", "optimizer.eps=1e-4", f"data.batch_size={rows}",
               f"train.grad_accum={micro_batches}", *extra)
    losses = []
    with _engine(cfg) as engine:
        for tokens, mask, seg, pos in steps:
            split = [x.reshape((micro_batches, rows) + x.shape[1:]) for x in (tokens, mask, seg, pos)]
            losses.append(engine.step(token_batch(*split)).fetched().loss)
        offset = 1.0 - norm_scale_init(cfg.model.arch)  # Gemma 3's norms multiply by 1 + scale
        params = [np.asarray(x, np.float32) + (offset if "norm" in jax.tree_util.keystr(path) else 0.0)
                  for path, x in jax.tree_util.tree_flatten_with_path(engine.params)[0]]
    return np.array(losses), params


@pytest.mark.parametrize("arch", list(ARCHS))
def test_vertical_micro_batches_equal_one_batch_of_all_rows(tmp_path, corpus, packed_steps, arch):
    """Packed rows of two examples each with very different mask counts; A = 1 (the reference,
    one batch of 4 rows), 2 and 4, overlapped, in float32: losses and weights within 1e-6 (a
    norm's weight as the scale it applies: Gemma 3's start at 0 and multiply by 1 + scale, and
    their relative error would be Adam's noise on a value of about 3 x learning rate)."""
    reference, ref_params = _run_engine(tmp_path, corpus, "a1", packed_steps, 1, *ARCHS[arch])
    for micro_batches in (2, 4):
        losses, params = _run_engine(tmp_path, corpus, f"a{micro_batches}", packed_steps, micro_batches, *ARCHS[arch])
        np.testing.assert_allclose(losses, reference, rtol=1e-6)
        assert max(_relative(p, r) for p, r in zip(params, ref_params)) <= 1e-6, micro_batches


# ----------------------------------------------------------------------------- the trainer's modes

def _train(out, corpus, *extra):
    from jaxascend.config import load_config
    from jaxascend.trainer import run

    cfg = load_config("configs/tiny.yaml", TINY + [f"data.paths=[{corpus}]", "data.include=['*.txt']",
                                                   f"train.out_dir={out}", f"offload.dir={out}/offload",
                                                   "model.dtype=float32", "model.param_dtype=float32",
                                                   "optimizer.eps=1e-4", "checkpoint.async_save=false", *extra])
    result = run(cfg)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    from safetensors.numpy import load
    return result, records, load((out / "params.safetensors").read_bytes())


# (mode) -> overrides; each runs A = 2 micro-batches of 1 row against one batch of 2 rows
MODES = {
    "resident-overlap": ["offload.params=resident", "offload.overlap=true"],
    "ssd-sequential": ["offload.params=ssd", "offload.overlap=false"],
    "ssd-overlap": ["offload.params=ssd", "offload.overlap=true"],
    "ssd-overlap-int8-state": ["offload.params=ssd", "offload.overlap=true", "optimizer.state_dtype=int8"],
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus):
    """Each mode with one batch of 2 rows and with 2 micro-batches of 1 row (lazily, per mode)."""
    root, cache = tmp_path_factory.mktemp("modes"), {}

    def get(mode, micro_batches):
        key = (mode, micro_batches)
        if key not in cache:
            cache[key] = _train(root / f"{mode}-a{micro_batches}", corpus, *MODES[mode], "data.batch_size=" +
                                str(2 // micro_batches), f"train.grad_accum={micro_batches}")
        return cache[key]

    return get


@pytest.mark.parametrize("mode", list(MODES))
def test_each_mode_runs_micro_batches_as_one_batch(trained, mode):
    (one, _, ref), (two, records, params) = trained(mode, 1), trained(mode, 2)
    np.testing.assert_allclose(two.losses, one.losses, rtol=1e-6)
    # int8 moments quantize the update: a 1e-6 difference in a gradient can move a code by one step
    tolerance = 1e-6 if "int8" not in mode else 2e-3
    for name in ref:
        assert _relative(params[name], ref[name]) <= tolerance, name
    assert records[-1]["overlap"] is ("overlap" in mode)
    if "ssd" in mode:  # each layer read once in the forward and once in the backward's recomputation, whatever A
        assert records[-1]["param_source_misses"] == 0


def test_weight_reads_per_step_do_not_grow_with_micro_batches(tmp_path, corpus):
    counted = {}
    for micro_batches in (1, 8):
        # sequential: an overlapped update's reads land in whichever step's count the timing gives them
        _, records, _ = _train(tmp_path / f"a{micro_batches}", corpus, "offload.params=ssd", "data.batch_size=1",
                               "offload.overlap=false", f"train.grad_accum={micro_batches}")
        counted[micro_batches] = ([r["param_source_fetches"] for r in records],
                                  [r["ssd_read_bytes"] for r in records[1:]])
    assert counted[1][0] == counted[8][0] == [2 * 3 * step for step in (1, 2, 3)]
    assert counted[1][1] == counted[8][1]  # the SSD bytes each step reads (weights and optimizer state)
