"""sft-tiny: the committed files are scripts/make_sft_tiny.py's output, small, held out, and train."""

import importlib.util
import json
from pathlib import Path

import numpy as np

from jaxascend.config import DataConfig
from jaxascend.data import ByteTokenizer, eval_batches
from jaxascend.data.chat_templates import chat_prompt_ids, chat_stop_ids
from jaxascend.data.example_packing import ExampleStream

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data" / "sft_tiny"
FILES = ("train.jsonl", "eval.jsonl", "template.jinja")
BYTE = ByteTokenizer()


def _script():
    spec = importlib.util.spec_from_file_location("make_sft_tiny", ROOT / "scripts" / "make_sft_tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _records(name):
    return [json.loads(line) for line in (DATA / name).read_text().splitlines()]


def _cfg(name, **kw):
    return DataConfig(paths=[str(DATA / name)], format="chat", tokenizer="byte",
                      chat_template=str(DATA / "template.jinja"), **kw)


def test_the_script_reproduces_the_committed_files(tmp_path, capsys):
    _script().main(["--out", str(tmp_path)])
    for name in FILES:
        assert (tmp_path / name).read_bytes() == (DATA / name).read_bytes(), name
    assert capsys.readouterr().out.split() == [str(tmp_path / n) for n in FILES]


def test_sizes_answers_and_held_out_items():
    assert sum((DATA / n).stat().st_size for n in FILES) < 100_000
    train, held_out = _records("train.jsonl"), _records("eval.jsonl")
    assert 280 <= len(train) <= 320 and len(held_out) == 40
    for record in train + held_out:
        roles = [m["role"] for m in record["messages"]]
        body = roles[1:] if roles[0] == "system" else roles
        assert body in (["user", "assistant"], ["user", "assistant"] * 2)
        assert all(len(m["content"].encode()) < 60 for m in record["messages"] if m["role"] == "assistant")
    questions = lambda records: {m["content"] for r in records for m in r["messages"] if m["role"] == "user"}
    assert not questions(train) & questions(held_out)
    assert sum(r["messages"][0]["role"] == "system" for r in train) > 50
    assert sum(len(r["messages"]) >= 4 for r in train) >= 50


def test_the_template_trains_the_answers_and_stops_at_eos():
    train = _records("train.jsonl")
    stream = ExampleStream(_cfg("train.jsonl", seq_len=255, batch_size=4), BYTE)
    batch = next(stream)
    placed = sum(int(batch.segment_ids[r].max()) for r in range(4))
    assert stream.stats() == {"examples_seen": placed, "examples_truncated": 0, "examples_dropped": 0}
    # The trained targets are each assistant answer followed by eos, in the epoch's order.
    order = np.random.default_rng([0, 0]).permutation(len(train))[:placed]
    expected = "".join(m["content"] + "<|eos|>" for i in order for m in train[i]["messages"]
                       if m["role"] == "assistant")
    assert BYTE.decode(batch.tokens[:, 1:][batch.loss_mask]) == expected
    assert chat_stop_ids(_cfg("train.jsonl"), BYTE) == [BYTE.eos_id]
    prompt = chat_prompt_ids(_cfg("train.jsonl"), BYTE, [{"role": "user", "content": "Say hello to Anna."}])
    assert BYTE.decode(prompt) == "<|bos|><|user|>\nSay hello to Anna.\n<|assistant|>\n"


def test_the_eval_set_is_one_pass():
    batches = list(eval_batches(_cfg("eval.jsonl", seq_len=255, batch_size=8), BYTE))
    assert all(b.loss_mask.any() for b in batches)
    assert sum(int(b.segment_ids[r].max()) for b in batches for r in range(8)) == 40
