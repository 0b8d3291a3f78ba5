"""Data-parallel offloaded training across real processes on 127.0.0.1 (jax.distributed, gloo):
two processes, each owning half of every tensor's SSD state, train like one process on the same
global batches."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tests._jobs import local_job

CHILD = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    from flax import nnx
    from jaxascend.distributed import initialize
    from jaxascend.config import load_config
    from jaxascend.models import build_model, token_batch
    from jaxascend.offload import JobShape, OffloadEngine, StepPlan

    out, dtype, loss = sys.argv[1], sys.argv[2], sys.argv[3]
    group = initialize(None)
    cfg = load_config("configs/tiny.yaml", [
        "model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=2",
        "model.num_attention_heads=4", "model.num_key_value_heads=2", f"model.dtype={dtype}",
        "model.param_dtype=float32", "data.seq_len=32", "data.batch_size=4", "optimizer.warmup_steps=0",
        "optimizer.learning_rate=3e-3", "optimizer.eps=1e-4", "offload.chunk_bytes=1MiB", "offload.staging_bytes=1MiB",
        "offload.overlap=false", f"offload.dir={out}/offload-{group.index}", f"train.out_dir={out}",
        f"model.loss={loss}"])
    model = build_model(cfg.model, 259, rngs=nnx.Rngs(0))
    plan = StepPlan.resolve(cfg, cfg.model, JobShape(group.count, group.index))
    rng = np.random.default_rng(0)
    losses, norms = [], []
    with OffloadEngine(cfg, model, cfg.model, plan) as engine:
        for step in range(3):
            tokens = rng.integers(0, 259, (1, 4, 33)).astype(np.int32)
            mask = rng.random((1, 4, 32)) < 0.7
            stats = engine.step(token_batch(tokens, mask))
            losses.append(stats.loss); norms.append(stats.grad_norm)
        masters = {str(leaf.index): engine.state.read_state(leaf, "master").tolist() for leaf in engine.state.leaves}
        stacked = {str(leaf.index): bool(leaf.stacked) for leaf in engine.state.leaves}
        shard_bytes = sum(os.path.getsize(f) for f in engine.shard_files())
        state_bytes = sum(r.nbytes for r in engine.state.store.regions())
    json.dump({"losses": losses, "norms": norms, "masters": masters, "stacked": stacked, "shard_bytes": shard_bytes,
               "state_bytes": state_bytes, "index": group.index, "count": group.count},
              open(f"{out}/result-{group.index}.json", "w"))
""")


def _run(out, n, dtype, loss="auto"):
    out.mkdir(parents=True, exist_ok=True)
    for code, _, err in local_job(CHILD, n, args=(out, dtype, loss)):
        assert code == 0, err[-3000:]
    return [json.loads((out / f"result-{i}.json").read_text()) for i in range(n)]


# float32 with the dense loss: tests/test_train_distributed.py's jobs
@pytest.mark.parametrize("dtype, loss", [("bfloat16", "auto"), ("float32", "blocked")])
def test_two_processes_train_like_one_with_half_the_state_each(tmp_path, dtype, loss):
    (one,) = _run(tmp_path / "p1", 1, dtype, loss)
    two = _run(tmp_path / "p2", 2, dtype, loss)
    # The same losses and norms step by step: the job's loss is the sum of the two processes'
    # halves (another summation order than one process's), so they agree to float rounding.
    for r in two:
        np.testing.assert_allclose(r["losses"], one["losses"], rtol=1e-6 if dtype == "float32" else 2e-3)
        np.testing.assert_allclose(r["norms"], one["norms"], rtol=1e-5 if dtype == "float32" else 2e-2)
    # The master weights: each process's slices, put together, are the single process's (eps 1e-4:
    # Adam's first steps are ~lr * sign(g), which would turn a rounding difference in a gradient
    # element near 0 into a visible step).
    for key, whole in one["masters"].items():
        whole = np.asarray(whole, np.float32)
        stacked = one["stacked"][key]
        parts = [np.asarray(r["masters"][key], np.float32) for r in two]
        joined = np.concatenate(parts, axis=-1)
        flat = whole.reshape(whole.shape[0], -1) if stacked else whole.reshape(-1)
        joined = joined[..., :flat.shape[-1]]
        np.testing.assert_allclose(joined, flat, rtol=0, atol=1e-6 if dtype == "float32" else 2e-3, err_msg=key)
    # Each process holds half the state (every region rounds up to whole blocks on its own).
    for r in two:
        assert abs(r["state_bytes"] - one["state_bytes"] / 2) <= 0.02 * one["state_bytes"], (r["state_bytes"],
                                                                                              one["state_bytes"])


