"""Every collective of a data-parallel step runs alone, in an order the step fixes by data
dependencies (collective_order): the ordering changes no value, and in the compiled step every
pair of collectives (or loops holding one) is ordered by a data path, small and large token
tables, resident and streamed weights alike."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxascend.offload.collective_order import after, after_each, token_of
from tests._hlo_order import unordered_collectives


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int32"])
def test_after_a_token_the_values_are_bit_for_bit_the_same(dtype):
    specials = [-0.0, 0.0, np.nan, np.inf, -np.inf, 1.5, -3.25] if dtype != "int32" else [0, -1, 7, 2**31 - 1]
    x = jnp.asarray(np.array(specials * 3), dtype)
    # a token from a value that is not finite itself: still a zero
    token = jax.jit(lambda v: token_of(v, [jnp.full((2,), jnp.nan), jnp.full((3,), -jnp.inf)]))(x)
    assert float(token) == 0.0 and not np.signbit(np.asarray(token))
    out = jax.jit(after)(x, token)
    assert out.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(out).view(np.uint8), np.asarray(x).view(np.uint8))
    chained = jax.jit(lambda v: after_each([v, v * 2], None, lambda y: y + 1))(x)
    np.testing.assert_array_equal(np.asarray(chained[1]), np.asarray(x * 2 + 1))


def test_the_order_is_a_buffer_read_xla_keeps():
    # The token reaches the collective's input through an op that reads it: in the compiled
    # program the second all-reduce's operand depends on the first's result.
    text = jax.jit(lambda a, b: (a * 2, after(b, token_of(a * 2)) + 1)).lower(
        jnp.ones(8), jnp.ones(8)).compile().as_text()
    assert "subtract" in text  # the first element less the token, not folded away


STEP = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from jaxascend.models import vocab
    table, params, routing, overlap = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[5]
    if table == "large":
        vocab.LARGE_TABLE_ELEMENTS, vocab.MAX_BLOCK_ROWS = 1024, 64  # 512 rows of 32: 8 blocks
    if routing == "per-leaf":  # every leaf's own sink hook, the loss summed as soon as it exists
        import jaxascend.offload.collective_order as order, jaxascend.offload.step as step
        order.after = step.after = lambda x, token: x
        step._OrderedSinkHooks = step._SinkHooks
    from jaxascend.config import load_config
    from jaxascend.models import build_model, token_batch
    from jaxascend.offload import JobShape, OffloadEngine, StepPlan
    from tests._hlo_order import unordered_collectives
    out = sys.argv[4]
    cfg = load_config("configs/tiny.yaml", [
        "model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=2",
        "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.remat=full", "data.seq_len=16",
        "data.batch_size=4", f"offload.params={params}", f"offload.overlap={overlap}", f"offload.dir={out}/offload",
        f"train.out_dir={out}"])
    model = build_model(cfg.model, 512, rngs=nnx.Rngs(0))
    plan = StepPlan.resolve(cfg, cfg.model, JobShape(local_devices=jax.local_device_count()))
    with OffloadEngine(cfg, model, cfg.model, plan) as engine:
        batch = engine.routing.step_input(token_batch(np.zeros((1, 4, 17), np.int32)))
        text = engine.routing.fwd_bwd.lower(engine.weights.inputs(), batch, jnp.float32(1)).compile().as_text()
        blocks = max(leaf.row_blocks for leaf in engine.state.leaves)
    print(json.dumps({"unordered": unordered_collectives(text), "blocks": blocks, "devices": plan.local_devices,
                      "source": plan.weight_source}))
""")


def _compiled(tmp_path, table, params, routing="ordered", overlap="true"):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    done = subprocess.run([sys.executable, "-c", STEP, table, params, routing, str(tmp_path), overlap], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("table, params", [("small", "resident"), ("large", "ssd")])
def test_a_data_parallel_step_orders_every_collective(tmp_path, table, params):
    # One process on two devices: the same hooks as a job's, the reductions over its devices.
    step = _compiled(tmp_path, table, params)
    assert step["devices"] == 2 and step["blocks"] == (8 if table == "large" else 1)
    assert step["source"] == ("ssd" if params == "ssd" else "host")  # served by the first device, gathered
    assert step["unordered"] == []


def test_the_check_sees_collectives_that_may_run_together(tmp_path):
    # Each leaf's own sink hook and a loss summed as soon as it exists: a top-level leaf's
    # reduction and the loss's are ordered against neither the layers' loop nor the lookup's.
    # (With a small table XLA happens to combine them with the table's, which follows the loops.)
    step = _compiled(tmp_path, "large", "resident", routing="per-leaf", overlap="false")
    assert step["source"] == "arrays" and [u for u in step["unordered"] if u[0] == "ENTRY"]
