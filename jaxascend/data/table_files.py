"""Table files: Parquet and Arrow IPC files read through pyarrow, one group of rows at a time.

    table = open_table(path, "parquet")                 # or "arrow" (IPC file or stream form)
    for batch in table.scan(["text"]):                   # the whole file, group by group
        ...
    layout = table.layout                                # rows (and offsets) of every group seen
    reader = TableRows()
    rows = reader.rows(layout, group=3, lo=0, hi=500, columns=["text"])   # {"text": [str, ...]}

A *group* is the unit a file is read in: a Parquet row group (read in batches of about
``_BATCH_BYTES``, so even a huge row group is never held whole) or an Arrow record batch (read
whole). :class:`TableRows` holds one open file and the current group's reader at a time and
continues where the last call stopped, so reading a group's rows in order decodes it once.
Nothing here loads a whole file, and no format is parsed by hand: Arrow IPC streams (what
``datasets`` writes) are read message by message at the offsets found while scanning.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Optional, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

_BATCH_BYTES = 4 << 20  # a Parquet row group is decoded in batches of about this many bytes
_BUFFER_BYTES = 1 << 20  # Parquet reads are buffered in pieces of this size, not a column chunk at once


@dataclass(frozen=True)
class TableLayout:
    """Where the groups of one table file are: enough to read any of them again."""

    path: str
    kind: str  # "parquet", "arrow_file" or "arrow_stream"
    group_rows: tuple[int, ...]  # rows in each group
    group_offsets: tuple[int, ...] = ()  # arrow_stream: byte offset of each record batch's message
    starts: np.ndarray = field(init=False, compare=False, repr=False)  # int64 [G + 1] first row of each group

    def __post_init__(self):
        object.__setattr__(self, "starts", np.concatenate(([0], np.cumsum(self.group_rows, dtype=np.int64))))


class Table(Protocol):
    """An open table file (see the module doc)."""

    path: str
    schema: pa.Schema
    layout: TableLayout

    def scan(self, columns: list[str]) -> Iterator[pa.RecordBatch]: ...
    def group_batches(self, group: int, columns: list[str]) -> Iterator[pa.RecordBatch]: ...
    def close(self) -> None: ...


def release_unused() -> None:
    """Hands Arrow's freed memory back to the system: its allocator (mimalloc) keeps freed pages
    otherwise, and the RSS of a pass over a file would grow by tens of MiB past what is in use."""
    pa.default_memory_pool().release_unused()


def _unreadable(path: str, what: str, err: Exception) -> ValueError:
    """A one-line error: ``"<path>: <what> (<pyarrow's first line>)"``."""
    return ValueError(f"{path}: {what} ({str(err).splitlines()[0] if str(err) else repr(err)})")


class _ParquetTable:
    def __init__(self, path: str):
        self.path = path
        try:
            self._file = pq.ParquetFile(path, buffer_size=_BUFFER_BYTES, pre_buffer=False)
        except (pa.ArrowException, OSError) as err:
            raise _unreadable(path, "not a readable Parquet file", err) from None
        meta = self._file.metadata
        self.schema = self._file.schema_arrow
        rows = tuple(meta.row_group(g).num_rows for g in range(meta.num_row_groups))
        self.layout = TableLayout(path, "parquet", rows)
        self._batch_rows_of: dict[tuple[str, ...], int] = {}

    def _batch_rows(self, columns: list[str]) -> int:
        """Rows per decoded batch: about ``_BATCH_BYTES`` of the columns read (by the footer's sizes)."""
        wanted = tuple(columns)
        if wanted not in self._batch_rows_of:
            meta, total = self._file.metadata, 0
            for g in range(meta.num_row_groups):
                group = meta.row_group(g)
                total += sum(group.column(c).total_uncompressed_size for c in range(group.num_columns)
                             if group.column(c).path_in_schema.split(".")[0] in wanted)
            per_row = max(1, total // max(1, meta.num_rows))
            self._batch_rows_of[wanted] = int(np.clip(_BATCH_BYTES // per_row, 1, 1 << 16))
        return self._batch_rows_of[wanted]

    def group_batches(self, group: int, columns: list[str]) -> Iterator[pa.RecordBatch]:
        try:
            for batch in self._file.iter_batches(batch_size=self._batch_rows(columns), row_groups=[group],
                                                 columns=columns, use_threads=False):
                yield batch
                del batch
                release_unused()
        except (pa.ArrowException, OSError) as err:
            raise _unreadable(self.path, f"row group {group} could not be read", err) from None

    def scan(self, columns: list[str]) -> Iterator[pa.RecordBatch]:
        for group in range(len(self.layout.group_rows)):
            yield from self.group_batches(group, columns)

    def close(self) -> None:
        self._file.close()


class _ArrowTable:
    """An Arrow IPC file, in the random-access file form (``ARROW1``) or the stream form. Its
    groups (record batches) are known once :meth:`scan` has passed them; a stream's batches are
    then read at the offsets the scan found."""

    def __init__(self, path: str, layout: Optional[TableLayout] = None):
        self.path = path
        try:
            self._source = pa.OSFile(path)
        except OSError as err:
            raise ValueError(f"{path}: cannot be opened ({err})") from None
        try:
            try:
                self._file_reader = pa.ipc.open_file(self._source)
                self.schema = self._file_reader.schema
            except pa.ArrowInvalid:  # not the file form: a stream (datasets' save_to_disk writes those)
                self._file_reader = None
                self._source.seek(0)
                self._stream = pa.ipc.open_stream(self._source)
                self.schema = self._stream.schema
        except (pa.ArrowException, OSError) as err:
            self.close()
            raise _unreadable(path, "not a readable Arrow IPC file", err) from None
        if self._file_reader is None and any(pa.types.is_dictionary(f.type) for f in self.schema):
            self.close()
            raise ValueError(f"{path}: an Arrow IPC stream with dictionary-encoded columns, which is not read; "
                             "write it without dictionaries (or in the IPC file form)")
        kind = "arrow_file" if self._file_reader is not None else "arrow_stream"
        self.layout = layout if layout is not None else TableLayout(path, kind, ())

    def _next_batch(self, group: int) -> Optional[pa.RecordBatch]:
        if self._file_reader is not None:
            return self._file_reader.get_batch(group) if group < self._file_reader.num_record_batches else None
        try:
            return self._stream.read_next_batch()
        except StopIteration:
            return None

    def scan(self, columns: list[str]) -> Iterator[pa.RecordBatch]:
        rows, offsets = [], []  # offsets[k]: where a stream's record batch k starts
        try:
            while True:
                offsets.append(self._source.tell())
                batch = self._next_batch(len(rows))
                if batch is None:
                    break
                rows.append(batch.num_rows)
                yield batch.select(columns)
                del batch
                release_unused()
        except (pa.ArrowException, OSError) as err:
            raise _unreadable(self.path, f"record batch {len(rows)} could not be read", err) from None
        finally:  # also when the caller stops early: the layout holds the groups seen
            self.layout = TableLayout(self.path, self.layout.kind, tuple(rows),
                                      tuple(offsets[:len(rows)]) if self._file_reader is None else ())

    def group_batches(self, group: int, columns: list[str]) -> Iterator[pa.RecordBatch]:
        try:
            if self._file_reader is not None:
                batch = self._file_reader.get_batch(group)
            else:
                self._source.seek(self.layout.group_offsets[group])
                batch = pa.ipc.read_record_batch(pa.ipc.read_message(self._source), self.schema)
        except (pa.ArrowException, OSError) as err:
            raise _unreadable(self.path, f"record batch {group} could not be read", err) from None
        yield batch.select(columns)

    def close(self) -> None:
        self._source.close()


def open_table(path: str, kind: str) -> Table:
    """Opens a ``"parquet"`` or ``"arrow"`` file (its footer or schema only); a one-line
    ValueError naming the file if pyarrow cannot read it."""
    return _ParquetTable(path) if kind == "parquet" else _ArrowTable(path)


def _reopen(layout: TableLayout) -> Table:
    if layout.kind == "parquet":
        return _ParquetTable(layout.path)
    return _ArrowTable(layout.path, layout)


# ----------------------------------------------------------------------------- reading rows

class TableRows:
    """Reads rows of one group at a time, holding one open file and that group's reader.

    ``rows(layout, group, lo, hi, columns)`` returns rows ``lo..hi`` of ``group`` (each column's
    values as a Python list); a call that starts at or after where the last one stopped, in the
    same group, continues decoding from there, any other call restarts at the group's start.
    """

    def __init__(self):
        self._table: Optional[Table] = None
        self._key: Optional[tuple] = None  # (path, group, columns) of the reader in progress
        self._batches: Optional[Iterator[pa.RecordBatch]] = None
        self._held: Optional[pa.RecordBatch] = None  # the batch the last call stopped in
        self._held_start = 0  # the group row of self._held's first row (or of the next batch)

    def close(self) -> None:
        if self._table is not None:
            self._table.close()
        self._table, self._key, self._batches, self._held = None, None, None, None

    def _start(self, layout: TableLayout, group: int, columns: list[str]) -> None:
        if self._table is None or self._table.path != layout.path:
            self.close()
            self._table = _reopen(layout)
        self._key = (layout.path, group, tuple(columns))
        self._batches = self._table.group_batches(group, columns)
        self._held, self._held_start = None, 0

    def rows(self, layout: TableLayout, group: int, lo: int, hi: int, columns: list[str]) -> dict[str, list]:
        if self._key != (layout.path, group, tuple(columns)) or lo < self._held_start:
            self._start(layout, group, columns)
        parts = []
        while True:
            if self._held is None:
                self._held = next(self._batches, None)
                if self._held is None:
                    raise ValueError(f"{layout.path}: row group {group} ends before row {hi} of it; the file "
                                     "changed after the data index was built")
            end = self._held_start + self._held.num_rows
            if end > lo:
                start = max(lo, self._held_start)
                parts.append(self._held.slice(start - self._held_start, min(hi, end) - start))
            if end >= hi:
                break
            self._held, self._held_start = None, end
            release_unused()
        table = pa.Table.from_batches(parts, schema=self._held.schema)
        values = {name: table.column(name).to_pylist() for name in columns}
        del table, parts
        release_unused()
        return values


# ----------------------------------------------------------------------------- column facts

def row_bytes(column: pa.Array) -> np.ndarray:
    """int64 [n]: the bytes of each row's strings and fixed-width values, nested lists and
    structs summed (nulls count 0): a row's size, for fingerprints and read-ahead budgets."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if pa.types.is_string_view(column.type) or pa.types.is_binary_view(column.type):
        column = column.cast(pa.large_binary())  # binary_length has no kernel for the view types
    n, kind = len(column), column.type
    if pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind) \
            or pa.types.is_large_binary(kind):
        return pc.binary_length(column).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    if pa.types.is_struct(kind):
        return sum((row_bytes(column.field(k)) for k in range(kind.num_fields)), np.zeros(n, np.int64))
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        child = row_bytes(pc.list_flatten(column))
        parents = pc.list_parent_indices(column).to_numpy(zero_copy_only=False)
        return np.bincount(parents, weights=child, minlength=n).astype(np.int64)
    try:
        width = kind.bit_width // 8
    except ValueError:  # not a fixed-width type
        width = 0
    return np.full(n, width, np.int64)


def first_null(column: pa.Array) -> Optional[int]:
    """The index of the first null row of ``column``, or None."""
    if column.null_count == 0:
        return None
    return int(pc.index(pc.is_null(column), True).as_py())
