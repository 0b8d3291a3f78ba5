"""Record fields: what a record of each ``data.format`` holds, checked alike in a JSONL object
and a table (Parquet / Arrow) row.

    fields = record_fields(cfg)                          # (RecordField("text", "data.text_field", "string"),)
    check_schema("d.parquet", schema, cfg)               # every field a column of the right type
    text = field_value(record, "d.jsonl: line 3", fields[0], cfg)

A missing field names the config key that chose it, the fields present and, when the fields
present are another format's, that format (``data.format: chat`` for records with
``messages``). Every message is one line that starts with where the record is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Literal

import pyarrow as pa

from jaxascend.config import DataConfig
from jaxascend.data.chat_templates import check_messages


@dataclass(frozen=True)
class RecordField:
    """One field a record must have."""

    name: str  # the JSON key or column name
    config_key: str  # the DataConfig key that names it, e.g. "data.text_field"
    kind: Literal["string", "messages"]  # a string, or a list of {"role", "content"} messages


def record_fields(cfg: DataConfig) -> tuple[RecordField, ...]:
    """The fields a record of ``cfg.format`` has, in the order they are read."""
    if cfg.format == "text":
        return (RecordField(cfg.text_field, "data.text_field", "string"),)
    if cfg.format == "prompt_completion":
        return (RecordField(cfg.prompt_field, "data.prompt_field", "string"),
                RecordField(cfg.completion_field, "data.completion_field", "string"))
    return (RecordField(cfg.messages_field, "data.messages_field", "messages"),)


def wanted(cfg: DataConfig) -> str:
    """What a record should hold, for an error: ``"a 'text' field"``."""
    names = [f"{f.name!r}" for f in record_fields(cfg)]
    return f"a {names[0]} field" if len(names) == 1 else f"{' and '.join(names)} fields"


def format_hint(present: Collection[str], cfg: DataConfig) -> str:
    """``"; ... set data.format: chat"`` when the fields ``present`` are another format's, else ``""``."""
    candidates = (("chat", (cfg.messages_field,)), ("prompt_completion", (cfg.prompt_field, cfg.completion_field)),
                  ("text", (cfg.text_field,)))
    for fmt, names in candidates:
        if fmt != cfg.format and all(n in present for n in names):
            return f"; records with {' and '.join(repr(n) for n in names)} are read with data.format: {fmt}"
    return ""


def listed_fields(present: Collection[str]) -> str:
    """The field names ``present``, for an error: the first ten, then how many in all (``"none"`` if empty)."""
    names = list(present)
    return ", ".join(names[:10]) + (f", ... ({len(names)} in all)" if len(names) > 10 else "") or "none"


def field_value(record: dict, where: str, field: RecordField, cfg: DataConfig) -> object:
    """``record[field.name]``, checked: a one-line ValueError starting with ``where`` (``"<file>:
    line <n>"`` or ``"<file>: row <n>"``) if it is missing or of the wrong kind."""
    if field.name not in record:
        raise ValueError(f"{where} has no field {field.name!r} ({field.config_key}); fields present: "
                         f"{listed_fields(record)}{format_hint(record, cfg)}")
    value = record[field.name]
    if field.kind == "string":
        if not isinstance(value, str):
            raise ValueError(f"{where}: field {field.name!r} ({field.config_key}) is a {type(value).__name__}, "
                             "expected a string")
        return value
    try:
        check_messages(value, field=field.name, need_assistant=not cfg.train_on_prompt)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    return value


def _is_string(kind: pa.DataType) -> bool:
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)


def _is_list(kind: pa.DataType) -> bool:
    return pa.types.is_list(kind) or pa.types.is_large_list(kind)


def check_schema(path: str, schema: pa.Schema, cfg: DataConfig) -> None:
    """Every field of ``cfg.format`` is a column of ``schema`` of the right type (strings; a list
    for messages), or a one-line ValueError naming the file, the column and the columns present."""
    for field in record_fields(cfg):
        if field.name not in schema.names:
            raise ValueError(f"{path} has no column {field.name!r} ({field.config_key}); columns present: "
                             f"{listed_fields(schema.names)}{format_hint(schema.names, cfg)}")
        kind = schema.field(field.name).type
        if field.kind == "string" and not _is_string(kind):
            raise ValueError(f"{path}: column {field.name!r} ({field.config_key}) holds {kind}, expected strings")
        if field.kind == "messages" and not _is_list(kind):
            raise ValueError(f"{path}: column {field.name!r} ({field.config_key}) holds {kind}, expected lists "
                             "of {'role': ..., 'content': ...} messages")
