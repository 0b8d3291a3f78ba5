"""First records: the format ``data.format: auto`` finds in the data, and the first record of
every file checked against the run's format, before a tokenizer is loaded or anything is written.

    choice = read_data_format(cfg.data, eval_paths=cfg.eval.paths)
    choice.data.format      # "chat": auto resolved (an explicit format is kept)
    choice.note             # "data.format: auto found chat records ('messages') in d.jsonl: chat", or None

Only the first record of each file is read: a JSONL file's first non-blank line, a Parquet or
Arrow file's schema and first row (a ``datasets`` folder's files each); a text file is not
opened. So the planner says what the trainer says about a wrong field or a mixed format, without
a tokenizer and without reading the data whole.

What auto finds in a record (the field names are the config's): ``messages_field`` means chat,
``prompt_field`` or ``completion_field`` prompt_completion, ``text_field`` text, in that order; a
plain text file (``.txt``, ``data.include``'s matches, ``@stdlib``) is text. Files that disagree
are one error naming two of them and what each holds; a record with none of the fields is one
error naming the file, the line (row) and the fields it has.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import pyarrow as pa

from jaxascend.config import ConfigError, DataConfig
from jaxascend.data.discovery import DataFile, discover_files
from jaxascend.data.fields import check_schema, field_value, listed_fields, record_fields, wanted
from jaxascend.data.jsonl_files import load_jsonl_object
from jaxascend.data.table_files import open_table

_BLANK = b" \t\r\n"  # a JSONL line of only these holds no record (as jaxascend.data.jsonl_files skips it)


@dataclass(frozen=True)
class FirstRecord:
    """What the first record of one data file holds."""

    file: DataFile
    where: str  # "<file>: line <n>" (JSONL), "<file>: row 1" (table), "<file>" (text)
    record: Optional[dict] = None  # the JSONL object or the table's first row; None: a text file, or no record
    columns: Optional[pa.Schema] = None  # a table's columns (also when it has no row)
    text: bool = False  # a non-empty text file: one document

    @property
    def fields(self) -> Optional[list[str]]:
        """The fields (columns) a record holds, None for a text file or a file with no record."""
        if self.record is None:
            return None
        return list(self.columns.names) if self.columns is not None else list(self.record)


@dataclass(frozen=True)
class FormatChoice:
    """The data section with its format resolved, and the note when auto chose it."""

    data: DataConfig  # format is "text", "prompt_completion" or "chat", never "auto"
    note: Optional[str] = None  # one line, without "note: "; None for an explicit format


# ----------------------------------------------------------------------------- reading

def _first_line(path: str) -> Optional[tuple[int, bytes]]:
    """The 1-based number and bytes of the first non-blank line of a JSONL file, or None."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if raw.strip(_BLANK):
                return number, raw
    return None


def _first_row(data_file: DataFile) -> tuple[pa.Schema, Optional[dict]]:
    """A table file's columns and first row (None when it has no row): its first group only."""
    table = open_table(data_file.path, data_file.kind)
    try:
        scan = table.scan(list(table.schema.names))
        try:
            row = next((b.slice(0, 1).to_pylist()[0] for b in scan if b.num_rows), None)
        finally:
            scan.close()
        return table.schema, row
    finally:
        table.close()


def _auto_wanted(cfg: DataConfig) -> str:
    return f"a {cfg.messages_field!r}, {cfg.prompt_field!r} and {cfg.completion_field!r}, or {cfg.text_field!r} field"


def read_first_records(cfg: DataConfig, paths: Sequence[str]) -> list[FirstRecord]:
    """The first record of every file ``paths`` name (found as the data index finds them)."""
    want = _auto_wanted(cfg) if cfg.format == "auto" else wanted(cfg)
    firsts = []
    for data_file in discover_files(list(paths), cfg.include):
        path = data_file.path
        if data_file.kind == "text":
            firsts.append(FirstRecord(data_file, path, text=os.path.getsize(path) > 0))
        elif data_file.kind == "jsonl":
            line = _first_line(path)
            if line is None:
                firsts.append(FirstRecord(data_file, path))
            else:
                where = f"{path}: line {line[0]}"
                firsts.append(FirstRecord(data_file, where, load_jsonl_object(line[1], where, want)))
        else:
            schema, row = _first_row(data_file)
            firsts.append(FirstRecord(data_file, f"{path}: row 1", row, schema))
    return firsts


# ----------------------------------------------------------------------------- auto

