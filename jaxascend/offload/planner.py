"""The run planner: what a run will need, computed before anything is allocated.

    plan = plan_run(cfg, model_cfg)         # model_cfg with its vocab_size; pure arithmetic
    print(plan.format())                    # host memory by part, device memory, SSD, step floor
    plan.check()                            # PlanError naming the part that does not fit

Host memory is predicted part by part (bytes, for one process):

* ``runtime``: this process as it is when the plan is made (Python, the imports, the tokenizer,
  the data index: measured), plus what JAX's runtime and the compiled step add
  (:data:`STEP_RUNTIME_BYTES`, measured once);
* ``arena``: exact: the arena plan the engine will carve (staging, step slots, parameter source);
* ``resident params``: exact: the compute-dtype weights that stay in memory (all of them with
  ``offload.params: resident``; the embeddings, final norm and head with ``ssd``), plus the
  ``param_dtype`` copy held while the model is loaded when that dtype differs;
* ``activations``: what the backward pass keeps: the scan carry of every layer (remat saves the
  layer inputs) and the float32 logits with their softmax and gradient;
* ``temporaries``: the larger of XLA's working set in the forward/backward (two logits-sized
  float32 arrays, plus one layer's weights and gradient, widened, or one block of a large
  vocabulary table widened twice, see models.vocab; a separate large head is differentiated
  whole) and the optimizer's one leaf being filled (the largest resident leaf).

``offload.params: auto`` is resolved here: resident if the resident plan fits
``offload.host_memory_budget`` (resident without a budget), else ssd. The in-memory engine
(``offload.enabled: false``) is planned too: fp32 params, gradients and both moments in RAM.

The coefficients of the last two parts are not fitted per run: they are the byte counts of the
arrays named above; ``scripts/bench_scale.py`` prints the prediction beside each measured peak.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from dataclasses import dataclass, field
from typing import Optional

import jax
import numpy as np
import psutil

from jaxascend.config import Config, ConfigError, ModelConfig, check_param_placement
from jaxascend.hf import abstract_params
from jaxascend.models import DTYPES
from jaxascend.offload.layout import OffloadLayout
from jaxascend.offload.state_layout import StateLayoutOptions, TableLayout, checkpoint_slot_requests
from jaxascend.ssd import ArenaPlan, SsdStore

# What JAX's CPU runtime, the compiled step and a step's Python objects add to the process as it
# is at planning time (measured: a 0.5B run's steady state less its arena, weights and XLA
# temporaries, Qwen2.5 shapes, seq 128).
STEP_RUNTIME_BYTES = 320 * 2**20
LAYER_WORKSET_BYTES_PER_PARAM = 6  # one layer in the backward, as XLA's CPU buffer assignment has it
DEFAULT_DISK_GBPS = 1.5  # O_DIRECT sequential, the development machines' SSD (see docs/bench_io.md)


def format_bytes(n: int) -> str:
    """``"3.21 GiB"``: short enough for a plan line."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


class PlanError(ConfigError):
    """The run does not fit: host memory budget or disk space; the message names the part."""


