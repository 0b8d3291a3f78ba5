"""Example packing: the row layout on a hand-checked case, agreement with a slow reference packer,
padding mode, overlong examples, determinism, resumption and state checks."""

import json

import numpy as np
import pytest

from jaxascend.config import DataConfig
from jaxascend.data import BatchStream, ByteTokenizer, make_batch_stream
from jaxascend.data.example_packing import ExampleStream, PackedBatch
from jaxascend.data.examples import Example
from jaxascend.data.example_packing import BatchBuilder
from tests.data.conftest import CONVERSATION, chat_cfg, write_jsonl

BYTE = ByteTokenizer()
PAD = BYTE.pad_id
F, T = False, True


def _example(ids, trained):
    return Example(np.asarray(ids, np.int32), np.asarray(trained, bool))


# ----------------------------------------------------------------------------- the layout, by hand

def test_rows_segments_positions_and_mask_on_a_hand_checked_case():
    builder = BatchBuilder(rows=2, seq_len=7, pad_id=PAD, packing=True)  # rows of 8 tokens
    a = _example([256, 1, 2, 257], [F, F, T, T])
    b = _example([256, 3, 257], [T, T, T])  # all trained (train_on_prompt): its first token still is not a target of a's
    c = _example([256, 4, 5, 6, 257], [F, F, T, T, T])  # 1 slot left in row 0: starts row 1
    d = _example([256, 7, 8, 257], [F, F, T, T])  # fits nowhere: the batch is full
    assert [builder.add(e) for e in (a, b, c, d)] == [True, True, True, False]
    batch = builder.finish()
    assert isinstance(batch, PackedBatch)
    np.testing.assert_array_equal(batch.tokens, [[256, 1, 2, 257, 256, 3, 257, PAD],
                                                 [256, 4, 5, 6, 257, PAD, PAD, PAD]])
    np.testing.assert_array_equal(batch.segment_ids, [[1, 1, 1, 1, 2, 2, 2], [1, 1, 1, 1, 1, 0, 0]])
    np.testing.assert_array_equal(batch.positions, [[0, 1, 2, 3, 0, 1, 2], [0, 1, 2, 3, 4, 0, 0]])
    # loss_mask[t]: target t+1 is trained and belongs to the example of input t.
    np.testing.assert_array_equal(batch.loss_mask, [[F, T, T, F, T, T, F], [F, T, T, T, F, F, F]])
    assert [x.dtype for x in batch] == [np.int32, bool, np.int32, np.int32]
    assert [x.shape for x in batch] == [(2, 8), (2, 7), (2, 7), (2, 7)]


def test_padding_mode_puts_one_example_per_row():
    builder = BatchBuilder(rows=3, seq_len=7, pad_id=PAD, packing=False)
    a, b = _example([256, 1, 257], [F, T, T]), _example([256, 2, 3, 257], [F, F, T, T])
    assert [builder.add(e) for e in (a, b, a, b)] == [True, True, True, False]
    batch = builder.finish()
    np.testing.assert_array_equal(batch.tokens, [[256, 1, 257] + [PAD] * 5, [256, 2, 3, 257] + [PAD] * 4,
                                                 [256, 1, 257] + [PAD] * 5])
    np.testing.assert_array_equal(batch.segment_ids, [[1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0],
                                                      [1, 1, 1, 0, 0, 0, 0]])
    np.testing.assert_array_equal(batch.loss_mask, [[T, T, F, F, F, F, F], [F, T, T, F, F, F, F],
                                                    [T, T, F, F, F, F, F]])


def test_an_example_filling_a_row_exactly_and_a_full_row():
    builder = BatchBuilder(rows=1, seq_len=3, pad_id=PAD, packing=True)
    assert builder.add(_example([256, 1, 2, 257], [F, T, T, T]))
    assert not builder.add(_example([256, 257], [F, T]))
    batch = builder.finish()
    np.testing.assert_array_equal(batch.tokens, [[256, 1, 2, 257]])
    np.testing.assert_array_equal(batch.loss_mask, [[T, T, T]])
    with pytest.raises(ValueError, match="an example of 5 tokens does not fit a row of 4"):
        builder.add(_example([1] * 5, [T] * 5))


# ----------------------------------------------------------------------------- the stream

