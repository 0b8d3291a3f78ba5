"""What the ``offloaded`` checkpoint item streams, and the checks that it can be streamed.

An :class:`ArraySpec` is one checkpointed array whose C-order bytes are :class:`Span` records
(byte ranges of :class:`~jaxascend.ssd.SsdStore` regions); its :class:`Piece` says where it sits
in a tensor split over the processes of a data-parallel job. :class:`SsdArrays` is the set of
them with their store and the class of arena slots a checkpoint pass streams them through
(:func:`checkpoint_arena_requests` plans those slots). An engine builds the specs of its own
regions; this package knows nothing of its layout.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

from jaxascend.checkpoint.zarr_layout import numpy_dtype
from jaxascend.config import OffloadConfig
from jaxascend.ssd import SlotRequest

CHECKPOINT_SHAPE_CLASS = "checkpoint"
# int8 optimizer state: the top-level names of its arrays of block scales (one float32 scale per
# block of each layer). They are coded per block of a process's slices and cannot be re-split.
SCALE_ARRAYS = ("m_scale", "v_scale")


@dataclasses.dataclass(frozen=True)
class Span:
    """``nbytes`` at byte ``offset`` of store region ``region``: one contiguous piece of an array."""

    region: str
    offset: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Piece:
    """Where an array sits in a tensor split over ``count`` processes (see
    :mod:`jaxascend.offload.partition`): each of the tensor's layers (``shape[0]`` of a
    ``stacked`` tensor, the ``blocks`` of rows of a large token table, else one) is split as a
    flat array of ``size`` elements, and process ``index`` holds elements ``[index * s,
    (index + 1) * s)`` of each with ``s = ceil(size / count)``, zero-padded; the array is
    ``[layers, s]`` (``[layers * s]`` unstacked). ``count`` 1: the whole tensor, in its own shape."""

    index: int
    count: int
    shape: tuple  # the whole tensor's
    stacked: bool
    blocks: int = 1  # an unstacked tensor's blocks of rows, each split on its own

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if not 0 <= self.index < self.count:
            raise ValueError(f"Piece: process {self.index} of {self.count}")
        if self.blocks < 1 or (self.blocks > 1 and (self.stacked or not self.shape or self.shape[0] % self.blocks)):
            raise ValueError(f"Piece: {self.blocks} blocks of rows of {self.shape}")

    @classmethod
    def from_dict(cls, d: dict) -> "Piece":
        return cls(int(d["index"]), int(d["count"]), tuple(d["shape"]), bool(d["stacked"]), int(d.get("blocks", 1)))

    @property
    def layers(self) -> int:
        return self.shape[0] if self.stacked else self.blocks

    @property
    def size(self) -> int:
        """Elements of one layer (block)."""
        return math.prod(self.shape) // self.layers

    @property
    def slice_size(self) -> int:
        return -(-self.size // self.count)

    def to_dict(self) -> dict:
        out = {"index": self.index, "count": self.count, "shape": list(self.shape), "stacked": self.stacked}
        return {**out, "blocks": self.blocks} if self.blocks > 1 else out


@dataclasses.dataclass(frozen=True)
class ArraySpec:
    """One checkpointed array of ``shape``/``dtype`` whose C-order bytes are the concatenation of
    ``spans`` (contiguous byte ranges of store regions, e.g. one per layer and chunk).

    ``name`` is a ``"/"``-separated path (``"master/layers/mlp/w"``): the keys of the leaf in the
    restored pytree; the zarr directory is the keys joined with ``"."``, as Orbax names leaves.
    """

    name: str
    shape: tuple
    dtype: Any
    spans: tuple
    piece: Optional[Piece] = None  # its place in a tensor split over processes (None: not known)

    def __post_init__(self):
        keys = tuple(self.name.split("/")) if isinstance(self.name, str) else ()
        if not keys or not all(keys):
            raise ValueError(f"ArraySpec.name: expected a '/'-separated path like 'master/w', got {self.name!r}")
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "dtype", numpy_dtype(self.dtype))
        spans = tuple(Span(str(r), int(o), int(n)) for r, o, n in
                      (dataclasses.astuple(x) if isinstance(x, Span) else x for x in self.spans))
        object.__setattr__(self, "spans", spans)
        if any(d < 0 for d in self.shape):
            raise ValueError(f"ArraySpec.shape of {self.name!r}: dimensions must be >= 0, got {self.shape}")
        if any(x.offset < 0 or x.nbytes < 0 for x in spans):
            raise ValueError(f"ArraySpec.spans of {self.name!r}: offsets and sizes must be >= 0, got {spans}")
        if any(x.nbytes % self.dtype.itemsize for x in spans):
            raise ValueError(f"ArraySpec.spans of {self.name!r}: every span must hold whole {self.dtype} elements")
        if sum(x.nbytes for x in spans) != self.nbytes:
            raise ValueError(f"ArraySpec.spans of {self.name!r} hold {sum(x.nbytes for x in spans)} bytes; "
                             f"{self.dtype}{self.shape} is {self.nbytes} bytes")
        piece = self.piece
        if piece is not None and self.size != piece.layers * piece.slice_size:
            raise ValueError(f"ArraySpec.piece of {self.name!r}: {self.shape} is not process {piece.index} of "
                             f"{piece.count}'s slice of {piece.shape}")

    @classmethod
    def contiguous(cls, name: str, region: str, offset: int, shape, dtype) -> "ArraySpec":
        """An array stored as one byte range: ``shape``/``dtype`` at ``offset`` of ``region``."""
        dtype = numpy_dtype(dtype)
        return cls(name, shape, dtype, (Span(region, offset, math.prod(shape) * dtype.itemsize),))

    @property
    def keys(self) -> tuple:
        return tuple(self.name.split("/"))

    @property
    def dirname(self) -> str:
        return ".".join(self.keys)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class SsdArrays:
    """The store regions a checkpoint streams: ``specs`` in ``store``, staged in ``slot_class`` slots.

    ``specs``: :class:`ArraySpec` records, or ``(name, region, offset, shape, dtype)`` tuples for
    contiguous arrays. ``depth`` (default ``offload.stream_depth``, at most the number of such
    slots) is how many slots one pass uses: one being copied, the others read ahead/written behind.
    """

    store: Any  # jaxascend.ssd.store.SsdStore
    specs: tuple
    slot_class: str = CHECKPOINT_SHAPE_CLASS
    depth: Optional[int] = None
    max_chunk_bytes: Optional[int] = None  # zarr chunk size cap; default offload.chunk_bytes
    # Recorded in the manifest and checked on restore: {"state": StateFormat.describe()} (the
    # format of the optimizer's moments), compared key by key where both sides have the key.
    attributes: Optional[dict] = None

    def __post_init__(self):
        specs = tuple(s if isinstance(s, ArraySpec) else ArraySpec.contiguous(*s) for s in self.specs)
        object.__setattr__(self, "specs", specs)
        seen: dict[str, str] = {}
        for s in specs:
            if s.dirname in seen:
                raise ValueError(f"SsdArrays: arrays {seen[s.dirname]!r} and {s.name!r} map to the same "
                                 f"directory {s.dirname!r}")
            seen[s.dirname] = s.name
        names = {s.keys for s in specs}
        for s in specs:  # a leaf cannot also be a node of the tree ("m" and "m/w")
            for i in range(1, len(s.keys)):
                if s.keys[:i] in names:
                    raise ValueError(f"SsdArrays: array {'/'.join(s.keys[:i])!r} is a prefix of {s.name!r}")

    @property
    def process(self) -> tuple[int, int]:
        """``(index, count)``: this process's place in the job the arrays are split over ((0, 1):
        one process, or no split recorded)."""
        places = {(s.piece.index, s.piece.count) for s in self.specs if s.piece is not None}
        if len(places) > 1:
            raise ValueError(f"SsdArrays: the arrays disagree on their process: {sorted(places)}")
        return places.pop() if places else (0, 1)

    @classmethod
    def of(cls, value) -> "SsdArrays":
        """Accepts an :class:`SsdArrays`, ``(store, arena, specs)`` or ``(store, specs)``."""
        if isinstance(value, SsdArrays):
            return value
        if isinstance(value, tuple) and len(value) in (2, 3):
            return cls(value[0], tuple(value[-1]))
        raise TypeError(f"ssd: expected SsdArrays or (store, arena, specs), got {type(value).__name__}")


def checkpoint_arena_requests(cfg: OffloadConfig, chunk_bytes: Optional[int] = None) -> list[SlotRequest]:
    """The arena slots a checkpoint pass uses: ``stream_depth`` slots of ``chunk_bytes``
    (default ``offload.chunk_bytes``) plus two SSD blocks, of class ``"checkpoint"``."""
    chunk = int(chunk_bytes if chunk_bytes is not None else cfg.chunk_bytes)
    return [SlotRequest(CHECKPOINT_SHAPE_CLASS, chunk + 2 * cfg.block_bytes, cfg.stream_depth)]


# ----------------------------------------------------------------------------- a pass's geometry

def pass_geometry(arrays: SsdArrays) -> tuple[int, int, int]:
    """(slot bytes, depth, block bytes) for streaming ``arrays``; errors name what is missing."""
    store = arrays.store
    slots = store.arena.slots(arrays.slot_class)
    if len(slots) < 2:
        raise ValueError(f"checkpoint: the arena has {len(slots)} slot(s) of class {arrays.slot_class!r}, a "
                         f"checkpoint pass needs at least 2; add checkpoint_arena_requests(cfg.offload) to the "
                         f"arena plan or pass the class of idle slots as SsdArrays.slot_class")
    block = store.cfg.block_bytes
    slot_bytes = min(s.nbytes for s in slots) // block * block
    if slot_bytes < 3 * block:
        raise ValueError(f"checkpoint: slots of class {arrays.slot_class!r} hold {slot_bytes} bytes; they must "
                         f"hold at least 3 SSD blocks ({3 * block} bytes)")
    depth = store.cfg.stream_depth if arrays.depth is None else int(arrays.depth)
    return slot_bytes, max(2, min(depth, len(slots))), block


def regions_of(store, spec: ArraySpec) -> dict:
    """The store regions ``spec`` reads, checking that every span fits its region."""
    regions = {}
    for span in spec.spans:
        region = regions.setdefault(span.region, store.region(span.region))
        if span.offset + span.nbytes > region.nbytes:
            raise ValueError(f"checkpoint array {spec.name!r}: bytes [{span.offset}, {span.offset + span.nbytes}) "
                             f"do not fit region {region.name!r} ({region.nbytes} bytes)")
    return regions


def validate_arrays(arrays: SsdArrays) -> None:
    """Checks, without any I/O, that ``arrays`` can be streamed: enough slots of its class, and
    every span inside its region (``ValueError`` naming the class or the array)."""
    pass_geometry(arrays)
    for spec in arrays.specs:
        regions_of(arrays.store, spec)


def whole_blocks(lo: int, hi: int, block: int, region_bytes: int) -> tuple[int, int]:
    """The smallest block-aligned byte range around ``[lo, hi)`` (ending at most at the region's end)."""
    return lo // block * block, min(-(-hi // block) * block, region_bytes)
