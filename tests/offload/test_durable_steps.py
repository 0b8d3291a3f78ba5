"""Durable steps at the state's owner (``offload/durable_records.py``): records move through slot
rings and a journal says which step the files hold; updates are the in-place ones bit for bit,
and a SIGKILL anywhere (inside a chunk's update, at every journal write and fsync) reopens to the
step before or rolls the interrupted update forward, ending bit-identical to an uninterrupted run."""

import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from jaxascend.offload import OffloadedAdamState
from jaxascend.offload.step_journal import StepJournal
from jaxascend.optim import AdamHyperParams, StateFormat
from tests.offload.test_state import STACKED, offload_cfg, random_tree, spec

STEPS = 3
FORMATS = {"float32": StateFormat(),
           "int8+bf16-compensated": StateFormat.of("int8", 256, master="bfloat16", master_rounding="compensated")}


def _make(path, fmt="float32", spares=None, streamed=False, reopen=False, grad_store="ssd", host_grad_layers=None):
    import jax.numpy as jnp
    cfg = offload_cfg(path)
    return OffloadedAdamState.create(spec(jnp.bfloat16), cfg, stacked=STACKED, state=FORMATS[fmt],
                                     stream_params=streamed, durable_spares=spares, reopen=reopen,
                                     grad_store=grad_store, host_grad_layers=host_grad_layers)


def _step(state, s):
    """Step ``s`` (1-based): its gradients and its update, the trainer's state in the journal."""
    state.write_grads(random_tree(100 + s, ml_dtypes.bfloat16, scale=0.1))
    return state.step(AdamHyperParams(lr=1e-2, weight_decay=0.1, grad_scale=0.5, count=s - 1),
                      journal={"step": s, "data": [s * 7]})


def _run(path, steps, **kw):
    """A fresh state, init, ``steps`` steps; the state (open) and the last step's new params."""
    state = _make(path, **kw)
    state.init(random_tree(1))
    new = None
    for s in range(1, steps + 1):
        new = _step(state, s)
    return state, new


def _snapshot(state):
    return {(leaf.path, which): state.read_state(leaf, which).view(np.uint32).copy()
            for leaf in state.leaves for which in ("master", "m", "v")}


def _same(a, b):
    assert a.keys() == b.keys()
    bad = [k for k in a if not np.array_equal(a[k], b[k])]
    assert not bad, f"differ: {bad[:4]}"


@pytest.mark.parametrize("fmt, streamed", [("float32", False), ("int8+bf16-compensated", False), ("float32", True),
                                           ("int8+bf16-compensated", True)])
def test_durable_updates_are_the_in_place_ones_bit_for_bit(tmp_path, fmt, streamed):
    ref, ref_params = _run(tmp_path / "in-place", STEPS, fmt=fmt, streamed=streamed)
    dur, dur_params = _run(tmp_path / "durable", STEPS, fmt=fmt, streamed=streamed, spares=2)
    try:
        _same(_snapshot(ref), _snapshot(dur))
        for a, b in zip(_leaves(ref_params), _leaves(dur_params)):
            assert np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))
        # the records really moved: not every one is at home after three updates
        assert any(c.region != c.leaf.state_regions[c.layer] or c.state_offset != h.state_offset
                   for c, h in zip(dur.records.placed(), dur.layout.chunks()))
        assert dur.records.step == STEPS and dur.records.updates == STEPS
        assert dur.records.trainer == {"step": STEPS, "data": [STEPS * 7]} and dur.records.commits >= 1
        for leaf in dur.layout.streamed_leaves:  # the weights the next forward reads, wherever they are now
            for layer in range(leaf.layers):
                assert np.array_equal(ref.read_params(leaf, layer).view(np.uint16),
                                      dur.read_params(leaf, layer).view(np.uint16))
        if dur.layout.masters_in_params:  # a bfloat16 master's layers rotated through their rings
            assert any(dur.records.param_region(leaf, 0) != leaf.param_regions[0] for leaf in dur.layout.streamed_leaves)
    finally:
        ref.close()
        dur.close()


def _leaves(tree):
    import jax
    return jax.tree.leaves(tree)