def _records(n, rng_seed=0, long_every=0, seq_len=23):
    """Prompt/completion records of varied lengths, each starting with its number."""
    rng = np.random.default_rng(rng_seed)
    out = []
    for i in range(n):
        extra = seq_len + 5 if long_every and i % long_every == long_every - 1 else int(rng.integers(0, 8))
        out.append({"prompt": f"{i}:" + "p" * int(rng.integers(0, 6)), "completion": "c" * extra})
    return out


def _encode(record, train_on_prompt=False):
    prompt, completion = list(record["prompt"].encode()), list(record["completion"].encode())
    ids = [256] + prompt + completion + [257]
    return ids, [train_on_prompt] * (1 + len(prompt)) + [True] * (len(completion) + 1)


def _reference_rows(records, cfg, epochs):
    """The documented rows, the slow obvious way: each epoch's permutation, examples cut or
    dropped, placed greedily (or one per row), one token at a time."""
    row_len = cfg.seq_len + 1
    rows, row = [], []  # a row: list of (ids, trained) examples

    for epoch in range(epochs):
        for i in np.random.default_rng([cfg.seed, epoch]).permutation(len(records)):
            ids, trained = _encode(records[i], cfg.train_on_prompt)
            if len(ids) > row_len:
                if cfg.overlong == "drop":
                    continue
                ids, trained = ids[:row_len], trained[:row_len]
            if row and (not cfg.packing or sum(len(e[0]) for e in row) + len(ids) > row_len):
                rows.append(row)
                row = []
            row.append((ids, trained))
    out = []
    for row in rows:
        tokens, seg, pos, trained = [], [], [], []
        for k, (ids, tr) in enumerate(row, 1):
            tokens += ids
            seg += [k] * len(ids)
            pos += list(range(len(ids)))
            trained += tr
        pad = row_len - len(tokens)
        tokens, seg, pos, trained = tokens + [PAD] * pad, seg + [0] * pad, pos + [0] * pad, trained + [False] * pad
        mask = [trained[t + 1] and seg[t + 1] == seg[t] and seg[t] > 0 for t in range(row_len - 1)]
        out.append((tokens, mask, seg[:-1], pos[:-1]))
    return out


def _pc_stream_cfg(path, **kw):
    kw.setdefault("seq_len", 23)
    kw.setdefault("batch_size", 3)
    return DataConfig(paths=[str(path)], format="prompt_completion", **kw)


@pytest.mark.parametrize("packing,overlong,train_on_prompt", [
    (True, "truncate", False), (False, "truncate", False), (True, "drop", False), (False, "drop", False),
    (True, "truncate", True)])
def test_stream_matches_the_reference_packer(tmp_path, packing, overlong, train_on_prompt):
    records = _records(17, long_every=5)
    path = write_jsonl(tmp_path / "pc.jsonl", records)
    cfg = _pc_stream_cfg(path, packing=packing, overlong=overlong, seed=3, train_on_prompt=train_on_prompt)
    stream = ExampleStream(cfg, BYTE)
    batches = [next(stream) for _ in range(12)]  # several epochs
    reference = _reference_rows(records, cfg, epochs=12)
    got_rows = [tuple(x[r].tolist() for x in b) for b in batches for r in range(cfg.batch_size)]
    assert len(reference) > len(got_rows)
    for got, want in zip(got_rows, reference):
        assert got == tuple(want)
    assert stream.epoch >= 2


def test_rows_hold_whole_examples(tmp_path):
    records = _records(11)
    path = write_jsonl(tmp_path / "pc.jsonl", records)
    whole = {tuple(_encode(r)[0]) for r in records}
    stream = ExampleStream(_pc_stream_cfg(path, seq_len=31), BYTE)
    for _ in range(8):
        batch = next(stream)
        for r in range(batch.tokens.shape[0]):
            # The last slot is only a target: it continues the last input's example unless padded
            # (the byte tokenizer's pad id never occurs inside an example).
            last = batch.segment_ids[r, -1] if batch.tokens[r, -1] != PAD else 0
            seg = np.append(batch.segment_ids[r], last)
            for k in range(1, seg.max() + 1):
                assert tuple(batch.tokens[r][seg == k].tolist()) in whole


