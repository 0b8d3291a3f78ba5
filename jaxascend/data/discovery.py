"""Discovery: the files ``DataConfig.paths`` names, each with the kind of data it holds.

    files = discover_files(cfg.paths, cfg.include)   # [DataFile(path, kind, bundled), ...]

A file's kind comes from its name: ``.jsonl`` (one record per line), ``.parquet``, ``.arrow``
(Arrow IPC, file or stream form) or ``text`` (a ``.txt`` file, or whatever else ``include``
matches: one document). A folder written by Hugging Face ``datasets``' ``save_to_disk``
(``state.json`` + ``dataset_info.json`` + ``data-*.arrow``) is one dataset, its Arrow files in
``state.json``'s order, whether named in ``paths`` or met inside a directory; a ``DatasetDict``
folder (``dataset_dict.json``) with one split is that split, with several it is refused until
``paths`` names one. ``"@stdlib"`` is the running Python's standard library (without
site-packages). :func:`text_file_problem` says why a ``text`` file is not text (NUL bytes,
invalid UTF-8), so that no binary file is ever trained on as text.
"""

from __future__ import annotations

import codecs
import fnmatch
import json
import os
import sysconfig
from dataclasses import dataclass
from typing import Literal, Optional

STDLIB = "@stdlib"
KINDS_ACCEPTED = "UTF-8 text, .jsonl, .parquet and .arrow files and datasets save_to_disk folders"
_STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_SUFFIX_KINDS = {".jsonl": "jsonl", ".parquet": "parquet", ".arrow": "arrow"}
_CHECK_CHUNK_BYTES = 4 << 20  # text files are checked in pieces of this size

FileKind = Literal["text", "jsonl", "parquet", "arrow"]


@dataclass(frozen=True)
class DataFile:
    """One file to read and what it holds."""

    path: str
    kind: FileKind
    bundled: bool = False  # a file of "@stdlib": skipped, not refused, if it is not UTF-8 text


def file_kind(path: str) -> FileKind:
    """The kind of ``path`` by its suffix (case-insensitive); anything unknown is ``text``."""
    return _SUFFIX_KINDS.get(os.path.splitext(path)[1].lower(), "text")


def missing_paths(paths: list[str]) -> list[str]:
    """The entries of ``DataConfig.paths`` that name nothing on disk (``"@stdlib"`` always exists)."""
    return [spec for spec in paths if spec != STDLIB and not os.path.exists(os.path.expanduser(spec))]


# ----------------------------------------------------------------------------- datasets folders

