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

With ``offload.overlap`` the optimizer of step t runs on a thread
(:class:`~jaxascend.offload.overlap.BackgroundUpdate`) while :meth:`OffloadEngine.step` returns
and step t+1's forward/backward is dispatched: it waits only for the leaves outside the layer
stack, and its layer scan reads each layer through the parameter source once step t has
updated it. Resident stacked weights then live in host buffers the kernel writes in place and
the source serves. A checkpoint, an export, a report of the state or closing waits for the
running update first.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from typing import Any, Callable, Iterable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxascend.checkpoint import CHECKPOINT_SHAPE_CLASS, Checkpointer, Piece, SsdArrays, checkpoint_arena_requests
from jaxascend.offload.checkpoint_specs import specs_for_offload_layout
from jaxascend.config import Config, ModelConfig
from jaxascend.hf import tree_path_to_dotted
from jaxascend.kill_points import kill_point
from jaxascend.models import DTYPES, TokenBatch, as_token_batch, batch_loss, is_large_table, micro_batch, table_blocks
from jaxascend.offload.grad_sink import step_errors
from jaxascend.offload.layout import STATE_SLOT_CLASS, OffloadLayout
from jaxascend.offload.overlap import BackgroundUpdate
from jaxascend.offload.timeline import StepTimeline
from jaxascend.offload.param_source import PARAM_SOURCE_ERRORS
from jaxascend.offload.partition import DataParallel, JobReads, Partition, local_value
from jaxascend.offload.post_backward_check import PostBackwardCheckedStep, make_full_gradient_step
from jaxascend.offload.ssd_adamw import ssd_adamw_state, ssd_adamw_step
from jaxascend.offload.state import OffloadedAdamState, _to_default_device
from jaxascend.offload.step import (SinkRouting, _first_key, make_accumulating_offload_step, make_offload_eval,
                                    make_offload_step, total_stats)
from jaxascend.optim import AdamWSettings, LossScaleState, StateFormat, update_loss_scale


log = logging.getLogger(__name__)


def overlap_refusal(cfg: Config) -> Optional[str]:
    """Why a run with ``offload.overlap`` runs its steps one after the other (None: it overlaps)."""
    if cfg.train.grad_accum > 1:
        return "train.grad_accum > 1 (the accumulating step takes the whole layer stack as an input)"
    if cfg.offload.post_backward_overflow_check:
        return "offload.post_backward_overflow_check (the ablation differentiates the whole tree)"
    if cfg.offload.fp32_grad_buffer:
        return "offload.fp32_grad_buffer (the ablation's host buffer has no receipts to order the arrivals)"
    if cfg.model.remat == "none" and cfg.offload.params != "ssd":
        return ("model.remat: none (the layer scan would keep every layer it fetched for the backward: 2 B/param "
                "more; remat dots recomputes only the fetch and the element-wise work)")
    return None


def partition_refusal(cfg: Config, model_cfg: ModelConfig, one_process: bool = False) -> Optional[str]:
    """What data parallelism cannot run yet (None: it can): over the processes of a job, or
    (``one_process``) over the devices of one process."""
    if cfg.offload.params == "ssd" and one_process:
        return "offload.params: ssd (each device would read every layer from the one SSD state)"
    if cfg.train.grad_accum > 1 and cfg.offload.params == "ssd":
        return "train.grad_accum > 1 with offload.params: ssd (the accumulating step takes the whole layer stack)"
    if cfg.offload.post_backward_overflow_check or cfg.offload.fp32_grad_buffer:
        return "the ablation switches (post_backward_overflow_check, fp32_grad_buffer) are single-process"
    if model_cfg.vocab_size and is_large_table(jax.ShapeDtypeStruct((model_cfg.vocab_size, model_cfg.hidden_size),
                                                                  DTYPES[model_cfg.dtype])):
        return "a token table computed in blocks (a large vocabulary) is not supported yet"
    return None


def stack_key_of(arch: str) -> str:
    """The attribute holding the scanned layer stack of each architecture."""
    return "h" if arch == "gpt2" else "layers"