def test_durable_steps_refuse_what_they_do_not_cover(tmp_path):
    import jax.numpy as jnp
    with pytest.raises(ValueError, match="must be store regions .offload.gradients: ssd or host., not host_fp32"):
        OffloadedAdamState.create(spec(jnp.bfloat16), offload_cfg(tmp_path / "h"), stacked=STACKED,
                                  grad_store="host_fp32", durable_spares=2)
    with pytest.raises(ValueError, match="nothing to recover"):
        with _make(tmp_path / "plain") as state:
            state.recover()


_CHILD = """
import sys
from tests.offload.test_durable_steps import _run
from pathlib import Path
_run(Path(sys.argv[1]), int(sys.argv[2]), fmt=sys.argv[3], spares=int(sys.argv[4]), streamed=sys.argv[5] == "1")
"""

# (point, occurrence): inside the updates' chunks (14 a step), at journal writes and fsyncs (the
# init's two, then a step's begin, commits and end), and at the store's syncs; each combination
# takes its own share, so that together they cover every kind of point early and late
KILLS = {"float32-2-resident": [("optimizer_chunk", 1), ("optimizer_chunk", 13), ("optimizer_chunk", 22),
                                ("optimizer_chunk", 42), ("journal_write", 2), ("journal_write", 4),
                                ("journal_fsync", 3), ("durable_sync", 2)],
         "int8-4-resident": [("optimizer_chunk", 6), ("optimizer_chunk", 15), ("optimizer_chunk", 29),
                             ("journal_write", 1), ("journal_write", 3), ("journal_write", 9), ("journal_fsync", 5),
                             ("durable_sync", 4)],
         "float32-3-streamed": [("optimizer_chunk", 9), ("optimizer_chunk", 20), ("optimizer_chunk", 34),
                                ("journal_write", 6), ("journal_fsync", 2), ("journal_fsync", 8), ("durable_sync", 1),
                                ("durable_sync", 7)],
         "int8-bf16-2-streamed": [("optimizer_chunk", 4), ("optimizer_chunk", 17), ("optimizer_chunk", 31),
                                  ("journal_write", 5), ("journal_write", 10), ("journal_fsync", 4),
                                  ("durable_sync", 3), ("durable_sync", 6)]}


@pytest.mark.parametrize("fmt, spares, streamed, kills", [
    ("float32", 2, False, "float32-2-resident"), ("int8+bf16-compensated", 4, False, "int8-4-resident"),
    ("float32", 3, True, "float32-3-streamed"), ("int8+bf16-compensated", 2, True, "int8-bf16-2-streamed")])
def test_a_kill_anywhere_resumes_from_the_files_bit_identically(tmp_path, fmt, spares, streamed, kills):
    ref, _ = _run(tmp_path / "reference", STEPS, fmt=fmt, streamed=streamed)
    expected = _snapshot(ref)
    ref.close()
    resumed_from = {}
    for point, nth in KILLS[kills]:
        where = tmp_path / f"{point}-{nth}"
        env = {**os.environ, "JAXASCEND_KILL_AT": f"{point}:{nth}"}
        proc = subprocess.run([sys.executable, "-c", _CHILD, str(where), str(STEPS), fmt, str(spares),
                               "1" if streamed else "0"], env=env, capture_output=True, cwd=os.getcwd())
        if proc.returncode == 0:  # the point is not reached that often: nothing to resume
            continue
        assert proc.returncode == -9, proc.stderr.decode()[-3000:]
        with StepJournal(where / "offload", create=False) as journal:
            record = journal.record
        if record is None or record.step < 0:  # killed while the initial state was written
            resumed_from[(point, nth)] = "init"
            state, _ = _run(where / "again", STEPS, fmt=fmt, streamed=streamed, spares=spares)
        else:
            state = _make(where, fmt=fmt, spares=spares, streamed=streamed, reopen=True)
            step = state.recover()
            resumed_from[(point, nth)] = step
            assert state.records.trainer == ({"step": step, "data": [step * 7]} if step else {})
            for s in range(step + 1, STEPS + 1):
                _step(state, s)
        try:
            _same(_snapshot(state), expected)
        finally:
            state.close()
    # the kills landed before, inside and after updates: resumed from several steps
    print(f"kill matrix {kills}: " + ", ".join(f"{p}:{n} -> {s}" for (p, n), s in resumed_from.items()))
    assert len(set(resumed_from.values())) >= 2, resumed_from