def _read_json(path: str, what: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: not a readable {what} ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a {what} (a JSON {type(data).__name__}, expected an object)")
    return data


def datasets_folder_files(folder: str) -> Optional[list[str]]:
    """The Arrow files of a ``datasets`` ``save_to_disk`` folder in their order, or None if
    ``folder`` is not one. A ``DatasetDict`` folder of one split gives that split's files; one
    of several splits is refused (one-line ValueError naming the splits)."""
    state = os.path.join(folder, "state.json")
    if os.path.isfile(state) and os.path.isfile(os.path.join(folder, "dataset_info.json")):
        entries = _read_json(state, "datasets state.json").get("_data_files")
        if not isinstance(entries, list) or not all(isinstance(e, dict) and isinstance(e.get("filename"), str)
                                                     for e in entries):
            raise ValueError(f"{state}: '_data_files' is not a list of {{'filename': ...}} entries")
        files = [os.path.join(folder, e["filename"]) for e in entries]
        for path in files:
            if not os.path.isfile(path):
                raise ValueError(f"{folder}: a datasets folder whose state.json names {path}, which is missing")
        return files
    listing = os.path.join(folder, "dataset_dict.json")
    if not os.path.isfile(listing):
        return None
    splits = _read_json(listing, "datasets dataset_dict.json").get("splits")
    if not isinstance(splits, list) or not splits or not all(isinstance(s, str) for s in splits):
        raise ValueError(f"{listing}: 'splits' is not a non-empty list of split names")
    if len(splits) > 1:
        raise ValueError(f"{folder} is a datasets DatasetDict with the splits {', '.join(splits)}; name "
                         f"one split's folder in data.paths (e.g. {os.path.join(folder, splits[0])})")
    files = datasets_folder_files(os.path.join(folder, splits[0]))
    if files is None:
        raise ValueError(f"{folder}: the split folder {splits[0]!r} of this DatasetDict is not a datasets folder")
    return files


# ----------------------------------------------------------------------------- discovery

def _stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def _matches(name: str, rel_path: str, include: list[str]) -> bool:
    return any(fnmatch.fnmatch(name, g) or fnmatch.fnmatch(rel_path, g) for g in include)


def _walk(root: str, include: list[str], skip_dirs: set[str], bundled: bool) -> list[DataFile]:
    """Files under ``root`` whose name (or path relative to root) matches a glob, and the files of
    every datasets folder met, sorted by path relative to root.

    Hidden directories (``.git``, ...) and ``skip_dirs`` are not entered; undecodable file names
    are kept as the OS gives them.
    """
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        prefix = "" if rel_dir == "." else rel_dir.replace(os.sep, "/") + "/"
        dataset = datasets_folder_files(dirpath)
        if dataset is not None:  # its files in state.json's order, whatever include says
            found += [(f"{prefix}{k:08d}", DataFile(path, "arrow", bundled)) for k, path in enumerate(dataset)]
            dirnames[:] = []
            continue
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in skip_dirs]
        for name in filenames:
            path = os.path.join(dirpath, name)
            if _matches(name, prefix + name, include):
                found.append((prefix + name, DataFile(path, file_kind(name), bundled)))
    return [data_file for _, data_file in sorted(found, key=lambda item: item[0])]


def _named_file(spec: str, path: str, include: list[str]) -> DataFile:
    name = os.path.basename(path)
    kind = file_kind(name)
    if kind == "text" and not (name.endswith(".txt") or _matches(name, name, include)):
        raise ValueError(f"data path {spec!r}: {KINDS_ACCEPTED}, or text files matching data.include "
                         f"{include}, can be read; add a glob such as "
                         f"'*{os.path.splitext(name)[1] or name}' to data.include if it is text")
    return DataFile(path, kind)


def discover_files(paths: list[str], include: list[str]) -> list[DataFile]:
    """Expands ``DataConfig.paths`` into a deterministic list of files (first occurrence wins).

    A named file is taken if it is ``.txt`` / ``.jsonl`` / ``.parquet`` / ``.arrow`` or matches
    ``include``; a datasets folder contributes its Arrow files; any other directory its matching
    files (and datasets folders) recursively; ``"@stdlib"`` is the standard library's directory.
    """
    files: list[DataFile] = []
    for spec in paths:
        if spec == STDLIB:
            files += _walk(_stdlib_root(), include, _STDLIB_SKIP_DIRS, bundled=True)
            continue
        path = os.path.expanduser(spec)
        if os.path.isdir(path):
            files += _walk(path, include, {"__pycache__"}, bundled=False)
        elif os.path.isfile(path):
            files.append(_named_file(spec, path, include))
        else:
            raise ValueError(f"data path {spec!r} does not exist")
    seen, unique = set(), []
    for f in files:
        key = os.path.realpath(f.path)
        if key not in seen:
            seen.add(key)
            unique.append(f)
    return unique


# ----------------------------------------------------------------------------- text files

def text_file_problem(path: str) -> Optional[str]:
    """Why ``path`` is not UTF-8 text (a NUL byte, an invalid byte, a cut character), or None.

    Read in pieces of ``_CHECK_CHUNK_BYTES``; the answer names the byte and its offset.
    """
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHECK_CHUNK_BYTES):
            nul = chunk.find(b"\0")
            if nul >= 0:
                return f"a NUL byte at offset {offset + nul}, so a binary file"
            pending = len(decoder.getstate()[0])  # bytes of a character cut at the last piece's end
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as err:
                return (f"not UTF-8 (byte 0x{err.object[err.start]:02x} at offset "
                        f"{offset - pending + err.start})")
            offset += len(chunk)
    if decoder.getstate()[0]:
        return "not UTF-8 (it ends inside a character)"
    return None
