"""Lean import of Hugging Face safetensors weights into our models.

    model_cfg = model_config_from_hf(folder, base=cfg.model)   # shape from config.json
    model = load_hf_model(folder, model_cfg)                   # ready nnx.Module
    params = load_hf_params(folder, model_cfg)                 # or just its nnx.State

Memory: each parameter of ours gets one buffer, allocated once in the target dtype (stacked
layer parameters ``[L, ...]`` included), and every HF tensor is read with ``pread`` straight
into its slice when no conversion is needed, or into one reusable scratch buffer (sized for
the largest tensor that needs a cast or transpose) and converted from there. On the CPU backend
the finished buffer becomes the jax array without a copy (64-byte aligned buffers are aliased by
``device_put``). So the peak is the model in its parameter dtype plus one tensor.

Before any data is read the checkpoint is checked against the model: missing tensors,
unexpected tensors, shape mismatches and non-float dtypes raise errors naming the tensor, the
file and both shapes.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Iterator, Optional

import jax
import numpy as np
from flax import nnx

from jaxascend.config import ModelConfig
from jaxascend.hf.config_map import model_config_from_hf
from jaxascend.hf.errors import (DTypeMismatchError, MissingTensorError, ShapeMismatchError,
                                 UnexpectedTensorError, format_shape)
from jaxascend.hf.names import (HF_PREFIX, HF_TEXT_PART_PREFIXES, ParamMapping, abstract_params,
                                is_ignored_hf_tensor, param_plan)
from jaxascend.hf.safetensors_io import FLOAT_DTYPES, CheckpointFiles, TensorEntry, dominant_dtype
from jaxascend.models import DTYPES

_ALIGN = 64  # XLA's CPU client aliases (does not copy) host buffers aligned to this


def aligned_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """``np.empty(shape, dtype)`` whose data starts on a 64-byte boundary."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    start = -raw.ctypes.data % _ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(shape)


_TILE = 256  # transpose tile: 256 x 256 x 4 B = 256 KiB, cache-sized on each side


