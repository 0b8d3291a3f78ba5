"""The plan as figures: :class:`ResourcePlan` (host memory by part, device memory, disk per
filesystem, SSD bytes per step), what it is checked against (:class:`HostLimit`), the parts that
do not fit as one line each with their levers (:meth:`ResourcePlan.problems`), and its printout.
:mod:`jaxascend.planning.resource_plan` computes it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import jax

from jaxascend.config import ConfigError
from jaxascend.devices import DeviceCapacity
from jaxascend.planning.deepspeed_anchor import deepspeed_zero3_estimate
from jaxascend.planning.disk_plan import FilesystemUse


def format_bytes(n: int) -> str:
    """``"3.21 GiB"``: short enough for a plan line."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


class PlanError(ConfigError):
    """The run does not fit: host memory, device memory, disk or the arena; the message names the part."""


@dataclass(frozen=True)
class HostLimit:
    """What the plan's host memory is checked against: the budget, or what the machine gives."""

    nbytes: int
    source: str  # "offload.host_memory_budget", "MemAvailable", "cgroup memory.max (...)", ...
    held: int = 0  # of the runtime part, what this process already holds (not in the machine's figure)

    def describe(self) -> str:
        """``"23.00 GiB available (MemAvailable)"``, with what this process already holds."""
        if not self.held:
            return f"{format_bytes(self.nbytes)} available ({self.source})"
        return (f"{format_bytes(self.nbytes)} the run can have ({self.source} {format_bytes(self.nbytes - self.held)} "
                f"+ {format_bytes(self.held)} this process already holds)")


@dataclass(frozen=True)
class ResourcePlan:
    """What a run needs of this machine (host memory by part, device memory, disk per filesystem,
    SSD bytes per step) against what it can give, the planner's choices and, for each part that
    does not fit, its levers. Its JSON (``to_dict``) is ``plan.json``'s, field by field."""

    params: str  # resolved offload.params: "resident" or "ssd" ("in-memory" for the baseline engine)
    num_params: int
    host: dict  # part -> bytes, in print order
    device: dict  # part -> bytes of the device memory kind (on the CPU backend: host RAM, counted once)
    ssd_bytes: int  # offload shard files
    ssd_dir: str
    checkpoint_bytes: int  # one checkpoint of the offloaded state (each kept step needs this)
    ssd_read_step: int
    ssd_write_step: int
    disk_gbps: float
    limit: Optional[HostLimit] = None  # None: no figure (no budget, nothing readable)
    disk: tuple = ()  # FilesystemUse per filesystem the run writes to
    arena_problem: Optional[str] = None  # offload.arena_bytes too small for the arena plan
    notes: tuple = field(default=())
    largest_layer_params: int = 0  # the largest tensor (one layer of a stacked one)
    streaming_refused: Optional[str] = None  # why offload.params: ssd is not allowed here (None: it is)
    choices: tuple = field(default=())  # what the planner chose for the user (offload.params: auto), one line each
    host_levers: tuple = ()  # Lever, when host memory does not fit
    disk_levers: tuple = ()  # (filesystem folder, (Lever, ...)) for each filesystem that does not fit
    phase: str = ""  # the forward/backward's largest working set: "attention", "mlp" or "head"
    device_limit: Optional[DeviceCapacity] = None  # None: not known (the CPU backend: host RAM, checked above)
    device_levers: tuple = ()  # Lever, when device memory does not fit
    # where the gradients wait: "ssd", "host" (resolved offload.gradients), "host_fp32" (the
    # ablation's buffer), "device" (the in-memory engine)
    gradients: str = "device"
    host_gradient_layers: Optional[int] = None  # with host: the layer stack's first N layers' only

    @property
    def streamable(self) -> bool:
        return self.streaming_refused is None

    @property
    def host_peak(self) -> int:
        return sum(self.host.values())

    @property
    def device_peak(self) -> int:
        return sum(self.device.values())

    @property
    def host_limit(self) -> Optional[int]:
        return self.limit.nbytes if self.limit is not None else None

    @property
    def budget(self) -> Optional[int]:
        return self.host_limit if self.limit is not None and self.limit.source == BUDGET else None

    @property
    def step_floor_seconds(self) -> float:
        """The step can be no faster than its SSD traffic at :attr:`disk_gbps`."""
        return (self.ssd_read_step + self.ssd_write_step) / (self.disk_gbps * 1e9) if self.disk_gbps > 0 else 0.0

    def problems(self) -> list[str]:
        """One line per part that does not fit (empty: the run fits)."""
        out = [self.arena_problem] if self.arena_problem else []
        if self.limit is not None and self.host_peak > self.limit.nbytes:
            out.append(self._host_problem())
        if self.device_limit is not None and self.device_peak > self.device_limit.nbytes:
            worst, limit = max(self.device, key=self.device.get), self.device_limit
            out.append(f"device memory: the plan needs {format_bytes(self.device_peak)} per device, "
                       f"{format_bytes(self.device_peak - limit.nbytes)} more than the {format_bytes(limit.nbytes)} "
                       f"it has ({limit.source}) (largest part: {worst}, {format_bytes(self.device[worst])})"
                       + _lever_text(self.device_levers))
        out.extend(_disk_problem(fs, dict(self.disk_levers).get(fs.folder, ())) for fs in self.disk if fs.short > 0)
        return out

    def _host_problem(self) -> str:
        worst = max(self.host, key=self.host.get)
        limit = self.limit
        if limit.source == BUDGET:
            head = (f"offload.host_memory_budget: the plan needs {format_bytes(self.host_peak)} of host memory, "
                    f"{format_bytes(self.host_peak - limit.nbytes)} more than the budget of {format_bytes(limit.nbytes)}")
        else:
            head = (f"host memory: the plan needs {format_bytes(self.host_peak)}, "
                    f"{format_bytes(self.host_peak - limit.nbytes)} more than the {limit.describe()}")
        return f"{head} (largest part: {worst}, {format_bytes(self.host[worst])})" + _lever_text(self.host_levers)

    def check(self) -> None:
        problems = self.problems()
        if problems:
            raise PlanError(problems[0])

    def to_dict(self) -> dict:
        out = {**dataclasses.asdict(self), "host_peak": self.host_peak,
               "host_bytes_per_param": self.host_peak / max(self.num_params, 1),
               "step_floor_seconds": self.step_floor_seconds, "host_limit": self.host_limit,
               "device_peak": self.device_peak,
               "problems": self.problems()}
        out["disk"] = [{"folder": fs.folder, "free": fs.free, "need": fs.need, "shared_at_end": fs.shared_at_end,
                        "parts": {p.name: p.nbytes for p in fs.parts}} for fs in self.disk]
        return out

    def format(self) -> str:
        n = max(self.num_params, 1)
        lines = [f"plan: {self.num_params:,} parameters, params {self.params}"]
        lines.append("host memory (peak):")
        for part, nbytes in self.host.items():
            lines.append(f"  {part:<20} {format_bytes(nbytes):>12}  {nbytes / n:6.2f} B/param")
        limit = self.limit
        against = "" if limit is None else (f"  (budget {format_bytes(limit.nbytes)})" if limit.source == BUDGET else
                                            f"  ({limit.describe()})")
        lines.append(f"  {'total':<20} {format_bytes(self.host_peak):>12}  {self.host_peak / n:6.2f} B/param{against}")
        device = self.device_limit
        lines.append("device memory:" + (f" (per device; {format_bytes(device.nbytes)}, {device.source})" if device else
                                          " (the CPU backend's device memory is host RAM, counted above)"
                                          if jax.default_backend() == "cpu" else ""))
        for part, nbytes in {**self.device, **({"total": self.device_peak} if device else {})}.items():
            lines.append(f"  {part:<20} {format_bytes(nbytes):>12}")
        for fs in self.disk:
            lines.append(f"disk: {_disk_parts(fs)} on {fs.folder} ({format_bytes(fs.free)} free)")
        lines.append(f"SSD: offload files {format_bytes(self.ssd_bytes)} on {self.ssd_dir}; "
                     f"each checkpoint {format_bytes(self.checkpoint_bytes)}")
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


