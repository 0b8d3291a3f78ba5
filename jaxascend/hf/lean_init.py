"""Random initialisation without a memory spike: one tensor (one layer of a stack) at a time.

``build_model`` initialises the layer stack under ``nnx.vmap``, which materialises random bits
and float32 intermediates for whole stacked tensors at once (about 3x the model's bf16 size at
0.5B parameters). :func:`build_model_lean` makes the abstract model, allocates each parameter
once in its final dtype and fills it layer by layer from a seeded numpy generator (normal(init_std)
for matrices and embeddings, ones for norm scales (zeros for Gemma 3's zero-centred ones), zeros
for biases), so peak host memory is the model plus one tensor.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx

from jaxascend.config import ModelConfig
from jaxascend.hf.load import aligned_empty
from jaxascend.hf.names import abstract_params, param_plan
from jaxascend.hf.presets import random_reader
from jaxascend.models import DTYPES, norm_scale_init


def lean_init_reader(cfg: ModelConfig, seed: int):
    """``read(path, layer, rows=None)`` of the initial weights :func:`build_model_lean` gives (one
    layer of a stacked tensor, or a whole other one; ``rows``: a block of its rows), rounded to
    ``param_dtype`` and held in float32: the master weights of a run whose layer stack is
    streamed from SSD start from it, one layer at a time."""
    read = random_reader(seed, cfg.init_std, random_norms=False, norm_scale=norm_scale_init(cfg.arch))
    plan = {m.path: m for m in param_plan(cfg)}
    dtype = DTYPES[cfg.param_dtype]

    last: dict = {}  # the last whole tensor drawn: a large table is read a block of rows at a time

    def read_layer(path, layer, rows=None):
        m = plan[tuple(path)]
        key = (m.path, layer if m.stacked else None)
        if key in last:
            values = last[key]
        else:
            # float32 holding param_dtype values: what the resident model's weights widen to.
            values = read(m.path, key[1], m.layer_shape)
            last.clear()
            if rows is not None:  # its values depend on the whole tensor's seed: drawn once for its blocks
                last[key] = values
        if rows is not None:
            values = values[rows[0]:rows[1]]
            if rows[1] >= m.layer_shape[0]:
                last.clear()  # the table's last block: done with it
        return values.astype(dtype).astype(np.float32)

    return read_layer


def build_model_lean(cfg: ModelConfig, vocab_size: int, seed: int, *, layer_stack: bool = True) -> nnx.Module:
    """The model of ``cfg`` with random weights, built one tensor at a time; each tensor's
    values depend only on ``seed``, its path and layer. ``layer_stack=False``: the stacked
    leaves stay ``jax.ShapeDtypeStruct`` (see :func:`lean_init_reader` for their values)."""
    cfg = dataclasses.replace(cfg, vocab_size=vocab_size)
    graphdef, state = abstract_params(cfg)
    read = random_reader(seed, cfg.init_std, random_norms=False, norm_scale=norm_scale_init(cfg.arch))
    dtype = DTYPES[cfg.param_dtype]
    values: dict = {}
    for m in param_plan(cfg):
        if m.stacked and not layer_stack:
            continue
        out = aligned_empty(m.shape, dtype)
        for layer in range(m.shape[0]) if m.stacked else (None,):
            dst = out if layer is None else out[layer]
            dst[...] = read(m.path, layer, m.layer_shape)  # one layer's float32 scratch, cast on copy
        node = values
        for key in m.path[:-1]:
            node = node.setdefault(key, {})
        # A copy (one tensor at a time), not an alias of the numpy buffer: jitted steps donate
        # their parameters, and XLA cannot reuse memory it does not own.
        node[m.path[-1]] = jax.device_put(out, may_alias=False)
        del out
    nnx.replace_by_pure_dict(state, values)
    return nnx.merge(graphdef, state)
