"""Table data: Parquet files, Arrow IPC files and streams, and datasets folders, written by
``pyarrow`` and ``datasets`` themselves, read for every data.format like JSONL; the refusals;
reading a row group at a time; resuming inside a Parquet file."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxascend.config import DataConfig
from jaxascend.data import BatchStream, ByteTokenizer, documents, eval_batches, table_files
from jaxascend.data.documents import build_document_index
from jaxascend.data.example_packing import ExampleStream
from jaxascend.data.examples import ExampleSource
from tests.data.conftest import write_jsonl


def _datasets():
    """The ``datasets`` package (the test extra), which writes the datasets fixtures; the tests that
    need it are skipped, with this reason, where it is not installed."""
    datasets = pytest.importorskip("datasets", reason="the datasets package (pip install -e '.[test]') writes "
                                                      "the datasets fixtures")
    datasets.disable_progress_bars()
    return datasets


BYTE = ByteTokenizer()
N = 45
RECORDS = {
    "text": [{"text": f"document {i} " + "x" * (i % 11), "id": i} for i in range(N)],
    "prompt_completion": [{"prompt": f"{i}+{i}=", "completion": str(2 * i), "id": i} for i in range(N)],
    "chat": [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a" * (i % 5 + 1)}],
              "id": i} for i in range(N)],
}


def _write_arrow(path, records, stream):
    table = pa.Table.from_pylist(records)
    with pa.OSFile(str(path), "wb") as sink:
        writer = (pa.ipc.new_stream if stream else pa.ipc.new_file)(sink, table.schema)
        for batch in table.to_batches(max_chunksize=8):
            writer.write_batch(batch)
        writer.close()
    return path


WRITERS = {  # (folder, records) -> the path to put in data.paths
    "jsonl": lambda d, r: write_jsonl(d / "d.jsonl", r),
    "parquet_pyarrow": lambda d, r: pq.write_table(pa.Table.from_pylist(r), d / "d.parquet", row_group_size=7)
    or d / "d.parquet",
    "parquet_datasets": lambda d, r: _datasets().Dataset.from_list(r).to_parquet(str(d / "d.parquet"), batch_size=10)
    and d / "d.parquet",
    "arrow_file_pyarrow": lambda d, r: _write_arrow(d / "d.arrow", r, stream=False),
    "arrow_stream_pyarrow": lambda d, r: _write_arrow(d / "d.arrow", r, stream=True),
    "datasets_folder": lambda d, r: _datasets().Dataset.from_list(r).save_to_disk(str(d / "ds"), num_shards=2)
    or d / "ds",
    "dataset_dict_one_split": lambda d, r: _datasets().DatasetDict(
        {"train": _datasets().Dataset.from_list(r)}).save_to_disk(str(d / "dd")) or d / "dd",
    "folder_with_a_datasets_folder": lambda d, r: _datasets().Dataset.from_list(r).save_to_disk(
        str(d / "parent" / "ds")) or d / "parent",
}


def _cfg(path, fmt, template=None, **kw):
    kw.setdefault("seq_len", 31)
    kw.setdefault("batch_size", 3)
    return DataConfig(paths=[str(path)], format=fmt, chat_template=None if template is None else str(template), **kw)


def _contents(cfg):
    """Every document's text, or every example's ids and mask, in index order."""
    if cfg.format == "text":
        index = build_document_index(cfg)
        return [index.read(i) for i in range(len(index))]
    source = ExampleSource(cfg, BYTE)
    return [(e.ids.tolist(), e.trained.tolist()) for e in source.encode(range(len(source)))]


# ----------------------------------------------------------------------------- every kind, every format

@pytest.mark.parametrize("fmt", list(RECORDS))
@pytest.mark.parametrize("kind", list(WRITERS))
def test_every_kind_reads_like_jsonl(tmp_path, byte_template, kind, fmt):
    records = RECORDS[fmt]
    (tmp_path / "ref").mkdir()
    (tmp_path / "data").mkdir()
    template = byte_template if fmt == "chat" else None
    reference = _cfg(write_jsonl(tmp_path / "ref" / "r.jsonl", records), fmt, template)
    cfg = _cfg(WRITERS[kind](tmp_path / "data", records), fmt, template)
    assert _contents(cfg) == _contents(reference)
    for got, want in zip(eval_batches(cfg, BYTE), eval_batches(reference, BYTE), strict=True):  # file order
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)


def test_an_epoch_of_table_rows_visits_every_row_once_grouped_by_row_group(tmp_path):
    path = WRITERS["parquet_pyarrow"](tmp_path, RECORDS["text"])
    index = build_document_index(_cfg(path, "text"))
    for epoch in range(3):
        order = index.epoch_order(seed=4, epoch=epoch)
        assert sorted(order.tolist()) == list(range(N))
        groups = order // 7  # row groups of 7 rows
        assert (np.diff(groups) != 0).sum() == len(set(groups.tolist())) - 1  # each group's rows together
    assert not np.array_equal(index.epoch_order(4, 0), index.epoch_order(4, 1))


def test_text_and_tables_mix_and_max_documents_counts_rows(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", RECORDS["text"][:5])
    WRITERS["parquet_pyarrow"](tmp_path, RECORDS["text"][5:])
    (tmp_path / "z.txt").write_text("plain")
    index = build_document_index(DataConfig(paths=[str(tmp_path)]))
    texts = [index.read(i) for i in range(len(index))]
    assert texts == [r["text"] for r in RECORDS["text"]] + ["plain"]
    assert sorted(index.epoch_order(0, 0).tolist()) == list(range(N + 1))
    capped = build_document_index(DataConfig(paths=[str(tmp_path)], max_documents=12))
    assert [capped.read(i) for i in range(len(capped))] == texts[:12]


# ----------------------------------------------------------------------------- refusals

def test_a_dataset_dict_of_several_splits_asks_for_one(tmp_path):
    datasets = _datasets()
    ds = datasets.Dataset.from_list(RECORDS["text"])
    datasets.DatasetDict({"train": ds, "test": ds.select(range(3))}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'dd'} is a datasets DatasetDict with the splits train, test; "
                                         rf"name one split's folder in data.paths \(e.g. {tmp_path / 'dd' / 'train'}\)$"):
        build_document_index(_cfg(tmp_path / "dd", "text"))
    with pytest.raises(ValueError, match="DatasetDict with the splits train, test"):  # also inside a directory
        build_document_index(_cfg(tmp_path, "text"))
    assert len(build_document_index(_cfg(tmp_path / "dd" / "test", "text"))) == 3


def test_records_of_another_format_name_it(tmp_path):
    chat = write_jsonl(tmp_path / "chat.jsonl", RECORDS["chat"][:2])
    with pytest.raises(ValueError, match=rf"^{chat}: line 1 has no field 'text' \(data.text_field\); fields present: "
                                         r"messages, id; records with 'messages' are read with data.format: chat$"):
        build_document_index(_cfg(chat, "text"))
    table = WRITERS["parquet_pyarrow"](tmp_path, RECORDS["chat"])
    with pytest.raises(ValueError, match=rf"^{table} has no column 'text' \(data.text_field\); columns present: "
                                         r"messages, id; records with 'messages' are read with data.format: chat$"):
        build_document_index(_cfg(table, "text"))
    pairs = WRITERS["parquet_pyarrow"](tmp_path, RECORDS["prompt_completion"])
    with pytest.raises(ValueError, match="records with 'prompt' and 'completion' are read with data.format: "
                                         "prompt_completion$"):
        build_document_index(_cfg(pairs, "text"))


@pytest.mark.parametrize("case", ["int_column", "null", "not_parquet", "messages_not_a_list"])
def test_bad_table_files_are_one_line_errors(tmp_path, case):
    path = tmp_path / "d.parquet"
    rows = {"int_column": {"text": list(range(5))}, "null": {"text": ["a", "b", None, "d"]},
            "messages_not_a_list": {"messages": ["hi"]}}
    if case == "not_parquet":
        path.write_text('{"text": "this is JSON, not Parquet"}\n')
    else:
        pq.write_table(pa.table(rows[case]), path, row_group_size=2)
    fmt = "chat" if case == "messages_not_a_list" else "text"
    message = {
        "int_column": rf"^{path}: column 'text' \(data.text_field\) holds int64, expected strings$",
        "null": rf"^{path}: row 3: field 'text' \(data.text_field\) is null$",
        "not_parquet": rf"^{path}: not a readable Parquet file \(.*magic bytes",
        "messages_not_a_list": rf"^{path}: column 'messages' \(data.messages_field\) holds string, expected lists",
    }[case]
    with pytest.raises(ValueError, match=message) as err:
        documents.index_documents(_cfg(path, fmt))
    assert "\n" not in str(err.value)


def test_a_malformed_chat_row_names_the_file_and_row(tmp_path, byte_template):
    records = list(RECORDS["chat"][:5])
    records[3] = {"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}], "id": 3}
    path = WRITERS["parquet_pyarrow"](tmp_path, records)
    with pytest.raises(ValueError) as err:
        ExampleStream(_cfg(path, "chat", byte_template), BYTE)
    assert str(err.value) == f"{path}: row 4: message 2 has role 'robot'; allowed roles: system, user, assistant, tool"


def test_a_file_named_arrow_that_is_not_is_refused_by_name(tmp_path):
    path = tmp_path / "d.arrow"
    path.write_text("text, not Arrow")
    with pytest.raises(ValueError, match=rf"^{path}: not a readable Arrow IPC file \(") as err:
        build_document_index(_cfg(tmp_path, "text"))
    assert "\n" not in str(err.value)


def test_an_arrow_stream_with_dictionary_columns_is_refused(tmp_path):
    table = pa.table({"text": pa.array(["a", "b", "a"]).dictionary_encode()})
    path = tmp_path / "d.arrow"
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    with pytest.raises(ValueError, match=rf"^{path}: an Arrow IPC stream with dictionary-encoded columns"):
        build_document_index(_cfg(path, "text"))


# ----------------------------------------------------------------------------- reading by groups

@pytest.fixture
def counted_reads(monkeypatch):
    """Every Parquet read goes through iter_batches of one row group; its (group, rows) are logged."""
    log = []
    real = pq.ParquetFile.iter_batches

    def iter_batches(self, *args, row_groups=None, **kw):
        assert row_groups is not None and len(row_groups) == 1, "a read of more than one row group"
        log.append(row_groups[0])
        yield from real(self, *args, row_groups=row_groups, **kw)

    def whole(*args, **kw):
        raise AssertionError("a whole-file read")

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", iter_batches)
    for name in ("read", "read_row_group", "read_row_groups"):
        monkeypatch.setattr(pq.ParquetFile, name, whole)
    monkeypatch.setattr(pq, "read_table", whole)
    return log


def test_a_multi_group_parquet_file_is_read_one_group_at_a_time(tmp_path, counted_reads):
    records = [{"text": f"row {i:04d} " + "y" * (i % 17)} for i in range(400)]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(records), path, row_group_size=25)  # 16 row groups
    cfg = _cfg(path, "text", seq_len=63, batch_size=2)
    stream = BatchStream(cfg, BYTE)
    assert counted_reads == list(range(16))  # the index: one scan, group by group
    counted_reads.clear()
    held = []
    real_rows = table_files.TableRows.rows

    def rows(self, layout, group, lo, hi, columns):
        out = real_rows(self, layout, group, lo, hi, columns)
        held.append(len(out["text"]))
        return out

    table_files.TableRows.rows = rows
    try:
        while stream.epoch == 0:
            next(stream)
    finally:
        table_files.TableRows.rows = real_rows
    first_epoch = counted_reads[:16]
    assert sorted(first_epoch) == list(range(16))  # each group read once in the epoch, in a shuffled order
    assert first_epoch != list(range(16))
    assert max(held) == 25  # never more than a group's rows at once


def test_a_huge_row_group_is_decoded_in_batches_and_shuffled_in_blocks(tmp_path, counted_reads, monkeypatch):
    monkeypatch.setattr(table_files, "_BATCH_BYTES", 64)  # a few rows per decoded batch
    monkeypatch.setattr(documents, "_BLOCK_BYTES", 200)  # blocks of about 12 rows
    records = [{"text": f"row {i:04d} " + "z" * (i % 7)} for i in range(120)]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(records), path)  # one row group
    index = build_document_index(_cfg(path, "text"))
    assert len(index.block_group) > 5 and set(index.block_group.tolist()) == {0}
    counted_reads.clear()
    order = index.epoch_order(seed=1, epoch=0)
    texts = [index.read(int(i)) for i in order]
    assert counted_reads == [0]  # the blocks, in file order, come from one pass over the group
    assert sorted(texts) == sorted(r["text"] for r in records)
    block_of = np.searchsorted(index.blocks, order, side="right") - 1
    assert (np.diff(block_of) >= 0).all() and order.tolist() != sorted(order.tolist())


# ----------------------------------------------------------------------------- resuming

@pytest.mark.parametrize("first", [1, 6, 17])
def test_resume_inside_a_parquet_file_continues_exactly(tmp_path, first):
    records = [{"text": f"doc {i} " + "w" * (i % 23)} for i in range(90)]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(records), path, row_group_size=8)
    cfg = _cfg(path, "text", seq_len=31, batch_size=2, seed=3)
    uninterrupted = BatchStream(cfg, BYTE)
    expected = [next(uninterrupted) for _ in range(first + 40)]  # past the end of epoch 0
    stream = BatchStream(cfg, BYTE)
    for _ in range(first):
        next(stream)
    saved = json.loads(json.dumps(stream.state()))
    restored = BatchStream(cfg, BYTE, state=saved)
    for i in range(40):
        np.testing.assert_array_equal(next(restored), expected[first + i])
    assert restored.epoch >= 1


def test_resume_inside_a_datasets_folder_of_chats_continues_exactly(tmp_path, byte_template):
    path = WRITERS["datasets_folder"](tmp_path, RECORDS["chat"])
    cfg = _cfg(path, "chat", byte_template, seed=5)
    expected = [next(s) for s in [ExampleStream(cfg, BYTE)] for _ in range(30)]
    stream = ExampleStream(cfg, BYTE)
    for _ in range(7):
        next(stream)
    restored = ExampleStream(cfg, BYTE, state=json.loads(json.dumps(stream.state())))
    for i in range(7, 30):
        got = next(restored)
        for a, b in zip(got, expected[i]):
            np.testing.assert_array_equal(a, b)


def test_the_same_rows_in_other_row_groups_do_not_resume(tmp_path):
    path = tmp_path / "d.parquet"
    table = pa.Table.from_pylist(RECORDS["text"])
    pq.write_table(table, path, row_group_size=7)
    stream = BatchStream(_cfg(path, "text"), BYTE)
    next(stream)
    pq.write_table(table, path, row_group_size=9)  # the order by groups would differ
    with pytest.raises(ValueError, match="does not match this data.*fingerprint"):
        BatchStream(_cfg(path, "text"), BYTE, state=stream.state())
