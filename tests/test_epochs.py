"""``train.epochs``: the steps are the batches until every document or example of the epochs was in
one (counted here independently, by drawing batches from a fresh stream), over ``train.grad_accum``
rounded up; a run of one epoch trains on each document once; both lengths given is one error line;
the plan, the trainer's note, summary.json and metrics.jsonl say what the epochs came to; a
resumed run counts the same steps."""

from __future__ import annotations

import json
import math

import pytest

from jaxascend import plan
from jaxascend.config import ConfigError, DataConfig, load_config
from jaxascend.data import ByteTokenizer, EpochCount, make_batch_stream, with_epoch_steps
from jaxascend.trainer import run
from tests._corpus import write_word_corpus
from tests.data.conftest import write_jsonl

BYTE = ByteTokenizer()
DOCUMENTS, RECORDS = 3, 23
SMALL = [
    "model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=2", "model.num_attention_heads=4",
    "model.num_key_value_heads=2", "data.seq_len=32", "data.batch_size=4", "data.format=text",
    "data.include=['*.txt']", "train.progress=false", "train.log_every=1", "optimizer.warmup_steps=1",
    "export.save_params=false", "checkpoint.async_save=false", "offload.enabled=false", "model.dtype=float32",
    "train.steps=null",  # configs/tiny.yaml gives train.steps
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_word_corpus(tmp_path_factory.mktemp("corpus"), docs=DOCUMENTS, words_per_doc=60)  # ~8 batches an epoch


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """A prompt/completion file of RECORDS records of assorted lengths (some longer than a row of 33)."""
    rows = [{"prompt": "q" * (i * 7 % 19), "completion": "a" * (1 + i * 11 % 37)} for i in range(RECORDS)]
    return write_jsonl(tmp_path_factory.mktemp("records") / "pc.jsonl", rows)


def _cfg(out, corpus, *extra):
    return load_config("configs/tiny.yaml", SMALL + [f"data.paths=[{corpus}]", f"train.out_dir={out}", *extra])


def _seen(stream) -> int:
    stats = stream.stats()
    return stats["documents_seen"] if "documents_seen" in stats else stats["examples_seen"]


def _drawn_batches(data: DataConfig, items: int) -> int:
    """Batches a fresh stream yields until ``items`` documents or examples were consumed (at least one)."""
    stream, batches = make_batch_stream(data, BYTE), 0
    while batches == 0 or _seen(stream) < items:
        next(stream)
        batches += 1
    return batches


def _count(cfg) -> EpochCount:
    return with_epoch_steps(cfg, make_batch_stream(cfg.data, BYTE))[1]


# ----------------------------------------------------------------------------- the count

@pytest.mark.parametrize("epochs", [0.5, 1, 2, 2.5])
@pytest.mark.parametrize("grad_accum", [1, 3])
@pytest.mark.parametrize("data", ["text", "packed", "padded", "drop"])
def test_the_steps_are_the_batches_the_stream_draws_for_the_epochs(tmp_path, corpus, records, data, epochs,
                                                                   grad_accum):
    paths = {"text": [f"data.paths=[{corpus}]"]}.get(data, [f"data.paths=[{records}]", "data.format=prompt_completion",
                                                            "data.include=['*.jsonl']"])
    mode = {"padded": ["data.packing=false"], "drop": ["data.overlong=drop"]}.get(data, [])
    cfg = load_config("configs/tiny.yaml", SMALL + paths + mode + [f"train.epochs={epochs}",
                                                                   f"train.grad_accum={grad_accum}"])
    resolved, count, lines = with_epoch_steps(cfg, make_batch_stream(cfg.data, BYTE))
    per_epoch = DOCUMENTS if data == "text" else RECORDS
    covered = math.ceil(epochs * per_epoch)
    batches = _drawn_batches(cfg.data, covered)
    assert (count.per_epoch, count.covered, count.batches) == (per_epoch, covered, batches)
    assert count.steps == resolved.train.steps == math.ceil(batches / grad_accum)
    assert resolved.train.epochs is None and lines == (count.line(),)
    # The last step is needed: one batch fewer leaves the last document or example of the epochs out.
    stream = make_batch_stream(cfg.data, BYTE)
    for _ in range(batches - 1):
        next(stream)
    assert _seen(stream) < covered


def test_two_epochs_of_text_are_twice_one_but_for_the_batch_they_share(corpus):
    one, two = (_count(_cfg("unused", corpus, f"train.epochs={e}")) for e in (1, 2))
    assert two.covered == 2 * one.covered
    # The stream runs on without a gap: the batch that ends epoch 1 may already hold epoch 2's first tokens.
    assert two.batches in (2 * one.batches - 1, 2 * one.batches)


def test_the_line_says_what_the_epochs_came_to():
    count = EpochCount(epochs=1.0, unit="examples", per_epoch=592, covered=592, batches=37, grad_accum=1, steps=37)
    assert count.line() == "steps: train.epochs 1 = 592 examples in 37 batches = 37 steps"
    count = EpochCount(epochs=2.0, unit="documents", per_epoch=30, covered=60, batches=21, grad_accum=4, steps=6)
    assert count.line() == ("steps: train.epochs 2 = 2 x 30 documents in 21 batches = 6 steps of train.grad_accum 4 "
                            "batches (the last step's last 3 batches come after them)")
    count = EpochCount(epochs=0.5, unit="examples", per_epoch=23, covered=12, batches=5, grad_accum=5, steps=1)
    assert count.line() == "steps: train.epochs 0.5 = 12 of 23 examples in 5 batches = 1 step of train.grad_accum 5 batches"
    count = EpochCount(epochs=1.5, unit="examples", per_epoch=4, covered=6, batches=3, grad_accum=2, steps=2)
    assert count.line() == ("steps: train.epochs 1.5 = 6 examples (4 an epoch) in 3 batches = 2 steps of "
                            "train.grad_accum 2 batches (the last step's last 1 batch comes after them)")


# ----------------------------------------------------------------------------- the config

def test_neither_length_is_the_default_steps(corpus):
    cfg = load_config(None, [f"data.paths=[{corpus}]"])
    assert (cfg.train.steps, cfg.train.epochs) == (100, None)
    assert with_epoch_steps(cfg, None) == (cfg, None, ())


@pytest.mark.parametrize("yaml_train, overrides, message", [
    ("steps: 5\n  epochs: 1", [], r"^train\.epochs: give train\.steps or train\.epochs, not both \(steps 5, epochs 1\)$"),
    ("log_every: 1", ["train.steps=5", "train.epochs=1"], r"^train\.epochs: give train\.steps or train\.epochs, not both"),
    ("epochs: 0", [], r"^train\.epochs: must be > 0, got 0\.0$"),
    ("epochs: many", [], r"^train\.epochs: expected a number or null, got 'many'$"),
])
def test_a_bad_length_is_one_error_line(tmp_path, corpus, yaml_train, overrides, message):
    path = tmp_path / "run.yaml"
    path.write_text(f"data:\n  paths: [{corpus}]\ntrain:\n  {yaml_train}\n")
    with pytest.raises(ConfigError, match=message):
        load_config(path, overrides)


def test_the_set_that_clears_the_other_length_runs_as_asked(tmp_path, corpus):
    path = tmp_path / "run.yaml"
    path.write_text(f"data:\n  paths: [{corpus}]\ntrain:\n  epochs: 3\n")
    cfg = load_config(path, ["train.steps=10", "train.epochs=null"])
    assert (cfg.train.steps, cfg.train.epochs) == (10, None)


@pytest.mark.parametrize("yaml_train, overrides, length, note", [
    ("epochs: 3", ["train.steps=10"], (10, None),
     "note: train.steps: --set train.steps=10 replaces the config file's train.epochs: 3 (the two are exclusive)"),
    ("steps: 300", ["train.epochs=0.5"], (None, 0.5),
     "note: train.epochs: --set train.epochs=0.5 replaces the config file's train.steps: 300 (the two are exclusive)"),
])
def test_a_set_of_one_length_over_the_files_other_wins_in_a_note(tmp_path, corpus, capsys, yaml_train, overrides,
                                                                    length, note):
    path = tmp_path / "run.yaml"
    path.write_text(f"data:\n  paths: [{corpus}]\ntrain:\n  {yaml_train}\n")
    cfg = load_config(path, overrides)
    assert (cfg.train.epochs, None) == (length[1], None) and (length[0] is None or cfg.train.steps == length[0])
    assert capsys.readouterr().err.splitlines() == [note]


def test_a_stop_at_step_past_the_epochs_is_refused_once_counted(corpus):
    cfg = _cfg("unused", corpus, "train.epochs=1", "train.stop_at_step=1000")  # not known before the count
    steps = _count(_cfg("unused", corpus, "train.epochs=1")).steps
    with pytest.raises(ConfigError, match=rf"^train\.stop_at_step: 1000 is past the run's last step, {steps} "
                                          r"\(train\.epochs 1\)$"):
        with_epoch_steps(cfg, make_batch_stream(cfg.data, BYTE))


# ----------------------------------------------------------------------------- the plan

def test_the_plan_says_the_steps_and_without_the_data_that_they_are_not_known(tmp_path, corpus, capsys):
    base = ["--config", "configs/tiny.yaml", *sum((["--set", s] for s in SMALL), []), "--set", "train.epochs=1",
            "--set", f"train.out_dir={tmp_path}"]
    line = _count(_cfg("unused", corpus, "train.epochs=1")).line()
    assert plan.main(base + ["--set", f"data.paths=[{corpus}]"]) == 0
    out = capsys.readouterr()
    assert f"note: {line}\n" in out.out
    assert plan.main(base + ["--set", f"data.paths=[{corpus}]", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert planned["epochs"]["steps"] == planned["steps"] > 0
    assert plan.main(base + ["--set", f"data.paths=[{tmp_path / 'absent'}]"]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: steps:")]
    assert notes == ["note: steps: train.epochs 1: not known until the data is read (the disk part counts the most "
                     "checkpoints the run can keep)"]


# ----------------------------------------------------------------------------- the run

def test_one_epoch_trains_on_every_document_once(tmp_path, corpus, capsys):
    cfg = _cfg(tmp_path / "run", corpus, "train.epochs=1")
    documents = DOCUMENTS
    batches = _drawn_batches(cfg.data, documents)
    result = run(cfg)
    assert result.steps == len(result.losses) == batches
    err = capsys.readouterr().err
    assert sum(line.startswith("note: steps: ") for line in err.splitlines()) == 1
    assert f"note: steps: train.epochs 1 = {documents} documents in {batches} batches = {batches} steps\n" in err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == batches
    assert summary["epochs"] == {"epochs": 1.0, "unit": "documents", "per_epoch": documents, "covered": documents,
                                 "batches": batches, "grad_accum": 1, "steps": batches}
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == list(range(1, batches + 1))
    # Each step's batch is the next of the epoch: the last step completes it, the one before does not.
    assert logged[-2]["data_documents_seen"] < documents <= logged[-1]["data_documents_seen"]
    assert logged[-2]["epoch"] < 1.0 <= logged[-1]["epoch"]
    assert [r["epoch"] for r in logged] == sorted(r["epoch"] for r in logged)
    assert load_config(tmp_path / "run" / "config.yaml").train.steps == batches  # the resolved config


def test_a_resumed_epoch_run_counts_the_same_steps(tmp_path, corpus, capsys):
    out = tmp_path / "run"
    steps = _count(_cfg(out, corpus, "train.epochs=1", "train.grad_accum=2")).steps
    first = run(_cfg(out, corpus, "train.epochs=1", "train.grad_accum=2", "train.stop_at_step=2",
                     "checkpoint.every_steps=2"))
    assert first.steps == 2 and first.stop_at_step == 2
    resumed = run(_cfg(out, corpus, "train.epochs=1", "train.grad_accum=2"))
    assert resumed.steps == len(resumed.losses) == steps and resumed.steps_this_run == steps - 2
    assert json.loads((out / "summary.json").read_text())["epochs"]["steps"] == steps
    # Once there, the same command has nothing to do, and says to raise the epochs (not the steps).
    run(_cfg(out, corpus, "train.epochs=1", "train.grad_accum=2"))
    assert f"at or past train.epochs 1 ({steps} steps); nothing to do (raise train.epochs to train further)" in \
        capsys.readouterr().err
