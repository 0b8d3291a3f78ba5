"""Reading a saved ``offloaded`` item with another number of processes than saved it.

A data-parallel job saves one slice of every tensor per process (:class:`~jaxascend.checkpoint.array_specs.Piece`).
:class:`SavedTensor` is one tensor as a whole, whatever the number of saved slices;
:class:`SliceReader` reads this run's slice of it (the padding past the tensor's end as zeros),
so a run of any number of processes restores its own slice of every tensor from whichever saved
slices hold it. :func:`saved_tensors` also serves exports, which read whole tensors.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from jaxascend.checkpoint.array_specs import SCALE_ARRAYS, ArraySpec, Piece
from jaxascend.checkpoint.errors import CorruptCheckpointError, IncompatibleCheckpointError
from jaxascend.checkpoint.offloaded_item import (MANIFEST_FILE, ChunkReader, chunk_reader, part_directory,
                                                 read_manifest, saved_processes)
from jaxascend.checkpoint.zarr_layout import numpy_dtype


class SavedTensor:
    """One tensor of a saved ``offloaded`` item as a whole, whatever the number of processes that
    saved it: :meth:`copy_flat` reads a run of its elements (in the whole tensor's C order) from
    whichever slices hold them, one zarr chunk in memory at a time (each checked against its
    crc32c)."""

    def __init__(self, name: str, parts: list[tuple[Path, dict]], context=None):
        self.name, self.parts, self.context = name, parts, context
        entry = parts[0][1]
        self.dtype = numpy_dtype(entry["dtype"])
        self.count = len(parts)
        saved = entry.get("piece")
        self.piece = Piece.from_dict(saved) if saved else None
        self.shape = self.piece.shape if self.piece else tuple(entry["shape"])
        self.stacked = self.piece.stacked if self.piece else None  # unknown for a plain save
        self._readers: list[Optional[ChunkReader]] = [None] * self.count

    def copy(self, out: np.ndarray, layer: Optional[int], start: int) -> None:
        """Fills ``out`` (uint8, whole elements) with elements ``start, start + 1, ...`` of layer
        ``layer`` of a stacked tensor (None: of the whole tensor)."""
        row = math.prod(self.shape[1:]) if layer is not None else 0
        self.copy_flat(out, (layer or 0) * row + start)

    def copy_flat(self, out: np.ndarray, start: int) -> None:
        """Fills ``out`` (uint8, whole elements) with the whole tensor's elements ``start, start +
        1, ...`` (C order): the saved slices are those of each saved layer (or block of rows)."""
        isz, n, pos = self.dtype.itemsize, out.size // self.dtype.itemsize, 0
        if self.count == 1:  # one array of the tensor's shape
            self._reader(0).copy_to(out, start * isz)
            return
        size, s = self.piece.size, self.piece.slice_size  # elements of one saved layer, of its slices
        while pos < n:
            layer, within = divmod(start + pos, size)
            p, offset = divmod(within, s)
            take = min(n - pos, s - offset, size - within)
            self._reader(p).copy_to(out[pos * isz:(pos + take) * isz], (layer * s + offset) * isz)
            pos += take

    def release(self) -> None:
        """Drops the chunks the readers hold (the next :meth:`copy` opens them again)."""
        self._readers = [None] * self.count

    def _reader(self, p: int) -> "ChunkReader":
        if self._readers[p] is None:
            directory, entry = self.parts[p]
            self._readers[p] = chunk_reader(directory, entry, self.context)
        return self._readers[p]


def saved_tensors(directory: Path, context=None) -> dict[str, SavedTensor]:
    """Every array of the ``offloaded`` item in ``directory`` as a :class:`SavedTensor`, by name."""
    directory = Path(directory)
    count = saved_processes(directory)
    parts = [part_directory(directory, p, count) for p in range(count)]
    manifests = [read_manifest(d) for d in parts]
    names = [e["name"] for e in manifests[0]["arrays"]]
    by_name: dict[str, list] = {name: [] for name in names}
    for p, (d, manifest) in enumerate(zip(parts, manifests)):
        entries = {e["name"]: e for e in manifest["arrays"]}
        if sorted(entries) != sorted(names):
            raise CorruptCheckpointError(f"checkpoint {d} holds other arrays than {parts[0]}")
        for name in names:
            piece = entries[name].get("piece")
            if count > 1 and (not piece or piece["index"] != p or piece["count"] != count):
                raise CorruptCheckpointError(f"checkpoint file {d / MANIFEST_FILE}: array {name!r} is not process "
                                             f"{p} of {count}'s slice (it records {piece})")
            by_name[name].append((d, entries[name]))
    return {name: SavedTensor(name, by_name[name], context) for name in names}


def check_tensors_match(tensors: dict[str, SavedTensor], specs: Sequence[ArraySpec], where: Path, saved: int,
                         count: int) -> None:
    """Refuses to re-partition arrays whose names, whole shapes or dtypes differ from the checkpoint's."""
    no_piece = [s.name for s in specs if s.piece is None]
    if any(name.split("/")[0] in SCALE_ARRAYS for name in no_piece):
        raise IncompatibleCheckpointError(f"checkpoint {where} was saved by {saved} process(es), this run has "
                                          f"{count}: int8 optimizer state is coded in blocks of each process's "
                                          f"slices and cannot be re-split; resume with {saved} process(es)")
    if no_piece:
        raise IncompatibleCheckpointError(f"checkpoint {where} was saved by {saved} process(es), this run has "
                                          f"{count}, and array {no_piece[0]!r} records no partition to re-split")
    missing = sorted({s.name for s in specs} - set(tensors))
    extra = sorted(set(tensors) - {s.name for s in specs})
    if missing or extra:
        raise IncompatibleCheckpointError(
            f"checkpoint {where} holds other optimizer-state arrays than this run: "
            f"not in the checkpoint: {missing[:5] or 'none'}; only in the checkpoint: {extra[:5] or 'none'}")
    for spec in specs:
        t = tensors[spec.name]
        stacked_differs = t.stacked is not None and t.stacked != spec.piece.stacked
        if t.shape != spec.piece.shape or t.dtype != spec.dtype or stacked_differs:
            raise IncompatibleCheckpointError(
                f"checkpoint {where}: array {spec.name!r} is {t.dtype.name}{t.shape} in the checkpoint, "
                f"{spec.dtype.name}{spec.piece.shape} in this run")


class SliceReader:
    """``copy_to(out, flat_byte)`` over this process's slice array of a tensor (``piece``),
    read from a :class:`SavedTensor` saved by another number of processes (or split into other
    layers); the padding past each layer's end reads as zeros."""

    def __init__(self, tensor: SavedTensor, piece: Piece, itemsize: int):
        self.tensor, self.piece, self.itemsize = tensor, piece, itemsize
        self.s = piece.slice_size

    def copy_to(self, out: np.ndarray, flat_byte: int) -> None:
        isz, piece = self.itemsize, self.piece
        first, n, pos = flat_byte // isz, out.size // isz, 0
        while pos < n:
            layer, k = divmod(first + pos, self.s)
            take = min(n - pos, self.s - k)
            g = piece.index * self.s + k  # the element of the whole layer
            inside = max(0, min(take, piece.size - g))
            view = out[pos * isz:(pos + take) * isz]
            if inside:
                self.tensor.copy_flat(view[:inside * isz], layer * piece.size + g)
            view[inside * isz:] = 0
            pos += take