@dataclass(frozen=True)
class RunPlan:
    params: str  # resolved offload.params: "resident" or "ssd" ("in-memory" for the baseline engine)
    num_params: int
    host: dict  # part -> bytes, in print order
    device: dict  # part -> bytes of the device memory kind (on the CPU backend: host RAM, counted once)
    ssd_bytes: int  # offload shard files
    ssd_dir: str
    ssd_free: int  # bytes free on the offload filesystem (+ the shard files already there)
    checkpoint_bytes: int  # one checkpoint of the offloaded state (each kept step needs this)
    ssd_read_step: int
    ssd_write_step: int
    disk_gbps: float
    budget: Optional[int] = None
    notes: tuple = field(default=())
    largest_layer_params: int = 0  # the largest tensor (one layer of a stacked one)
    streaming_refused: Optional[str] = None  # why offload.params: ssd is not allowed here (None: it is)
    choices: tuple = field(default=())  # what the planner chose for the user (offload.params: auto), one line each

    @property
    def streamable(self) -> bool:
        return self.streaming_refused is None

    @property
    def host_peak(self) -> int:
        return sum(self.host.values())

    @property
    def step_floor_seconds(self) -> float:
        """The step can be no faster than its SSD traffic at :attr:`disk_gbps`."""
        return (self.ssd_read_step + self.ssd_write_step) / (self.disk_gbps * 1e9) if self.disk_gbps > 0 else 0.0

    def problems(self) -> list[str]:
        """One line per part that does not fit (empty: the run fits)."""
        out = []
        if self.budget is not None and self.host_peak > self.budget:
            worst = max(self.host, key=self.host.get)
            out.append(f"offload.host_memory_budget: the plan needs {format_bytes(self.host_peak)} of host memory, "
                       f"{format_bytes(self.host_peak - self.budget)} more than the budget of "
                       f"{format_bytes(self.budget)} (largest part: {worst}, {format_bytes(self.host[worst])})"
                       + ("; try offload.params: ssd" if self.params == "resident" and self.streamable else ""))
        if self.ssd_bytes > self.ssd_free:
            out.append(f"offload.dir: the offload files need {format_bytes(self.ssd_bytes)} on {self.ssd_dir}, "
                       f"{format_bytes(self.ssd_bytes - self.ssd_free)} more than the {format_bytes(self.ssd_free)} "
                       "free there")
        return out

    def check(self) -> None:
        problems = self.problems()
        if problems:
            raise PlanError(problems[0])

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "host_peak": self.host_peak,
                "host_bytes_per_param": self.host_peak / max(self.num_params, 1),
                "step_floor_seconds": self.step_floor_seconds}

    def format(self) -> str:
        n = max(self.num_params, 1)
        lines = [f"plan: {self.num_params:,} parameters, params {self.params}"]
        lines.append("host memory (peak):")
        for part, nbytes in self.host.items():
            lines.append(f"  {part:<18} {format_bytes(nbytes):>12}  {nbytes / n:6.2f} B/param")
        lines.append(f"  {'total':<18} {format_bytes(self.host_peak):>12}  {self.host_peak / n:6.2f} B/param"
                     + (f"  (budget {format_bytes(self.budget)})" if self.budget is not None else ""))
        lines.append("device memory:" + (" (the CPU backend's device memory is host RAM, counted above)"
                                          if jax.default_backend() == "cpu" else ""))
        for part, nbytes in self.device.items():
            lines.append(f"  {part:<18} {format_bytes(nbytes):>12}")
        lines.append(f"SSD: offload files {format_bytes(self.ssd_bytes)} on {self.ssd_dir} "
                     f"({format_bytes(self.ssd_free)} free); each checkpoint {format_bytes(self.checkpoint_bytes)}")
        lines.append(f"SSD per step: read {format_bytes(self.ssd_read_step)}, "
                     f"write {format_bytes(self.ssd_write_step)} "
                     f"({(self.ssd_read_step + self.ssd_write_step) / n:.1f} B/param)")
        lines.append(f"step-time floor: {self.step_floor_seconds:.2f} s at {self.disk_gbps:g} GB/s")
        ds_host, ds_gpu = deepspeed_zero3_estimate(self.num_params, self.largest_layer_params)
        lines.append(f"anchor: DeepSpeed estimate_zero3_model_states_mem_needs (params + optimizer offloaded to "
                     f"CPU, 1 GPU): host {format_bytes(ds_host)} ({ds_host / n:.0f} B/param), GPU "
                     f"{format_bytes(ds_gpu)} (model states only)")
        lines.extend(f"note: {note}" for note in self.notes + self.choices)
        for problem in self.problems():
            lines.append(f"does not fit: {problem}")
        return "\n".join(lines)


def deepspeed_zero3_estimate(total_params: int, largest_layer_params: int) -> tuple[int, int]:
    """(host, GPU) bytes of DeepSpeed's ``estimate_zero3_model_states_mem_needs`` with parameters
    and optimizer offloaded to CPU, one GPU, ``zero_init`` and its default 1.5x buffer factor:
    18 B/param of model states on the host, the largest layer in fp32 on the GPU."""
    return int(total_params * 18 * 1.5), 4 * largest_layer_params


def _streaming_refusal(cfg: Config) -> Optional[str]:
    """Why ``cfg`` could not run with ``offload.params: ssd`` (the config check's message), or None."""
    try:
        check_param_placement(dataclasses.replace(cfg, offload=dataclasses.replace(cfg.offload, params="ssd")))
    except ConfigError as err:
        return str(err)
    return None


