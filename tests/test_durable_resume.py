"""Durable steps through the CLI (``offload.durable``): with no checkpoint but the final one, a
chain of SIGKILLs (in a backward, inside an update, at a journal write, at a store sync) each
resumes from the step the offload files hold, and the run ends bit-identical to a straight one;
a stop signal saves nothing and the same command goes on."""

import json
import os
import signal
import subprocess
import sys

import pytest

from tests._corpus import write_word_corpus
from tests.test_resume import SMALL, _assert_bitwise_equal, _final_state

DURABLE = ["offload.enabled=true", "model.dtype=bfloat16", "offload.durable=true", "checkpoint.every_steps=0",
           "offload.durable_spares=2"]
MODES = {  # the tiny shapes: the update is 2 passes of a few chunks each
    "resident-sequential": ["model.remat=none"],
    "resident-overlap": ["model.remat=dots"],
    "ssd-overlap": ["model.remat=dots", "offload.params=ssd", "offload.gradients=ssd"],  # the others' in RAM, logged
    # a bfloat16 master that is the streamed weights: their layers rotate through rings too
    "ssd-overlap-bf16-master": ["model.remat=dots", "offload.params=ssd", "optimizer.master_dtype=bfloat16",
                                "optimizer.state_dtype=int8"],
    # the first layer's gradients in RAM (logged), the other layer's and leaves' on SSD
    "ssd-overlap-bf16-master-split": ["model.remat=dots", "offload.params=ssd", "optimizer.master_dtype=bfloat16",
                                      "optimizer.state_dtype=int8", "offload.gradients=host",
                                      "offload.host_gradient_layers=1"],
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_word_corpus(tmp_path_factory.mktemp("corpus"), docs=4, words_per_doc=300)


def _cli(out, corpus, mode, kill_at=None, signal_at=None, durable=True, extra=()):
    env = {k: v for k, v in os.environ.items() if k not in ("JAXASCEND_KILL_AT", "JAXASCEND_SIGNAL_AT")}
    if kill_at:
        env["JAXASCEND_KILL_AT"] = kill_at
    if signal_at:
        env["JAXASCEND_SIGNAL_AT"] = signal_at
    args = [sys.executable, "-m", "jaxascend.train", "--config", "configs/tiny.yaml"]
    overrides = SMALL + DURABLE + MODES[mode] + [f"data.paths=[{corpus}]", "data.include=['*.txt']",
                                                 f"train.out_dir={out}", f"offload.dir={out}/offload"]
    if not durable:
        overrides.append("offload.durable=false")
    overrides += list(extra)
    for o in overrides:
        args += ["--set", o]
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)


def _losses(out):
    return json.loads((out / "summary.json").read_text())["losses"]


@pytest.mark.parametrize("mode, kills", [
    ("resident-sequential", ["optimizer_chunk:9", "backward:2", "journal_write:4", "durable_sync:3"]),
    ("resident-overlap", ["optimizer_chunk:14", "journal_fsync:5", "backward:3", "durable_sync:4"]),
    ("ssd-overlap", ["optimizer_chunk:11", "backward:2", "journal_write:6", "durable_sync:2"]),
    ("ssd-overlap-bf16-master", ["optimizer_chunk:13", "journal_write:7", "backward:3", "durable_sync:5"]),
    ("ssd-overlap-bf16-master-split", ["optimizer_chunk:13", "backward:3", "durable_sync:5"]),
])
def test_a_chain_of_kills_resumes_from_the_files_bit_identically(tmp_path, corpus, mode, kills):
    straight = _cli(tmp_path / "straight", corpus, mode)
    assert straight.returncode == 0, straight.stderr[-3000:]
    out = tmp_path / "killed"
    resumed = []
    for kill_at in kills:
        proc = _cli(out, corpus, mode, kill_at=kill_at)
        assert proc.returncode == -9, f"{kill_at}: expected SIGKILL, got {proc.returncode}: {proc.stderr[-3000:]}"
        resumed += [line for line in proc.stderr.splitlines() + proc.stdout.splitlines() if "resuming from" in line]
    final = _cli(out, corpus, mode)
    assert final.returncode == 0, final.stderr[-3000:]
    resumed += [line for line in final.stderr.splitlines() + final.stdout.splitlines() if "resuming from" in line]
    assert resumed and all("held by the offload files" in line for line in resumed), resumed
    assert not (out / "checkpoints" / "2").exists()  # no checkpoint but the final one was ever written
    _assert_bitwise_equal(_final_state(tmp_path / "straight"), _final_state(out))
    assert _losses(out) == _losses(tmp_path / "straight")
    if mode in ("resident-overlap", "ssd-overlap-bf16-master", "ssd-overlap-bf16-master-split"):  # = plain steps
        plain = _cli(tmp_path / "plain", corpus, mode, durable=False)
        assert plain.returncode == 0, plain.stderr[-3000:]
        _assert_bitwise_equal(_final_state(tmp_path / "plain"), _final_state(out))
        assert _losses(tmp_path / "plain") == _losses(out)


