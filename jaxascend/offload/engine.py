"""The offloaded engine: compute params in the compute dtype, everything else on SSD.

One step, top to bottom (:meth:`OffloadEngine.step`):

1. forward/backward, jitted, with every gradient leaving for the SSD store the moment the
   backward pass computes it (:mod:`jaxascend.offload.step`), in the compute dtype;
2. the probes' statistics come back: overflow (any inf/NaN) and the global norm are known
   before the optimizer touches any state (the one host sync of the step);
3. on overflow the step is skipped, state untouched, and the loss scale backs off (fp16);
   otherwise the streamed fused AdamW (:class:`~jaxascend.offload.state.OffloadedAdamState`)
   reads master/m/v/grad chunk by chunk, unscales and clips in the kernel, writes master/m/v
   back and emits the new compute params leaf by leaf.

The engine does not branch on modes: it composes three parts from its
:class:`~jaxascend.offload.step_plan.StepPlan`, chosen once:

* the compute weights (:class:`~jaxascend.offload.compute_weights.ComputeWeights`): arrays,
  host buffers served layer by layer (overlapped, resident), or the SSD (``offload.params: ssd``);
* the gradient routing (:class:`~jaxascend.offload.gradient_routing.GradientRouting`): instant,
  accumulated, or the post-backward ablation, under ``shard_map`` when data parallel;
* the update runner (:mod:`jaxascend.offload.update_runner`): sequential, or overlapped with the
  next step's forward/backward.

Host memory: the compute params (2 B/param for bf16/fp16; with the stack on SSD only the
embeddings, final norm and head), the fixed-size arena, and one leaf being filled by the step.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Iterable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxascend.checkpoint import CHECKPOINT_SHAPE_CLASS, Checkpointer, Piece, SsdArrays
from jaxascend.offload.checkpoint_specs import specs_for_offload_layout
from jaxascend.config import ModelConfig
from jaxascend.distributed import ProcessGroup, job_barrier
from jaxascend.engine_contract import EngineReport, StepResult
from jaxascend.kill_points import kill_point
from jaxascend.models import DTYPES, TokenBatch, layer_stack_key
from jaxascend.offload.compute_weights import ComputeWeights
from jaxascend.offload.engine_settings import EngineSettings, StateOptions, param_paths
from jaxascend.offload.grad_sink import step_errors
from jaxascend.offload.gradient_routing import GradientRouting, leaf_routes
from jaxascend.offload.initial_state import master_weights
from jaxascend.offload.layout import STATE_SLOT_CLASS
from jaxascend.offload.param_source import PARAM_SOURCE_ERRORS
from jaxascend.offload.placement import placement_of
from jaxascend.offload.raw_bits import bit_leaves
from jaxascend.offload.ssd_adamw import ssd_adamw_state
from jaxascend.offload.state import OffloadedAdamState
from jaxascend.offload.state_layout import StateLayoutOptions, TableLayout, checkpoint_slot_requests
from jaxascend.offload.step import LeafRoutes, total_stats
from jaxascend.offload.step_plan import StepPlan
from jaxascend.offload.timeline import StepTimeline
from jaxascend.offload.update_runner import OverlappedUpdates, SequentialUpdates, UpdateRunner
from jaxascend.offload.weight_readers import WeightReaders
from jaxascend.optim import LossScaleState

MasterReader = Callable[[tuple, Optional[int]], np.ndarray]


def _read_master(master: MasterReader, path: tuple, leaf, layer: Optional[int], shape: tuple) -> np.ndarray:
    """One layer (or one block of rows of a table stored in blocks) of a leaf of whole shape
    ``shape`` from ``master``."""
    if leaf.row_blocks > 1:
        rows = shape[0] // leaf.row_blocks
        return master(path, None, rows=(layer * rows, (layer + 1) * rows))
    return master(path, layer)


class PlannedOffloadEngine:
    """Owns the arena, the SSD store and the AdamW state on it (through
    :class:`OffloadedAdamState`); a context manager that closes them (and unlocks
    ``offload.dir``) on exit. Implements :class:`jaxascend.engine_contract.Engine`. Built from the
    step's plan and typed settings (:class:`~jaxascend.offload.engine_settings.EngineSettings`),
    it reads no config; :class:`~jaxascend.offload.engine_settings.OffloadEngine` is the same
    engine built from one."""

    name = "offload"

    def __init__(self, model: nnx.Module, model_cfg: ModelConfig, plan: StepPlan, settings: EngineSettings,
                 master: Optional[MasterReader] = None, from_files: Optional[int] = None):
        """``plan``: the step's strategy (:meth:`StepPlan.resolve`). ``master``: where the fp32
        master weights start, as a reader ``read(path, layer)`` of one layer at a time (e.g.
        :class:`~jaxascend.hf.load.HFParamReader` over the checkpoint the run fine-tunes, whose
        values the compute copy in ``model`` only approximates); None: from ``model``'s parameters.
        ``from_files`` (durable steps): the step of the offload files a run left that is the state,
        recovered (an interrupted update rolled forward), not written from the model."""
        self.plan = plan
        if plan.engine != "offload":
            raise ValueError("OffloadEngine: the plan is the in-memory engine's (offload.enabled: false)")
        self.compute_dtype = model_cfg.dtype
        self.streams_layers = plan.weights == "ssd"  # the sampler reads the stack layer by layer too
        self.settings, self.loss_scaling, self.grad_clip_norm = settings.adamw, settings.loss_scaling, \
            settings.grad_clip_norm
        self.placement = placement_of(plan)  # one device, this process's devices, or a job's
        self.graphdef, params, self.rest = nnx.split(model, nnx.Param, ...)
        table = TableLayout.of(params, model_cfg)
        routing = leaf_routes(plan, self.placement, params, model_cfg, table)
        full_spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, DTYPES[model_cfg.dtype]), params)
        self.state = self._create_state(full_spec, model_cfg, table, routing, settings.state, from_files is not None)
        try:
            if plan.durable:  # a job's processes agree on the step their files hold
                self.state.records.join(job_barrier(ProcessGroup(plan.partition.index, plan.processes)
                                                    if plan.partitioned else ProcessGroup()))
            paths = param_paths(params)  # our parameter path of every leaf, in the layout's leaf order
            leaves = self._recover_state(model_cfg, from_files, full_spec) if from_files is not None else \
                self._init_state(params, master, paths, model_cfg)
            del params
            self.weights = ComputeWeights(plan, self.state, leaves, [x.shape for x in jax.tree.leaves(full_spec)],
                                          self.placement,
                                          bits=bit_leaves(routing, [leaf.dtype for leaf in self.state.leaves]))
            del leaves
            self.routing = GradientRouting.build(plan, self.graphdef, self.rest, routing, self.state, self.weights,
                                                 self.placement)
            runner = OverlappedUpdates if plan.overlap else SequentialUpdates
            self.updates: UpdateRunner = runner(self.state, self.weights, self.settings)
            self.readers = self.placement.readers(WeightReaders(self.state, self.weights, paths, self.finish_update))
            self.loss_scale = self.loss_scaling.initial()
            if from_files is not None and "loss_scale" in self.state.records.trainer:
                self.loss_scale = LossScaleState.from_dict(self.state.records.trainer["loss_scale"])
            # durable steps: the trainer's state (data position, losses so far) for the next step's journal
            self._resume_state: dict = {"losses": list(self.state.records.trainer.get("losses", []))} \
                if from_files is not None else {}
            self._steps = 0
            self._last_timeline: Optional[StepTimeline] = None  # of the last step that ran an update
            # SSD traffic of the steps (each step's, from one step's end to the next's: the
            # backward's gradient writes, the parameter source's reads and the optimizer's
            # records), checkpoints and evaluations left out; the store's own counters hold
            # the run's totals, init and restore included (the endurance cost).
            self.ssd_bytes_read = self.ssd_bytes_written = 0
            self.ssd_first_step: Optional[tuple[int, int]] = None  # this run's first step's (read, written)
            self._io_mark = self._io_counters()
        except BaseException:
            self.state.close()
            raise

    def _create_state(self, full_spec, model_cfg: ModelConfig, table: TableLayout, routing: LeafRoutes,
                      options: StateOptions, reopen: bool) -> OffloadedAdamState:
        """The arena, the store and the layout of this process's state (a job's: its slices)."""
        row_blocks = table.row_blocks
        spec = self.placement.local_spec(full_spec, routing.is_stacked, row_blocks)  # a job's: its slices
        layout = StateLayoutOptions(layer_stack_key(model_cfg.arch), self.plan.weights == "ssd", tuple(row_blocks),
                                    options.format, self.plan.grad_store, options.offload.host_gradient_layers)
        extra = checkpoint_slot_requests(layout.plan(spec, options.offload), options.offload)
        self._checkpoint_slots = CHECKPOINT_SHAPE_CLASS if extra else STATE_SLOT_CLASS
        return OffloadedAdamState.create(spec, options.offload, **layout.keywords(),
                                         kernel_threads=options.offload.kernel_threads, extra_requests=extra,
                                         rounding_seed=options.rounding_seed,
                                         partition_index=self.placement.partition.index,
                                         durable_spares=options.offload.durable_spares if self.plan.durable else None,
                                         reopen=reopen)

    def _init_state(self, params, master: Optional[MasterReader], paths: list, model_cfg: ModelConfig) -> list:
        """Writes the initial state (fp32 master weights from ``master`` or ``params``, zero
        moments); returns the compute copy in leaf order (None for the streamed leaves)."""
        dtype, param_dtype = DTYPES[model_cfg.dtype], DTYPES[model_cfg.param_dtype]
        # A streamed leaf's compute weights are the reader's values as the resident copy gets
        # them: cast to param_dtype (the model's), then to the compute dtype.
        compute = lambda leaf, x: np.asarray(x).astype(param_dtype).astype(dtype)  # noqa: E731
        shapes = [x.shape for x in jax.tree.leaves(params)]  # whole (a job's state holds slices)
        read = None if master is None else \
            (lambda leaf, layer: _read_master(master, paths[leaf.index], leaf, layer, shapes[leaf.index]))
        # This process's state (a job's: its slice of each layer), from the reader or the params.
        self.placement.write_initial_state(self.state, params, read, compute)
        # The compute copy, without the streamed leaves (on SSD now); the param_dtype copy is
        # dropped once the master weights are on SSD. A bfloat16 master's is the master itself.
        fmt = self.state.layout.state
        # A bfloat16 master of bfloat16 params is the params exactly: no copy (as astype's).
        copy = (lambda x: x.astype(dtype)) if fmt.master == "float32" else \
            (lambda x: x if x.dtype == dtype else jnp.asarray(master_weights(np.asarray(x), fmt)))
        return [None if leaf.streamed else copy(x) for leaf, x in zip(self.state.leaves, jax.tree.leaves(params))]

    def _recover_state(self, model_cfg: ModelConfig, step: int, full_spec) -> list:
        """Durable steps: the offload files' ``step`` (an interrupted update rolled forward); returns
        the compute copy in leaf order, from the master weights (None for the streamed leaves); a
        job's whole, from every process's slices (a collective each leaf, in leaf order)."""
        self.state.recover(step)
        fmt, dtype = self.state.layout.state, DTYPES[model_cfg.dtype]
        compute = (lambda x: x.astype(dtype)) if fmt.master == "float32" else \
            (lambda x: jnp.asarray(master_weights(x, fmt)))  # a bfloat16 master's weights are its high half
        leaves = [None if leaf.streamed else compute(self.state.read_state(leaf)) for leaf in self.state.leaves]
        if not self.plan.partitioned:
            return leaves
        shapes = [x.shape for x in jax.tree.leaves(full_spec)]
        return [None if x is None else self.placement.whole_host(np.asarray(x).reshape(-1), shapes[leaf.index],
                                                                 leaf.layers, leaf.shape)
                for leaf, x in zip(self.state.leaves, leaves)]

    def resume_state(self, trainer: dict) -> None:
        """With durable steps, what the run needs to go on once the next step is complete (its data
        position): the journal keeps it with the losses so far and the loss scale."""
        self._resume_state.update(trainer)

    @property
    def params(self):
        """The compute params as the last finished update left them (waits for a running one);
        resident stacked weights of an overlapped run are views of their host buffers, streamed
        ones None."""
        self.finish_update()
        return self.weights.tree()

    @property
    def opt_state(self):
        """The optax state matching the SSD state (:func:`~jaxascend.offload.ssd_adamw.ssd_adamw_state`)."""
        return ssd_adamw_state(self.state)

    def step(self, tokens, optimizer: bool = True) -> StepResult:
        """One optimizer step over ``tokens`` (a :class:`~jaxascend.models.TokenBatch` ``[A, ...]``
        or plain rows ``int32 [A, B, T+1]``, every target counted). Overlapped, the update of this
        step is still running when it returns, and the optimizer's figures are the previous
        step's update's. ``optimizer=False``: the forward/backward only, its gradients dropped
        and nothing updated (the compute-only time of ``scripts/bench_step.py``)."""
        self._steps += 1
        timeline = StepTimeline(self._steps, self.plan.overlap)
        scale = self.loss_scale.scale
        batch = self.routing.step_input(tokens)
        front_wait = self.updates.before_forward()
        before = self._source_stats()
        started = time.perf_counter()
        loss, sumsq, nonfinite = self._forward_backward(batch, scale)
        ended = time.perf_counter()
        timing = {"fwd_bwd_seconds": ended - started}
        if front_wait:
            timeline.add("trainer thread", started - front_wait, started, "waits for top leaves")
        timeline.add("trainer thread", started, ended, "forward/backward")
        timeline.add_fetches(self.weights.source_events())
        self.updates.after_forward(timing, timeline, started, ended)
        self._source_waits(before, front_wait, timing)
        self.loss_scale, skip = self.loss_scaling.update(self.loss_scale, bool(nonfinite > 0))
        grad_norm = math.sqrt(float(sumsq)) / scale
        max_norm = self.grad_clip_norm
        clip = max_norm / grad_norm if max_norm is not None and not skip and grad_norm > max_norm else 1.0
        if self.plan.durable:  # what a resume from the offload files goes on with, once this step is
            losses = self._resume_state.get("losses", []) + [float(loss)]
            self._resume_state["losses"] = losses
            self.state.records.stage({**self._resume_state, "losses": losses, "saved_at": time.time(),
                                      "loss_scale": self.loss_scale.to_dict()})
        if optimizer:
            self.updates.run(clip / scale, skip, timing, timeline)
        else:
            self.state.step(None, skip=True)  # the gradients are dropped; the weights stay
        if timeline.bars["optimizer thread"]:
            self._last_timeline = timeline
        self._count_traffic(timing)
        return StepResult(loss=float(loss), grad_norm=grad_norm if not skip else float("nan"), skipped=bool(skip),
                          loss_scale=scale, **timing)

    def _forward_backward(self, batch: TokenBatch, scale: float) -> tuple:
        """The jitted forward/backward and its one sync: (loss, sum of squares, non-finite count)."""
        self.weights.begin_step()
        try:
            with step_errors(PARAM_SOURCE_ERRORS):  # a sink or source failure, at dispatch or at the fetch
                # replicated over several devices: the job's loss and statistics, as this process holds them
                loss, stats = self.placement.local_values(self.routing.run(self.weights.inputs(), batch, scale))
                kill_point("backward")  # tests: the backward pass is running and writing gradients
                # SYNC: the overflow check and the clip factor need the statistics, and the optimizer
                # may read the gradient regions only once the backward pass has written all of them.
                loss, (sumsq, nonfinite) = jax.device_get((loss, total_stats(stats)))
        except BaseException:
            self.updates.abandon()  # a running update's own error, if any, explains the fetch's
            raise
        finally:
            self.weights.end_step()
        return loss, sumsq, nonfinite

    def _source_stats(self) -> Optional[dict]:
        return self.weights.source.stats() if self.weights.source is not None else None

    def _source_waits(self, before: Optional[dict], front_wait: float, timing: dict) -> None:
        """The forward/backward's waits for streamed weights and (overlapped) for the update."""
        if before is None:
            return
        after = self._source_stats()
        timing["param_wait_seconds"] = after["wait_seconds"] - before["wait_seconds"]
        self.updates.count_waits(front_wait + after["optimizer_wait_seconds"] - before["optimizer_wait_seconds"],
                                 timing)

    def _count_traffic(self, timing: dict) -> None:
        read, written = self._io_counters()
        timing.update(ssd_read_bytes=read - self._io_mark[0], ssd_written_bytes=written - self._io_mark[1])
        self.ssd_bytes_read += timing["ssd_read_bytes"]
        self.ssd_bytes_written += timing["ssd_written_bytes"]
        if self.ssd_first_step is None:  # its forward had no update beside it (overlap): apart in the summary
            self.ssd_first_step = (timing["ssd_read_bytes"], timing["ssd_written_bytes"])
        self._io_mark = (read, written)

    def evaluate(self, batches: Iterable[TokenBatch]) -> tuple[float, int]:
        """``(sum of the counted targets' losses, their count)`` over ``batches`` (micro-batches
        ``[B, ...]``; a target counts where its weight is non-zero), on the compute params as
        the last update left them (waits for a running one). Forward only: no gradient is sent
        and the optimizer state on SSD is neither read nor written; streamed weights are read
        layer by layer through the parameter source, as in a step."""
        self.finish_update()
        params = self.weights.inputs()
        total, count = 0.0, 0
        for batch in batches:
            self.weights.begin_step(forward_only=True)
            try:
                with step_errors(PARAM_SOURCE_ERRORS):
                    out = self.routing.evaluate(params, self.routing.eval_input(batch))  # the job's sums
                    loss_sum, counted = jax.device_get(self.placement.local_values(out))  # SYNC: per batch
            finally:
                self.weights.end_step()
            total += float(loss_sum)
            count += int(counted)
        self.weights.source_events()  # the evaluation's fetches are not the next step's timeline
        self._io_mark = self._io_counters()  # nor its reads the next step's traffic
        return total, count

    def finish_update(self) -> None:
        """Waits for the optimizer step running in the background (overlap); raises its error."""
        self.updates.finish()

    def end_training(self) -> int:
        """The run trains no more step: the last update is waited for and the gradients' disk
        blocks go back to the filesystem (with ``offload.gradients: ssd``; in RAM, a durable run's
        log of them), for the outputs the run writes next. Returns the bytes freed."""
        self.finish_update()
        if self.state.store.cfg.keep_files:  # kept files stay as they are
            return 0
        on_ssd = [region for region, _ in self.state.layout.grad_regions_in(ram=False)]
        log = self.state.records.gradient_log if self.plan.durable else None  # gradients in RAM: their log
        return self.state.store.release(on_ssd + ([twin for _, twin in log.pairs] if log is not None else []))

    def _io_counters(self) -> tuple[int, int]:
        """(bytes read, bytes written) by the store since it was opened."""
        c = self.state.store.stats()
        return int(c["bytes_read"]), int(c["bytes_written"])

    def _ssd_arrays(self) -> SsdArrays:
        # The step's state slots are idle between steps; checkpoints stream through them. Each
        # array records where it sits in its whole tensor, so that another number of processes
        # can re-partition it on restore.
        part = self.placement.partition
        pieces = [Piece(part.index, part.count, self.weights.full_shapes[leaf.index], leaf.stacked, leaf.row_blocks)
                  for leaf in self.state.leaves]
        return SsdArrays(self.state.store, specs_for_offload_layout(self.state.layout, pieces=pieces,
                                                                    placed=self.state.records.placed()),
                         slot_class=self._checkpoint_slots, attributes={"state": self.state.layout.state.describe()})

    def save_checkpoint(self, ckpt: Checkpointer, step: int, meta: dict) -> None:
        """Compute params and the run's scalars, plus master/m/v streamed from SSD chunk by chunk
        (after the update of ``step``, if it runs in the background). In a job every process
        saves its slices of master/m/v into the same step; the compute params (the same on every
        process) are written once."""
        params = self.readers.local_params()
        meta = {**meta, "updates_applied": self.state.updates_applied, "loss_scale": self.loss_scale.to_dict(),
                "processes": self.plan.processes}
        ckpt.save(step, params=params, ssd=self._ssd_arrays(), meta=meta)
        if self.weights.host:
            # The stack's weights are views of the buffers the next (background) update writes in
            # place: the save must have copied them out before this returns.
            ckpt.wait()
        self._io_mark = self._io_counters()  # the save's reads are not the next step's

    def restore_checkpoint(self, ckpt: Checkpointer, step: int) -> dict:
        """Rebuilds the SSD shards from checkpoint ``step`` (so a kill during an optimizer step can
        never poison a resume) and restores the compute params; returns the checkpoint's meta."""
        self.state.records.invalidate()  # durable steps: until restored, the files hold no step
        restored = ckpt.restore(step, params_like=self.readers.local_params(), ssd=self._ssd_arrays())
        self.weights.restore(jax.tree.leaves(restored.params, is_leaf=lambda x: x is None))
        self.state.restored(int(restored.meta["updates_applied"]))
        self.loss_scale = LossScaleState.from_dict(restored.meta["loss_scale"])
        self._resume_state = {"losses": list(restored.meta["losses"])}
        self.state.records.record_step(step, {"data_state": restored.meta["data_state"], **self._resume_state,
                                              "loss_scale": restored.meta["loss_scale"], "saved_at": time.time()},
                                       int(restored.meta["updates_applied"]))
        self._io_mark = self._io_counters()
        return restored.meta

    def sampled_weights(self):
        """``with engine.sampled_weights() as weights:`` on every process: the compute params to
        sample from (:meth:`compute_weights`) on process 0, None on the others."""
        return self.readers.sampled()

    def compute_weights(self):
        """The compute params to sample from: the tree itself when the layer stack is resident,
        else a reader ``read(path, layer)`` of the streamed layers on SSD (one process's own)."""
        return self.readers.compute()

    def export_params(self):
        """The weights to save or export, as a reader ``read(path, layer)`` of the fp32 master
        weights on SSD, one tensor (one layer) at a time. One process only."""
        return self.readers.master()

    def exported_weights(self):
        """``with engine.exported_weights() as read:`` on every process of the job: ``read`` (the
        reader of :meth:`export_params`) on process 0, None on the others, which serve their slices."""
        return self.readers.exported()

    def timeline(self) -> Optional[dict]:
        """The last step that ran an update: which thread did what, when."""
        return self._last_timeline.to_dict() if self._last_timeline is not None else None

    def report(self) -> EngineReport:
        """The engine's figures (of the last finished update; a running one is not waited for)."""
        state, store, last = self.state, self.state.store, self.state.last_step
        read_run, written_run = self._io_counters()
        source = {f"param_source_{k}": v for k, v in self.weights.source.stats().items()} \
            if self.weights.source is not None else {}
        return EngineReport(
            engine=self.name, skipped_steps=self.loss_scale.skipped_steps, loss_scale=self.loss_scale.scale,
            arena_capacity_bytes=store.arena.capacity, arena_high_water_bytes=store.arena.high_water_bytes,
            arena_locked=store.arena.locked, arena_pinned=store.arena.pinned, direct_io=store.direct_io,
            io_engine=store.io_engine,
            host_grad_buffer_bytes=state.grad_buffer.nbytes if state.grad_buffer is not None else 0,
            ssd_read_bytes_step=last.bytes_read if last else 0, ssd_write_bytes_step=last.bytes_written if last else 0,
            ssd_gbps_step=last.ssd_gbps if last else 0.0, optimizer_seconds_step=last.seconds if last else 0.0,
            ssd_read_bytes_steps=self.ssd_bytes_read, ssd_written_bytes_steps=self.ssd_bytes_written,
            ssd_bytes_first_step=self.ssd_first_step,
            ssd_read_bytes_run=read_run, ssd_written_bytes_run=written_run,
            state_dtype=state.layout.state.dtype, state_rounding=state.layout.state.rounding,
            state_bytes=state.layout.state_bytes, resident_param_bytes=state.layout.resident_param_bytes,
            streamed_param_bytes=state.layout.streamed_param_bytes, params=self.plan.weights,
            gradients=self.plan.grad_store, grad_bytes=state.layout.grad_bytes, host_grad_bytes=state.layout.ram_grad_bytes,
            overlap=self.plan.overlap, overlap_refused=self.plan.overlap_refused,
            data_parallel_processes=self.plan.processes,
            data_parallel_devices=self.placement.devices,
            early_gradient_arrivals=state.early_gradient_arrivals,
            initial_write=state.initial_write.to_dict() if state.initial_write else None, **source)

    def shard_files(self) -> list[str]:
        return sorted({e.shard_path for r in self.state.store.regions() for e in r.extents})

    def __enter__(self) -> "PlannedOffloadEngine":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self.finish_update()  # its error is the run's
            else:
                self.updates.abandon()  # the run already failed; that error is reported
        finally:
            self.state.close()
