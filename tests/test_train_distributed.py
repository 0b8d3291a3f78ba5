"""The trainer as a data-parallel job of processes on 127.0.0.1 (``python -m jaxascend.launch``):
two processes, and one process on two devices, train like one (losses and weights within
rounding of the reduction order), each process of the job holding half the SSD state; process 0 alone writes the outputs; a job whose process is killed
stops and resumes to the uninterrupted run's weights bit for bit; a checkpoint of 2 processes
resumes with 1 (and one of 1 with 2) by re-partitioning the state."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxascend.checkpoint import CheckpointWeights
from tests._jobs import TIMEOUT, free_port

SETTINGS = [
    "model.hidden_size=64", "model.intermediate_size=128", "model.num_hidden_layers=2", "model.num_attention_heads=4",
    "model.num_key_value_heads=2", "model.dtype=float32", "data.seq_len=32", "data.batch_size=4",
    "data.max_documents=40", "optimizer.warmup_steps=0", "optimizer.eps=1e-4", "train.steps=6", "train.log_every=1",
    "checkpoint.every_steps=3", "train.progress=false", "eval.batches=2", "eval.batch_size=2",
    "train.distributed={heartbeat_timeout_seconds: 10}",
]
STEPS = 6
EVAL_TEXT = "def add(a, b):\n    return a + b\n\n\nclass Point:\n    x: int = 0\n    y: int = 0\n" * 8


def train(out: Path, processes: int, *extra: str, env=None, code=None) -> subprocess.CompletedProcess:
    """The trainer on the test config, as one process or a launched job of ``processes``
    (``code``: a ``python -c`` program that runs ``jaxascend.train.main`` on its arguments)."""
    sets = [a for s in SETTINGS + [f"train.out_dir={out}", f"eval.paths=[{out.parent / 'eval.py'}]", *extra]
            for a in ("--set", s)]
    entry = ["-c", code] if code else ["-m", "jaxascend.train"]
    cmd = [sys.executable, *entry, "--config", "configs/tiny.yaml", *sets]
    if processes > 1:
        cmd = [sys.executable, "-m", "jaxascend.launch", "--nproc", str(processes), "--port", str(free_port()),
               "--", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env={**os.environ, **(env or {})})


def trained(out: Path, processes: int, *extra: str, code=None) -> Path:
    done = train(out, processes, *extra, code=code)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def eval_losses(out: Path) -> list[float]:
    return [r["eval_loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if "eval_loss" in r]


def weights(out: Path) -> dict[str, np.ndarray]:
    return load_file(out / "params.safetensors")


def assert_trains_like(out: Path, ref: Path) -> None:
    """The same losses (rtol 1e-5) and exported weights (atol 1e-5) as the reference run."""
    np.testing.assert_allclose(losses(out), losses(ref), rtol=1e-5)
    w, want = weights(out), weights(ref)
    for name in want:
        np.testing.assert_allclose(w[name], want[name], rtol=0, atol=1e-5, err_msg=name)


def state_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file() and p.name.startswith("shard"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same run as one process and as a job of two, uninterrupted."""
    root = tmp_path_factory.mktemp("dp")
    (root / "eval.py").write_text(EVAL_TEXT)
    return root, trained(root / "one", 1), trained(root / "two", 2)


def test_two_processes_train_like_one_with_half_the_state_each(runs):
    root, one, two = runs
    # The job's loss is the sum of the two processes' halves: another summation order than one
    # process's, so float32 losses agree to rounding, not bit for bit.
    assert len(losses(two)) == STEPS  # process 0 alone wrote the metrics
    np.testing.assert_allclose(losses(two), losses(one), rtol=1e-5)
    np.testing.assert_allclose(eval_losses(two), eval_losses(one), rtol=1e-5)
    assert len(eval_losses(two)) == 1
    # The exported fp32 master weights, gathered a tensor at a time from both processes' slices
    # (eps 1e-4: Adam's first steps are ~lr*sign(g), so a rounding difference in a gradient near 0
    # would otherwise show as a whole step).
    w1, w2 = weights(one), weights(two)
    assert sorted(w1) == sorted(w2)
    for name in w1:
        np.testing.assert_allclose(w2[name], w1[name], rtol=0, atol=1e-5, err_msg=name)
    # Each process's own offload directory holds half the state: every region (a state and a
    # gradient region per layer of each of the 9 stacked leaves, and per top-level leaf: 40)
    # rounds up to whole blocks on its own, so half within one block per region.
    whole = state_bytes(one / "offload")
    for i in (0, 1):
        part = state_bytes(two / "offload" / f"process{i}")
        assert abs(part - whole / 2) <= 40 * 4096, (i, part, whole)
    # One checkpoint step, written by both: a slice of every tensor per process...
    offloaded = two / "checkpoints" / str(STEPS) / "offloaded"
    assert json.loads((offloaded / "jaxascend_processes.json").read_text())["processes"] == 2
    assert (offloaded / "process0").is_dir() and (offloaded / "process1").is_dir()
    # ... from which the whole weights read back (what `python -m jaxascend.export` reads).
    with CheckpointWeights(two / "checkpoints" / str(STEPS)) as a, \
            CheckpointWeights(one / "checkpoints" / str(STEPS)) as b:
        for path in (("embed_tokens", "embedding"), ("layers", "mlp", "up_proj", "kernel"), ("norm", "scale")):
            np.testing.assert_allclose(a.read(path), b.read(path), rtol=0, atol=1e-5, err_msg=str(path))
            np.testing.assert_array_equal(a.read(path, 1) if path[0] == "layers" else a.read(path)[1],
                                          a.read(path)[1])


