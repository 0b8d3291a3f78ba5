"""Documents: every document (or record) of ``DataConfig.paths``, indexed, read when asked for.

    index = build_document_index(cfg.data)   # where every document is; nothing tokenized
    text = index.read(i)                      # one document, read from disk when asked for
    order = index.epoch_order(seed, epoch)    # the documents in an epoch's seeded order

What a file holds (:mod:`jaxascend.data.discovery`): a ``.jsonl`` file one document per
non-blank line (:mod:`jaxascend.data.jsonl_files`); a Parquet or Arrow file (and so a
``datasets`` folder) one per row (:mod:`jaxascend.data.table_files`); any other file is one
document and must be UTF-8 text (a binary one is refused by name; ``@stdlib``'s few non-UTF-8
files are skipped). The fields read are ``data.format``'s (:mod:`jaxascend.data.fields`). At
start only the index is built: JSONL files are scanned for line breaks, text files checked, and
table files scanned group by group for the size of every row (never read whole).

Order: without table files an epoch's order is ``default_rng([seed, epoch]).permutation(n)``.
Table rows are read a group at a time (a Parquet row group, an Arrow record batch), so they are
shuffled by groups: the groups (every other document is a group of its own) in a seeded order,
and within a group its blocks (at most ``_BLOCK_BYTES`` of rows each, so a huge row group is not
held whole) in file order, the rows of each block in a seeded order.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Iterator, Optional

import numpy as np

from jaxascend.config import DataConfig
from jaxascend.data.discovery import KINDS_ACCEPTED, DataFile, discover_files, missing_paths, text_file_problem
from jaxascend.data.fields import check_schema, field_value, record_fields, wanted
from jaxascend.data.first_records import resolve_format, text_file_refusal
from jaxascend.data.jsonl_files import index_jsonl, load_jsonl_object
from jaxascend.data.table_files import TableLayout, TableRows, first_null, open_table, row_bytes

__all__ = ["DocumentIndex", "build_document_index", "discover_files", "index_documents", "missing_paths"]

_BLOCK_BYTES = 16 << 20  # table rows are shuffled within blocks of about this many bytes of a group


class _BlockCache:
    """The fields of the block of table rows read last, and the reader that continues after it."""

    def __init__(self):
        self.reader = TableRows()
        self.block, self.first, self.values = -1, 0, {}


@dataclass(frozen=True)
class DocumentIndex:
    """Where every document lives: one entry per document, in discovery order.

    The documents of a file are consecutive. ``blocks`` / ``block_group`` (None without table
    files) split the documents into blocks read together and say which group each block is of.
    """

    files: list[str]  # path of each file, by file number
    kinds: list[str]  # what each file is: "text" (one document), "jsonl" or "table"
    file: np.ndarray  # int32 [n] file number of each document
    offset: np.ndarray  # int64 [n] byte offset in the file (a table row: its row number)
    length: np.ndarray  # int64 [n] bytes of the document (a table row: of its fields)
    line: np.ndarray  # int64 [n] 1-based line (JSONL) or row (table) number; 0 for a whole file
    cfg: DataConfig
    tables: dict = field(default_factory=dict)  # file number -> TableLayout of every table file
    blocks: Optional[np.ndarray] = None  # int64 [num_blocks + 1] first document of each block, then n
    block_group: Optional[np.ndarray] = None  # int64 [num_blocks] group of each block, 0, 1, ... in order
    _cache: _BlockCache = field(default_factory=_BlockCache, compare=False, repr=False)

    def __len__(self) -> int:
        return len(self.file)

    @property
    def total_bytes(self) -> int:
        return int(self.length.sum())

    def fingerprint(self) -> str:
        """A short hash of the document sizes (and table groups), to notice data that changed under a saved state."""
        digest = hashlib.sha1(np.ascontiguousarray(self.length, dtype="<i8").tobytes())
        if self.blocks is not None:
            digest.update(np.ascontiguousarray(self.blocks, dtype="<i8").tobytes())
            digest.update(np.ascontiguousarray(self.block_group, dtype="<i8").tobytes())
        return digest.hexdigest()[:16]

    def epoch_order(self, seed: int, epoch: int) -> np.ndarray:
        """int64 [n]: the documents in epoch ``epoch``'s order (see the module doc)."""
        rng = np.random.default_rng([seed, epoch])
        if self.blocks is None:
            return rng.permutation(len(self))
        block_of_doc = np.repeat(np.arange(len(self.block_group)), np.diff(self.blocks))
        group_rank = rng.permutation(int(self.block_group[-1]) + 1)
        return np.lexsort((rng.random(len(self)), block_of_doc, group_rank[self.block_group[block_of_doc]]))

    def where(self, i: int) -> str:
        """``"<file>: line <n>"``, ``"<file>: row <n>"`` or ``"<file>"`` of document ``i``."""
        file_no = int(self.file[i])
        unit = {"jsonl": "line", "table": "row"}.get(self.kinds[file_no])
        return f"{self.files[file_no]}: {unit} {int(self.line[i])}" if unit else self.files[file_no]

    def read_bytes(self, i: int) -> bytes:
        """Returns the raw bytes of document ``i`` (a whole file, or one JSONL line)."""
        path, offset, length = self.files[self.file[i]], int(self.offset[i]), int(self.length[i])
        with open(path, "rb") as f:
            f.seek(offset)
            raw = f.read(length)
        if len(raw) != length:
            raise ValueError(f"{path}: expected {length} bytes at offset {offset} but the file is "
                             "shorter; it changed after the data index was built")
        return raw

    def record(self, i: int) -> dict:
        """Document ``i`` as a record: a JSONL line's object, or a table row's fields."""
        if self.kinds[self.file[i]] == "table":
            return self._table_record(i)
        return load_jsonl_object(self.read_bytes(i), self.where(i), wanted(self.cfg))

    def read(self, i: int) -> str:
        """Returns the text of document ``i`` (``data.format: text``)."""
        if self.kinds[self.file[i]] != "text":
            return field_value(self.record(i), self.where(i), record_fields(self.cfg)[0], self.cfg)
        try:
            return self.read_bytes(i).decode("utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"{self.where(i)}: not UTF-8 at offset {err.start}; it changed after the data "
                             "index was built") from None

    def records(self) -> Iterator[tuple[int, dict]]:
        """``(i, record(i))`` for every record, in index order; each JSONL file is opened once."""
        for file_no, path in enumerate(self.files):
            first, last = np.searchsorted(self.file, [file_no, file_no + 1])
            if self.kinds[file_no] != "jsonl":
                yield from ((i, self.record(i)) for i in range(first, last))
                continue
            with open(path, "rb") as f:
                for i in range(first, last):
                    f.seek(int(self.offset[i]))
                    raw = f.read(int(self.length[i]))
                    if len(raw) != int(self.length[i]):
                        raise ValueError(f"{self.where(i)} is shorter than when it was indexed; the file changed")
                    yield i, load_jsonl_object(raw, self.where(i), wanted(self.cfg))

    def _table_record(self, i: int) -> dict:
        """The fields of table row ``i``, from its block (read whole when first asked for)."""
        cache = self._cache
        block = int(np.searchsorted(self.blocks, i, side="right")) - 1
        if block != cache.block:
            first, end = int(self.blocks[block]), int(self.blocks[block + 1])
            layout: TableLayout = self.tables[int(self.file[first])]
            row = int(self.offset[first])
            group = int(np.searchsorted(layout.starts, row, side="right")) - 1
            lo = row - int(layout.starts[group])
            columns = [f.name for f in record_fields(self.cfg)]
            cache.values = {}  # the last block's values go before the next block's come
            cache.values = cache.reader.rows(layout, group, lo, lo + end - first, columns)
            cache.block, cache.first = block, first
        k = i - cache.first
        return {name: values[k] for name, values in cache.values.items()}


