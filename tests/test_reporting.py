"""``train.report_to``: every metrics.jsonl field, the held-out loss and the samples reach
TensorBoard (read back with tensorboard's own reader) and W&B (offline); only process 0 writes; a
backend whose package is missing is refused in one line naming the pip command."""

import json
import time

import pytest

from jaxascend.config import ConfigError, load_config
from jaxascend.reporting import Reporter, flatten, samples_markdown
from jaxascend.trainer import run
from tests._corpus import write_word_corpus

event_accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator",
    reason="tensorboard (the reader of the event files) is not installed: pip install -e '.[test]'")

SMALL = [
    "model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=2",
    "model.num_attention_heads=4", "model.num_key_value_heads=2", "data.seq_len=32", "data.batch_size=4",
    "train.progress=false", "optimizer.warmup_steps=1", "export.save_params=false",
]
RECORDS = [{"step": s, "loss": 3.0 / s, "eval_loss": 2.5, "engine": "offload", "skipped": False,
            "data_state": {"document": s, "fingerprint": "ab12"}, "stop": None} for s in (1, 2, 3)]


def _events(folder):
    acc = event_accumulator.EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def _text(acc, tag):
    return [event.tensor_proto.string_val[0].decode() for event in acc.Tensors(tag)]


def test_flatten_splits_numbers_and_text():
    scalars, texts = flatten(RECORDS[1])
    assert scalars == {"step": 2.0, "loss": 1.5, "eval_loss": 2.5, "skipped": 0.0, "data_state/document": 2.0}
    assert texts == {"engine": "offload", "data_state/fingerprint": "ab12"}
    assert samples_markdown([{"prompt": "a|b", "completion": "c\nd"}]).splitlines()[-1] == "| a\\|b | c<br>d |"


def test_tensorboard_events_hold_every_field_and_the_samples(tmp_path):
    with Reporter(["tensorboard"], tmp_path) as reporter:
        for record in RECORDS:
            reporter.write(record)
        reporter.samples([{"prompt": "Capital of Japan?", "completion": "Tokyo."}], step=3)
    acc = _events(tmp_path / "tensorboard")
    assert set(acc.Tags()["scalars"]) == {"loss", "eval_loss", "skipped", "data_state/document"}
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 3.0), (2, 1.5), (3, 1.0)]
    assert _text(acc, "engine/text_summary") == ["offload"]  # text is written when it changes
    assert "| Capital of Japan? | Tokyo. |" in _text(acc, "samples/text_summary")[0]


def test_a_resumed_run_purges_the_steps_past_its_checkpoint(tmp_path):
    with Reporter(["tensorboard"], tmp_path) as reporter:
        for record in RECORDS:
            reporter.write(record)
    with Reporter(["tensorboard"], tmp_path, resumed_from=1) as reporter:
        reporter.write({**RECORDS[1], "loss": 9.0})
    assert [(e.step, e.value) for e in _events(tmp_path / "tensorboard").Scalars("loss")] == [(1, 3.0), (2, 9.0)]


def test_only_process_0_writes(tmp_path):
    with Reporter(["tensorboard"], tmp_path, enabled=False) as reporter:
        reporter.write(RECORDS[0])
        reporter.samples([{"prompt": "a", "completion": "b"}], step=1)
    assert not (tmp_path / "tensorboard").exists()


def test_a_run_reports_every_metrics_field_the_eval_loss_and_the_samples(tmp_path):
    corpus = write_word_corpus(tmp_path / "corpus", docs=4, words_per_doc=300)
    out = tmp_path / "run"
    run(load_config("configs/tiny.yaml", SMALL + [
        f"data.paths=[{corpus}]", "data.include=['*.txt']", f"eval.paths=[{corpus}]", "eval.batches=1",
        "eval.sample_prompts=['alpha beta']", "eval.sample_max_tokens=4", "train.steps=2", "train.log_every=1",
        f"train.out_dir={out}", "train.report_to=[tensorboard]"]))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    acc = _events(out / "tensorboard")
    numeric = {k for r in records for k, v in flatten(r)[0].items() if k != "step"}
    assert "eval_loss" in numeric and "tokens_per_s" in numeric and "ssd_read_bytes" in numeric
    assert set(acc.Tags()["scalars"]) == numeric
    assert [e.value for e in acc.Scalars("loss")] == pytest.approx([r["loss"] for r in records], rel=1e-6)
    assert [e.value for e in acc.Scalars("eval_loss")] == pytest.approx([records[-1]["eval_loss"]], rel=1e-6)
    texts = {k for r in records for k in flatten(r)[1]}
    assert {f"{k}/text_summary" for k in texts} <= set(acc.Tags()["tensors"])
    samples = json.loads((out / "samples.json").read_text())
    assert f"| {samples[0]['prompt']} |" in _text(acc, "samples/text_summary")[0]


def test_a_missing_backend_is_refused_naming_the_pip_command(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    (tmp_path / "d.txt").write_text("text")
    with pytest.raises(ConfigError, match=r"^train\.report_to: 'wandb' needs the wandb package, which is not "
                                          r"installed: pip install wandb"):
        load_config("configs/tiny.yaml", [f"data.paths=[{tmp_path / 'd.txt'}]", "train.report_to=[tensorboard, wandb]"])
    with pytest.raises(ConfigError, match=r"^train\.report_to\[0\]: expected one of 'tensorboard', 'wandb', got "
                                          r"'tensorbord'; did you mean 'tensorboard'\?$"):
        load_config("configs/tiny.yaml", ["train.report_to=[tensorbord]"], inputs=False)
    assert load_config("configs/tiny.yaml", ["train.report_to=tensorboard"], inputs=False).train.report_to == [
        "tensorboard"]


def test_wandb_offline_run_holds_the_figures_and_the_samples(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is not installed (pip install wandb): W&B reporting is optional")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "jaxascend-test")
    with Reporter(["wandb"], tmp_path / "run", run_config={"train": {"steps": 3}}) as reporter:
        for record in RECORDS:
            reporter.write(record)
        reporter.samples([{"prompt": "Capital of Japan?", "completion": "Tokyo."}], step=3)
    (run_dir,) = (tmp_path / "run" / "wandb").glob("offline-run-*")
    (log,) = run_dir.glob("run-*.wandb")
    # The run's records (protobuf): the keys are there as written. W&B's service process writes
    # the file on its own, and under load it may still be flushing after finish() returned.
    deadline = time.monotonic() + 60
    while b"data_state/document" not in (data := log.read_bytes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    for key in (b"loss", b"eval_loss", b"data_state/document"):
        assert key in data, key
    tables = list(run_dir.glob("files/media/table/samples_*.table.json"))
    assert tables and json.loads(tables[0].read_text())["data"] == [["Capital of Japan?", "Tokyo."]]
