"""Every config field with its type, default and meaning, read from the dataclasses themselves.

The meaning of a field is the comment written beside it in the source: the block of ``#`` lines
right above its line, then the comment at the end of its line (either may be missing, not both;
``tests/test_config_docs.py`` holds every field to it). The source is read with :mod:`tokenize`
and :mod:`ast`, so a comment is never confused with a string and a field's place is its
annotation's, however it is wrapped.

    for doc in config_fields():                    # Config's sections, nested ones included
        print(doc.name, doc.type_label, doc.default_label, doc.meaning)

``python -m jaxascend.config`` prints them (:mod:`jaxascend.config.__main__`).
"""

from __future__ import annotations

import dataclasses
import functools
import io
import re
import textwrap
import typing
from dataclasses import dataclass

import yaml

from jaxascend.config.sections import Config
from jaxascend.config.values import type_text


@dataclass(frozen=True)
class FieldDoc:
    """One field of a config section: ``name`` is its dotted path (``train.distributed.coordinator``)."""

    name: str
    type_label: str  # e.g. "'cosine' | 'linear'", "int | null", "list[str]"
    default_label: str  # the default as YAML writes it
    meaning: str  # the source's comments, one line


@dataclass(frozen=True)
class SectionDoc:
    """One section of :class:`Config` (or a section nested in one) and its fields."""

    name: str  # "optimizer", "train.distributed"
    summary: str  # the first line of the section's docstring
    fields: tuple[FieldDoc, ...]


def type_label(tp) -> str:
    """A short spelling of an annotation: ``int``, ``'a' | 'b'``, ``float | null``, ``list[str]``."""
    return type_text(tp, words=False)


def default_label(field: dataclasses.Field) -> str:
    """The field's default as YAML writes it (``null``, ``true``, ``[a, b]``, ``8MiB``)."""
    if field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    elif field.default is not dataclasses.MISSING:
        value = field.default
    else:
        return "(required)"
    if dataclasses.is_dataclass(value):
        return "(section)"
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 16).strip()
    return text[:-len("\n...")].strip() if text.endswith("\n...") else text


@functools.lru_cache(maxsize=None)
def field_comments(cls: type) -> dict[str, str]:
    """``{field name: its comments as one line}`` from ``cls``'s source (see the module doc)."""
    import ast  # here, not at the top: the CLIs' --help imports this module and needs neither
    import inspect
    import tokenize

    source = textwrap.dedent(inspect.getsource(cls))
    comments: dict[int, str] = {}  # line -> comment text
    code_lines: set[int] = set()  # lines holding something other than a comment
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                              tokenize.ENDMARKER):
            code_lines.update(range(tok.start[0], tok.end[0] + 1))
    body = ast.parse(source).body[0].body
    found = {}
    for node in body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above = []
        line = node.lineno - 1
        while line in comments and line not in code_lines:  # the block of comment lines above
            above.insert(0, comments[line])
            line -= 1
        beside = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
        found[node.target.id] = " ".join(part for part in (" ".join(above), " ".join(beside)) if part)
    return found


def section_fields(cls: type, prefix: str) -> list[SectionDoc]:
    """The section ``cls`` named ``prefix`` and, after it, each section nested in one of its fields."""
    hints = typing.get_type_hints(cls)
    comments = field_comments(cls)
    fields, nested = [], []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        name = f"{prefix}.{f.name}"
        fields.append(FieldDoc(name, type_label(tp), default_label(f), comments.get(f.name, "")))
        inner = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
        if dataclasses.is_dataclass(tp) or inner:
            nested += section_fields(tp if dataclasses.is_dataclass(tp) else inner[0], name)
    return [SectionDoc(prefix, _summary(cls), tuple(fields))] + nested


def _summary(cls: type) -> str:
    """The first paragraph of ``cls``'s docstring as one line of plain text (no reST markup)."""
    text = " ".join(textwrap.dedent(cls.__doc__ or "").strip().split("\n\n")[0].split())
    return re.sub(r":\w+:`~?([^`]*)`|``([^`]*)``", lambda m: m.group(1) or m.group(2), text)


def config_sections() -> list[SectionDoc]:
    """Every section of :class:`Config`, in its order, each followed by those nested in it."""
    hints = typing.get_type_hints(Config)
    return [doc for f in dataclasses.fields(Config) for doc in section_fields(hints[f.name], f.name)]


def config_fields() -> list[FieldDoc]:
    """Every field of every section (a nested section's fields included)."""
    return [field for section in config_sections() for field in section.fields]


def section_summaries() -> list[tuple[str, str]]:
    """``(section, first line of its docstring)`` for each top-level section of :class:`Config`."""
    hints = typing.get_type_hints(Config)
    return [(f.name, _summary(hints[f.name])) for f in dataclasses.fields(Config)]


def sections_help() -> str:
    """The CLIs' ``--help`` epilog: the config's sections, and where every field is described."""
    summaries = section_summaries()
    width = max(len(name) for name, _ in summaries)
    lines = ["config sections (a YAML file with any of them; --set SECTION.FIELD=VALUE overrides one field, SECTION.SUB.FIELD a nested one):"]
    for name, summary in summaries:
        lines += textwrap.wrap(summary, 100, initial_indent=f"  {name.ljust(width)}  ",
                               subsequent_indent=" " * (width + 4))
    lines += ["", "Every field with its type, default and meaning: python -m jaxascend.config [SECTION ...]",
              "README.md, \"Writing a config\", describes them by topic; configs/ has examples."]
    return "\n".join(lines)


def describe(sections: list[SectionDoc], width: int = 100) -> str:
    """The listing ``python -m jaxascend.config`` prints: per section its summary, then each field
    as ``name: type = default`` with its meaning wrapped below it."""
    out = []
    for section in sections:
        out.append(f"[{section.name}] {section.summary}".rstrip())
        for f in section.fields:
            out.append(f"  {f.name}: {f.type_label} = {f.default_label}")
            if f.meaning:
                out += textwrap.wrap(f.meaning, width, initial_indent="      ", subsequent_indent="      ")
        out.append("")
    return "\n".join(out).rstrip() + "\n"
