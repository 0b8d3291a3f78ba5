"""The end of a run, through the CLI: a kill after the final checkpoint leaves outputs that the same
command writes from that checkpoint, byte for byte those of an uninterrupted run; a run stopped at
train.stop_at_step says how to go on and does what it says; a run shorter than its warmup runs,
with one note on how far the learning rate gets."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from tests.test_signals import BASE, checkpoints, train

SAMPLED = ["export.enabled=true", "eval.sample_prompts=['def ']", "eval.sample_max_tokens=4", "train.steps=4"]


def _digests(out: Path) -> dict[str, str]:
    """sha256 of the weights a finished run wrote: params.safetensors and the export's shards."""
    files = [out / "params.safetensors", *sorted((out / "hf").glob("*.safetensors")), out / "samples.json"]
    return {f.relative_to(out).as_posix(): hashlib.sha256(f.read_bytes()).hexdigest() for f in files}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from tests._corpus import write_word_corpus

    return write_word_corpus(tmp_path_factory.mktemp("corpus"), docs=4, words_per_doc=400)


@pytest.fixture(scope="module")
def straight(tmp_path_factory, corpus):
    out = tmp_path_factory.mktemp("straight") / "run"
    done = train(out, corpus, *SAMPLED)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.mark.parametrize("kill_at, missing", [
    ("final_outputs:1", "params.safetensors, {hf}, samples.json and summary.json"),  # after the checkpoint
    ("export_tensor:2", "{hf}, samples.json and summary.json"),  # in the middle of the export
])
def test_a_kill_after_the_final_checkpoint_leaves_outputs_the_same_command_writes(tmp_path, corpus, straight,
                                                                                  kill_at, missing):
    out = tmp_path / "run"
    killed = train(out, corpus, *SAMPLED, kill_at=kill_at)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert checkpoints(out)[-1] == 4 and not (out / "summary.json").exists()
    assert list((out / "offload").glob("shard-*.bin"))  # left by the kill
    again = train(out, corpus, *SAMPLED)
    assert again.returncode == 0, again.stderr[-3000:]
    notes = [line for line in again.stderr.splitlines() if line.startswith("note: the run reached")]
    assert notes == [f"note: the run reached step 4, but {missing.format(hf=out / 'hf')} were not written (it was "
                     f"stopped after its last checkpoint): writing them from checkpoint 4 in {out / 'checkpoints'}"]
    assert _digests(out) == _digests(straight)  # the weights, the export and the samples, byte for byte
    summary = json.loads((out / "summary.json").read_text())
    assert summary["losses"] == json.loads((straight / "summary.json").read_text())["losses"]
    assert summary["written_from_checkpoint"] and summary["num_params"] > 0
    assert not (out / "offload").exists() and not list(out.glob(".hf.partial-*"))
    finished = train(out, corpus, *SAMPLED)  # now complete: nothing to do, nothing touched
    assert finished.returncode == 0 and "nothing to do" in finished.stderr and "note:" not in finished.stderr


def test_a_run_stopped_at_stop_at_step_says_how_to_go_on_and_does(tmp_path, corpus, straight):
    out = tmp_path / "run"
    stopped = train(out, corpus, *SAMPLED, "train.stop_at_step=2")
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert stopped.stderr.strip().splitlines()[-1] == (
        f"stopped at step 2 (train.stop_at_step), before train.steps 4: checkpoint 2 is in {out / 'checkpoints'}; "
        "to go on, run the same command without train.stop_at_step (or with a later step)")
    assert "checkpoint of step 2 holds the state" in stopped.stdout  # the summary's offload files line
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stop_at_step"] == 2 and summary["steps"] == 2
    assert not (out / "params.safetensors").exists() and not (out / "hf").exists()  # not a finished run
    same = train(out, corpus, *SAMPLED, "train.stop_at_step=2")
    assert same.returncode == 0 and same.stderr.strip() == (
        f"{out / 'checkpoints'}: the run is already at step 2, at or past train.stop_at_step 2; nothing to do (to go "
        "on to train.steps 4, run the same command without train.stop_at_step or with a later step)")
    on = train(out, corpus, *SAMPLED)
    assert on.returncode == 0, on.stderr[-3000:]
    assert _digests(out) == _digests(straight)


