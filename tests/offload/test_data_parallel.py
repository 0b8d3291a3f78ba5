"""Data-parallel offloaded training across real processes on 127.0.0.1 (jax.distributed, gloo):
two processes, each owning half of every tensor's SSD state, train like one process on the same
global batches. (The large token table in a job: test_data_parallel_table_job.py.)"""

from __future__ import annotations

import json
import textwrap

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
