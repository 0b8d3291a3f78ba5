"""The offloaded engine: compute params in the compute dtype, everything else on SSD.

One step, top to bottom:

1. forward/backward, jitted, with every gradient leaving for the SSD store the moment the
   backward pass computes it (:mod:`jaxascend.offload.step`), in the compute dtype;
2. the probes' statistics come back: overflow (any inf/NaN) and the global norm are known
   before the optimizer touches any state (the one host sync of the step);
3. on overflow the step is skipped, state untouched, and the loss scale backs off (fp16);
   otherwise the streamed fused AdamW (:class:`~jaxascend.offload.state.OffloadedAdamState`)
   reads master/m/v/grad chunk by chunk, unscales and clips in the kernel, writes master/m/v
   back and emits the new compute params leaf by leaf.

Host memory: the compute params (2 B/param for bf16/fp16), the fixed-size arena, and one leaf
being filled by the step. With ``train.grad_accum > 1`` a float32 accumulator (4 B/param)
lives in the device memory kind during the backward passes.

With ``offload.params: ssd`` the layer stack's compute params live on SSD instead: the step
writes them there, and the forward/backward reads them layer by layer through the parameter
source (:mod:`jaxascend.offload.param_source`); only the embeddings, final norm and head stay in
memory. ``model`` may then hold the stack as ``jax.ShapeDtypeStruct`` leaves (never
materialized) when ``master`` reads the weights layer by layer.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxascend.checkpoint import (CHECKPOINT_SHAPE_CLASS, Checkpointer, SsdArrays, checkpoint_arena_requests,
                                  specs_for_offload_layout)
from jaxascend.config import Config, ModelConfig
from jaxascend.hf import tree_path_to_dotted
from jaxascend.kill_points import kill_point
from jaxascend.models import DTYPES, is_large_table, next_token_loss, table_blocks
from jaxascend.offload.grad_sink import step_errors
from jaxascend.offload.layout import STATE_SLOT_CLASS, OffloadLayout
from jaxascend.offload.param_source import PARAM_SOURCE_ERRORS
from jaxascend.offload.post_backward_check import PostBackwardCheckedStep, make_full_gradient_step
from jaxascend.offload.ssd_adamw import ssd_adamw_state, ssd_adamw_step
from jaxascend.offload.state import OffloadedAdamState
from jaxascend.offload.step import SinkRouting, make_accumulating_offload_step, make_offload_step, total_stats
from jaxascend.optim import AdamWSettings, LossScaleState, update_loss_scale


def stack_key_of(arch: str) -> str:
    """The attribute holding the scanned layer stack of each architecture."""
    return "h" if arch == "gpt2" else "layers"


def _loss_with_hook(model, tokens, layer_hook, table_hook=None):
    return next_token_loss(model(tokens[:, :-1], layer_hook=layer_hook, table_hook=table_hook), tokens)


def _read_master(master, path: tuple, leaf, layer: Optional[int]) -> np.ndarray:
    """One layer (or one block of rows of a table stored in blocks) of a leaf from ``master``."""
    if leaf.row_blocks > 1:
        rows = leaf.layer_shape[0]
        return master(path, None, rows=(layer * rows, (layer + 1) * rows))
    return master(path, layer)


def token_table_of(model_cfg: ModelConfig) -> tuple[str, ...]:
    """The path of the token embedding table (also the output head when tied)."""
    return ("wte", "embedding") if model_cfg.arch == "gpt2" else ("embed_tokens", "embedding")


def layout_options(model_cfg: ModelConfig, stream: bool, row_blocks: list[int]) -> dict:
    """How the engine lays out its state on SSD (``OffloadLayout.plan`` / ``OffloadedAdamState.create``
    keywords); the planner plans with the same."""
    stack_key = stack_key_of(model_cfg.arch)
    return {"stacked": lambda path, shape: path.split("/")[0] == stack_key, "stream_params": stream,
            "row_blocks": row_blocks}


def checkpoint_slot_requests(layout: OffloadLayout, cfg) -> tuple:
    """Checkpoints stream master/m/v through the step's state slots, idle between steps; a model
    so small that those slots hold under 3 SSD blocks gets a few slots of its own (these)."""
    if layout.state_slot_bytes < 3 * cfg.block_bytes:
        return tuple(checkpoint_arena_requests(cfg, chunk_bytes=cfg.block_bytes))
    return ()


def table_layout(params, model_cfg: ModelConfig) -> tuple[list[int], int, bool]:
    """(blocks of rows per leaf in flattening order, the token table's blocks, whether the table
    is large): a large table's gradient arrives, and is stored, in the blocks of rows the model
    computes it in (see models.vocab)."""
    table = token_table_of(model_cfg)
    blocks, large = [], False
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        keys = tuple(str(getattr(p, "key", getattr(p, "name", p))) for p in path)
        is_table = keys[:len(table)] == table and len(leaf.shape) == 2
        blocks.append(table_blocks(*leaf.shape) if is_table else 1)
        large = large or (is_table and is_large_table(leaf))
    return blocks, max(blocks), large


class OffloadEngine:
    """Owns the arena, the SSD store and the AdamW state on it (through
    :class:`OffloadedAdamState`); a context manager that closes them (and unlocks
    ``offload.dir``) on exit."""

    name = "offload"

    def __init__(self, cfg: Config, model: nnx.Module, model_cfg: ModelConfig,
                 master: Optional[Callable[[tuple, Optional[int]], np.ndarray]] = None):
        """``master``: where the fp32 master weights start, as a reader ``read(path, layer)`` of
        one layer at a time (e.g. :class:`~jaxascend.hf.load.HFParamReader` over the checkpoint
        the run fine-tunes, whose values the compute copy in ``model`` only approximates);
        None: from ``model``'s parameters. ``cfg.offload.params`` must be resolved ("auto" is
        taken as "resident"; the trainer resolves it with :func:`jaxascend.plan.resolve`)."""
        self.cfg = cfg
        self.compute_dtype = compute_dtype = model_cfg.dtype
        dtype = DTYPES[compute_dtype]
        self.streams_params = stream = cfg.offload.params == "ssd"
        param_dtype = DTYPES[model_cfg.param_dtype]
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        self.graphdef, self.rest = graphdef, rest
        self.stack_key = stack_key_of(model_cfg.arch)
        spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype), params)
        # The instant-offload step has each use of the token table (the lookup and, tied, the head)
        # send its gradient block by block (the sink sums the uses); the accumulating and
        # post-backward steps differentiate the whole tree and send the table's blocks at the end.
        per_use = cfg.train.grad_accum == 1 and not cfg.offload.post_backward_overflow_check
        row_blocks, blocks, large_table = table_layout(params, model_cfg)
        uses = (("lookup",) + (("head",) if model_cfg.tie_word_embeddings else ())) if per_use else ()
        routing = SinkRouting.for_params(params, self.stack_key, token_table_of(model_cfg), uses, blocks,
                                         table_as_bits=large_table)
        options = layout_options(model_cfg, stream, row_blocks)
        extra = checkpoint_slot_requests(OffloadLayout.plan(spec, cfg.offload, **options), cfg.offload)
        self._checkpoint_slots = CHECKPOINT_SHAPE_CLASS if extra else STATE_SLOT_CLASS
        self.state = OffloadedAdamState.create(spec, cfg.offload, **options,
                                               kernel_threads=cfg.offload.kernel_threads, extra_requests=extra)
        self._source = None
        tree = nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params
        # Our parameter path of every leaf, in the layout's leaf order.
        self._paths = [tuple(tree_path_to_dotted(path).split("."))
                       for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
        try:
            if master is None:
                self.state.init(params)  # fp32 master weights from the loaded/initialised params
            else:
                # A streamed leaf's compute weights are the reader's values as the resident copy
                # gets them: cast to param_dtype (the model's), then to the compute dtype.
                self.state.init_from(lambda leaf, layer: _read_master(master, self._paths[leaf.index], leaf, layer),
                                     compute=lambda leaf, x: np.asarray(x).astype(param_dtype).astype(dtype))
            # The compute copy (without the streamed leaves, which are on SSD now); the
            # param_dtype copy is dropped once the master weights are on SSD.
            leaves = [None if leaf.streamed else x.astype(dtype)
                      for leaf, x in zip(self.state.leaves, jax.tree.leaves(params))]
            self.params = self.state.layout.treedef.unflatten(leaves)
            del params, leaves
            sink = self.state.gradient_sink(routing.arrivals())
            ids = jax.tree.leaves(self.state.tensor_ids())
            if ids != [r.tensor for r in routing.routes]:
                raise RuntimeError("offload: gradient-sink tensor ids disagree with the optimizer's leaf order")
            if cfg.offload.post_backward_overflow_check:  # ablation: full tree, then a scan
                full_step = make_full_gradient_step(graphdef, rest, cfg.train.grad_accum, _loss_with_hook)
                self._fwd_bwd = PostBackwardCheckedStep(full_step, self.state)
            elif stream:
                self._source = self.state.param_source()
                self._fwd_bwd = make_offload_step(graphdef, rest, routing, sink.handle, _loss_with_hook,
                                                  source=self._source)
            else:
                make = make_offload_step if cfg.train.grad_accum == 1 else make_accumulating_offload_step
                self._fwd_bwd = make(graphdef, rest, routing, sink.handle, _loss_with_hook)
            self.settings = AdamWSettings.from_config(cfg.optimizer, cfg.train.steps)
            self.opt_state = ssd_adamw_state(self.state)
            self.loss_scale = LossScaleState.initial(cfg.optimizer, compute_dtype)
            self.ssd_bytes_read = 0
            self.ssd_bytes_written = 0
        except BaseException:
            self.state.close()
            raise

    def step(self, tokens: np.ndarray) -> dict[str, Any]:
        """One optimizer step over ``tokens[A, B, T+1]``; returns host scalars."""
        scale = self.loss_scale.scale
        micro = tokens[0] if self.cfg.train.grad_accum == 1 else tokens
        started = time.perf_counter()
        before = self._source.stats() if self._source is not None else None
        if self._source is not None:
            self._source.begin_step()  # reads layer 0, 1, ... while the step is dispatched
        try:
            with step_errors(PARAM_SOURCE_ERRORS):  # a sink or source failure, at dispatch or at the fetch
                loss, stats = self._fwd_bwd(self.params, micro, jnp.float32(scale))
                kill_point("backward")  # tests: the backward pass is running and writing gradients
                # SYNC: the overflow check and the clip factor need the statistics, and the optimizer
                # may read the gradient regions only once the backward pass has written all of them.
                loss, (sumsq, nonfinite) = jax.device_get((loss, total_stats(stats)))
        finally:
            if self._source is not None:
                self._source.end_step()
        timing = {"fwd_bwd_seconds": time.perf_counter() - started}
        if self._source is not None:  # the weights read during the forward/backward, and the wait for them
            after = self._source.stats()
            timing["param_wait_seconds"] = after["wait_seconds"] - before["wait_seconds"]
            self.ssd_bytes_read += after["bytes_read"] - before["bytes_read"]
        self.loss_scale, skip = update_loss_scale(self.loss_scale, bool(nonfinite > 0), self.cfg.optimizer,
                                                  self.compute_dtype)
        grad_norm = math.sqrt(float(sumsq)) / scale
        clip = 1.0
        max_norm = self.cfg.optimizer.grad_clip_norm
        if max_norm is not None and not skip and grad_norm > max_norm:
            clip = max_norm / grad_norm
        if not skip:
            self.params = None  # the step emits new leaves; the old ones need not outlive it
        new_params, self.opt_state = ssd_adamw_step(self.settings, self.opt_state, self.state,
                                                    grad_scale=clip / scale, skip=skip)
        if new_params is not None:
            self.params = new_params
            last = self.state.last_step
            self.ssd_bytes_read += last.bytes_read
            self.ssd_bytes_written += last.bytes_written
            timing.update(grad_flush_seconds=last.flush_seconds, optimizer_seconds=last.seconds - last.flush_seconds)
        return {"loss": float(loss), "grad_norm": grad_norm if not skip else float("nan"),
                "skipped": bool(skip), "loss_scale": scale, **timing}

    def _ssd_arrays(self) -> SsdArrays:
        # The step's state slots are idle between steps; checkpoints stream through them.
        return SsdArrays(self.state.store, specs_for_offload_layout(self.state.layout), slot_class=self._checkpoint_slots)

    def save_checkpoint(self, ckpt: Checkpointer, step: int, meta: dict) -> None:
        """Compute params and the run's scalars, plus master/m/v streamed from SSD chunk by chunk."""
        meta = {**meta, "updates_applied": self.state.updates_applied, "loss_scale": self.loss_scale.to_dict()}
        ckpt.save(step, params=self.params, ssd=self._ssd_arrays(), meta=meta)

    def restore_checkpoint(self, ckpt: Checkpointer, step: int) -> dict:
        """Rebuilds the SSD shards from checkpoint ``step`` (so a kill during an optimizer step can
        never poison a resume) and restores the compute params; returns the checkpoint's meta."""
        restored = ckpt.restore(step, params_like=self.params, ssd=self._ssd_arrays())
        self.params = restored.params
        self.state.restored(int(restored.meta["updates_applied"]))
        self.opt_state = ssd_adamw_state(self.state)
        self.loss_scale = LossScaleState.from_dict(restored.meta["loss_scale"])
        return restored.meta

    def export_params(self):
        """The weights to save or export, as a reader ``read(path, layer)`` of the fp32 master
        weights on SSD: an exporter pulls one tensor (one layer of a stack) at a time, so saving
        never holds more than that in RAM."""
        index = {path: i for i, path in enumerate(self._paths)}

        def read(path: tuple[str, ...], layer):
            if tuple(path) not in index:
                raise ValueError(f"offload: no parameter {'.'.join(path)!r} to export")
            return self.state.read_state(self.state.leaves[index[tuple(path)]], "master", layer=layer)

        return read

    def report(self) -> dict[str, Any]:
        arena = self.state.store.arena
        last = self.state.last_step
        return {
            "arena_capacity_bytes": arena.capacity,
            "arena_high_water_bytes": arena.high_water_bytes,
            "arena_locked": arena.locked,
            "arena_pinned": arena.pinned,
            "direct_io": self.state.store.direct_io,
            # the fp32_grad_buffer ablation's full fp32 host gradient copy (0 without it)
            "host_grad_buffer_bytes": self.state.grad_buffer.nbytes if self.state.grad_buffer is not None else 0,
            "ssd_read_bytes_step": last.bytes_read if last else 0,
            "ssd_write_bytes_step": last.bytes_written if last else 0,
            "ssd_gbps_step": last.ssd_gbps if last else 0.0,
            "optimizer_seconds_step": last.seconds if last else 0.0,
            "loss_scale": self.loss_scale.scale,
            "skipped_steps": self.loss_scale.skipped_steps,
            "params": "ssd" if self.streams_params else "resident",
            "resident_param_bytes": self.state.layout.resident_param_bytes,
            "streamed_param_bytes": self.state.layout.streamed_param_bytes,
            **({"param_source_" + k: v for k, v in self._source.stats().items()} if self._source else {}),
        }

    def shard_files(self) -> list[str]:
        return sorted({e.shard_path for r in self.state.store.regions() for e in r.extents})

    def __enter__(self) -> "OffloadEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.state.close()
