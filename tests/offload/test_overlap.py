"""``offload.overlap``: the optimizer of step t on a thread while step t+1's forward/backward runs,
layer by layer behind it. With and without overlap the runs are bit-identical (losses, the fp32
master weights, m and v), the sink's receipts refuse a gradient that would overwrite one the
optimizer has not read, and SIGKILL in the middle of the overlap resumes bit-identically."""

import json
import os
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxascend.native import extension as _native
from jaxascend.config import load_config
from jaxascend.offload.native_path import sink_gradient
from jaxascend.offload.param_source import ParamSource
from jaxascend.metrics import format_bytes
from jaxascend.trainer import _ssd_per_step, run
from tests._corpus import write_word_corpus
from tests.offload.test_streamed_params import TINY
from tests.test_resume import _assert_bitwise_equal, _final_state

CASES = {
    "float32": ["model.dtype=float32", "model.param_dtype=float32"],
    # step 1 is finite at 2**10; the scale then grows to 2**30 and step 2's fp16 gradients
    # overflow (skipped, the scale backs off to ~2**10 again); step 3 is finite
    "float16-overflow-mid": ["model.dtype=float16", "optimizer.loss_scale_init=1024",
                             "optimizer.loss_scale_growth=1048576", "optimizer.loss_scale_growth_interval=1",
                             "optimizer.loss_scale_max=1099511627776", "optimizer.loss_scale_backoff=0.000001"],
    "bfloat16-clipped": ["model.dtype=bfloat16", "optimizer.grad_clip_norm=0.01"],
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_word_corpus(tmp_path_factory.mktemp("corpus"), docs=4, words_per_doc=400)


def _train(out, corpus, *extra):
    cfg = load_config("configs/tiny.yaml", TINY + [f"data.paths=[{corpus}]", "data.include=['*.txt']",
                                                   f"train.out_dir={out}", f"offload.dir={out}/offload",
                                                   "checkpoint.async_save=false", *extra])
    result = run(cfg)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return result, records


def _final_checkpoint(out, step=3):
    """The final checkpoint's compute params and offloaded master/m/v, read with plain Orbax."""
    path = out / "checkpoints" / str(step)
    return {"params": ocp.StandardCheckpointer().restore(path / "params"),
            "offloaded": ocp.StandardCheckpointer().restore(path / "offloaded")}


# Each case with one placement, both placements over the cases (bfloat16 with both placements and
# micro-batches: test_micro_batches_overlap_and_match_the_sequential_step).
@pytest.mark.parametrize("params, case", [("ssd", "float32"), ("resident", "float16-overflow-mid"),
                                          ("ssd", "float16-overflow-mid"), ("resident", "bfloat16-clipped")])
def test_overlap_is_bit_identical_to_the_sequential_step(tmp_path, corpus, params, case):
    extra = [f"offload.params={params}", *CASES[case]]
    seq, seq_records = _train(tmp_path / "sequential", corpus, "offload.overlap=false", *extra)
    ovl, records = _train(tmp_path / "overlap", corpus, "offload.overlap=true", *extra)
    assert ovl.losses == seq.losses  # floats compared exactly
    state = _final_checkpoint(tmp_path / "overlap")
    assert {k.split("/")[0] for k in state["offloaded"]} >= {"master", "m", "v"}
    _assert_bitwise_equal(_final_checkpoint(tmp_path / "sequential"), state)  # master, m, v, params
    assert (tmp_path / "overlap" / "params.safetensors").read_bytes() == \
        (tmp_path / "sequential" / "params.safetensors").read_bytes()
    assert records[-1]["overlap"] is True and seq_records[-1]["overlap"] is False
    assert records[-1]["early_gradient_arrivals"] == 0 and records[-1]["param_source_misses"] == 0
    # Every layer fetched twice per step (the forward, the backward's recomputation), in order.
    assert records[-1]["param_source_fetches"] == 2 * 3 * len(records)
    updated = [r for r in records[1:] if "optimizer_seconds" in r]  # the previous step's update
    assert all(0.0 <= r["overlap_fraction"] <= 1.0 and r["optimizer_wait_seconds"] >= 0.0 for r in updated)
    if params == "ssd":  # every layer an update wrote went to the next forward in memory
        overlapped = sum(1 for r in records if "optimizer_seconds" in r)
        handed = records[-1]["param_source_handovers"] + records[-1]["param_source_handover_skips"]
        # The last record is written while the last step's update runs: its layers may be counted too.
        assert 3 * overlapped <= handed <= 3 * (overlapped + 1)
        # The update waits for the forward rather than skip a layer: none is read back from SSD.
        assert records[-1]["param_source_handover_skips"] == 0 and records[-1]["param_source_handovers"] > 0
        # The summary's step traffic leaves out the first step (no update beside its forward).
        first = (records[0]["ssd_read_bytes"], records[0]["ssd_written_bytes"])
        later = records[1:]
        assert ovl.ssd_bytes_first_step == first and sum(r["ssd_read_bytes"] for r in later) > 0
        assert _ssd_per_step(ovl).startswith(
            f"{format_bytes(sum(r['ssd_read_bytes'] for r in later) / len(later))} / "
            f"{format_bytes(sum(r['ssd_written_bytes'] for r in later) / len(later))} (")
        assert _ssd_per_step(ovl).endswith("; this run's steps after its first)")
    if case == "float16-overflow-mid":
        assert [r["skipped"] for r in records] == [False, True, False]
        assert [r["skipped"] for r in seq_records] == [False, True, False]
    else:
        assert len(updated) == len(records) - 1  # every update but the last overlapped a forward
    if case == "bfloat16-clipped":
        assert all(r["grad_norm"] > 0.01 for r in records)  # the clip is active on every step


def test_a_layer_without_a_free_slot_is_read_from_ssd_instead(tmp_path, corpus, monkeypatch):
    extra = ["offload.params=ssd", "model.dtype=bfloat16"]
    seq, _ = _train(tmp_path / "sequential", corpus, "offload.overlap=false", *extra)
    taken = ParamSource.acquire_handover
    monkeypatch.setattr(ParamSource, "acquire_handover", lambda self, layer: None if layer % 2 else taken(self, layer))
    ovl, records = _train(tmp_path / "overlap", corpus, "offload.overlap=true", *extra)
    assert ovl.losses == seq.losses
    _assert_bitwise_equal(_final_checkpoint(tmp_path / "sequential"), _final_checkpoint(tmp_path / "overlap"))
    assert records[-1]["param_source_handover_skips"] == len(records) - 1  # layer 1 of each overlapped update
    assert records[-1]["param_source_handovers"] == 2 * (len(records) - 1)
    assert records[-1]["param_source_misses"] == 0


@pytest.mark.parametrize("params", ["resident", "ssd"])
def test_micro_batches_overlap_and_match_the_sequential_step(tmp_path, corpus, capsys, params):
    extra = [f"offload.params={params}", "model.dtype=bfloat16", "train.grad_accum=2"]
    seq, _ = _train(tmp_path / "sequential", corpus, "offload.overlap=false", *extra)
    capsys.readouterr()
    ovl, records = _train(tmp_path / "overlap", corpus, "offload.overlap=true", *extra)
    assert ovl.losses == seq.losses
    _assert_bitwise_equal(_final_checkpoint(tmp_path / "sequential"), _final_checkpoint(tmp_path / "overlap"))
    assert records[-1]["overlap"] is True
    assert not [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: offload.overlap")]


def test_a_checkpoint_written_with_overlap_resumes_without_it(tmp_path, corpus):
    extra = ["offload.params=resident", "model.dtype=bfloat16", "train.steps=4", "checkpoint.every_steps=2"]
    straight, _ = _train(tmp_path / "straight", corpus, "offload.overlap=false", *extra)
    _train(tmp_path / "halves", corpus, "offload.overlap=true", "train.stop_at_step=2", *extra)
    resumed, _ = _train(tmp_path / "halves", corpus, "offload.overlap=false", "train.resume=auto", *extra)
    assert resumed.losses == straight.losses
    _assert_bitwise_equal(_final_checkpoint(tmp_path / "straight", 4), _final_checkpoint(tmp_path / "halves", 4))


def test_the_sink_refuses_a_gradient_the_optimizer_has_not_read(tmp_path):
    from jaxascend.config import OffloadConfig
    from jaxascend.offload.state import OffloadedAdamState

    cfg = OffloadConfig(enabled=True, dir=str(tmp_path / "offload"), block_bytes=4096, chunk_bytes=16384,
                        staging_bytes=65536, pin_memory=False)
    spec = {"w": jax.ShapeDtypeStruct((2, 64), jnp.bfloat16)}
    with OffloadedAdamState.create(spec, cfg, stacked=True) as state:
        sink = state.gradient_sink()
        g = jnp.ones((64,), jnp.bfloat16)
        send = jax.jit(lambda g, layer: sink_gradient(g, layer, sink=sink.handle, tensor=0))
        jax.block_until_ready(send(g, 0))
        sink.hold()
        with pytest.raises(Exception, match="arrived while the optimizer of the previous step had not yet read "
                                            "that region"):
            jax.block_until_ready(send(g, 1))
        assert sink.early_arrivals == 1
        sink.release(0, 1)
        jax.block_until_ready(send(g, 1))  # released: it lands
        assert sink.received(0) == [1, 1]


def test_the_source_serves_a_layer_only_once_the_optimizer_has_updated_it(tmp_path):
    from jaxascend.config import OffloadConfig
    from jaxascend.offload.state import OffloadedAdamState

    cfg = OffloadConfig(enabled=True, dir=str(tmp_path / "offload"), block_bytes=4096, chunk_bytes=16384,
                        staging_bytes=65536, pin_memory=False)
    spec = {"w": jax.ShapeDtypeStruct((3, 128), jnp.bfloat16)}
    with OffloadedAdamState.create(spec, cfg, stacked=True) as state:
        host = np.arange(3 * 128, dtype=np.float32).astype(jnp.bfloat16)
        source = ParamSource(state.store, state.leaves, depth=2, host=[host])
        try:
            out = np.empty(128, jnp.bfloat16)

            def fetch(layer):
                _native.fetch_params_to_host(source.handle, layer, [out.view(np.uint8)], ["bfloat16"])

            fetch(1)  # ungated: served at once
            np.testing.assert_array_equal(out.view(np.uint16), host[128:256].view(np.uint16))
            source.gate()
            assert not source.ready(1)
            done = threading.Event()
            worker = threading.Thread(target=lambda: (fetch(1), done.set()))
            worker.start()
            time.sleep(0.2)
            assert not done.is_set()  # waits for the optimizer
            host[128:256] = 7  # the optimizer writes layer 1 in place, then says so
            source.mark_ready(1)
            worker.join(timeout=10)
            assert done.is_set()
            assert (out.astype(np.float32) == 7).all()
            assert source.stats()["optimizer_wait_seconds"] >= 0.15
            source.fail("injected: disk gone")
            with pytest.raises(RuntimeError, match="layer 2 never received its new weights: injected: disk gone"):
                fetch(2)
        finally:
            source.close()


def _cli(out, corpus, kill_at=None, params="resident"):
    env = {k: v for k, v in os.environ.items() if k != "JAXASCEND_KILL_AT"}
    if kill_at:
        env["JAXASCEND_KILL_AT"] = kill_at
    args = [sys.executable, "-m", "jaxascend.train", "--config", "configs/tiny.yaml"]
    sets = TINY + ["model.dtype=bfloat16", f"offload.params={params}", "offload.overlap=true", "train.steps=6",
                   "checkpoint.every_steps=2", "checkpoint.async_save=false", "export.save_params=false",
                   f"data.paths=[{corpus}]", "data.include=['*.txt']", f"train.out_dir={out}",
                   f"offload.dir={out}/offload"]
    for o in sets:
        args += ["--set", o]
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)


# Streamed weights are killed and resumed overlapped, with micro-batches, in
# tests/offload/test_streamed_params.py (offload.overlap is on by default).
@pytest.mark.parametrize("params", ["resident"])
def test_sigkill_in_the_middle_of_the_overlap_resumes_bit_identically(tmp_path, corpus, params):
    straight = _cli(tmp_path / "straight", corpus, params=params)
    assert straight.returncode == 0, straight.stderr
    out = tmp_path / "killed"
    # In the optimizer thread while the next forward waits on it (step 3's update, beside step
    # 4's forward), in a backward that follows an overlapped update, in a checkpoint.
    for kill_at in ("optimizer_chunk:60", "backward:3", "checkpoint_chunk:4"):
        proc = _cli(out, corpus, kill_at, params=params)
        assert proc.returncode == -9, f"{kill_at}: expected SIGKILL, got {proc.returncode}: {proc.stderr[-2000:]}"
    final = _cli(out, corpus, params=params)
    assert final.returncode == 0, final.stderr
    _assert_bitwise_equal(_final_state(tmp_path / "straight"), _final_state(out))
    losses = json.loads((out / "summary.json").read_text())["losses"]
    assert losses == json.loads((tmp_path / "straight" / "summary.json").read_text())["losses"]


def test_what_runs_without_overlap_says_why(tmp_path, corpus):
    from jaxascend.offload.step_plan import overlap_refusal

    base = TINY + [f"data.paths=[{corpus}]", "data.include=['*.txt']", f"train.out_dir={tmp_path}",
                   "offload.overlap=true"]
    assert overlap_refusal(load_config("configs/tiny.yaml", base)) is None
    assert overlap_refusal(load_config("configs/tiny.yaml", base + ["offload.params=ssd"])) is None
    assert overlap_refusal(load_config("configs/tiny.yaml", base + ["train.grad_accum=4"])) is None
    cases = {"offload.fp32_grad_buffer=true": "offload.fp32_grad_buffer",
             "offload.post_backward_overflow_check=true": "offload.post_backward_overflow_check",
             "model.remat=none": "model.remat: none"}
    for override, reason in cases.items():
        assert overlap_refusal(load_config("configs/tiny.yaml", base + [override])).startswith(reason), override


def test_only_xla_compute_threads_are_deprioritized():
    import ctypes

    from jaxascend.offload.overlap import COMPUTE_NICE, deprioritize_compute_threads

    libc = ctypes.CDLL(None, use_errno=True)
    named, release, tids = threading.Event(), threading.Event(), {}

    def worker(name):
        libc.prctl(15, name.encode(), 0, 0, 0)  # PR_SET_NAME: the OS thread name, as XLA names its pool
        tids[name] = threading.get_native_id()
        if len(tids) == 2:
            named.set()
        release.wait(10)

    threads = [threading.Thread(target=worker, args=(n,)) for n in ("tf_XLAEigen", "other")]
    for t in threads:
        t.start()
    try:
        assert named.wait(10)
        before_main = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        assert deprioritize_compute_threads() >= 1
        assert os.getpriority(os.PRIO_PROCESS, tids["tf_XLAEigen"]) == COMPUTE_NICE
        assert os.getpriority(os.PRIO_PROCESS, tids["other"]) == before_main
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before_main
    finally:
        release.set()
        for t in threads:
            t.join()
