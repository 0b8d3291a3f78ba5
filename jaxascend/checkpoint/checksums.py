"""Checksums of a checkpoint step: crc32c of every array leaf (kept in the meta item, checked on
restore: Orbax stores none, so a garbled OCDBT file would restore silently) and of every file of
the Orbax items (``<step>/jaxascend_files.json``, written once the step is complete), which name
the damaged file when a leaf comes back wrong."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import jax
import numpy as np

from jaxascend.native import extension as _native
from jaxascend.checkpoint.errors import CorruptCheckpointError

FILE_CHECKSUMS = "jaxascend_files.json"  # crc32c of every file of the Orbax items, written once complete
ORBAX_ITEMS = ("params", "opt_state", "rng")


def leaf_name(path) -> str:
    """Orbax's name of a leaf: its keys joined with '.'."""
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
    return ".".join(parts)


def leaf_bytes(x: Any) -> Optional[np.ndarray]:
    """The C-order bytes of an array leaf (zero-copy for host arrays), None for other leaves."""
    if not isinstance(x, (np.ndarray, np.generic, jax.Array)):
        return None
    return np.ascontiguousarray(np.asarray(x)).reshape(-1).view(np.uint8)


def tree_checksums(tree: Any) -> dict:
    """``{leaf name: crc32c of its bytes}`` for every array leaf of ``tree``."""
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        data = leaf_bytes(x)
        if data is not None:
            out[leaf_name(path)] = _native.crc32c(data)
    return out


def verify_checksums(tree: Any, expected: Optional[dict], item_dir: Path) -> None:
    if expected is None:
        return
    for name, crc in tree_checksums(tree).items():
        if name in expected and crc != expected[name]:
            raise CorruptCheckpointError(
                f"checkpoint item {item_dir} is corrupt: leaf {name!r} restored with crc32c {crc:#010x}, "
                f"saved with {expected[name]:#010x} (its data files are under {item_dir})")


def write_file_checksums(step_dir: Path) -> None:
    """Records the crc32c of every file of the Orbax items (params, opt_state, rng) of a complete
    step, so that a damaged one can be named on restore (the leaf checksums in the meta item only
    say which array came back wrong). A step whose record is missing is still restored."""
    sums = {}
    for item in ORBAX_ITEMS:
        for path in sorted((step_dir / item).rglob("*")):
            if path.is_file():
                sums[str(path.relative_to(step_dir))] = _native.crc32c(np.fromfile(path, np.uint8))
    tmp = step_dir / (FILE_CHECKSUMS + ".tmp")
    tmp.write_text(json.dumps(sums, indent=0, sort_keys=True))
    tmp.replace(step_dir / FILE_CHECKSUMS)


def raise_if_a_file_is_corrupt(step_dir: Path) -> None:
    """Raises :class:`CorruptCheckpointError` naming the first file of ``step_dir`` whose crc32c
    differs from the one recorded when the step was saved (or which is gone)."""
    try:
        sums = json.loads((step_dir / FILE_CHECKSUMS).read_text())
    except (OSError, ValueError):
        return
    for rel, crc in sums.items():
        path = step_dir / rel
        if not path.is_file():
            raise CorruptCheckpointError(f"checkpoint file {path} is missing")
        actual = _native.crc32c(np.fromfile(path, np.uint8))
        if actual != crc:
            raise CorruptCheckpointError(f"checkpoint file {path} is corrupt: its data has crc32c {actual:#010x}, "
                                         f"{step_dir / FILE_CHECKSUMS} recorded {crc:#010x}")
