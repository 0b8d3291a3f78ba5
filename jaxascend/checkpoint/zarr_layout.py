"""How an array is laid out as a zarr v2 array that plain Orbax and tensorstore read back.

Chunks are runs of whole rows, shape ``(1, .., 1, k, *trailing)``, so every chunk is one
contiguous byte range of the C-order array and can be copied to or from a contiguous buffer;
:func:`orbax_tree_metadata` is the ``_METADATA`` file Orbax's PyTree handler writes for a tree of
numpy arrays stored without OCDBT, so ``ocp.StandardCheckpointer().restore(dir)`` reads the
arrays back as a nested dict.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

import ml_dtypes
import numpy as np


def numpy_dtype(dtype: Any) -> np.dtype:
    """``np.dtype`` of a numpy/JAX dtype or a name, including ``"bfloat16"``."""
    if isinstance(dtype, str) and hasattr(ml_dtypes, dtype):
        return np.dtype(getattr(ml_dtypes, dtype))
    return np.dtype(dtype)


def zarr_chunk_shape(shape: Sequence[int], itemsize: int, max_chunk_bytes: int) -> tuple:
    """The chunk shape ``(1, .., 1, k, *shape[axis+1:])`` with the most elements that fit
    ``max_chunk_bytes``: whole trailing rows, so each chunk is one contiguous byte range."""
    max_elems = max(1, max_chunk_bytes // itemsize)
    dims = [max(int(d), 1) for d in shape]
    inner = 1
    for axis in reversed(range(len(dims))):
        if inner * dims[axis] > max_elems:
            return (1,) * axis + (max(1, max_elems // inner),) + tuple(dims[axis + 1:])
        inner *= dims[axis]
    return tuple(dims)


def chunk_grid(shape: Sequence[int], chunks: Sequence[int]) -> list[tuple]:
    """``(grid_index, box, flat_start, flat_stop)`` of every chunk in C order (flat order, for
    chunks made by :func:`zarr_chunk_shape`)."""
    if math.prod(shape) == 0:
        return []
    grid = [-(-d // c) for d, c in zip(shape, chunks)]
    out = []
    for idx in np.ndindex(*grid):
        box = tuple(slice(i * c, min((i + 1) * c, d)) for i, c, d in zip(idx, chunks, shape))
        start = int(np.ravel_multi_index([b.start for b in box], shape)) if shape else 0
        out.append((idx, box, start, start + math.prod(b.stop - b.start for b in box)))
    return out


def orbax_tree_metadata(leaf_keys: Sequence[tuple]) -> dict:
    """The ``_METADATA`` Orbax's PyTree handler writes for numpy arrays without OCDBT, one leaf
    per key tuple (``("m", "layers", "w")`` -> ``tree["m"]["layers"]["w"]``, directory ``m.layers.w``)."""
    tree = {}
    for keys in leaf_keys:
        tree[str(tuple(keys))] = {"key_metadata": [{"key": k, "key_type": 2} for k in keys],  # 2: dict key
                                  "value_metadata": {"value_type": "np.ndarray", "skip_deserialize": False}}
    return {"tree_metadata": tree, "use_ocdbt": False, "use_zarr3": False,
            "store_array_data_equal_to_fill_value": True, "custom_metadata": None}


def zarr_spec(path: Path) -> dict:
    """The tensorstore spec of the zarr v2 array in directory ``path``."""
    return {"driver": "zarr", "kvstore": {"driver": "file", "path": str(path)}}


def zarr_dtype(dtype: np.dtype) -> str:
    """The zarr v2 ``dtype`` string (tensorstore spells bfloat16 by name)."""
    return "bfloat16" if dtype == np.dtype(ml_dtypes.bfloat16) else dtype.str