BUDGET = "offload.host_memory_budget"


def _lever_text(levers: tuple) -> str:
    if not levers:
        return ""
    return "; levers: " + "; ".join(f"{lever.setting} saves {format_bytes(lever.saves)} (needs "
                                    f"{format_bytes(lever.needs)})" for lever in levers)


def _disk_parts(fs: FilesystemUse) -> str:
    """The parts on one filesystem, and what the end-of-run outputs reuse of the gradients' space."""
    parts = " + ".join(f"{p.name} {format_bytes(p.nbytes)}" for p in fs.parts)
    if fs.shared_at_end:
        parts += (f" - {format_bytes(fs.shared_at_end)} (the outputs written at the end reuse the offloaded "
                  f"gradients' space, freed once the last step is done) = {format_bytes(fs.need)}")
    return parts


def _disk_problem(fs: FilesystemUse, levers: tuple) -> str:
    parts = _disk_parts(fs)
    by_field: dict[str, int] = {}
    for part in fs.parts:
        by_field[part.field] = by_field.get(part.field, 0) + part.nbytes
    move = " or ".join(f"{name} (needs {format_bytes(nbytes)})" for name, nbytes in by_field.items())
    total = "" if fs.shared_at_end else f" = {format_bytes(fs.need)}"  # else _disk_parts gave it
    return (f"disk: {', '.join(by_field)}: {parts}{total} on {fs.folder}, "
            f"{format_bytes(fs.short)} more than the {format_bytes(fs.free)} free there" + _lever_text(levers)
            + f"; or put {move} on a filesystem with that much free")
