"""Evaluation batches: one pass in file order, every document or example exactly once, the last
batch padded, max_batches, for text and for examples."""

import json

import numpy as np
import pytest

from jaxascend.config import DataConfig
from jaxascend.data import ByteTokenizer, HFTokenizer, eval_batches, write_hf_tokenizer
from jaxascend.data.example_packing import PackedBatch
from tests.data.conftest import BPE_TEXTS, chat_cfg, write_jsonl

BYTE = ByteTokenizer()
PAD = BYTE.pad_id


def _examples_in(batch):
    """The token ids of each example in each row, by segment (the byte pad id never occurs in one)."""
    out = []
    for r in range(batch.tokens.shape[0]):
        last = batch.segment_ids[r, -1] if batch.tokens[r, -1] != PAD else 0
        seg = np.append(batch.segment_ids[r], last)
        out += [batch.tokens[r][seg == k].tolist() for k in range(1, seg.max() + 1)]
    return out


@pytest.mark.parametrize("packing", [True, False])
def test_every_example_once_in_file_order_and_last_batch_padded(tmp_path, packing):
    records = [{"prompt": f"{i}:" + "p" * (i % 5), "completion": "c" * (i % 7)} for i in range(23)]
    write_jsonl(tmp_path / "a.jsonl", records[:15])
    write_jsonl(tmp_path / "b.jsonl", records[15:])
    cfg = DataConfig(paths=[str(tmp_path)], format="prompt_completion", seq_len=31, batch_size=3,
                     packing=packing, seed=9)
    batches = list(eval_batches(cfg, BYTE))
    assert all(isinstance(b, PackedBatch) and b.tokens.shape == (3, 32) for b in batches)
    got = [ids for b in batches for ids in _examples_in(b)]
    expected = [[256] + list(r["prompt"].encode()) + list(r["completion"].encode()) + [257] for r in records]
    assert got == expected
    last = batches[-1]
    assert (last.segment_ids == 0).any() and not last.loss_mask[last.segment_ids == 0].any()
    # Each example's trained targets: its completion and eos.
    trained = sum(int(b.loss_mask.sum()) for b in batches)
    assert trained == sum(len(r["completion"]) + 1 for r in records)
    assert len(list(eval_batches(cfg, BYTE, max_batches=2))) == 2
    assert len(list(eval_batches(cfg, BYTE, max_batches=1000))) == len(batches)


def test_chat_eval_skips_dropped_examples(tmp_path, byte_template):
    short = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}
    long = {"messages": [{"role": "user", "content": "x" * 100}, {"role": "assistant", "content": "Yo"}]}
    path = write_jsonl(tmp_path / "c.jsonl", [short, long, short])
    batches = list(eval_batches(chat_cfg([path], byte_template, overlong="drop", seq_len=63, batch_size=1), BYTE))
    assert [len(_examples_in(b)) for b in batches] == [2]
    with pytest.raises(ValueError, match="every one of the 1 held-out examples is longer than a row"):
        list(eval_batches(chat_cfg([write_jsonl(tmp_path / "l.jsonl", [long])], byte_template,
                                   overlong="drop", seq_len=63), BYTE))


def test_text_rows_cut_the_framed_documents_in_file_order(tmp_path):
    docs = [f"document {i} " + "z" * (3 * i) for i in range(9)]
    write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in docs])
    cfg = DataConfig(paths=[str(tmp_path / "d.jsonl")], seq_len=15, batch_size=4, seed=3)
    batches = list(eval_batches(cfg, BYTE))
    stream = [t for d in docs for t in [256] + list(d.encode()) + [257]]
    rows = [b.tokens[r] for b in batches for r in range(4)]
    n_full = len(stream) // 16
    for r in range(n_full):
        assert rows[r].tolist() == stream[r * 16:(r + 1) * 16]
    rest = len(stream) - n_full * 16
    assert rows[n_full].tolist() == stream[n_full * 16:] + [PAD] * (16 - rest)
    assert all((row == PAD).all() for row in rows[n_full + 1:])
    for b in batches:
        np.testing.assert_array_equal(b.positions, np.broadcast_to(np.arange(15), (4, 15)))
    flat_seg = np.concatenate([b.segment_ids for b in batches])
    flat_mask = np.concatenate([b.loss_mask for b in batches])
    assert flat_seg[:n_full].all() and flat_mask[:n_full].all()
    assert flat_seg[n_full].tolist() == [1] * rest + [0] * (15 - rest)
    assert flat_mask[n_full].tolist() == [True] * (rest - 1) + [False] * (16 - rest)
    assert not flat_seg[n_full + 1:].any() and not flat_mask[n_full + 1:].any()
    assert len(list(eval_batches(cfg, BYTE, max_batches=1))) == 1
    with pytest.raises(ValueError, match="max_batches must be at least 1 or None, got 0"):
        eval_batches(cfg, BYTE, max_batches=0)


def test_text_padding_is_by_position_when_pad_is_eos(tmp_path):
    folder = write_hf_tokenizer(tmp_path / "tok", BPE_TEXTS, vocab_size=300)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):  # no pad token: pad falls back to eos
        config = json.loads((folder / name).read_text())
        del config["pad_token"]
        (folder / name).write_text(json.dumps(config))
    tok = HFTokenizer(folder)
    assert tok.pad_id == tok.eos_id
    (tmp_path / "a.txt").write_text("hello world")
    [batch] = eval_batches(DataConfig(paths=[str(tmp_path / "a.txt")], seq_len=31, batch_size=1), tok)
    n = len(tok.encode("hello world")) + 2  # bos + ids + eos
    assert batch.segment_ids[0].tolist() == [1] * n + [0] * (31 - n)
    assert batch.loss_mask[0].tolist() == [True] * (n - 1) + [False] * (32 - n)  # the eos target counts


def test_eval_checks_the_data_when_called(tmp_path, byte_template):
    path = write_jsonl(tmp_path / "c.jsonl", ["{bad"])
    with pytest.raises(ValueError, match=rf"^{path}: line 1 is not valid JSON"):
        eval_batches(chat_cfg([path], byte_template), BYTE)  # no next() needed
