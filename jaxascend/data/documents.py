"""Documents: find the files of ``DataConfig.paths`` and index every document in them.

    index = build_document_index(cfg.data)   # file, byte offset and length of every document
    text = index.read(i)                      # one document, read from disk when asked for

A ``.jsonl`` file holds one document per non-blank line (the ``text_field`` of a JSON object);
any other file (``.txt``, or whatever the ``include`` globs match, such as ``*.py``) is one
document. Directories are searched recursively for files matching ``include``. ``"@stdlib"`` is
the running Python's standard library (without site-packages). At start only the index is built;
:class:`~jaxascend.data.packing.BatchStream` reads and tokenizes documents as it reaches them.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass

import numpy as np

from jaxascend.config import DataConfig

STDLIB = "@stdlib"
_STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_INDEX_CHUNK_BYTES = 4 << 20  # JSONL files are scanned for line breaks in pieces of this size
_WHITESPACE = np.array([9, 10, 13, 32], dtype=np.uint8)


# ----------------------------------------------------------------------------- discovery

def _stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def _matches(name: str, rel_path: str, include: list[str]) -> bool:
    return any(fnmatch.fnmatch(name, g) or fnmatch.fnmatch(rel_path, g) for g in include)


def _walk(root: str, include: list[str], skip_dirs: set[str]) -> list[str]:
    """Files under ``root`` whose name (or path relative to root) matches a glob, sorted by that path.

    Hidden directories (``.git``, ...) and ``skip_dirs`` are not entered; undecodable file names
    are kept as the OS gives them.
    """
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in skip_dirs]
        rel_dir = os.path.relpath(dirpath, root)
        for name in filenames:
            rel = name if rel_dir == "." else os.path.join(rel_dir, name).replace(os.sep, "/")
            if _matches(name, rel, include):
                found.append((rel, os.path.join(dirpath, name)))
    return [path for _, path in sorted(found)]


def missing_paths(paths: list[str]) -> list[str]:
    """The entries of ``DataConfig.paths`` that name nothing on disk (``"@stdlib"`` always exists)."""
    return [spec for spec in paths if spec != STDLIB and not os.path.exists(os.path.expanduser(spec))]


def discover_files(paths: list[str], include: list[str]) -> list[str]:
    """Expands ``DataConfig.paths`` into a deterministic list of files (first occurrence wins).

    A named file is taken if it is ``.txt`` / ``.jsonl`` or matches ``include``; a directory
    contributes its matching files recursively; ``"@stdlib"`` is the standard library's directory.
    """
    files: list[str] = []
    for spec in paths:
        if spec == STDLIB:
            files += _walk(_stdlib_root(), include, _STDLIB_SKIP_DIRS)
            continue
        path = os.path.expanduser(spec)
        if os.path.isdir(path):
            files += _walk(path, include, {"__pycache__"})
        elif os.path.isfile(path):
            name = os.path.basename(path)
            if not (name.endswith((".txt", ".jsonl")) or _matches(name, name, include)):
                raise ValueError(f"data path {spec!r}: only .txt and .jsonl files, or files matching "
                                 f"data.include {include}, can be read; add a glob such as "
                                 f"'*{os.path.splitext(name)[1] or name}' to data.include")
            files.append(path)
        else:
            raise ValueError(f"data path {spec!r} does not exist")
    seen, unique = set(), []
    for f in files:
        key = os.path.realpath(f)
        if key not in seen:
            seen.add(key)
            unique.append(f)
    return unique


# ----------------------------------------------------------------------------- the document index

def load_jsonl_object(raw: bytes, path: str, line: int, wanted: str) -> dict:
    """Parses one JSONL line into a dict; ``wanted`` says what the object should hold (for the error).

    Raises a one-line ValueError naming the file and the 1-based line if the line is not JSON or
    not an object.
    """
    try:
        record = json.loads(raw)
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError
        raise ValueError(f"{path}: line {line} is not valid JSON ({err})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{path}: line {line} is a JSON {type(record).__name__}, expected an object "
                         f"with {wanted}")
    return record


def jsonl_field(record: dict, path: str, line: int, name: str, config_key: str) -> object:
    """``record[name]``, or a one-line ValueError naming the field, its config key and the fields present."""
    if name not in record:
        keys = ", ".join(list(record)[:10])
        raise ValueError(f"{path}: line {line} has no field {name!r} ({config_key}); "
                         f"fields present: {keys or 'none'}")
    return record[name]


def _parse_jsonl_line(raw: bytes, path: str, line: int, text_field: str) -> str:
    record = load_jsonl_object(raw, path, line, f"a {text_field!r} field")
    text = jsonl_field(record, path, line, text_field, "data.text_field")
    if not isinstance(text, str):
        raise ValueError(f"{path}: line {line}: field {text_field!r} is a {type(text).__name__}, "
                         "expected a string")
    return text


def _non_blank(buf: bytes, arr: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Indices of the lines ``buf[starts[i]:ends[i]]`` that hold more than whitespace.

    Only lines that are empty or start with whitespace can be blank; those few are checked one
    by one, so the scan costs one pass over the first byte of each line.
    """
    lengths = ends - starts
    first = arr[np.minimum(starts, max(len(arr) - 1, 0))] if len(arr) else np.zeros(len(starts), np.uint8)
    suspect = np.flatnonzero((lengths == 0) | np.isin(first, _WHITESPACE))
    blank = [i for i in suspect.tolist() if not buf[starts[i]:ends[i]].strip()]
    return np.delete(np.arange(len(starts)), blank)


