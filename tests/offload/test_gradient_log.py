"""Durable steps with the gradients in RAM (``offload.gradients: host``, ``offload/gradient_log.py``):
each update's gradients are copied to their twin regions on SSD before it is journaled, the
updates are those of gradients on SSD bit for bit, and a SIGKILL inside an update rolls it
forward from the log, ending bit-identical to an uninterrupted run."""

import os
import subprocess
import sys

import numpy as np
import pytest

from jaxascend.offload.gradient_log import LOG_PREFIX
from jaxascend.offload.step_journal import StepJournal
from tests.offload.test_durable_steps import STEPS, _make, _run, _same, _snapshot, _step

_CHILD = """
import sys
from pathlib import Path
from tests.offload.test_durable_steps import _run
_run(Path(sys.argv[1]), int(sys.argv[2]), spares=2, grad_store="host",
     host_grad_layers=int(sys.argv[3]) if len(sys.argv) > 3 else None)
"""


@pytest.mark.parametrize("layers", [None, 1], ids=["all", "first-layer"])
def test_updates_with_a_gradient_log_are_those_of_gradients_on_ssd(tmp_path, layers):
    ref, _ = _run(tmp_path / "ssd", STEPS, spares=2)
    logged, _ = _run(tmp_path / "host", STEPS, spares=2, grad_store="host", host_grad_layers=layers)
    try:
        _same(_snapshot(ref), _snapshot(logged))
        twins = [r for r in logged.store.regions() if r.name.startswith(LOG_PREFIX)]
        grads = [r for r in logged.store.regions() if r.in_memory]
        assert grads and len(twins) == len(grads) and not any(t.in_memory for t in twins)
        if layers:  # the stack's first layer in RAM (and logged), its others and the other leaves on SSD
            assert all(g.name.endswith("/L0/grad") for g in grads)
            assert any(r.name.endswith("/L1/grad") and not r.in_memory for r in logged.store.regions())
        assert sum(t.nbytes for t in twins) == sum(g.nbytes for g in grads) == logged.records.figures()["gradient_log_bytes"]
        # the log holds the last update's gradients
        for twin in twins:
            region = twin.name[len(LOG_PREFIX):]
            assert (logged.store.read(twin.name) == logged.store.read(region)).all(), region
    finally:
        ref.close()
        logged.close()


@pytest.mark.parametrize("kill, layers", [("optimizer_chunk:9", None), ("optimizer_chunk:20", None),
                                         ("durable_sync:3", None), ("journal_fsync:4", None),
                                         ("optimizer_chunk:20", 1)])
def test_a_kill_in_an_update_rolls_forward_from_the_log(tmp_path, kill, layers):
    ref, _ = _run(tmp_path / "reference", STEPS)
    expected = _snapshot(ref)
    ref.close()
    where = tmp_path / "killed"
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(where), str(STEPS)] + ([str(layers)] if layers else []),
                          capture_output=True, env={**os.environ, "JAXASCEND_KILL_AT": kill}, cwd=os.getcwd())
    assert proc.returncode == -9, proc.stderr.decode()[-3000:]
    with StepJournal(where / "offload", create=False) as journal:
        in_flight = journal.record.update is not None
    state = _make(where, spares=2, grad_store="host", reopen=True, host_grad_layers=layers)
    try:
        step = state.recover()
        assert step >= 1 or not in_flight
        for s in range(step + 1, STEPS + 1):
            _step(state, s)
        _same(_snapshot(state), expected)
    finally:
        state.close()


@pytest.mark.parametrize("layers", [None, 1], ids=["all", "first-layer"])
def test_the_sink_writes_each_gradient_to_its_log_as_it_arrives(tmp_path, layers):
    """The native sink's mirrors: every layer's gradient lands in its memory region and, whole, in
    its twin on SSD, byte for byte the reference gradient (ffi/offload_store_sink.cc); with
    ``host_grad_layers``, the other layers' and leaves' in their regions on SSD, with no twin."""
    import jax
    import jax.numpy as jnp

    from jaxascend.offload import OffloadedAdamState
    from tests.offload.test_state import _scanned_loss, _sinked_grad_step, _sinked_setup, offload_cfg

    _, params, x = _sinked_setup(tmp_path / "unused", jnp.bfloat16)
    state = OffloadedAdamState.create(params, offload_cfg(tmp_path / "run"), stacked={"emb": False, "w": True},
                                      grad_store="host", durable_spares=2, host_grad_layers=layers)
    with state:
        state.init(params)
        ref = jax.jit(jax.grad(lambda p: _scanned_loss(p["w"], p["emb"], x, lambda q, n, i: q)))(params)
        step, probes = _sinked_grad_step(state, 3)
        jax.block_until_ready(step(probes, params, x))
        state.store.flush()
        for name in ("emb", "w"):
            leaf = state.leaf(name)
            want = np.asarray(ref[name]).view(np.uint8).reshape(leaf.layers, -1)
            for layer, region in enumerate(leaf.grad_regions):
                in_ram = layers is None or (name == "w" and layer < layers)
                assert state.store.region(region).in_memory == in_ram
                np.testing.assert_array_equal(state.store.read(region), want[layer])
                if in_ram:
                    np.testing.assert_array_equal(state.store.read(LOG_PREFIX + region), want[layer])
                else:
                    assert LOG_PREFIX + region not in {r.name for r in state.store.regions()}


@pytest.mark.parametrize("store", ["host", "ssd", "host for the stack's first layer"])
def test_auto_keeps_where_the_files_journal_put_the_gradients(tmp_path, store):
    from jaxascend.config import load_config
    from jaxascend.preparation import _gradients_of_the_files

    kw = {"grad_store": "host", "host_grad_layers": 1 if store != "host" else None} if store != "ssd" else {}
    state, _ = _run(tmp_path / "run", 2, spares=2, **kw)
    state.close()
    folder = tmp_path / "run" / "offload"

    def cfg(*more):
        return load_config("configs/tiny.yaml", [f"offload.dir={folder}", "offload.durable=true",
                                                 f"train.out_dir={tmp_path / 'out'}", *more], inputs=False)

    kept, notes = _gradients_of_the_files(cfg())
    assert (kept.offload.gradients, kept.offload.host_gradient_layers) == (kw.get("grad_store", "ssd"),
                                                                          kw.get("host_grad_layers"))
    assert notes == (f"offload.gradients: auto keeps {store}, as the offload files in {folder} were written "
                     f"(they hold step 2)",)
    for asked in (cfg("train.resume=none"), cfg("offload.gradients=ssd"), cfg("offload.gradients=host")):
        assert _gradients_of_the_files(asked) == (asked, ())  # a fresh start, or the user's choice