def test_overlong_examples_are_counted(tmp_path):
    records = _records(10, long_every=4)  # examples 3 and 7 are longer than a row
    path = write_jsonl(tmp_path / "pc.jsonl", records)
    for overlong in ("truncate", "drop"):
        stream = ExampleStream(_pc_stream_cfg(path, overlong=overlong, packing=False, batch_size=5), BYTE)
        assert stream.stats() == {"examples_seen": 0, "examples_truncated": 0, "examples_dropped": 0}
        next(stream), next(stream)  # the first epoch exactly: 8 or 10 rows, one example each
        stats = stream.stats()
        if overlong == "truncate":
            assert stats == {"examples_seen": 10, "examples_truncated": 2, "examples_dropped": 0}
        else:
            # 10 rows: the first epoch's 8 short examples, then 2 of the next epoch; the long ones met
            # on the way, up to the example that starts the third batch, are dropped.
            dropped, short = 2, 0
            for i in np.random.default_rng([0, 1]).permutation(10):
                if i in (3, 7):
                    dropped += 1
                elif (short := short + 1) == 3:
                    break
            assert stats == {"examples_seen": 10 + dropped, "examples_truncated": 0, "examples_dropped": dropped}


def test_truncated_example_keeps_its_first_tokens(tmp_path):
    record = {"prompt": "Q", "completion": "x" * 40}
    path = write_jsonl(tmp_path / "pc.jsonl", [record])
    batch = next(ExampleStream(_pc_stream_cfg(path, seq_len=15, batch_size=1), BYTE))
    ids, trained = _encode(record)
    np.testing.assert_array_equal(batch.tokens[0], ids[:16])  # no eos: it was cut off
    np.testing.assert_array_equal(batch.loss_mask[0], trained[1:16])


def test_an_epoch_of_dropped_examples_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "p" * 30, "completion": "c"}] * 3)
    stream = ExampleStream(_pc_stream_cfg(path, seq_len=15, overlong="drop"), BYTE)
    with pytest.raises(ValueError) as err:
        next(stream)
    assert str(err.value) == ("data.overlong: drop: every one of the 3 examples is longer than a row of "
                              "data.seq_len + 1 = 16 tokens; raise data.seq_len or set data.overlong: truncate")


def test_same_seed_same_batches_other_seed_other(tmp_path):
    path = write_jsonl(tmp_path / "pc.jsonl", _records(13))

    def take(seed):
        stream = ExampleStream(_pc_stream_cfg(path, seed=seed), BYTE)
        return np.stack([next(stream).tokens for _ in range(6)])

    np.testing.assert_array_equal(take(5), take(5))
    assert not np.array_equal(take(5), take(6))


# ----------------------------------------------------------------------------- resumption

@pytest.mark.parametrize("first", [1, 2, 5, 9])
def test_resume_gives_the_same_following_batches(tmp_path, first):
    path = write_jsonl(tmp_path / "pc.jsonl", _records(13, long_every=6))
    cfg = _pc_stream_cfg(path, seed=2, overlong="drop")
    uninterrupted = ExampleStream(cfg, BYTE)
    expected = [next(uninterrupted) for _ in range(first + 10)]
    stream = ExampleStream(cfg, BYTE)
    for _ in range(first):
        next(stream)
    saved = json.loads(json.dumps(stream.state()))
    assert len(json.dumps(saved)) < 400
    restored = ExampleStream(cfg, BYTE, state=saved)
    assert restored.stats() == stream.stats()
    for i in range(10):
        for got, want in zip(next(restored), expected[first + i]):
            np.testing.assert_array_equal(got, want)
    assert restored.stats() == uninterrupted.stats() and restored.state() == uninterrupted.state()
    assert restored.epoch >= 1


def test_resume_with_another_batch_size_continues_the_example_order(tmp_path):
    path = write_jsonl(tmp_path / "pc.jsonl", _records(9))
    cfg = _pc_stream_cfg(path, packing=False)
    stream = ExampleStream(cfg, BYTE)
    head = [next(stream) for _ in range(2)]
    other = ExampleStream(_pc_stream_cfg(path, packing=False, batch_size=4), BYTE, state=stream.state())
    tail = [next(other) for _ in range(3)]
    rows = [b.tokens[r] for b in head + tail for r in range(b.tokens.shape[0])]
    reference = _reference_rows(_records(9), cfg, epochs=4)
    for got, want in zip(rows, reference):
        assert got.tolist() == want[0]