def _process_rss() -> int:
    return psutil.Process().memory_info().rss


def _free_bytes(directory: str) -> int:
    """Free bytes on the filesystem that will hold ``directory`` (its nearest existing parent),
    plus the shard files already there (a run reopens and truncates them)."""
    probe = os.path.abspath(os.path.expanduser(directory))
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    free = shutil.disk_usage(probe).free
    if os.path.isdir(directory):
        for name in os.listdir(directory):
            if name.startswith("shard-") and name.endswith(".bin"):
                free += os.path.getsize(os.path.join(directory, name))
    return free


def _layout(cfg: Config, model_cfg: ModelConfig, stream: bool) -> OffloadLayout:
    _, params = abstract_params(model_cfg)
    dtype = DTYPES[model_cfg.dtype]
    spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype), params)
    row_blocks = TableLayout.of(params, model_cfg).row_blocks
    return StateLayoutOptions.of(cfg, model_cfg, row_blocks, stream).plan(spec, cfg.offload)


def _arena_bytes(cfg: Config, layout: OffloadLayout) -> int:
    plan = (ArenaPlan().extend(SsdStore.arena_requests(cfg.offload)).extend(layout.arena_requests())
            .extend(checkpoint_slot_requests(layout, cfg.offload)))  # as OffloadEngine carves it
    if cfg.offload.pow2_buffers:
        plan = plan.rounded_to_power_of_two()
    if cfg.offload.arena_bytes is not None:
        return max(plan.total_bytes, int(cfg.offload.arena_bytes))
    return plan.total_bytes


def _model_parts(cfg: Config, model_cfg: ModelConfig, layout: OffloadLayout) -> tuple[int, int]:
    """(activations, temporaries) of a step, in bytes."""
    c = np.dtype(DTYPES[model_cfg.dtype]).itemsize
    rows = cfg.data.batch_size * cfg.data.seq_len  # token positions of one micro-batch
    vocab, hidden, layers = model_cfg.vocab_size, model_cfg.hidden_size, model_cfg.num_hidden_layers
    remat = model_cfg.remat != "none"
    carries = layers * rows * hidden * c if remat else 0
    per_layer_acts = 0 if remat else layers * rows * (8 * hidden + 3 * model_cfg.intermediate_size) * c
    activations = carries + per_layer_acts
    logits = 2 * rows * vocab * 4  # fp32 logits and their gradient
    layer_elems = sum(leaf.layer_elements for leaf in layout.leaves if leaf.stacked)
    layer_ws = layer_elems * LAYER_WORKSET_BYTES_PER_PARAM
    tables = [leaf for leaf in layout.leaves if not leaf.stacked and len(leaf.shape) == 2]
    head_ws = 0
    for leaf in tables:
        block = leaf.layer_elements  # one block of a table in blocks of rows, else the whole tensor
        head_ws = max(head_ws, 2 * 4 * block if leaf.row_blocks > 1 else block * (8 + c))
    resident = [leaf for leaf in layout.leaves if not leaf.streamed]
    optimizer_leaf = max((leaf.size * leaf.dtype.itemsize for leaf in resident), default=0)
    return activations, max(logits + max(layer_ws, head_ws), optimizer_leaf)