def transpose_into(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src.T`` for 2-D arrays of one dtype, tile by tile: a plain strided copy walks
    one side with a stride of a whole row and runs ~3x slower on large matrices. Elements are
    moved as same-size unsigned integers (bit-exact; custom dtypes like bfloat16 would take
    numpy's slow per-element path)."""
    as_uint = np.dtype(f"u{src.dtype.itemsize}")
    d, s = dst.view(as_uint), src.view(as_uint)
    rows, cols = s.shape
    for i in range(0, rows, _TILE):
        for j in range(0, cols, _TILE):
            d[j:j + _TILE, i:i + _TILE] = s[i:i + _TILE, j:j + _TILE].T


def _resolve(folder: str, model_cfg: Optional[ModelConfig]) -> ModelConfig:
    if model_cfg is None:
        return model_config_from_hf(folder)
    if not model_cfg.vocab_size:
        raise ValueError("model.vocab_size: 0; build the config with model_config_from_hf(folder, base)")
    return model_cfg


def _detect_prefix(entries: dict[str, TensorEntry], arch: str) -> str:
    """``model.``/``transformer.`` as in ``*ForCausalLM`` checkpoints, the text model's prefix in
    a multimodal checkpoint (Gemma 3's ``language_model.model.``), or ``""`` for checkpoints
    saved from the base model (the original ``gpt2`` files have no prefix)."""
    for prefix in HF_TEXT_PART_PREFIXES.get(arch, ()) + (HF_PREFIX[arch],):
        if any(name.startswith(prefix) for name in entries):
            return prefix
    return ""


def check_checkpoint(ckpt: CheckpointFiles, plan: list[ParamMapping], cfg: ModelConfig) -> str:
    """Checks every tensor of ``ckpt`` against ``plan``; returns the HF name prefix in use.

    Raises MissingTensorError, UnexpectedTensorError, ShapeMismatchError or DTypeMismatchError
    (all ValueError) naming the first offending tensor, its file and both shapes.
    """
    prefix = _detect_prefix(ckpt.entries, cfg.arch)
    expected: dict[str, ParamMapping] = {}
    for m in plan:
        for layer in range(cfg.num_hidden_layers) if m.stacked else (None,):
            expected[m.hf_name(layer, prefix)] = m
    missing = [name for name in expected if name not in ckpt.entries]
    if missing:
        more = f" ({len(missing)} tensors missing, also {missing[1]!r})" if len(missing) > 1 else ""
        raise MissingTensorError(
            f"{ckpt.folder}: tensor {missing[0]!r} (expected shape "
            f"{format_shape(expected[missing[0]].hf_shape)}) is missing{more}")
    unexpected = [name for name in ckpt.entries if name not in expected
                  and not is_ignored_hf_tensor(name, cfg.arch)
                  # a tied model's checkpoint may still carry the head: a copy of the embedding
                  and not (cfg.tie_word_embeddings and name == "lm_head.weight")]
    if unexpected:
        entry = ckpt.entries[unexpected[0]]
        more = f" ({len(unexpected)} unexpected tensors)" if len(unexpected) > 1 else ""
        raise UnexpectedTensorError(
            f"{entry.file}: unexpected tensor {entry.name!r} {format_shape(entry.shape)}: a "
            f"{cfg.arch} model with this config.json has no such parameter{more}")
    for name, m in expected.items():
        entry = ckpt.entries[name]
        if entry.shape != m.hf_shape:
            raise ShapeMismatchError(
                f"{entry.file}: tensor {name!r} has shape {format_shape(entry.shape)} but "
                f"config.json implies {format_shape(m.hf_shape)}")
        if entry.dtype not in FLOAT_DTYPES:
            raise DTypeMismatchError(
                f"{entry.file}: tensor {name!r} {format_shape(entry.shape)} has dtype {entry.dtype}; "
                f"weights must be one of {', '.join(FLOAT_DTYPES)}")
    return prefix


def open_checked(folder: str, cfg: ModelConfig) -> tuple[CheckpointFiles, str]:
    """The checkpoint in ``folder``, open, once every safetensors header is read and checked: the
    index's shard list, each file's tensor names, dtypes, shapes and byte ranges against its size
    (:class:`CheckpointFiles`), then the tensors against ``cfg``'s parameters
    (:func:`check_checkpoint`). No tensor data is read. Returns it with the HF name prefix in use;
    raises the first problem as a one-line ``HFCheckpointError`` (closing what it opened)."""
    ckpt = CheckpointFiles(folder)
    try:
        return ckpt, check_checkpoint(ckpt, param_plan(cfg), cfg)
    except BaseException:
        ckpt.close()
        raise


def check_hf_weights(folder: str | os.PathLike, model_cfg: ModelConfig) -> str:
    """Checks the weights in ``folder`` against ``model_cfg`` from their headers alone (see
    :func:`open_checked`): what a run reads before it writes anything, so that a truncated file
    or a missing tensor stops it at the start. Returns the checkpoint's dtype (the one that holds
    most of its bytes, :func:`~jaxascend.hf.safetensors_io.dominant_dtype`).

        check_hf_weights("/models/Qwen2.5-7B", model_config_from_hf("/models/Qwen2.5-7B"))
    """
    folder = os.path.expanduser(str(folder))
    ckpt, _ = open_checked(folder, _resolve(folder, model_cfg))
    try:
        return dominant_dtype(ckpt.entries.values())
    finally:
        ckpt.close()


def iter_hf_params(folder: str | os.PathLike, model_cfg: Optional[ModelConfig] = None, *,
                   dtype: Optional[str] = None, layer_stack: bool = True) -> Iterator[tuple[ParamMapping, np.ndarray]]:
    """Yields ``(mapping, array)`` for each of our parameters, in tree order, read from the
    checkpoint in ``folder`` and cast to ``dtype`` (default: ``model_cfg.param_dtype``);
    ``layer_stack=False`` skips the stacked ones (their weights are streamed from SSD).

    Each array is a fresh 64-byte-aligned numpy buffer in our layout (stacked layers, ``[in, out]``
    kernels) that the caller owns; only the scratch buffer is kept between parameters. This is the
    building block for loaders that place parameters elsewhere (e.g. fp32 masters on SSD).
    """
    folder = os.path.expanduser(str(folder))
    cfg = _resolve(folder, model_cfg)
    target = np.dtype(DTYPES[dtype or cfg.param_dtype])
    ckpt, prefix = open_checked(folder, cfg)
    with ckpt:
        plan = [m for m in param_plan(cfg) if layer_stack or not m.stacked]

        def sources(m: ParamMapping):
            return [(layer, source_entry(ckpt.entries, m, layer, prefix))
                    for layer in (range(cfg.num_hidden_layers) if m.stacked else (None,))]

        def direct(m: ParamMapping, entry: TensorEntry) -> bool:  # as _read_converted decides
            return not m.transpose and entry.numpy_dtype == target

        # One scratch buffer, for the largest tensor that must be cast or transposed.
        scratch_bytes = max([entry.nbytes for m in plan for _, entry in sources(m)
                             if not direct(m, entry)], default=0)
        scratch = np.empty(scratch_bytes, np.uint8)
        for m in plan:
            out = aligned_empty(m.shape, target)
            for layer, entry in sources(m):
                _read_converted(ckpt, m, entry, out if layer is None else out[layer], scratch)
            yield m, out
            del out


def source_entry(entries: dict[str, TensorEntry], m: ParamMapping, layer: Optional[int],
                 prefix: str) -> TensorEntry:
    """The bytes of the HF tensor that hold ``m`` (its ``layer``). For a fused tensor (Phi-3's
    qkv_proj, gate_up_proj) that is ``m``'s block of rows, a contiguous byte range of the
    row-major tensor: each part is read straight from the file, so the fused tensor is read once
    in all and never held beside its parts."""
    entry = entries[m.hf_name(layer, prefix)]
    if m.hf_rows is None:
        return entry
    row_bytes = entry.nbytes // entry.shape[0]
    start, stop = m.hf_rows
    return dataclasses.replace(entry, shape=m.hf_part_shape, begin=entry.begin + start * row_bytes,
                               end=entry.begin + stop * row_bytes)


def _read_converted(ckpt: CheckpointFiles, m: ParamMapping, entry: TensorEntry, dst: np.ndarray,
                    scratch: np.ndarray) -> None:
    """Reads HF tensor ``entry`` into ``dst`` (our layout and dtype): with one ``pread`` straight
    into ``dst`` when no conversion is needed, else through ``scratch`` (at least
    ``entry.nbytes``), transposed and/or cast from there."""
    if not m.transpose and entry.numpy_dtype == dst.dtype:
        ckpt.read_into(entry, dst)
        return
    raw = scratch[:entry.nbytes].view(entry.numpy_dtype).reshape(entry.shape)
    ckpt.read_into(entry, raw)
    if m.transpose and raw.dtype == dst.dtype:
        transpose_into(dst, raw)
    else:
        np.copyto(dst, raw.T if m.transpose else raw, casting="unsafe")


class HFParamReader:
    """One layer of one of our parameters at a time, read from a Hugging Face checkpoint in our
    layout and in ``dtype`` (default float32: the checkpoint's own values, widened exactly).

        with HFParamReader(folder, model_cfg) as reader:
            w = reader.read(("layers", "mlp", "up_proj", "kernel"), layer=3)   # [in, out] float32

    The checkpoint is checked against the model when the reader opens (as :func:`iter_hf_params`
    does). Each call reads one HF tensor and returns a fresh array, so a consumer that places the
    values elsewhere (the fp32 master weights on SSD) holds one tensor at a time. ``read`` has
    the signature of an export ``ParamReader``.
    """

    def __init__(self, folder: str | os.PathLike, model_cfg: Optional[ModelConfig] = None, *,
                 dtype: str = "float32"):
        self.folder = os.path.expanduser(str(folder))
        self.cfg = _resolve(self.folder, model_cfg)
        self.dtype = np.dtype(DTYPES[dtype])
        self.plan = {m.path: m for m in param_plan(self.cfg)}
        self._ckpt, self._prefix = open_checked(self.folder, self.cfg)
        self._scratch = np.empty(0, np.uint8)
        # The checkpoint's own dtype (what export.dtype "source" exports in).
        self.source_dtype = dominant_dtype(self._ckpt.entries.values())

    def read(self, path: tuple[str, ...], layer: Optional[int] = None,
             rows: Optional[tuple[int, int]] = None) -> np.ndarray:
        """Our parameter ``path`` (the whole tensor, or one ``layer`` of a stacked one; ``rows``:
        only rows ``[start, stop)`` of an unstacked, untransposed one, e.g. a block of a large
        vocabulary table, so that the table is never whole in float32)."""
        m = self.plan.get(tuple(path))
        if m is None:
            raise KeyError(f"{self.folder}: the model has no parameter {'.'.join(path)!r}")
        if rows is not None:
            return self._read_rows(m, *rows)
        if m.stacked and layer is None:
            out = aligned_empty(m.shape, self.dtype)
            for i in range(m.shape[0]):
                out[i] = self.read(path, i)
            return out
        entry = source_entry(self._ckpt.entries, m, layer if m.stacked else None, self._prefix)
        if self._scratch.nbytes < entry.nbytes:
            self._scratch = np.empty(entry.nbytes, np.uint8)
        out = aligned_empty(m.layer_shape, self.dtype)
        _read_converted(self._ckpt, m, entry, out, self._scratch)
        return out

    def _read_rows(self, m: ParamMapping, start: int, stop: int) -> np.ndarray:
        if m.stacked or m.transpose or m.hf_rows or not 0 <= start < stop <= m.shape[0]:
            raise ValueError(f"{self.folder}: cannot read rows [{start}, {stop}) of {'.'.join(m.path)!r}")
        entry = source_entry(self._ckpt.entries, m, None, self._prefix)
        row = entry.nbytes // entry.shape[0]
        part = dataclasses.replace(entry, shape=(stop - start,) + tuple(entry.shape[1:]),
                                   begin=entry.begin + start * row, end=entry.begin + stop * row)
        if self._scratch.nbytes < part.nbytes:
            self._scratch = np.empty(part.nbytes, np.uint8)
        out = aligned_empty(part.shape, self.dtype)
        _read_converted(self._ckpt, m, part, out, self._scratch)
        return out

    def close(self) -> None:
        self._ckpt.close()
        self._scratch = np.empty(0, np.uint8)

    def __enter__(self) -> "HFParamReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load_hf_params(folder: str | os.PathLike, model_cfg: Optional[ModelConfig] = None, *,
                   device: Optional[jax.Device] = None, layer_stack: bool = True) -> nnx.State:
    """The ``nnx.State`` (all ``nnx.Param``) of ``model_cfg``'s model, read from ``folder``.

    ``model_cfg`` defaults to :func:`model_config_from_hf(folder)`; pass
    ``model_config_from_hf(folder, base=cfg.model)`` to keep the run's dtype/remat settings.
    Arrays are in ``model_cfg.param_dtype`` on ``device`` (default: the default device).
    ``layer_stack=False``: the layer stack's leaves stay ``jax.ShapeDtypeStruct`` (nothing read or
    allocated for them; ``offload.params: ssd`` reads them layer by layer instead).
    """
    folder = os.path.expanduser(str(folder))
    cfg = _resolve(folder, model_cfg)
    _, state = abstract_params(cfg)
    values: dict = {}
    for m, array in iter_hf_params(folder, cfg, layer_stack=layer_stack):
        node = values
        for key in m.path[:-1]:
            node = node.setdefault(key, {})
        # On CPU an aligned buffer is aliased, not copied; elsewhere this is the host->device copy.
        node[m.path[-1]] = jax.device_put(array, device, may_alias=True)
        del array
    nnx.replace_by_pure_dict(state, values)
    return state


def load_hf_model(folder: str | os.PathLike, model_cfg: Optional[ModelConfig] = None, *,
                  device: Optional[jax.Device] = None, layer_stack: bool = True) -> nnx.Module:
    """The model of ``model_cfg`` with the weights in ``folder``; see :func:`load_hf_params`."""
    folder = os.path.expanduser(str(folder))
    cfg = _resolve(folder, model_cfg)
    graphdef, _ = abstract_params(cfg)
    return nnx.merge(graphdef, load_hf_params(folder, cfg, device=device, layer_stack=layer_stack))