# A job on Qwen's 151936-row vocabulary at a small width: the token table (4.9M elements here;
# large tables start at 2^24, lowered for the test) is computed and sent in 16 blocks of 9496
# rows, and each block's optimizer state is split between the processes like a layer's. One job
# runs each case in turn: a tied table `reps` times from the same start (restored), and an
# untied one overlapped and not.
TABLE_CHILD = textwrap.dedent("""
    import hashlib, json, subprocess, sys
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from jaxascend.models import vocab
    vocab.LARGE_TABLE_ELEMENTS = 1 << 20
    from jaxascend.checkpoint import Checkpointer
    from jaxascend.config import load_config
    from jaxascend.distributed import initialize
    from jaxascend.models import build_model, token_batch
    from jaxascend.offload import JobShape, OffloadEngine, StepPlan
    from tests._hlo_order import unordered_collectives

    out, reps = sys.argv[1], int(sys.argv[2])
    group = initialize(None)
    VOCAB = 151936

    def run(name, tied, overlap, reps):
        where = f"{out}/{name}"
        cfg = load_config("configs/tiny.yaml", [
            "model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=2",
            "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.dtype=float32",
            "model.param_dtype=float32", "model.remat=full", f"model.tie_word_embeddings={tied}", "data.seq_len=16",
            "data.batch_size=4", "optimizer.warmup_steps=0", "optimizer.learning_rate=3e-3", "optimizer.eps=1e-4",
            f"offload.overlap={overlap}", f"offload.dir={where}/offload-{group.index}", f"train.out_dir={where}",
            f"checkpoint.dir={where}/checkpoints"])
        model = build_model(cfg.model, VOCAB, rngs=nnx.Rngs(0))
        plan = StepPlan.resolve(cfg, cfg.model, JobShape(group.count, group.index))
        runs = []
        with OffloadEngine(cfg, model, cfg.model, plan) as engine, Checkpointer(cfg.checkpoint, cfg) as ckpt:
            blocks = engine.state.leaves[0].row_blocks
            engine.save_checkpoint(ckpt, 0, {})
            ckpt.wait()
            # Beside the runs of a job, a process that keeps a core busy (from the second run: the
            # first compiles the step).
            burner = None
            for rep in range(reps):  # each from the same start: the restored step 0
                if rep == 1 and group.index == 0:
                    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
                engine.restore_checkpoint(ckpt, 0)
                rng = np.random.default_rng(0)
                losses = [engine.step(token_batch(rng.integers(0, VOCAB, (1, 4, 17)).astype(np.int32))).loss
                          for _ in range(2)]
                engine.finish_update()
                digest = hashlib.sha256()
                for leaf in engine.state.leaves:
                    digest.update(engine.state.read_state(leaf, "master").tobytes())
                runs.append({"losses": losses, "master": digest.hexdigest()})
            if burner is not None:
                burner.kill()
                burner.wait()
            with engine.exported_weights() as read:
                if read is not None:
                    np.savez(f"{where}/weights.npz", **{".".join(p): read(p, None) for p in engine.readers.paths})
            unordered = None
            if group.count > 1:  # the compiled step's collectives, pairwise (the step just ran: no compile)
                batch = engine.routing.step_input(token_batch(np.zeros((1, 4, 17), np.int32)))
                text = engine.routing.fwd_bwd.lower(engine.weights.inputs(), batch, jnp.float32(1)).compile().as_text()
                unordered = [" ".join(u) for u in unordered_collectives(text)]
        return {"runs": runs, "blocks": blocks, "overlap": plan.overlap, "unordered": unordered}

    cases = [("tied", "true", "false", reps), ("untied", "false", "true", 1)]
    if group.count > 1:
        cases.append(("untied-sequential", "false", "false", 1))
    result = {name: run(name, tied, overlap, n) for name, tied, overlap, n in cases}
    json.dump(result, open(f"{out}/result-{group.index}.json", "w"))
""")


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    """The table cases as one process, and as a job of two (the tied case ten times)."""
    root = tmp_path_factory.mktemp("tables")
    out = {}
    for processes, reps in ((1, 1), (2, 10)):
        where = root / f"p{processes}"
        where.mkdir()
        results = local_job(TABLE_CHILD, processes, args=(where, reps))
        for code, _, err in results:
            assert code == 0, err[-3000:]
        out[processes] = (where, json.loads((where / "result-0.json").read_text()))
    return out


def _close(a: Path, b: Path, atol=1e-5):
    wa, wb = np.load(a / "weights.npz"), np.load(b / "weights.npz")
    assert sorted(wa) == sorted(wb)
    for name in wa:
        np.testing.assert_allclose(wa[name], wb[name], rtol=0, atol=atol, err_msg=name)


def test_a_tied_table_in_blocks_trains_like_one_process_every_time_under_load(tables):
    (root1, one), (root2, two) = tables[1], tables[2]
    # Ten runs of the job from the same start while another process keeps a core busy: the
    # collectives of a step run one at a time in the order the step fixes (collective_order), so
    # no run differs from another by a bit, and each trains like one process.
    assert one["tied"]["blocks"] == two["tied"]["blocks"] == 16
    assert two["tied"]["unordered"] == []
    runs = two["tied"]["runs"]
    assert len(runs) == 10 and len({r["master"] for r in runs}) == 1 and len({tuple(r["losses"]) for r in runs}) == 1
    np.testing.assert_allclose(runs[0]["losses"], one["tied"]["runs"][0]["losses"], rtol=1e-5)
    _close(root2 / "tied", root1 / "tied")


def test_an_untied_table_in_blocks_trains_like_one_process_overlapped_or_not(tables):
    (root1, one), (root2, two) = tables[1], tables[2]
    # The overlapped step of a job with resident weights: each process's slice of every layer in
    # host buffers, updated in place beside the next forward and gathered in the step.
    overlapped, sequential = two["untied"], two["untied-sequential"]
    assert overlapped["overlap"] and not sequential["overlap"] and overlapped["unordered"] == []
    assert overlapped["runs"] == sequential["runs"]  # bit for bit: the losses and every master slice
    np.testing.assert_allclose(overlapped["runs"][0]["losses"], one["untied"]["runs"][0]["losses"], rtol=1e-5)
    _close(root2 / "untied", root1 / "untied")