def plan_run(cfg: Config, model_cfg: ModelConfig, params: Optional[str] = None,
             disk_gbps: Optional[float] = None, runtime_bytes: Optional[int] = None) -> RunPlan:
    """The plan of ``cfg`` for ``model_cfg`` (whose ``vocab_size`` is the run's), with
    ``offload.params`` as given by ``params`` (default: the config's; "auto" is resolved).
    ``runtime_bytes``: the runtime part (default: this process's RSS now plus
    :data:`STEP_RUNTIME_BYTES`; make the plan where the run will run, after its tokenizer)."""
    if not model_cfg.vocab_size:
        raise ValueError("plan: model_cfg.vocab_size is 0; resolve the run's vocabulary first")
    params = params or cfg.offload.params
    off = cfg.offload
    if params == "auto":
        runtime_bytes = _process_rss() + STEP_RUNTIME_BYTES if runtime_bytes is None else runtime_bytes
        resident = plan_run(cfg, model_cfg, "resident", disk_gbps, runtime_bytes)
        if not off.enabled or off.host_memory_budget is None or resident.host_peak <= off.host_memory_budget:
            return dataclasses.replace(resident, choices=("offload.params: auto chose resident",))
        if not resident.streamable:
            return dataclasses.replace(resident, choices=(
                f"offload.params: auto stays resident over budget: {resident.streaming_refused}",))
        streamed = plan_run(cfg, model_cfg, "ssd", disk_gbps, runtime_bytes)
        return dataclasses.replace(streamed, choices=(
            f"offload.params: auto chose ssd (resident would need {format_bytes(resident.host_peak)})",))
    gbps = float(disk_gbps or DEFAULT_DISK_GBPS)
    refused = _streaming_refusal(cfg)
    stream = off.enabled and params == "ssd"
    layout = _layout(cfg, model_cfg, stream)
    n = layout.num_parameters
    c = np.dtype(DTYPES[model_cfg.dtype]).itemsize
    p = np.dtype(DTYPES[model_cfg.param_dtype]).itemsize
    activations, temporaries = _model_parts(cfg, model_cfg, layout)
    runtime = _process_rss() + STEP_RUNTIME_BYTES if runtime_bytes is None else int(runtime_bytes)
    ssd_dir = str(off.dir)
    if not off.enabled:  # the in-memory baseline: fp32 (param_dtype) params, gradients, m and v
        # The jitted optax step holds the gradients and, until the old state is freed, the
        # updated moments (8 B/param more; measured: 26.7 B/param at 0.5B in float32).
        host = {"runtime": runtime, "arena": 0, "resident params": n * p,
                "optimizer state": 8 * n, "gradients": n * p, "activations": activations,
                "temporaries": max(temporaries, 8 * n)}
        return RunPlan("in-memory", n, host, {"params + state": n * (2 * p + 8)}, 0, ssd_dir, _free_bytes(ssd_dir),
                       0, 0, 0, gbps, off.host_memory_budget, (), max(leaf.layer_elements for leaf in layout.leaves),
                       refused)
    resident = layout.resident_param_bytes
    loaded = resident * p // c if p != c else 0  # the param_dtype model beside its compute copy at start-up
    host = {"runtime": runtime, "arena": _arena_bytes(cfg, layout), "resident params": resident + loaded,
            "activations": activations, "temporaries": temporaries}
    device = {"resident params": resident, "activations + temps": activations + temporaries}
    grads = layout.grad_bytes
    streamed = layout.streamed_param_bytes
    ssd_bytes = layout.state_bytes + (grads if layout.grads_on_ssd else 0) + streamed
    # Per step: the optimizer reads master/m/v (+ grads) and writes master/m/v (+ the new
    # streamed weights); the backward writes the gradients; the source reads every streamed
    # layer twice (forward, and the backward's recomputation).
    read = layout.state_bytes + (grads if layout.grads_on_ssd else 0) + 2 * streamed
    write = layout.state_bytes + (grads if layout.grads_on_ssd else 0) + streamed
    largest = max(leaf.layer_elements for leaf in layout.leaves)
    fmt = layout.state
    notes = (f"optimizer state: {fmt.dtype} moments, {layout.state_bytes / n:.2f} B/param on SSD; a step moves "
             f"{(read + write) / n:.2f} B/param",)
    if stream:
        notes += (f"streamed weights: {format_bytes(streamed)} on SSD; resident embeddings/norms/head "
                  f"{format_bytes(resident)} ({resident / n:.2f} B/param)",)
    return RunPlan("ssd" if stream else "resident", n, host, device, ssd_bytes, ssd_dir, _free_bytes(ssd_dir),
                   int(fmt.bytes_per_element * n) + streamed + resident, read, write, gbps, off.host_memory_budget,
                   notes, largest, refused)


def resolve(cfg: Config, model_cfg: ModelConfig, disk_gbps: Optional[float] = None) -> tuple[Config, RunPlan]:
    """``cfg`` with ``offload.params`` resolved (auto -> resident or ssd) and its plan."""
    plan = plan_run(cfg, model_cfg, disk_gbps=disk_gbps)
    placement = "resident" if plan.params == "in-memory" else plan.params
    if placement != cfg.offload.params:
        cfg = dataclasses.replace(cfg, offload=dataclasses.replace(cfg.offload, params=placement))
    return cfg, plan