def test_one_process_on_two_devices_trains_like_one_device(runs):
    root, one, _ = runs
    out = root / "devices"
    done = train(out, 1, env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "offload (data parallel over 2 devices)" in done.stdout
    # The devices share the rows; the first sends each summed gradient to the one SSD state.
    np.testing.assert_allclose(losses(out), losses(one), rtol=1e-5)
    np.testing.assert_allclose(eval_losses(out), eval_losses(one), rtol=1e-5)
    w, ref = weights(out), weights(one)
    for name in ref:
        np.testing.assert_allclose(w[name], ref[name], rtol=0, atol=1e-5, err_msg=name)
    assert abs(state_bytes(out / "offload") - state_bytes(one / "offload")) <= 40 * 4096


def test_a_job_streams_its_slice_of_each_layer_from_ssd(runs):
    root, _, _ = runs
    streamed = ("offload.params=ssd", "model.remat=full", "eval.sample_prompts=['def ']", "eval.sample_max_tokens=8")
    one = trained(root / "streamed-one", 1, *streamed)
    two = trained(root / "streamed-two", 2, *streamed)
    # Each process keeps its slice of every layer's compute weights on its SSD; the step
    # all-gathers each layer as the scan fetches it, and (offload.overlap, the default) each
    # step's optimizer runs beside the next step's forward/backward.
    np.testing.assert_allclose(losses(two), losses(one), rtol=1e-5)
    last = json.loads((two / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["overlap"] is True and "overlap_refused" not in last
    w1, w2 = weights(one), weights(two)
    for name in w1:
        np.testing.assert_allclose(w2[name], w1[name], rtol=0, atol=1e-5, err_msg=name)
    # The samples of process 0, from the streamed layers gathered from both (greedy).
    samples = [json.loads((out / "samples.json").read_text()) for out in (one, two)]
    assert samples[0] == samples[1] and samples[0][0]["prompt"] == "def "
    # A checkpoint of 2 processes resumes with 1: the optimizer state and the compute weights on
    # SSD re-partitioned as they stream in (1 -> 2 with resident weights: a test below).
    out = root / "streamed-2to1"
    trained(out, 2, *streamed, "train.stop_at_step=3")
    trained(out, 1, *streamed)
    assert_trains_like(out, one)


@pytest.mark.parametrize("placement", ["resident", "ssd"])
def test_a_job_runs_vertical_micro_batches(runs, placement):
    root, one, _ = runs
    # 2 micro-batches of 2 rows: the same 4 rows per step as the reference's one batch of 4, each
    # micro-batch's rows split over the processes, each layer's summed gradient reduce-scattered
    # once; with the weights on SSD each process streams its slice of each layer once per step.
    extra = ("offload.params=ssd", "model.remat=full") if placement == "ssd" else ()
    out = trained(root / f"accumulated-{placement}", 2, "train.grad_accum=2", "data.batch_size=2", *extra)
    assert_trains_like(out, one)


def test_a_killed_process_stops_the_job_which_resumes_to_the_same_weights(runs):
    root, _, two = runs
    out = root / "killed"
    # Process 1 is SIGKILLed in step 5's backward pass (after the checkpoint of step 3).
    done = train(out, 2, env={"JAXASCEND_KILL_AT": "backward:5", "JAXASCEND_KILL_PROCESS": "1"})
    assert done.returncode != 0
    assert "process 1 was killed by SIGKILL" in done.stderr
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == ["3"]
    trained(out, 2)  # train.resume: auto
    assert losses(out) == losses(two)
    w, ref = weights(out), weights(two)
    for name in ref:
        np.testing.assert_array_equal(w[name], ref[name], err_msg=name)


def test_without_the_launcher_the_survivor_stops_with_one_line(runs, tmp_path):
    root, _, _ = runs
    port, out, procs = free_port(), tmp_path / "job", []
    sets = [a for s in SETTINGS + [f"train.out_dir={out}", f"eval.paths=[{root / 'eval.py'}]"] for a in ("--set", s)]
    for i in range(2):
        env = {**os.environ, "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2",
               "JAX_PROCESS_ID": str(i), "JAXASCEND_KILL_AT": "backward:2", "JAXASCEND_KILL_PROCESS": "1"}
        procs.append(subprocess.Popen([sys.executable, "-m", "jaxascend.train", "--config", "configs/tiny.yaml", *sets],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = [(p.wait(TIMEOUT), *p.communicate()) for p in procs]
    assert results[1][0] == -9
    code, _, err = results[0]
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith("error: train.distributed: process 0 of 2 lost the job"), err[-2000:]


def test_a_checkpoint_of_one_process_resumes_with_two(runs):
    root, _, two = runs
    out = root / "from1to2"
    trained(out, 1, "train.stop_at_step=3")
    trained(out, 2)
    # The state re-partitioned as it streamed in: the run continues as if uninterrupted (the
    # reduction order of the processes after the resume is that of 2 processes). 2 -> 1: the
    # streamed test above, the compute weights on SSD re-partitioned too.
    assert_trains_like(out, two)


@pytest.mark.parametrize("where", ["launcher", "one-process"])
def test_a_stop_signal_stops_every_process_of_the_job_at_one_checkpoint(runs, where):
    root, _, two = runs
    out = root / f"stopped-{where}"
    # SIGTERM to the launcher (process 0 sends it to its parent after step 2), which forwards it;
    # or to process 1 alone: the processes agree on the step at every boundary either way.
    env = ({"JAXASCEND_SIGNAL_AT": "step_end:2:SIGTERM@parent", "JAXASCEND_SIGNAL_PROCESS": "0"}
           if where == "launcher" else {"JAXASCEND_SIGNAL_AT": "step_end:2:SIGTERM", "JAXASCEND_SIGNAL_PROCESS": "1"})
    done = train(out, 2, env=env)
    assert done.returncode == 143, done.stderr[-3000:]
    assert "Traceback" not in done.stderr + done.stdout
    lines = done.stderr.strip().splitlines()
    stop = [line for line in lines if line.startswith("stopped by SIGTERM at step ")]
    assert len(stop) == 1, done.stderr[-3000:]  # process 0 speaks for the job
    step = int(stop[0].split(" at step ")[1].split(":")[0])
    assert lines[-1] == ("job stopped by SIGTERM: its 2 process(es) stopped on it; the same command resumes from the "
                         "step process 0 named (its checkpoint, or with offload.durable the offload files)")
    saved = sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())
    assert saved[-1] == step < STEPS
    assert {p.name for p in (out / "checkpoints" / str(step) / "offloaded").iterdir()} >= {"process0", "process1"}
    trained(out, 2)  # the same command resumes
    assert losses(out) == losses(two)
    w, ref = weights(out), weights(two)
    for name in ref:
        np.testing.assert_array_equal(w[name], ref[name], err_msg=name)


# The trainer with its token table in blocks of rows (an 8192-row table at width 64: large
# tables start at 2^24 elements, lowered here to 2^16; 8 blocks of 1024 rows).
TABLE = ["model.vocab_size=8192", "model.tie_word_embeddings=true"]
TABLE_TRAIN = textwrap.dedent("""
    import sys
    from jaxascend.models import vocab
    vocab.LARGE_TABLE_ELEMENTS, vocab.MAX_BLOCK_ROWS = 1 << 16, 1024
    from jaxascend.train import main
    sys.exit(main(sys.argv[1:]))
""")


def test_a_killed_job_with_a_table_in_blocks_resumes_with_one_process(runs):
    root, _, _ = runs
    one = trained(root / "table-one", 1, *TABLE, code=TABLE_TRAIN)
    out = root / "table-2to1"
    # Process 1 is SIGKILLed in step 5's backward pass; the checkpoint of step 3 holds each
    # process's slice of every block of the table, which one process re-joins as it resumes.
    done = train(out, 2, *TABLE, code=TABLE_TRAIN, env={"JAXASCEND_KILL_AT": "backward:5", "JAXASCEND_KILL_PROCESS": "1"})
    assert done.returncode != 0 and "process 1 was killed by SIGKILL" in done.stderr
    pieces = json.loads((out / "checkpoints" / "3" / "offloaded" / "process0" / "jaxascend_arrays.json").read_text())
    assert any(a.get("piece", {}).get("blocks") == 8 for a in pieces["arrays"])
    trained(out, 1, *TABLE, code=TABLE_TRAIN)
    assert_trains_like(out, one)


def test_two_processes_of_two_devices_train_like_one(runs):
    root, one, _ = runs
    out = root / "2x2"
    # A mesh of 2 processes x 2 devices: the rows split over the 4 devices, the state over the 2
    # processes; each layer's gradient reduce-scattered over the processes, summed over each
    # process's devices and sent by its first; the overlapped step's resident stack is each
    # process's slice, fetched by its first device and gathered in the step.
    # (eval.batch_size 4: the held-out rows split over the 4 devices too)
    done = train(out, 2, "model.remat=full", "eval.batch_size=4", "eval.sample_prompts=['def ']",
                 "eval.sample_max_tokens=8", env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "offload (data parallel over 2 processes x 2 devices; figures of process 0)" in done.stdout
    # process 0 samples from the layers every process's first device serves, gathered from both
    assert json.loads((out / "samples.json").read_text())[0]["prompt"] == "def "
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["overlap"] is True and "overlap_refused" not in last
    assert_trains_like(out, one)