def _loss_with_hook(model, batch, layer_hook, table_hook=None):
    return batch_loss(model, batch, layer_hook, table_hook)


def _read_master(master, path: tuple, leaf, layer: Optional[int]) -> np.ndarray:
    """One layer (or one block of rows of a table stored in blocks) of a leaf from ``master``."""
    if leaf.row_blocks > 1:
        rows = leaf.layer_shape[0]
        return master(path, None, rows=(layer * rows, (layer + 1) * rows))
    return master(path, layer)


def token_table_of(model_cfg: ModelConfig) -> tuple[str, ...]:
    """The path of the token embedding table (also the output head when tied)."""
    return ("wte", "embedding") if model_cfg.arch == "gpt2" else ("embed_tokens", "embedding")


def state_format(cfg: Config) -> StateFormat:
    """The format of m and v on SSD: ``optimizer.state_dtype`` (and ``state_block`` for int8),
    rounded as ``optimizer.state_rounding`` says."""
    return StateFormat.of(cfg.optimizer.state_dtype, cfg.optimizer.state_block, cfg.optimizer.state_rounding)


def layout_options(cfg: Config, model_cfg: ModelConfig, stream: bool, row_blocks: list[int]) -> dict:
    """How the engine lays out its state on SSD (``OffloadLayout.plan`` / ``OffloadedAdamState.create``
    keywords); the planner plans with the same."""
    stack_key = stack_key_of(model_cfg.arch)
    return {"stacked": lambda path, shape: path.split("/")[0] == stack_key, "stream_params": stream,
            "row_blocks": row_blocks, "state": state_format(cfg)}


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
                 master: Optional[Callable[[tuple, Optional[int]], np.ndarray]] = None,
                 partition: Optional[Partition] = None):
        """``master``: where the fp32 master weights start, as a reader ``read(path, layer)`` of
        one layer at a time (e.g. :class:`~jaxascend.hf.load.HFParamReader` over the checkpoint
        the run fine-tunes, whose values the compute copy in ``model`` only approximates);
        None: from ``model``'s parameters. ``cfg.offload.params`` must be resolved ("auto" is
        taken as "resident"; the trainer resolves it with :func:`jaxascend.plan.resolve`).

        ``partition``: this process's place in a data-parallel job (see
        :mod:`jaxascend.offload.partition`): its SSD state holds 1/P of every tensor, its rows of
        each global batch are its share of the step, and the updated weights are all-gathered.
        ``Partition(0, 1)``: one process whose several devices share the rows of each batch."""
        refused = partition_refusal(cfg, model_cfg, one_process=partition.count == 1) if partition is not None else None
        if refused:
            raise ValueError(f"data parallel over {len(jax.devices())} devices: {refused}")
        self.data_parallel = DataParallel(partition) if partition is not None else None
        # A job's process owns its slice of every tensor; one process on several devices, all.
        self.partitioned = partition is not None and partition.count > 1
        self.cfg = cfg
        self.compute_dtype = compute_dtype = model_cfg.dtype
        dtype = DTYPES[compute_dtype]
        self.streams_params = stream = cfg.offload.params == "ssd"
        param_dtype = DTYPES[model_cfg.param_dtype]
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        self.graphdef, self.rest = graphdef, rest
        self.stack_key = stack_key_of(model_cfg.arch)
        full_spec = spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype), params)
        dp = self.data_parallel
        if self.partitioned:  # this process's slices of every tensor
            spec = dp.partition.local_spec(spec, lambda path: _first_key(path) == self.stack_key)
        # The instant-offload step has each use of the token table (the lookup and, tied, the head)
        # send its gradient block by block (the sink sums the uses); the accumulating and
        # post-backward steps differentiate the whole tree and send the table's blocks at the end.
        per_use = cfg.train.grad_accum == 1 and not cfg.offload.post_backward_overflow_check
        row_blocks, blocks, large_table = table_layout(params, model_cfg)
        if dp is not None:
            row_blocks = [1] * len(row_blocks)
        uses = (("lookup",) + (("head",) if model_cfg.tie_word_embeddings else ())) if per_use else ()
        routing = SinkRouting.for_params(params, self.stack_key, token_table_of(model_cfg), uses, blocks,
                                         table_as_bits=large_table)
        options = layout_options(cfg, model_cfg, stream, row_blocks)
        extra = checkpoint_slot_requests(OffloadLayout.plan(spec, cfg.offload, **options), cfg.offload)
        self._checkpoint_slots = CHECKPOINT_SHAPE_CLASS if extra else STATE_SLOT_CLASS
        self.state = OffloadedAdamState.create(spec, cfg.offload, **options,
                                               kernel_threads=cfg.offload.kernel_threads, extra_requests=extra,
                                               rounding_seed=cfg.train.seed,
                                               partition_index=dp.partition.index if self.partitioned else 0)
        self._source = None
        self._update: Optional[BackgroundUpdate] = None  # the optimizer step running in the background
        self._resident: dict[int, np.ndarray] = {}  # overlapped, resident: stacked weights the source serves
        refusal = overlap_refusal(cfg) if cfg.offload.overlap else None
        if cfg.offload.overlap and dp is not None and not (self.partitioned and stream) and refusal is None:
            refusal = ("data parallelism with resident weights (they are all-gathered after the step; a job with "
                       "offload.params: ssd overlaps)" if self.partitioned else
                       "data parallelism over one process's devices")
        if refusal:
            log.info("offload.overlap: the optimizer step runs after the forward/backward, not beside it: %s", refusal)
        self.overlap = cfg.offload.overlap and refusal is None
        self._overlap_refusal = refusal
        self._steps = 0
        self._whole_front = None  # the background update whose top-level leaves are whole already (a job)
        self.last_timeline: Optional[StepTimeline] = None  # of the last step that ran an update
        tree = nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params
        # Our parameter path of every leaf, in the layout's leaf order.
        self._paths = [tuple(tree_path_to_dotted(path).split("."))
                       for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
        try:
            if self.partitioned:  # this process's slice of each layer, from the reader or the params
                full = jax.tree.leaves(params)
                take = dp.partition.take

                def value(leaf, layer):
                    if master is not None:
                        return _read_master(master, self._paths[leaf.index], leaf, layer)
                    x = np.asarray(full[leaf.index])
                    return x if layer is None or not leaf.stacked else x[layer]

                self.state.init_from(lambda leaf, layer: take(value(leaf, layer)).astype(np.float32),
                                     compute=lambda leaf, x: np.asarray(x).astype(param_dtype).astype(dtype))
            elif master is None:
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
            self._full_shapes = [tuple(x.shape) for x in jax.tree.leaves(full_spec)]
            if dp is not None:  # the whole compute weights on every process, as the step's replicated input
                leaves = [dp.replicate(x) for x in leaves]
            if self.overlap and not stream:
                # The stack's weights move to host buffers that the optimizer updates in place and
                # the parameter source serves to the layer scan, layer by layer.
                for leaf in self.state.leaves:
                    if leaf.stacked:
                        self._resident[leaf.index] = np.ascontiguousarray(leaves[leaf.index]).reshape(-1).copy()
                        leaves[leaf.index] = None
            self._leaves = leaves
            del params, leaves
            sink = self.state.gradient_sink(routing.arrivals())
            ids = jax.tree.leaves(self.state.tensor_ids())
            if ids != [r.tensor for r in routing.routes]:
                raise RuntimeError("offload: gradient-sink tensor ids disagree with the optimizer's leaf order")
            if cfg.offload.post_backward_overflow_check:  # ablation: full tree, then a scan
                full_step = make_full_gradient_step(graphdef, rest, cfg.train.grad_accum, _loss_with_hook)
                self._fwd_bwd = PostBackwardCheckedStep(full_step, self.state)
            elif dp is not None and cfg.train.grad_accum > 1:
                self._fwd_bwd = make_accumulating_offload_step(graphdef, rest, routing, sink.handle, _loss_with_hook,
                                                               data_parallel=dp)
            elif dp is not None:  # streamed: each process reads its slice of a layer; the step gathers them
                self._source = self.state.param_source() if stream else None
                self._fwd_bwd = make_offload_step(graphdef, rest, routing, sink.handle, _loss_with_hook,
                                                  source=self._source, data_parallel=dp,
                                                  whole_layers=self._whole_layers())
            elif stream or self._resident:
                self._source = self.state.param_source(host=self._resident or None)
                self._fwd_bwd = make_offload_step(graphdef, rest, routing, sink.handle, _loss_with_hook,
                                                  source=self._source)
            else:
                make = make_offload_step if cfg.train.grad_accum == 1 else make_accumulating_offload_step
                self._fwd_bwd = make(graphdef, rest, routing, sink.handle, _loss_with_hook)
            self._eval = make_offload_eval(graphdef, rest, routing, source=self._source, data_parallel=dp,
                                           whole_layers=self._whole_layers() if dp is not None else None)
            self.settings = AdamWSettings.from_config(cfg.optimizer, cfg.train.steps)
            self.opt_state = ssd_adamw_state(self.state)
            self.loss_scale = LossScaleState.initial(cfg.optimizer, compute_dtype)
            # SSD traffic of the steps (each step's, from one step's end to the next's: the
            # backward's gradient writes, the parameter source's reads and the optimizer's
            # records), checkpoints and evaluations left out; the store's own counters hold
            # the run's totals, init and restore included (the endurance cost).
            self.ssd_bytes_read = 0
            self.ssd_bytes_written = 0
            self._io_mark = self._io_counters()
        except BaseException:
            self.state.close()
            raise

    def _whole_layers(self) -> list:
        """One whole layer of each streamed leaf (what a job's step gathers the slices into)."""
        return [jax.ShapeDtypeStruct(self._full_shapes[leaf.index][1:], leaf.dtype)
                for leaf in self.state.layout.streamed_leaves]

    @property
    def params(self):
        """The compute params as the last finished update left them (waits for a running one);
        resident stacked weights of an overlapped run are views of their host buffers, streamed
        ones None."""
        self.finish_update()
        leaves = list(self._leaves)
        for index, buf in self._resident.items():
            leaves[index] = buf.reshape(self.state.leaves[index].shape)
        return self.state.layout.treedef.unflatten(leaves)

    def step(self, tokens, optimizer: bool = True) -> dict[str, Any]:
        """One optimizer step over ``tokens`` (a :class:`~jaxascend.models.TokenBatch` ``[A, ...]``
        or plain rows ``int32 [A, B, T+1]``, every target counted); returns host scalars. Overlapped, the
        update of this step is still running when it returns, and the timing of the optimizer
        (``optimizer_seconds``, ``overlap_fraction``, bytes) is that of the previous step's.
        ``optimizer=False``: the forward/backward only, its gradients dropped and nothing updated
        (the compute-only time of ``scripts/bench_step.py``)."""
        self._steps += 1
        timeline = StepTimeline(self._steps, self.overlap)
        scale = self.loss_scale.scale
        batch = as_token_batch(tokens)
        micro = micro_batch(batch, 0) if self.cfg.train.grad_accum == 1 else batch
        if self.data_parallel is not None:  # the global batch: this process computes its rows
            micro = self.data_parallel.shard_rows(micro, axis=0 if self.cfg.train.grad_accum == 1 else 1)
        previous, self._update = self._update, None
        front_wait = 0.0
        if previous is not None:  # the new embeddings, norm and head; the stack follows layer by layer
            try:
                front_wait = previous.wait_front()
            except BaseException:
                previous.join_quietly()
                raise
            previous.leaves = self._whole_leaves(previous.leaves)  # a job: every process's slices
            self._whole_front = previous
            for index, leaf in previous.leaves.items():
                self._leaves[index] = leaf
        started = time.perf_counter()
        before = self._source.stats() if self._source is not None else None
        if self._source is not None:
            self._source.begin_step()  # reads layer 0, 1, ... (once updated) while the step is dispatched
        try:
            with step_errors(PARAM_SOURCE_ERRORS):  # a sink or source failure, at dispatch or at the fetch
                loss, stats = self._fwd_bwd(self._leaves_tree(), micro, jnp.float32(scale))
                if self.data_parallel is not None:  # replicated: the job's loss and statistics
                    loss, stats = local_value(loss), jax.tree.map(local_value, stats)
                kill_point("backward")  # tests: the backward pass is running and writing gradients
                # SYNC: the overflow check and the clip factor need the statistics, and the optimizer
                # may read the gradient regions only once the backward pass has written all of them.
                loss, (sumsq, nonfinite) = jax.device_get((loss, total_stats(stats)))
        except BaseException:
            if previous is not None:
                previous.join_quietly()  # its own error, if any, explains the fetch's
            raise
        finally:
            if self._source is not None:
                self._source.end_step()
        ended = time.perf_counter()
        timing = {"fwd_bwd_seconds": ended - started}
        if front_wait:
            timeline.add("trainer thread", started - front_wait, started, "waits for top leaves")
        timeline.add("trainer thread", started, ended, "forward/backward")
        if self._source is not None:
            timeline.add_fetches(self._source.take_events())
        if previous is not None:  # done by now: the forward has used every layer it updated
            self._take(previous, timing)
            timeline.add_update(previous.trace, previous.layer_ready_at)
            timing["overlap_fraction"] = previous.overlap_with(started, ended)
        if self._source is not None:  # the weights read during the forward/backward, and the waits
            after = self._source.stats()
            timing["param_wait_seconds"] = after["wait_seconds"] - before["wait_seconds"]
            if self.overlap:
                timing["optimizer_wait_seconds"] = (front_wait + after["optimizer_wait_seconds"]
                                                    - before["optimizer_wait_seconds"])
        self.loss_scale, skip = update_loss_scale(self.loss_scale, bool(nonfinite > 0), self.cfg.optimizer,
                                                  self.compute_dtype)
        grad_norm = math.sqrt(float(sumsq)) / scale
        clip = 1.0
        max_norm = self.cfg.optimizer.grad_clip_norm
        if max_norm is not None and not skip and grad_norm > max_norm:
            clip = max_norm / grad_norm
        if not optimizer:
            self.state.step(None, skip=True)  # the gradients are dropped; the weights stay
        elif self.overlap:
            self._start_update(clip / scale, skip)
        else:
            self._update_now(clip / scale, skip, timing, timeline)
        if timeline.bars["optimizer thread"]:
            self.last_timeline = timeline
        read, written = self._io_counters()
        timing.update(ssd_read_bytes=read - self._io_mark[0], ssd_written_bytes=written - self._io_mark[1])
        self.ssd_bytes_read += timing["ssd_read_bytes"]
        self.ssd_bytes_written += timing["ssd_written_bytes"]
        self._io_mark = (read, written)
        return {"loss": float(loss), "grad_norm": grad_norm if not skip else float("nan"),
                "skipped": bool(skip), "loss_scale": scale, **timing}

    def evaluate(self, batches: Iterable[TokenBatch]) -> tuple[float, int]:
        """``(sum of the counted targets' losses, their count)`` over ``batches`` (micro-batches
        ``[B, ...]``; a target counts where its weight is non-zero), on the compute params as
        the last update left them (waits for a running one). Forward only: no gradient is sent
        and the optimizer state on SSD is neither read nor written; streamed weights are read
        layer by layer through the parameter source, as in a step."""
        self.finish_update()
        params = self._leaves_tree()
        total, count = 0.0, 0
        for batch in batches:
            if self._source is not None:
                self._source.begin_step(forward_only=True)
            try:
                with step_errors(PARAM_SOURCE_ERRORS):
                    if self.data_parallel is not None:  # this process's rows; the sums are the job's
                        loss_sum, counted = (local_value(x) for x in self._eval(
                            params, self.data_parallel.shard_rows(batch)))
                    else:
                        loss_sum, counted = jax.device_get(self._eval(params, batch))  # SYNC: per batch
            finally:
                if self._source is not None:
                    self._source.end_step()
            total += float(loss_sum)
            count += int(counted)
        if self._source is not None:
            self._source.take_events()  # the evaluation's fetches are not the next step's timeline
        self._io_mark = self._io_counters()  # nor its reads the next step's traffic
        return total, count

    def _leaves_tree(self):
        return self.state.layout.treedef.unflatten(self._leaves)

    def _io_counters(self) -> tuple[int, int]:
        """(bytes read, bytes written) by the store since it was opened."""
        c = self.state.store.stats()
        return int(c["bytes_read"]), int(c["bytes_written"])

    def _account(self, last, timing: dict) -> None:
        stream = last.seconds - last.flush_seconds
        timing.update(grad_flush_seconds=last.flush_seconds, optimizer_seconds=stream,
                      optimizer_bytes=last.bytes_read + last.bytes_written, ssd_gbps=last.ssd_gbps,
                      stream_gbps=(last.bytes_read + last.bytes_written) / stream / 1e9 if stream > 0 else 0.0)

    def _update_now(self, grad_scale: float, skip: bool, timing: dict, timeline: StepTimeline) -> None:
        if not skip:  # the step emits new leaves; the old ones need not outlive it
            self._leaves = [None] * len(self._leaves)
        trace: list = []
        new_params, self.opt_state = ssd_adamw_step(self.settings, self.opt_state, self.state,
                                                    grad_scale=grad_scale, skip=skip, trace=trace)
        timeline.add_update(trace, {})
        if new_params is not None:
            self._leaves = jax.tree.leaves(new_params, is_leaf=lambda x: x is None)
            if self.partitioned:  # every process's slices make the whole (replicated) weights again
                self._leaves = self.data_parallel.gather(self._leaves, self._full_shapes,
                                                         [leaf.stacked for leaf in self.state.leaves])
            elif self.data_parallel is not None:  # the whole weights, as the next step's replicated input
                self._leaves = [self.data_parallel.replicate(x) for x in self._leaves]
            self._account(self.state.last_step, timing)

    def _start_update(self, grad_scale: float, skip: bool) -> None:
        """The update of this step, on a thread (or, for an overflowed step, nothing)."""
        if skip:
            self.state.step(None, skip=True)  # forgets the gradients; the weights stay as they are
            return
        scalars = self.settings.scalars(self.state.updates_applied, grad_scale)
        for leaf in self.state.leaves:  # replaced by the update's; the old ones need not outlive it
            if not leaf.streamed and leaf.index not in self._resident:
                self._leaves[leaf.index] = None
        if self._source is not None:
            # The next forward waits for each layer's update; streamed weights are handed to it in memory.
            self._source.gate(handover=self.streams_params)
        self._update = BackgroundUpdate(self.state, scalars, source=self._source, outputs=self._resident,
                                        put=_to_default_device, trace=True).start()

    def _whole_leaves(self, new: dict) -> dict:
        """A job's updated top-level leaves (an overlapped update's, by leaf index) whole and
        replicated, from every process's slices; as they are for one process."""
        if not new or not self.partitioned:
            return new
        indices = sorted(new)
        full = self.data_parallel.gather([np.asarray(new[i]) for i in indices], [self._full_shapes[i] for i in indices],
                                         [self.state.leaves[i].stacked for i in indices])
        return dict(zip(indices, full))

    def finish_update(self) -> None:
        """Waits for the optimizer step running in the background (overlap); raises its error."""
        update, self._update = self._update, None
        if update is not None:
            self._take(update, {})

    def _take(self, update: BackgroundUpdate, timing: dict) -> None:
        """Joins a background update and takes what it left: its new leaves, the optax count, its
        bytes and timing (into ``timing``); raises its error."""
        update.join()
        if update is not self._whole_front:
            update.leaves = self._whole_leaves(update.leaves)
        self._whole_front = None
        for index, leaf in update.leaves.items():
            self._leaves[index] = leaf
        self.opt_state = ssd_adamw_state(self.state)
        self._account(update.stats, timing)

    def _ssd_arrays(self) -> SsdArrays:
        # The step's state slots are idle between steps; checkpoints stream through them. Each
        # array records where it sits in its whole tensor, so that another number of processes
        # can re-partition it on restore.
        part = self.data_parallel.partition if self.partitioned else Partition(0, 1)
        pieces = [Piece(part.index, part.count, self._full_shapes[leaf.index], leaf.stacked)
                  for leaf in self.state.leaves]
        return SsdArrays(self.state.store, specs_for_offload_layout(self.state.layout, pieces=pieces),
                         slot_class=self._checkpoint_slots, attributes={"state": self.state.layout.state.describe()})

    @property
    def processes(self) -> int:
        return self.data_parallel.partition.count if self.partitioned else 1

    def _local_params(self):
        """The compute params as this process holds them (a job's replicated arrays as numpy)."""
        params = self.params  # waits for a running update
        if self.data_parallel is None:
            return params
        return jax.tree.map(local_value, params)

    def save_checkpoint(self, ckpt: Checkpointer, step: int, meta: dict) -> None:
        """Compute params and the run's scalars, plus master/m/v streamed from SSD chunk by chunk
        (after the update of ``step``, if it runs in the background). In a job every process
        saves its slices of master/m/v into the same step; the compute params (the same on every
        process) are written once."""
        params = self._local_params()
        meta = {**meta, "updates_applied": self.state.updates_applied, "loss_scale": self.loss_scale.to_dict(),
                "processes": self.processes}
        ckpt.save(step, params=params, ssd=self._ssd_arrays(), meta=meta)
        if self._resident:
            # The stack's weights are views of the buffers the next (background) update writes in
            # place: the save must have copied them out before this returns.
            ckpt.wait()
        self._io_mark = self._io_counters()  # the save's reads are not the next step's

    def restore_checkpoint(self, ckpt: Checkpointer, step: int) -> dict:
        """Rebuilds the SSD shards from checkpoint ``step`` (so a kill during an optimizer step can
        never poison a resume) and restores the compute params; returns the checkpoint's meta."""
        restored = ckpt.restore(step, params_like=self._local_params(), ssd=self._ssd_arrays())
        leaves = jax.tree.leaves(restored.params, is_leaf=lambda x: x is None)
        if self.data_parallel is not None:
            leaves = [self.data_parallel.replicate(x) for x in leaves]
        for index, buf in self._resident.items():  # resident stacked weights: into the source's buffers
            np.copyto(buf, np.asarray(leaves[index]).reshape(-1))
            leaves[index] = None
        self._leaves = leaves
        self.state.restored(int(restored.meta["updates_applied"]))
        self.opt_state = ssd_adamw_state(self.state)
        self.loss_scale = LossScaleState.from_dict(restored.meta["loss_scale"])
        self._io_mark = self._io_counters()
        return restored.meta

    @contextlib.contextmanager
    def sampled_weights(self):
        """``with engine.sampled_weights() as weights:`` on every process: the compute params to
        sample from (:meth:`compute_weights`) on process 0, None on the others; a job's streamed
        layers are gathered from every process's slices as process 0 reads them."""
        if not (self.partitioned and self.streams_params):
            yield self.compute_weights() if not self.partitioned or self.data_parallel.partition.index == 0 else None
            return
        self.finish_update()  # on every process: its gather is a collective, and the served layers must be new
        with self._job_reads(self.state.read_params) as reads:
            yield self._weights_reader(lambda leaf, layer: reads.read(leaf.index, layer)) if reads.is_reader else None

    def compute_weights(self):
        """The compute params to sample from (the end-of-run samples): the tree itself when the
        layer stack is resident, else a reader ``read(path, layer)`` that reads a streamed
        layer from SSD when asked, one at a time (waits for a running update first). One
        process's own (a job's streamed layers: :meth:`sampled_weights`)."""
        if not self.streams_params:
            return self._local_params()
        return self._weights_reader(self.state.read_params)

    def _weights_reader(self, read_streamed: Callable):
        """``read(path, layer)`` of the compute params: a streamed leaf's layers through
        ``read_streamed(leaf, layer)``, the others from this process's copy (waits for a running update)."""
        leaves = jax.tree.leaves(self._local_params(), is_leaf=lambda x: x is None)

        def value(leaf, layer):
            if leaf.streamed:
                return read_streamed(leaf, layer)
            x = np.asarray(leaves[leaf.index])
            return x if layer is None else x[layer]

        return self._reader(value, "")

    def export_params(self):
        """The weights to save or export, as a reader ``read(path, layer)`` of the fp32 master
        weights on SSD: an exporter pulls one tensor (one layer of a stack) at a time, so saving
        never holds more than that in RAM. One process only (a job: :meth:`exported_weights`)."""
        if self.partitioned:
            raise RuntimeError("offload: a job's weights are read through exported_weights() on every process")
        self.finish_update()
        return self._reader(self._read_master_state, " to export")

    @contextlib.contextmanager
    def exported_weights(self):
        """``with engine.exported_weights() as read:`` on every process of the job: ``read`` (the
        reader of :meth:`export_params`) on process 0, None on the others, which meanwhile serve
        their slices of each tensor process 0 reads (gathered one tensor, or one layer, at a time)."""
        if not self.partitioned:
            yield self.export_params()
            return
        self.finish_update()
        with self._job_reads(self._read_master_state) as reads:
            yield self._reader(lambda leaf, layer: reads.read(leaf.index, layer), " to export") \
                if reads.is_reader else None

    def _read_master_state(self, leaf, layer: Optional[int]) -> np.ndarray:
        return self.state.read_state(leaf, "master", layer=layer)

    def _job_reads(self, read_slice: Callable) -> JobReads:
        """Process 0's whole-tensor reads of what ``read_slice(leaf, layer)`` reads of this
        process's slices (see :class:`~jaxascend.offload.partition.JobReads`)."""
        leaves = self.state.leaves
        return JobReads(self.data_parallel, lambda index, layer: read_slice(leaves[index], layer).reshape(-1),
                        self._full_shapes, [leaf.stacked for leaf in leaves])

    def _reader(self, value: Callable, purpose: str):
        """``read(path, layer)`` by our parameter path: ``value(leaf, layer)`` of that leaf's layout."""
        index = {path: i for i, path in enumerate(self._paths)}

        def read(path: tuple[str, ...], layer):
            if tuple(path) not in index:
                raise ValueError(f"offload: no parameter {'.'.join(path)!r}{purpose}")
            return value(self.state.leaves[index[tuple(path)]], layer)

        return read

    def report(self) -> dict[str, Any]:
        """The engine's figures (of the last finished update; a running one is not waited for)."""
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
            "ssd_read_bytes_step": last.bytes_read if last else 0,  # the last optimizer step's
            "ssd_write_bytes_step": last.bytes_written if last else 0,
            # the offload files' traffic since the engine opened them: init, restore, steps, saves
            **dict(zip(("ssd_read_bytes_run", "ssd_written_bytes_run"), self._io_counters())),
            "state_dtype": self.state.layout.state.dtype,
            "state_rounding": self.state.layout.state.rounding,  # "nearest" for float32
            "state_bytes": self.state.layout.state_bytes,
            "ssd_gbps_step": last.ssd_gbps if last else 0.0,
            "optimizer_seconds_step": last.seconds if last else 0.0,
            "loss_scale": self.loss_scale.scale,
            "skipped_steps": self.loss_scale.skipped_steps,
            "data_parallel_processes": self.processes,
            "data_parallel_devices": self.data_parallel.devices if self.data_parallel is not None else 1,
            "params": "ssd" if self.streams_params else "resident",
            "overlap": self.overlap,
            **({"overlap_refused": self._overlap_refusal} if self._overlap_refusal else {}),
            "io_engine": self.state.store.io_engine,
            "early_gradient_arrivals": getattr(self.state._sink, "early_arrivals", 0),
            "resident_param_bytes": self.state.layout.resident_param_bytes,
            "streamed_param_bytes": self.state.layout.streamed_param_bytes,
            **({"param_source_" + k: v for k, v in self._source.stats().items()} if self._source else {}),
        }

    def shard_files(self) -> list[str]:
        return sorted({e.shard_path for r in self.state.store.regions() for e in r.extents})

    def __enter__(self) -> "OffloadEngine":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self.finish_update()  # its error is the run's
            elif self._update is not None:
                self._update.join_quietly()  # the run already failed; that error is reported
        finally:
            self.state.close()