def _index_jsonl(path: str, limit: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Byte offsets, lengths and 1-based line numbers of the first ``limit`` non-blank lines."""
    offsets, lengths, lines = [], [], []
    count, base, line_no, carry = 0, 0, 0, []
    with open(path, "rb") as f:
        while count < limit:
            chunk = f.read(_INDEX_CHUNK_BYTES)
            if chunk and b"\n" not in chunk:  # inside a long line: join its pieces only once
                carry.append(chunk)
                continue
            buf = b"".join(carry + [chunk])
            arr = np.frombuffer(buf, dtype=np.uint8)
            ends = np.flatnonzero(arr == 10)
            if not chunk and len(buf):  # the last line has no newline
                ends = np.append(ends, len(buf))
            if len(ends):
                starts = np.concatenate(([0], ends[:-1] + 1))
                keep = _non_blank(buf, arr, starts, ends)[: limit - count]
                offsets.append(base + starts[keep])
                lengths.append((ends - starts)[keep])
                lines.append(line_no + 1 + keep)
                count += len(keep)
                line_no += len(ends)
                consumed = int(ends[-1]) + 1
                carry, base = [buf[consumed:]], base + consumed
            else:
                carry = [buf]
            if not chunk:
                break
    if not offsets:
        empty = np.zeros(0, np.int64)
        return empty, empty, empty
    return np.concatenate(offsets), np.concatenate(lengths), np.concatenate(lines)


@dataclass(frozen=True)
class DocumentIndex:
    """Where every document lives: one entry per document, in discovery order.

    ``line`` is the 1-based line number for JSONL documents and 0 for whole-file documents.
    """

    files: list[str]  # path of each file, by file number
    file: np.ndarray  # int32 [n] file number of each document
    offset: np.ndarray  # int64 [n] byte offset in the file
    length: np.ndarray  # int64 [n] byte length
    line: np.ndarray  # int64 [n] line number (JSONL) or 0
    text_field: str

    def __len__(self) -> int:
        return len(self.file)

    @property
    def total_bytes(self) -> int:
        return int(self.length.sum())

    def fingerprint(self) -> str:
        """A short hash of the document sizes, to notice data that changed under a saved state."""
        return hashlib.sha1(np.ascontiguousarray(self.length, dtype="<i8").tobytes()).hexdigest()[:16]

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

    def read(self, i: int) -> str:
        """Returns the text of document ``i`` (invalid UTF-8 in plain files becomes U+FFFD)."""
        raw = self.read_bytes(i)
        path = self.files[self.file[i]]
        if self.line[i]:
            return _parse_jsonl_line(raw, path, int(self.line[i]), self.text_field)
        return raw.decode("utf-8", errors="replace")


def index_documents(cfg: DataConfig) -> DocumentIndex:
    """Finds the documents of ``cfg`` (up to ``cfg.max_documents``) without reading or parsing any.

    :func:`build_document_index` (text) and the example index (records) check what they need on top.
    """
    limit = cfg.max_documents if cfg.max_documents is not None else np.iinfo(np.int64).max
    files = discover_files(cfg.paths, cfg.include)
    used_files: list[str] = []
    parts: list[tuple[np.ndarray, ...]] = []  # (file, offset, length, line) per run of documents
    whole_files: list[tuple[int, int]] = []  # (file number, size) of consecutive plain files

    def flush_whole_files():
        # Plain files are gathered in a Python list and turned into arrays in one go: corpora of
        # many small files would otherwise pay for several tiny numpy arrays per file.
        if whole_files:
            numbers, sizes = zip(*whole_files)
            zeros = np.zeros(len(sizes), np.int64)
            parts.append((np.array(numbers, np.int32), zeros, np.array(sizes, np.int64), zeros))
            whole_files.clear()

    count = 0
    for path in files:
        if count >= limit:
            break
        if path.endswith(".jsonl"):
            offsets, lengths, lines = _index_jsonl(path, limit - count)
            if len(offsets):
                flush_whole_files()
                parts.append((np.full(len(offsets), len(used_files), np.int32), offsets, lengths, lines))
                used_files.append(path)
                count += len(offsets)
        elif (size := os.path.getsize(path)) > 0:
            whole_files.append((len(used_files), size))
            used_files.append(path)
            count += 1
    flush_whole_files()
    if count == 0:
        found = f"{len(files)} matching files, all empty" if files else "no file matched"
        raise ValueError(f"no documents found in data.paths {cfg.paths} with data.include {cfg.include} "
                         f"({found})")
    return DocumentIndex(files=used_files, text_field=cfg.text_field,
                         **{k: np.concatenate([p[j] for p in parts])
                            for j, k in enumerate(("file", "offset", "length", "line"))})


def build_document_index(cfg: DataConfig) -> DocumentIndex:
    """Finds the documents of ``cfg`` (up to ``cfg.max_documents``) without reading their text.

    The first document of every JSONL file is parsed right away, so a wrong ``text_field`` or a
    non-JSON file fails here rather than mid-training; later lines are checked when read.
    """
    index = index_documents(cfg)
    for file_no in range(len(index.files)):
        first = int(np.searchsorted(index.file, file_no))
        if index.line[first]:
            index.read(first)
    return index
