"""JSONL files: the byte range of every non-blank line, and one line parsed into a record.

    offsets, lengths, lines = index_jsonl(path, limit)   # found in one pass, nothing parsed
    record = load_jsonl_object(raw, "d.jsonl: line 3", "a 'text' field")

A file is scanned for line breaks in pieces of ``_INDEX_CHUNK_BYTES`` (never held whole); a line
is parsed only when it is read.
"""

from __future__ import annotations

import json

import numpy as np

_INDEX_CHUNK_BYTES = 4 << 20  # JSONL files are scanned for line breaks in pieces of this size
_WHITESPACE = np.array([9, 10, 13, 32], dtype=np.uint8)


def load_jsonl_object(raw: bytes, where: str, wanted: str) -> dict:
    """Parses one JSONL line into a dict; ``where`` is ``"<file>: line <n>"``, ``wanted`` says what
    the object should hold (both for the error).

    Raises a one-line ValueError naming the file and the 1-based line if the line is not JSON or
    not an object.
    """
    try:
        record = json.loads(raw)
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError
        raise ValueError(f"{where} is not valid JSON ({err})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where} is a JSON {type(record).__name__}, expected an object with {wanted}")
    return record


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


def index_jsonl(path: str, limit: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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
