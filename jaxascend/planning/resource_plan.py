"""The run planner: what a run will need, computed before anything is allocated, against what
this machine can give it.

    cfg, plan = plan_resources(cfg, model_cfg)  # model_cfg with its vocab_size; arithmetic + a few stat calls
    print(plan.format())                    # host memory by part, device memory, disk, SSD traffic
    plan.check()                            # PlanError: one line naming the part, the figures, the levers

:func:`plan_resources` is the run's (its runtime part measured in this process, ``offload.params``
resolved into the config); :func:`plan_run` plans for given figures (a placement, a runtime part).

Host memory is predicted part by part (bytes, for one process):

* ``runtime``: this process as it is when the plan is made (Python, the imports, the tokenizer,
  the data index: measured), plus what JAX's runtime and the compiled step add
  (:data:`STEP_RUNTIME_BYTES`, measured); a plan made without the tokenizer and the data (the
  plan CLI from ``config.json`` alone) adds an estimate of them instead;
* ``arena``: exact: the arena plan the engine will carve (staging, step slots, parameter source),
  or ``offload.arena_bytes`` when set (too small for the plan: refused, as the arena would);
* ``resident params``: exact: the compute-dtype weights that stay in memory (all of them with
  ``offload.params: resident``; the embeddings, final norm and head with ``ssd``), plus the
  ``param_dtype`` copy held while the model is loaded when that dtype differs;
* ``activations``: what the backward keeps, per remat policy, by sequence length (step_memory);
* ``temporaries``: the largest working set of the forward/backward (one layer's attention,
  with its float32 scores and softmax, growing with T squared; one layer's MLP; the logits and
  head), or twice the largest resident leaf (held again while the run starts and while an
  update fills its new copy; measured), whichever is larger;
  With ``train.grad_accum: A`` the activations are the step's ``A * B`` rows' and a layer's
  phase one micro-batch's (its micro-batches run one after another, models.micro_batches).

The total is checked against ``offload.host_memory_budget`` when set, else against what the
machine can give (``MemAvailable`` or the memory cgroup's headroom, see machine_limits, plus
what this process already holds of the runtime part). Disk: the offload files, the checkpoints
kept at once and the end-of-run weights, per filesystem (disk_plan). Device memory, against the
smallest device's capacity where known (jaxascend.devices: a GPU's, or JAXASCEND_DEVICE_MEM_BYTES;
on CPU it is host RAM, counted above). A part that does not fit is
one line with its levers (plan_levers), e.g. ``optimizer.state_dtype: int8 saves 47.70 GiB``.

``offload.params: auto`` is resolved here: resident if the resident plan fits the budget (or,
without one, what the machine can give), else ssd; then ``offload.gradients: auto``: host (the
gradient regions in RAM) if the plan still fits with them, else ssd. The in-memory engine (``offload.enabled:
false``) is planned too: fp32 params, gradients and both moments in RAM.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import numpy as np
import psutil

from jaxascend.config import Config, ModelConfig
from jaxascend.devices import device_capacity
from jaxascend.models import DTYPES
from jaxascend.offload import (OffloadLayout, durable_disk_bytes, job_state_layout, overlap_refusal, state_arena_plan,
                               streaming_refusal)
from jaxascend.planning.disk_plan import disk_use, run_disk_parts
from jaxascend.planning.machine_limits import available_host_memory
from jaxascend.planning.plan_figures import BUDGET, HostLimit, PlanError, ResourcePlan, format_bytes  # noqa: F401 (the package's face)
from jaxascend.planning.plan_levers import device_levers, disk_levers, host_levers
from jaxascend.planning.step_memory import step_memory
from jaxascend.ssd import arena_shortfall

# What JAX's CPU runtime, the compiled step and a step's Python objects add to the process as it
# is at planning time: fitted to the measured peaks of docs/bench_plan.md (3M and 0.5B
# parameters, seq 128 to 2048).
STEP_RUNTIME_BYTES = 230 * 2**20
# What a tokenizer and a data index add to the runtime part when the plan is made without
# reading them (python -m jaxascend.plan from config.json alone): measured 28 MiB with a small
# BPE tokenizer and the bundled data; a 150k-token tokenizer holds more.
UNREAD_INPUTS_BYTES = 64 * 2**20
DEFAULT_DISK_GBPS = 1.5  # O_DIRECT sequential, the development machines' SSD (see docs/bench_io.md)


def _streaming_refusal(cfg: Config) -> Optional[str]:
    """Why ``cfg`` could not run with ``offload.params: ssd`` (the config check's message), or None."""
    return streaming_refusal(cfg)


def process_rss() -> int:
    """This process's resident memory now (the measured base of the runtime part)."""
    return psutil.Process().memory_info().rss


class Runtime(NamedTuple):
    """The runtime part, and how much of it this process already holds (its RSS when measured)."""

    nbytes: int
    held: int = 0

    @classmethod
    def measured(cls, unread: int = 0) -> "Runtime":
        """This process now plus :data:`STEP_RUNTIME_BYTES` (and ``unread`` for inputs not read yet)."""
        rss = process_rss()
        return cls(rss + STEP_RUNTIME_BYTES + unread, rss)


def _host_limit(cfg: Config, runtime: Runtime) -> Optional[HostLimit]:
    """``offload.host_memory_budget``, or what the machine can give plus what this process
    already holds of the runtime part (it is counted there and not in the machine's figure)."""
    if cfg.offload.host_memory_budget is not None:
        return HostLimit(int(cfg.offload.host_memory_budget), BUDGET)
    memory = available_host_memory()
    if memory is None:
        return None
    return HostLimit(memory.available + runtime.held, memory.source, runtime.held)


def _rows_of_one(cfg: Config, processes: int) -> Config:
    """``cfg`` as one process of a job of ``processes`` sees its batches: its rows of each."""
    if processes == 1:
        return cfg
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, batch_size=max(1, cfg.data.batch_size
                                                                                      // processes)))


def _arena(cfg: Config, layout: OffloadLayout) -> tuple[int, Optional[str]]:
    """(the arena's size, why offload.arena_bytes cannot hold its plan or None), as HostArena
    decides them (the same plan OffloadEngine carves)."""
    plan = state_arena_plan(cfg, layout)
    if cfg.offload.pow2_buffers:
        plan = plan.rounded_to_power_of_two()
    problem = arena_shortfall(plan, cfg.offload)
    size = plan.total_bytes if cfg.offload.arena_bytes is None else int(cfg.offload.arena_bytes)
    return max(size, plan.total_bytes), problem


def _export_itemsize(cfg: Config, model_cfg: ModelConfig) -> int:
    """Bytes per parameter of the export (``source``: taken as ``model.param_dtype``)."""
    dtype = model_cfg.param_dtype if cfg.export.dtype == "source" else cfg.export.dtype
    return np.dtype(DTYPES[dtype]).itemsize


def _step_parts(cfg: Config, model_cfg: ModelConfig, layout: OffloadLayout) -> tuple[dict, str]:
    """The forward/backward's parts (activations, temporaries) and its peak phase."""
    memory = step_memory(cfg, model_cfg, layout)
    resident = [leaf for leaf in layout.leaves if not leaf.streamed]
    # The largest resident leaf, twice more: while the run starts (the weights loaded, the initial
    # state written) and while an update fills its new copy (measured: a 0.5B run at seq 128
    # peaks before its first step, with about two copies of the tied table beside the step's own).
    optimizer_leaf = 2 * max((leaf.size * leaf.dtype.itemsize for leaf in resident), default=0)
    parts = {"activations": memory.activations, "temporaries": max(memory.working, optimizer_leaf)}
    return parts, memory.phase


def _in_memory_plan(cfg: Config, model_cfg: ModelConfig, layout: OffloadLayout, runtime: Runtime,
                    gbps: float) -> ResourcePlan:
    """The in-memory baseline: fp32 (param_dtype) params, gradients, m and v. The jitted optax
    step holds the gradients and, until the old state is freed, the updated moments (8 B/param
    more; measured: 26.7 B/param at 0.5B in float32)."""
    n = layout.num_parameters
    p = np.dtype(DTYPES[model_cfg.param_dtype]).itemsize
    step, phase = _step_parts(cfg, model_cfg, layout)
    host = {"runtime": runtime.nbytes, "arena": 0, "resident params": n * p, "optimizer state": 8 * n, "gradients": n * p,
            "activations": step["activations"], "temporaries": max(step["temporaries"], 8 * n)}
    disk = disk_use(run_disk_parts(cfg, 0, n * (p + 8), 4 * n, _export_itemsize(cfg, model_cfg) * n))
    device = {"params + state": n * (2 * p + 8), "activations + temps": sum(step.values())}
    return ResourcePlan("in-memory", n, host, device, 0, str(cfg.offload.dir), n * (p + 8),
                   0, 0, gbps, _host_limit(cfg, runtime), disk, None, (),
                   max(leaf.layer_elements for leaf in layout.leaves), _streaming_refusal(cfg), phase=phase)


def _offloaded_plan(cfg: Config, model_cfg: ModelConfig, stream: bool, runtime: Runtime, gbps: float,
                    processes: int = 1) -> ResourcePlan:
    """The offloaded engine's plan; in a job of ``processes``, one process's figures: its rows
    of each batch, its slice of the state (on SSD, in the arena, in its steps' traffic), and the
    compute weights every process holds whole (an overlapped resident stack: its slice)."""
    whole = job_state_layout(cfg, model_cfg, stream)
    layout = job_state_layout(cfg, model_cfg, stream, processes) if processes > 1 else whole
    n = whole.num_parameters
    c = np.dtype(DTYPES[model_cfg.dtype]).itemsize
    p = np.dtype(DTYPES[model_cfg.param_dtype]).itemsize
    resident = whole.resident_param_bytes
    if processes > 1 and not stream and cfg.offload.overlap and overlap_refusal(cfg) is None:
        # An overlapped resident stack of a job: this process's slice of every layer in host
        # buffers (the step gathers one layer at a time); the other leaves whole.
        stack = [leaf for leaf in layout.leaves if leaf.stacked]
        resident -= sum(leaf.size * leaf.dtype.itemsize for leaf in whole.leaves if leaf.stacked)
        resident += sum(leaf.size * leaf.dtype.itemsize for leaf in stack)
    loaded = whole.resident_param_bytes * p // c if p != c else 0  # the param_dtype model beside its compute copy
    arena, arena_problem = _arena(cfg, layout)
    step, phase = _step_parts(_rows_of_one(cfg, processes), model_cfg, whole)
    host = {"runtime": runtime.nbytes, "arena": arena, "resident params": resident + loaded, **step}
    if layout.grad_store != "ssd":  # offload.gradients: host (their regions), or the fp32 ablation's buffer
        host["gradients"] = layout.ram_grad_bytes if layout.grad_store == "host" else 4 * layout.num_parameters
    device = {"resident params": resident, "activations + temps": sum(step.values())}
    grads = layout.ssd_grad_bytes  # (with host_gradient_layers, the other layers' and leaves')
    logged = layout.ram_grad_bytes if cfg.offload.durable else 0  # durable: the gradients in RAM, their log
    streamed = layout.streamed_param_bytes
    # durable steps: one ring's W spare records per record size, the journal's two slots (and a host
    # gradients' log)
    spares = durable_disk_bytes(layout, cfg.offload.durable_spares) \
        if cfg.offload.durable else 0
    ssd_bytes = layout.state_bytes + grads + streamed + spares
    # Per step: the optimizer reads master/m/v (+ grads) and writes master/m/v (+ the new
    # streamed weights); the backward writes the gradients; the source reads every streamed
    # layer for the backward's recomputation, and for the forward unless the overlapped update
    # hands each layer over in memory (one process: it waits for the forward rather than skip one).
    # A streamed leaf's bfloat16 master is its weights: the update reads them once more.
    handed = stream and processes == 1 and cfg.offload.overlap and overlap_refusal(cfg) is None
    read = layout.state_bytes + grads + (1 if handed else 2) * streamed + \
        (streamed if layout.masters_in_params else 0)
    # Durable steps with the gradients in RAM write them to their log on SSD (read only to resume).
    write = layout.state_bytes + grads + streamed + logged
    fmt = layout.state
    # A job's checkpoint is one directory: every process's slices, the compute params once.
    checkpoint = int(sum(whole.record_format(leaf).bytes_per_element * leaf.size for leaf in whole.leaves)) \
        + whole.streamed_param_bytes + whole.resident_param_bytes
    freed = grads + logged  # the gradients on SSD and their log
    disk = disk_use(run_disk_parts(cfg, ssd_bytes, checkpoint, 4 * n, _export_itemsize(cfg, model_cfg) * n, freed))
    mine = layout.num_parameters
    master = "" if fmt.master == "float32" else f", a {fmt.master} {fmt.master_rounding} master"
    notes = (f"optimizer state: {fmt.dtype} moments{master}, {layout.state_bytes / mine:.2f} B/param on SSD; "
             f"a step moves {(read + write) / mine:.2f} B/param",)
    if stream:
        notes += (f"streamed weights: {format_bytes(streamed)} on SSD; resident embeddings/norms/head "
                  f"{format_bytes(resident)} ({resident / n:.2f} B/param)",)
        if handed:
            notes += (f"the overlapped forward takes each layer from its update in memory (handover; the update "
                      f"waits for the forward rather than let it read a layer back): none of the "
                      f"{format_bytes(streamed)} ({streamed / n:.2f} B/param) of streamed weights is read for it "
                      f"(the first step's forward reads them)",)
    if processes > 1:
        notes += (f"a job of {processes} processes: host memory, the offload files and the SSD traffic are one "
                  f"process's ({cfg.data.batch_size // processes} of each batch's {cfg.data.batch_size} rows, "
                  f"1/{processes} of the optimizer state: {mine:,} of {n:,} parameters); the checkpoints are "
                  f"the job's",)
    return ResourcePlan("ssd" if stream else "resident", n, host, device, ssd_bytes, str(cfg.offload.dir), checkpoint,
                   read, write, gbps, _host_limit(cfg, runtime), disk, arena_problem, notes,
                   max(leaf.layer_elements for leaf in whole.leaves), _streaming_refusal(cfg), phase=phase,
                   gradients=layout.grad_store, host_gradient_layers=layout.host_grad_layers)


def _with_levers(plan: ResourcePlan, cfg: Config, model_cfg: ModelConfig, params: str, gbps: float,
                 runtime: Runtime, processes: int) -> ResourcePlan:
    """``plan`` with the levers of each part that does not fit (each lever changes a copy of
    ``cfg`` with ``offload.params`` resolved to ``params``)."""
    cfg = dataclasses.replace(cfg, offload=dataclasses.replace(cfg.offload, params=params))

    def replan(variant: Config, variant_model: ModelConfig) -> ResourcePlan:
        return _plan(variant, variant_model, variant.offload.params, gbps, runtime, levers=False,
                     processes=processes)

    host = device = ()
    if plan.limit is not None and plan.host_peak > plan.limit.nbytes:
        host = host_levers(cfg, model_cfg, plan, replan)
    if plan.device_limit is not None and plan.device_peak > plan.device_limit.nbytes:
        device = device_levers(cfg, model_cfg, plan, replan)
    disk = tuple((fs.folder, disk_levers(cfg, model_cfg, plan, fs, replan)) for fs in plan.disk if fs.short > 0)
    return dataclasses.replace(plan, host_levers=host, device_levers=device, disk_levers=disk)


def plan_run(cfg: Config, model_cfg: ModelConfig, params: Optional[str] = None,
             disk_gbps: Optional[float] = None, runtime_bytes: Optional[int] = None, levers: bool = True,
             processes: int = 1) -> ResourcePlan:
    """The plan of ``cfg`` for ``model_cfg`` (whose ``vocab_size`` is the run's), with
    ``offload.params`` as given by ``params`` (default: the config's; "auto" is resolved).
    ``runtime_bytes``: the runtime part (default: measured, :meth:`Runtime.measured`; make the
    plan where the run will run, after its tokenizer). ``levers``: with each part that does not
    fit, what the settings that would help save. ``processes``: a data-parallel job's, whose
    figures are one process's (see :func:`_offloaded_plan`)."""
    runtime = Runtime.measured() if runtime_bytes is None else Runtime(int(runtime_bytes))
    return _plan(cfg, model_cfg, params or cfg.offload.params, float(disk_gbps or DEFAULT_DISK_GBPS), runtime, levers,
                 processes)


def _plan(cfg: Config, model_cfg: ModelConfig, params: str, gbps: float, runtime: Runtime, levers: bool,
          processes: int = 1) -> ResourcePlan:
    if not model_cfg.vocab_size:
        raise ValueError("plan: model_cfg.vocab_size is 0; resolve the run's vocabulary first")
    if params == "auto":
        return _resolve_auto(cfg, model_cfg, gbps, runtime, levers, processes)
    if cfg.offload.enabled and cfg.offload.gradients == "auto" and not cfg.offload.fp32_grad_buffer:
        return _resolve_gradients(cfg, model_cfg, params, gbps, runtime, levers, processes)
    if not cfg.offload.enabled:
        plan = _in_memory_plan(cfg, model_cfg, job_state_layout(cfg, model_cfg, False), runtime, gbps)
    else:
        plan = _offloaded_plan(cfg, model_cfg, params == "ssd", runtime, gbps, processes)
    plan = dataclasses.replace(plan, device_limit=device_capacity())  # None on CPU without the variable
    if levers and plan.problems():
        plan = _with_levers(plan, cfg, model_cfg, params, gbps, runtime, processes)
    return plan


def _resolve_auto(cfg: Config, model_cfg: ModelConfig, gbps: float, runtime: Runtime, levers: bool,
                  processes: int) -> ResourcePlan:
    """``offload.params: auto``: resident if that fits the budget (without one: what the machine
    can give) and the device's memory where it is known, else ssd where the config allows it."""
    resident = _plan(cfg, model_cfg, "resident", gbps, runtime, levers=False, processes=processes)
    limit, device = resident.limit, resident.device_limit
    if limit is not None and resident.host_peak > limit.nbytes:
        need, against = resident.host_peak, "the budget" if limit.source == BUDGET else f"the {limit.describe()}"
    elif device is not None and resident.device_peak > device.nbytes:
        need, against = resident.device_peak, f"the device's {format_bytes(device.nbytes)} ({device.source})"
    else:
        need = against = None
    if not cfg.offload.enabled or against is None:
        params, choice = "resident", "offload.params: auto chose resident"
    else:
        if resident.streamable:
            params = "ssd"
            choice = f"offload.params: auto chose ssd (resident would need {format_bytes(need)}, over {against})"
        else:
            params = "resident"
            choice = f"offload.params: auto stays resident over {against}: {resident.streaming_refused}"
    plan = resident if params == "resident" else _plan(cfg, model_cfg, "ssd", gbps, runtime, levers=False,
                                                       processes=processes)
    if levers and plan.problems():
        plan = _with_levers(plan, cfg, model_cfg, params, gbps, runtime, processes)
    return dataclasses.replace(plan, choices=(choice,) + plan.choices)


def _resolve_gradients(cfg: Config, model_cfg: ModelConfig, params: str, gbps: float, runtime: Runtime,
                       levers: bool, processes: int) -> ResourcePlan:
    """``offload.gradients: auto``: host (the gradient regions in RAM) if the plan still fits with
    them and :data:`GRADIENT_HEADROOM` of the limit free, else the most layers of the stack whose
    gradients fit so (``host_gradient_layers``), else ssd. ``offload.params: auto`` is resolved
    first, over the plans this makes: resident weights save more SSD traffic per byte of RAM than
    host gradients do."""
    def planned(where: str, layers: Optional[int] = None) -> ResourcePlan:
        variant = dataclasses.replace(cfg, offload=dataclasses.replace(cfg.offload, gradients=where,
                                                                       host_gradient_layers=layers))
        return _plan(variant, model_cfg, params, gbps, runtime, levers=False, processes=processes)

    def fits(plan: ResourcePlan) -> bool:  # with GRADIENT_HEADROOM of the limit free
        return plan.limit is None or plan.host_peak <= (1 - GRADIENT_HEADROOM) * plan.limit.nbytes

    host = planned("host")
    if fits(host):
        plan, choice = host, "offload.gradients: auto chose host (the gradients wait in RAM: "
    else:
        plan = _most_layers_that_fit(planned, fits, model_cfg.num_hidden_layers)
        against = "the budget" if host.limit.source == BUDGET else f"the {host.limit.describe()}"
        over = (f"{format_bytes(host.host['gradients'])} in all, {format_bytes(host.host_peak)} at the peak, over "
                f"{1 - GRADIENT_HEADROOM:.0%} of {against}")
        if plan is None:
            plan = planned("ssd")
            choice = f"offload.gradients: auto chose ssd (in RAM they would need {over})"
        else:
            choice = (f"offload.gradients: auto keeps the first {plan.host_gradient_layers} of the "
                      f"{model_cfg.num_hidden_layers} layers' gradients in RAM, the rest on SSD (all of them: {over}; ")
    if plan.gradients == "host":
        grads = plan.host["gradients"]
        # durable steps write them to their log on SSD all the same, and read them back only to resume
        saved, logged = (grads, "; offload.durable logs them on SSD") if cfg.offload.durable else (2 * grads, "")
        choice += f"{format_bytes(grads)} of host memory for {format_bytes(saved)} less SSD traffic a step{logged})"
    cfg = dataclasses.replace(cfg, offload=dataclasses.replace(cfg.offload, gradients=plan.gradients,
                                                               host_gradient_layers=plan.host_gradient_layers))
    if levers and plan.problems():
        plan = _with_levers(plan, cfg, model_cfg, params, gbps, runtime, processes)
    return dataclasses.replace(plan, choices=plan.choices + (choice,))


# The share of the limit that auto's gradients in RAM leave free: a split fills the RAM up to it by
# construction, and a run's peak has come out up to 6.4% over its plan (bench_scale_7b).
GRADIENT_HEADROOM = 0.10


def _most_layers_that_fit(planned, fits, layers: int) -> Optional[ResourcePlan]:
    """The plan with the most layers of the stack (fewer than all ``layers``) whose gradients fit
    in RAM (host peaks grow with them), or None where not even one layer's fit."""
    lo, hi, best = 1, layers - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        plan = planned("host", mid)
        if fits(plan):
            best, lo = plan, mid + 1
        else:
            hi = mid - 1
    return best


def plan_resources(cfg: Config, model_cfg: ModelConfig, disk_gbps: Optional[float] = None,
                   inputs_read: bool = True, processes: int = 1) -> tuple[Config, ResourcePlan]:
    """The run's resource plan, made in this process, and ``cfg`` with ``offload.params`` resolved
    by it (auto -> resident or ssd): ``(cfg, plan)``. ``inputs_read`` False: the tokenizer and
    data are not in it yet, and :data:`UNREAD_INPUTS_BYTES` stands for them in the runtime part.
    ``processes``: the job's (each process plans its own share)."""
    runtime = Runtime.measured(0 if inputs_read else UNREAD_INPUTS_BYTES)
    plan = _plan(cfg, model_cfg, cfg.offload.params, float(disk_gbps or DEFAULT_DISK_GBPS), runtime, levers=True,
                 processes=processes)
    placement = "resident" if plan.params == "in-memory" else plan.params
    if cfg.offload.params == "auto" and placement != "auto":  # an explicit choice stays for the step plan to judge
        cfg = dataclasses.replace(cfg, offload=dataclasses.replace(cfg.offload, params=placement))
    if cfg.offload.gradients == "auto" and plan.gradients in ("ssd", "host"):
        cfg = dataclasses.replace(cfg, offload=dataclasses.replace(cfg.offload, gradients=plan.gradients,
                                                                   host_gradient_layers=plan.host_gradient_layers))
    return cfg, plan