def test_state_from_other_data_or_settings_is_refused(tmp_path):
    path = write_jsonl(tmp_path / "pc.jsonl", _records(6))
    cfg = _pc_stream_cfg(path)
    stream = ExampleStream(cfg, BYTE)
    next(stream)
    state = stream.state()
    with pytest.raises(ValueError) as err:
        ExampleStream(_pc_stream_cfg(path, seed=1, packing=False), BYTE, state=state)
    assert str(err.value) == ("data stream state does not match this data: saved for seed 0 (now 1), "
                              "packing True (now False)")
    with pytest.raises(ValueError, match=r"saved for overlong 'truncate' \(now 'drop'\)$"):
        ExampleStream(_pc_stream_cfg(path, overlong="drop"), BYTE, state=state)
    with pytest.raises(ValueError, match=r"saved for format 'chat' \(now 'prompt_completion'\)$"):
        ExampleStream(cfg, BYTE, state={**state, "format": "chat"})
    with pytest.raises(ValueError, match="^data stream state: missing key 'example'$"):
        ExampleStream(cfg, BYTE, state={k: v for k, v in state.items() if k != "example"})
    with pytest.raises(ValueError, match="^data stream state: 'packing' must be a bool, got 1$"):
        ExampleStream(cfg, BYTE, state={**state, "packing": 1})
    with pytest.raises(ValueError, match=r"^data stream state: example 6 is out of range \(0..5\)$"):
        ExampleStream(cfg, BYTE, state={**state, "example": 6})
    write_jsonl(path, _records(6, rng_seed=1))
    with pytest.raises(ValueError, match=r"^data stream state does not match this data: saved for fingerprint"):
        ExampleStream(cfg, BYTE, state=state)


def test_text_and_example_states_are_told_apart(tmp_path, byte_template):
    (tmp_path / "a.txt").write_text("some text " * 20)
    text = BatchStream(DataConfig(paths=[str(tmp_path / "a.txt")], seq_len=15, batch_size=2), BYTE)
    next(text)
    chat = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATION}])
    chat_cfg_ = chat_cfg([chat], byte_template)
    with pytest.raises(ValueError) as err:
        ExampleStream(chat_cfg_, BYTE, state=text.state())
    assert str(err.value) == ("data stream state was saved by a data.format: text stream; this stream is "
                              "data.format: chat")
    examples = ExampleStream(chat_cfg_, BYTE)
    next(examples)
    with pytest.raises(ValueError) as err:
        BatchStream(DataConfig(paths=[str(tmp_path / "a.txt")]), BYTE, state=examples.state())
    assert str(err.value) == ("data stream state was saved by a data.format: chat stream; this stream is "
                              "data.format: text")


# ----------------------------------------------------------------------------- make_batch_stream

def test_make_batch_stream_picks_the_stream(tmp_path, byte_template):
    (tmp_path / "a.txt").write_text("hello")  # 7 tokens framed
    text_cfg = DataConfig(paths=[str(tmp_path / "a.txt")], seq_len=15, batch_size=2)
    text = make_batch_stream(text_cfg, BYTE)
    assert isinstance(text, BatchStream)
    batch = next(text)
    assert batch.shape == (2, 16) and batch.dtype == np.int32
    assert text.stats() == {"documents_seen": 4}  # 32 tokens: 4 whole documents (epochs) and 4 tokens
    resumed = make_batch_stream(text_cfg, BYTE, state=text.state())
    np.testing.assert_array_equal(next(resumed), next(text))
    chat = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATION}])
    examples = make_batch_stream(chat_cfg([chat], byte_template), BYTE)
    assert isinstance(examples, ExampleStream) and isinstance(next(examples), PackedBatch)


def test_chat_stream_with_a_hf_tokenizer_trains_the_assistant_tokens(tmp_path, chatml):
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATION}] * 3)
    batch = next(ExampleStream(chat_cfg([path], seq_len=127, batch_size=1), chatml))
    targets = batch.tokens[0, 1:][batch.loss_mask[0]]
    per_example = "Paris.<|im_end|>\nMadrid.<|im_end|>\n"
    assert chatml.decode(targets) == per_example * int(batch.segment_ids.max())
