"""The sampler's weights: where they come from (a run, a checkpoint, a parameter file, a Hugging
Face folder), and how they are held in the compute dtype: the whole tree built one tensor at a
time, or the top-level leaves only with the layer stack read one layer at a time, the next ahead.

    with open_for_sampling("runs/my-run") as w:
        Generator(w.model_config, w.read, stream_layers=streams_layers(w.run_config))

A *reader* is ``read(path, layer) -> array``: one of our parameters (``path`` a tuple such as
``("layers", "mlp", "up_proj", "kernel")``) or, for a stacked one, its slice ``layer``. Every
weight source of the package has one (``ParamsFile.read``, ``CheckpointWeights.read``,
``HFParamReader.read``); :func:`jaxascend.hf.reader_from_params` makes one of an in-memory tree.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxascend import console
from jaxascend.checkpoint import RunWeights, open_weights
from jaxascend.config import parse_hub_id
from jaxascend.hf import (CONFIG_FILE, HFParamReader, ParamMapping, aligned_empty, locate_model, model_config_from_hf,
                          param_leaves, reader_from_params)


def open_for_sampling(checkpoint: str, *, dtype: Optional[str] = None) -> RunWeights:
    """The weights ``checkpoint`` names: a Hugging Face model folder (``config.json`` and
    safetensors; read in ``dtype``, default its config's compute dtype, one tensor at a time,
    its tokenizer the folder's own), a hub id (``org/name[@revision]``: that folder in the
    Hugging Face cache, as ``model.path`` reads it) or anything
    :func:`jaxascend.checkpoint.open_weights` opens (a run's folder, a checkpoint step or
    directory, a ``params.safetensors`` file)."""
    path = Path(os.path.expanduser(checkpoint))
    if not path.exists() and parse_hub_id(checkpoint) is not None:
        source = locate_model(checkpoint, name="--checkpoint")
        console.note(source.note())
        path = Path(source.folder)
    if path.is_dir() and (path / CONFIG_FILE).is_file():
        model_cfg = model_config_from_hf(path)
        reader = HFParamReader(path, model_cfg, dtype=dtype or model_cfg.dtype)
        return RunWeights(reader.read, model_cfg, str(path), str(path), reader.source_dtype,
                          f"Hugging Face folder {path}", None, reader.close)
    return open_weights(checkpoint)


def streams_layers(run_config: Optional[dict]) -> bool:
    """Whether the run kept its layer stack on SSD (``offload.enabled`` and ``offload.params:
    ssd`` in its resolved config): its weights are then taken not to fit in memory either."""
    offload = (run_config or {}).get("offload")
    return isinstance(offload, dict) and bool(offload.get("enabled")) and offload.get("params") == "ssd"


def in_memory_leaves(weights) -> Optional[dict[tuple[str, ...], Any]]:
    """``{path: array}`` of an in-memory tree (module, state or nested dict), None for a reader."""
    return param_leaves(weights)


def _put(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def read_params(plan: list[ParamMapping], weights, dtype, *, layer_stack: bool = True) -> dict:
    """The pure nested dict of every parameter in ``plan`` in ``dtype``, built one tensor at a
    time (a stacked tensor is filled layer by layer into one buffer, so no second copy of the
    model is ever held); ``layer_stack=False`` leaves the stacked parameters out.

    An in-memory tree is used as it is when it already has ``dtype`` (no copy) and cast leaf by
    leaf otherwise."""
    leaves = in_memory_leaves(weights)
    read = None if leaves is not None else reader_from_params(weights)
    target = np.dtype(dtype)
    values: dict = {}
    for m in plan:
        if m.stacked and not layer_stack:
            continue
        if leaves is not None:
            if m.path not in leaves:
                raise ValueError(f"parameters: no {m.dotted!r} (the model needs it)")
            value = jnp.asarray(leaves[m.path], dtype)
        else:
            out = aligned_empty(m.shape, target)
            for layer in range(m.shape[0]) if m.stacked else (None,):
                part = np.asarray(read(m.path, layer))
                if part.shape != m.layer_shape:
                    raise ValueError(f"parameters: {m.dotted}{'' if layer is None else f'[{layer}]'} has "
                                     f"shape {list(part.shape)}, the model needs {list(m.layer_shape)}")
                np.copyto(out if layer is None else out[layer], part, casting="unsafe")
            # On CPU an aligned buffer becomes the array without a copy.
            value = jax.device_put(out, may_alias=True)
            del out
        if tuple(value.shape) != m.shape:
            raise ValueError(f"parameters: {m.dotted} has shape {list(value.shape)}, the model needs {list(m.shape)}")
        _put(values, m.path, value)
    return values


def merged(graphdef: nnx.GraphDef, abstract: nnx.State, pure: dict) -> nnx.Module:
    """The module of ``graphdef`` with the leaves of ``pure`` (the others stay abstract, which is
    fine for the parts of the model that never touch them)."""
    state = jax.tree.map(lambda x: x, abstract)  # a fresh container: replace_by_pure_dict updates it
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)


class LayerStream:
    """One layer of the stacked parameters at a time, read from a reader and cast to ``dtype``
    on a background thread: :meth:`get` returns layer ``i`` and starts reading layer ``i + 1``
    (after the last layer, layer 0 of the next forward pass), so about two layers of weights
    are in memory. Every read happens on the one worker thread, so the reader needs no locks.

        with LayerStream(read, plan, num_layers, jnp.bfloat16) as layers:
            for i in range(num_layers):
                params = layers.get(i)          # pure dict, as the layer's parameters
    """

    def __init__(self, weights, plan: list[ParamMapping], num_layers: int, dtype):
        self._read = reader_from_params(weights)
        self._stacked = [m for m in plan if m.stacked]
        self._num_layers = num_layers
        self._dtype = np.dtype(dtype)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="jaxascend-layer-read")
        self._ahead: dict[int, Future] = {}

    def _load(self, layer: int) -> dict:
        values: dict = {}
        for m in self._stacked:
            part = np.asarray(self._read(m.path, layer))
            if part.shape != m.layer_shape:
                raise ValueError(f"parameters: {m.dotted}[{layer}] has shape {list(part.shape)}, "
                                 f"the model needs {list(m.layer_shape)}")
            _put(values, m.path[1:], jax.device_put(part.astype(self._dtype, copy=False)))
        return values

    def get(self, layer: int) -> dict:
        """Layer ``layer``'s parameters (a pure dict without the stack's name), waiting for the
        read when it is not done yet; the next layer's read starts before this returns."""
        future = self._ahead.pop(layer, None) or self._pool.submit(self._load, layer)
        following = (layer + 1) % self._num_layers
        if following not in self._ahead:
            self._ahead[following] = self._pool.submit(self._load, following)
        return future.result()

    def close(self) -> None:
        """Stops the reads ahead (a read under way finishes) and drops what they hold."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._ahead.clear()

    def __enter__(self) -> "LayerStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