def _candidates(cfg: DataConfig) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """What auto looks for, in order: (format, the fields that mean it)."""
    return (("chat", (cfg.messages_field,)), ("prompt_completion", (cfg.prompt_field, cfg.completion_field)),
            ("text", (cfg.text_field,)))


def _holds(first: FirstRecord, cfg: DataConfig) -> Optional[tuple[str, str]]:
    """``(format, what the file holds)`` for auto, None for a file with no record; a one-line
    ValueError naming the file, the line (row) and its fields when it holds none of auto's fields."""
    if first.text:
        return "text", "plain text"
    present = first.fields
    if present is None:
        return None
    for fmt, names in _candidates(cfg):
        found = [n for n in names if n in present]
        if found:
            return fmt, f"{fmt} records ({' and '.join(repr(n) for n in found)})"
    unit = "column" if first.columns is not None else "field"
    looks = ", ".join(f"{' and '.join(repr(n) for n in names)} for {fmt}" for fmt, names in _candidates(cfg))
    raise ValueError(f"{first.where} has none of the {unit}s data.format: auto looks for ({looks}); {unit}s "
                     f"present: {listed_fields(present)}")


def resolve_format(cfg: DataConfig, firsts: Optional[list[FirstRecord]] = None) -> FormatChoice:
    """``cfg`` with ``format: auto`` resolved from ``firsts`` (default: read from ``cfg.paths``);
    an explicit format is kept, without a note. Data with no record at all resolves to text
    (chat with a ``chat_template``) and no note: the data index then says it found nothing."""
    if cfg.format != "auto":
        return FormatChoice(cfg)
    firsts = read_first_records(cfg, cfg.paths) if firsts is None else firsts
    found = [(first, *holds) for first in firsts if (holds := _holds(first, cfg)) is not None]
    if not found:
        return FormatChoice(dataclasses.replace(cfg, format="chat" if cfg.chat_template else "text"))
    first, fmt, holds = found[0]
    other = next((f for f in found if f[1] != fmt), None)
    if other is not None:
        raise ValueError(f"data.format: auto: {first.file.path} holds {holds} but {other[0].file.path} holds "
                         f"{other[2]}; a run reads one format, so data.paths must hold files of one")
    more = len(found) - 1
    where = first.file.path + (f" and {more} other file{'s' if more > 1 else ''}" if more else "")
    said = f"data.format: auto found {holds} in {where}"
    if cfg.chat_template is not None and fmt != "chat":
        raise ConfigError(f"data.chat_template: only used with data.format: chat ({said}: {fmt})")
    return FormatChoice(dataclasses.replace(cfg, format=fmt), f"{said}: {fmt}")


# ----------------------------------------------------------------------------- the field check

def text_file_refusal(path: str, cfg: DataConfig) -> ValueError:
    """The error for a text file among the data of a records format (prompt_completion, chat)."""
    return ValueError(f"data.format: {cfg.format} reads records (JSONL lines, Parquet or Arrow rows); "
                      f"{path} is a text file")


def check_first_records(cfg: DataConfig, firsts: list[FirstRecord]) -> None:
    """Each first record has ``cfg.format``'s fields, of the right kinds: the one-line
    ValueError the data index and the example source would raise for it (same words)."""
    for first in firsts:
        if first.text and cfg.format != "text":
            raise text_file_refusal(first.file.path, cfg)
        if first.columns is not None:
            check_schema(first.file.path, first.columns, cfg)
        if first.record is None:
            continue
        for field in record_fields(cfg):
            if first.columns is not None and first.record.get(field.name) is None:
                raise ValueError(f"{first.file.path}: row 1: field {field.name!r} ({field.config_key}) is null")
            field_value(first.record, first.where, field, cfg)


def read_data_format(cfg: DataConfig, eval_paths: Sequence[str] = ()) -> FormatChoice:
    """``cfg``'s format resolved (:func:`resolve_format`) and the first record of every
    ``cfg.paths`` and ``eval_paths`` file checked against it (errors about the latter start with
    ``eval.paths: ``, as the held-out data's do)."""
    firsts = read_first_records(cfg, cfg.paths)
    choice = resolve_format(cfg, firsts)
    check_first_records(choice.data, firsts)
    if eval_paths:
        held_out = dataclasses.replace(choice.data, paths=list(eval_paths), max_documents=None)
        try:
            check_first_records(held_out, read_first_records(held_out, held_out.paths))
        except ValueError as err:
            raise ValueError(f"eval.paths: {err}") from None
    return choice