def test_a_stop_signal_saves_nothing_and_the_same_command_goes_on(tmp_path, corpus):
    out = tmp_path / "run"
    stopped = _cli(out, corpus, "resident-overlap", signal_at="step_end:3:SIGTERM")
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    assert f"stopped by SIGTERM at step 3: the offload files in {out}/offload hold step 3" in stopped.stderr
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())
    final = _cli(out, corpus, "resident-overlap")
    assert final.returncode == 0, final.stderr[-3000:]
    assert "resuming from step 3 held by the offload files" in final.stderr + final.stdout
    straight = _cli(tmp_path / "straight", corpus, "resident-overlap")
    assert _losses(out) == _losses(tmp_path / "straight")


def test_a_second_sigint_abandons_the_step_and_the_files_resume_it(tmp_path, corpus):
    out = tmp_path / "run"
    abandoned = _cli(out, corpus, "resident-overlap", signal_at="backward:3:SIGINT,optimizer_chunk:+1:SIGINT")
    assert abandoned.returncode == 130, abandoned.stderr[-3000:]
    assert "held by the offload files" in abandoned.stderr, abandoned.stderr[-2000:]
    final = _cli(out, corpus, "resident-overlap")
    assert final.returncode == 0, final.stderr[-3000:]
    straight = _cli(tmp_path / "straight", corpus, "resident-overlap")
    assert _losses(out) == _losses(tmp_path / "straight")
    _assert_bitwise_equal(_final_state(tmp_path / "straight"), _final_state(out))


def test_a_resume_under_another_layout_names_what_differs_and_leaves_the_files(tmp_path, corpus):
    # The gradients in RAM (auto's choice here), killed inside an update; a resume that would lay
    # the files out otherwise is refused in one line naming the field, and the unchanged command
    # then goes on from the files, ending as a straight run does.
    straight = _cli(tmp_path / "straight", corpus, "resident-sequential")
    assert straight.returncode == 0, straight.stderr[-3000:]
    out = tmp_path / "killed"
    assert _cli(out, corpus, "resident-sequential", kill_at="optimizer_chunk:9").returncode == -9
    for extra, says in ((["optimizer.state_dtype=int8"], "(optimizer.state_dtype: the files have 'float32', this run "
                                                         "'int8'); resume with the config they were written under"),
                        (["offload.gradients=ssd"], "(offload.gradients: the files have 'host', this run 'ssd')"),
                        (["offload.gradients=host", "offload.host_gradient_layers=1"],
                         "(offload.host_gradient_layers: the files have 'all', this run 1)")):
        refused = _cli(out, corpus, "resident-sequential", extra=extra)
        errors = [line for line in refused.stderr.splitlines() if line.startswith("error: ")]
        assert refused.returncode != 0 and len(errors) == 1 and says in errors[0], refused.stderr[-3000:]
        assert "Traceback" not in refused.stderr
    final = _cli(out, corpus, "resident-sequential")
    assert final.returncode == 0, final.stderr[-3000:]
    assert "held by the offload files" in final.stderr + final.stdout
    _assert_bitwise_equal(_final_state(tmp_path / "straight"), _final_state(out))
    assert _losses(out) == _losses(tmp_path / "straight")
