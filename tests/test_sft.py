"""Instruction fine-tuning end to end: chat data through the trainer, held-out evaluation in the
records, exact resume of the example stream, and malformed records stopping the run before it
writes anything."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from jaxascend.config import load_config
from jaxascend.trainer import run

SMALL = [
    "model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=2",
    "model.num_attention_heads=4", "model.num_key_value_heads=2", "data.seq_len=128", "data.batch_size=2",
    "train.progress=false", "train.log_every=1", "eval.batch_size=4", "eval.batches=3", "eval.sample_prompts=[]",
    "offload.chunk_bytes=1MiB", "offload.staging_bytes=1MiB", "export.save_params=false",
    "optimizer.warmup_steps=1",
]


def _cfg(tmp_path, name, *extra):
    return load_config("configs/sft-tiny.yaml", SMALL + [f"train.out_dir={tmp_path / name}", *extra])


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_chat_run_evaluates_and_resumes_exactly(tmp_path):
    full = run(_cfg(tmp_path, "full", "train.steps=4", "eval.every_steps=2"))
    records = _records(tmp_path / "full")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    evals = {r["step"]: r for r in records if "eval_loss" in r}
    assert sorted(evals) == [2, 4]
    for r in evals.values():
        assert r["eval_tokens"] > 0 and np.isclose(r["eval_perplexity"], np.exp(r["eval_loss"]))
    assert full.eval_loss == evals[4]["eval_loss"]
    assert records[-1]["data_examples_seen"] > 0 and "data_examples_truncated" in records[-1]

    # Interrupted after step 2 and resumed: the same batches, losses and held-out losses.
    run(_cfg(tmp_path, "split", "train.steps=4", "eval.every_steps=2", "train.stop_at_step=2",
             "checkpoint.every_steps=2"))
    resumed = run(_cfg(tmp_path, "split", "train.steps=4", "eval.every_steps=2", "checkpoint.every_steps=2"))
    assert resumed.losses == full.losses
    assert resumed.eval_loss == full.eval_loss
    assert resumed.data == full.data


def test_without_every_steps_eval_runs_once_at_the_end(tmp_path):
    run(_cfg(tmp_path, "end", "train.steps=3", "eval.every_steps=0"))
    assert [r["step"] for r in _records(tmp_path / "end") if "eval_loss" in r] == [3]


def test_prompt_completion_trains_on_completions(tmp_path):
    data = tmp_path / "pc.jsonl"
    data.write_text("\n".join(json.dumps({"q": f"Count to {i}:", "a": " " + " ".join(map(str, range(1, i + 2)))})
                              for i in range(30)) + "\n")
    r = run(_cfg(tmp_path, "pc", "train.steps=2", "data.format=prompt_completion", f"data.paths=[{data}]",
                 "data.prompt_field=q", "data.completion_field=a", "data.chat_template=null", f"eval.paths=[{data}]"))
    assert r.eval_loss is not None and np.isfinite(r.losses).all()


@pytest.mark.parametrize("where", ["data", "eval"])
def test_a_malformed_record_stops_the_run_before_anything_is_written(tmp_path, where):
    bad = tmp_path / "bad.jsonl"
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})
    wrong = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}]})
    bad.write_text(good + "\n" + good + "\n" + wrong + "\n")
    out = tmp_path / "never"
    proc = subprocess.run(
        [sys.executable, "-m", "jaxascend.train", "--config", "configs/sft-tiny.yaml",
         *sum([["--set", s] for s in SMALL], []), "--set", f"{where}.paths=[{bad}]", "--set", f"train.out_dir={out}"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert f"{bad}" in lines[0] and "line 3" in lines[0] and "robot" in lines[0]
    assert not out.exists()


@pytest.mark.parametrize("params", ["resident", "ssd"])
def test_end_of_run_samples_match_the_generate_cli(tmp_path, capsys, params):
    """The trained model answers eval.sample_prompts at the end (samples.json, the terminal), with
    the compute weights as the run left them, and generate on the saved run says the same."""
    from jaxascend.generate import main

    extra = ["model.remat=full"] if params == "ssd" else []
    run(_cfg(tmp_path, params, "train.steps=3", f"offload.params={params}", "export.save_params=true",
             "eval.sample_prompts=['What is the capital of Japan?']", "eval.sample_max_tokens=12", *extra))
    samples = json.loads((tmp_path / params / "samples.json").read_text())
    assert [s["prompt"] for s in samples] == ["What is the capital of Japan?"]
    assert 0 < samples[0]["new_tokens"] <= 12
    printed = capsys.readouterr().out
    assert f"> What is the capital of Japan?\n{samples[0]['completion']}\n" in printed
    code = main(["--checkpoint", str(tmp_path / params), "--chat", "What is the capital of Japan?",
                 "--max-new-tokens", "12"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out == samples[0]["completion"] + "\n"