# ----------------------------------------------------------------------------- building the index

def _table_blocks(lengths: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows per block and whether the block starts a group, for the first ``len(lengths)`` rows of
    a table whose groups start at rows ``starts`` (blocks of at most about ``_BLOCK_BYTES``)."""
    sizes, new_group = [], []
    for lo, hi in zip(starts[:-1].tolist(), np.minimum(starts[1:], len(lengths)).tolist()):
        if lo >= hi:
            continue
        before = np.cumsum(lengths[lo:hi]) - lengths[lo:hi]  # bytes of the group before each row
        bounds = np.concatenate(([0], np.flatnonzero(np.diff(before // _BLOCK_BYTES)) + 1, [hi - lo]))
        sizes.append(np.diff(bounds))
        new_group.append(np.arange(len(bounds) - 1) == 0)
    if not sizes:
        return np.zeros(0, np.int64), np.zeros(0, bool)
    return np.concatenate(sizes), np.concatenate(new_group)


def _index_table(data_file: DataFile, cfg: DataConfig, limit: int) -> tuple[TableLayout, np.ndarray]:
    """The layout of a table file and the bytes of each of its first ``limit`` rows' fields,
    read group by group; a one-line ValueError for a missing or mistyped column or a null."""
    path = data_file.path
    table = open_table(path, data_file.kind)
    try:
        check_schema(path, table.schema, cfg)
        fields = record_fields(cfg)
        lengths, rows = [], 0
        scan = table.scan([f.name for f in fields])
        for batch in scan:
            batch = batch.slice(0, limit - rows)
            for f in fields:
                null = first_null(batch.column(f.name))
                if null is not None:
                    raise ValueError(f"{path}: row {rows + null + 1}: field {f.name!r} ({f.config_key}) is null")
            lengths.append(sum(row_bytes(batch.column(f.name)) for f in fields))
            rows += batch.num_rows
            if rows >= limit:
                break
        scan.close()  # the layout is complete up to here
        return table.layout, (np.concatenate(lengths) if lengths else np.zeros(0, np.int64))
    finally:
        table.close()


class _IndexParts:
    """The index's arrays, gathered file by file."""

    def __init__(self):
        self.files, self.kinds, self.tables = [], [], {}
        self.parts: list[tuple[np.ndarray, ...]] = []  # (file, offset, length, line) per run of documents
        self.whole_files: list[tuple[int, int]] = []  # (file number, size) of consecutive text files
        self.blocks: list = []  # per run: a count of one-document groups, or (sizes, new_group) of a table
        self.count = 0

    def _add_file(self, path: str, kind: str) -> int:
        self.files.append(path)
        self.kinds.append(kind)
        return len(self.files) - 1

    def flush_whole_files(self) -> None:
        # Text files are gathered in a Python list and turned into arrays in one go: corpora of
        # many small files would otherwise pay for several tiny numpy arrays per file.
        if self.whole_files:
            numbers, sizes = zip(*self.whole_files)
            zeros = np.zeros(len(sizes), np.int64)
            self.parts.append((np.array(numbers, np.int32), zeros, np.array(sizes, np.int64), zeros))
            self.blocks.append(len(sizes))
            self.whole_files.clear()

    def add_text(self, path: str, size: int) -> None:
        self.whole_files.append((self._add_file(path, "text"), size))
        self.count += 1

    def add_rows(self, path: str, kind: str, offsets, lengths, lines, layout: Optional[TableLayout] = None) -> None:
        self.flush_whole_files()
        file_no = self._add_file(path, kind)
        self.parts.append((np.full(len(offsets), file_no, np.int32), offsets, lengths, lines))
        if layout is None:
            self.blocks.append(len(offsets))
        else:
            self.tables[file_no] = layout
            self.blocks.append(_table_blocks(lengths, layout.starts))
        self.count += len(offsets)

    def block_arrays(self) -> tuple[Optional[np.ndarray], Optional[np.ndarray]]:
        """``blocks`` and ``block_group`` of the index; None, None without table files."""
        if not self.tables:
            return None, None
        sizes = [np.ones(b, np.int64) if isinstance(b, int) else b[0] for b in self.blocks]
        new_group = [np.ones(b, bool) if isinstance(b, int) else b[1] for b in self.blocks]
        blocks = np.concatenate(([0], np.cumsum(np.concatenate(sizes))))
        return blocks.astype(np.int64), np.cumsum(np.concatenate(new_group)).astype(np.int64) - 1


def _check_text(data_file: DataFile, cfg: DataConfig) -> bool:
    """Whether a text file is taken: True, False (an ``@stdlib`` file that is not UTF-8), or a
    one-line ValueError naming the file and what is wrong."""
    if cfg.format != "text":
        raise text_file_refusal(data_file.path, cfg)
    problem = text_file_problem(data_file.path)
    if problem is None:
        return True
    if data_file.bundled:
        return False
    raise ValueError(f"{data_file.path}: {problem}; data reads {KINDS_ACCEPTED}")


def index_documents(cfg: DataConfig) -> DocumentIndex:
    """Finds the documents of ``cfg`` (up to ``cfg.max_documents``) without parsing any JSONL line.

    :func:`build_document_index` (text) and the example source (records) check what they need on top.
    ``data.format: auto`` is resolved here if the caller has not (the run resolves it before).
    """
    cfg = resolve_format(cfg).data
    limit = cfg.max_documents if cfg.max_documents is not None else np.iinfo(np.int64).max
    files = discover_files(cfg.paths, cfg.include)
    index = _IndexParts()
    for data_file in files:
        if index.count >= limit:
            break
        path = data_file.path
        if data_file.kind == "jsonl":
            offsets, lengths, lines = index_jsonl(path, limit - index.count)
            if len(offsets):
                index.add_rows(path, "jsonl", offsets, lengths, lines)
        elif data_file.kind in ("parquet", "arrow"):
            layout, lengths = _index_table(data_file, cfg, limit - index.count)
            if len(lengths):
                rows = np.arange(len(lengths), dtype=np.int64)
                index.add_rows(path, "table", rows, lengths, rows + 1, layout)
        elif (size := os.path.getsize(path)) > 0 and _check_text(data_file, cfg):
            index.add_text(path, size)
    index.flush_whole_files()
    if index.count == 0:
        found = f"{len(files)} matching files, all empty" if files else "no file matched"
        raise ValueError(f"no documents found in data.paths {cfg.paths} with data.include {cfg.include} "
                         f"({found})")
    blocks, block_group = index.block_arrays()
    return DocumentIndex(files=index.files, kinds=index.kinds, cfg=cfg, tables=index.tables, blocks=blocks,
                         block_group=block_group,
                         **{k: np.concatenate([p[j] for p in index.parts])
                            for j, k in enumerate(("file", "offset", "length", "line"))})


def build_document_index(cfg: DataConfig) -> DocumentIndex:
    """Finds the documents of ``cfg`` (up to ``cfg.max_documents``) without reading their text.

    The first document of every JSONL file is parsed right away, so a wrong ``text_field`` or a
    non-JSON file fails here rather than mid-training; later lines are checked when read. Table
    files' columns and nulls were checked while indexing.
    """
    index = index_documents(cfg)
    for file_no, kind in enumerate(index.kinds):
        if kind == "jsonl":
            index.read(int(np.searchsorted(index.file, file_no)))
    return index