def test_a_run_shorter_than_its_warmup_runs_with_a_note(tmp_path, corpus):
    done = train(tmp_path / "run", corpus, "train.steps=3", "optimizer.warmup_steps=20", "checkpoint.every_steps=3")
    assert done.returncode == 0, done.stderr[-3000:]
    assert ("note: optimizer.warmup_steps: the warmup (20 steps) is longer than the schedule (3 steps): the "
            "learning rate ramps to 10% of its peak 0.002 and never reaches it") in done.stderr.splitlines()
    rates = [json.loads(line)["learning_rate"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rates == pytest.approx([0.0, 2e-3 / 20, 2 * 2e-3 / 20], rel=1e-6)  # the ramp of a 20-step warmup


def test_a_run_records_what_made_it_and_a_resume_says_what_changed(tmp_path, corpus, monkeypatch, capsys):
    import dataclasses

    import jax

    from jaxascend import trainer
    from jaxascend.config import load_config
    from jaxascend.provenance import collect

    def cfg(*extra):
        return load_config("configs/tiny.yaml", BASE + [f"data.paths=[{corpus}]", f"train.out_dir={tmp_path / 'run'}",
                                                        "train.steps=4", *extra])

    first = trainer.run(cfg("train.stop_at_step=2"))
    stack = first.stack
    assert stack["jax"] == jax.__version__ and stack["python"] and stack["cpu"] and stack["cpu_isa"]
    assert stack["adamw_kernel"] and stack["device_kind"] and stack["device_count"] == jax.device_count()
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["stack"] == stack
    first_record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert first_record["stack"] == stack
    assert "made by" in capsys.readouterr().out  # the summary table's line
    # The same run resumed on another jax: one note names the change.
    other = dataclasses.replace(collect(), jax="0.0.1")
    monkeypatch.setattr(trainer, "collect_stack", lambda *_: other)
    trainer.run(cfg())
    notes = [line for line in capsys.readouterr().err.splitlines() if "changed since checkpoint" in line]
    assert notes == [f"note: the software or machine changed since checkpoint step 2: jax {jax.__version__} -> 0.0.1; "
                     "results may differ in the last bits"]


def test_a_run_without_a_final_checkpoint_writes_its_outputs_in_the_gradients_space(tmp_path, corpus, straight):
    """checkpoint.final: false: no checkpoint at the end (every_steps 3 saves step 3 only), the same
    outputs byte for byte; the offloaded gradients' blocks are freed before the export is written
    (a kill in the export finds them punched out of the shard files)."""
    out = tmp_path / "run"
    no_final = [*SAMPLED, "checkpoint.final=false", "checkpoint.every_steps=3", "offload.gradients=ssd"]
    killed = train(out, corpus, *no_final, kill_at="export_tensor:2")
    assert killed.returncode == -9, killed.stderr[-3000:]
    shards = list((out / "offload").glob("shard-*.bin"))
    allocated = sum(p.stat().st_blocks * 512 for p in shards)
    plan = json.loads((out / "plan.json").read_text())
    assert plan["disk"][0]["shared_at_end"] > 0
    assert allocated <= sum(p.stat().st_size for p in shards) - plan["disk"][0]["shared_at_end"]
    done = train(tmp_path / "again", corpus, *no_final)
    assert done.returncode == 0, done.stderr[-3000:]
    assert checkpoints(tmp_path / "again") == [3]
    assert _digests(tmp_path / "again") == _digests(straight)
    summary = json.loads((tmp_path / "again" / "summary.json").read_text())
    assert "checkpoint.final: false" in summary["offload_files"]
