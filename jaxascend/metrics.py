"""Run metrics: host memory readings, a metrics.jsonl writer, the progress bar and the summary.

Everything here is host-side bookkeeping; nothing touches device arrays, so the trainer decides
where the (few) host<->device syncs happen.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import time
from pathlib import Path
from typing import Any, Optional, TextIO

import psutil
from tqdm import tqdm

from jaxascend import console
from jaxascend.reporting import Reporter

GIB = 2**30


def rss_bytes() -> int:
    """Current resident set size of this process."""
    return psutil.Process().memory_info().rss


def peak_rss_bytes() -> int:
    """Peak resident set size of this process: ``VmHWM`` of ``/proc/self/status``, the process's
    own. (``getrusage``'s ``ru_maxrss`` carries over across ``exec`` from the process that started
    the run, so a run started by a Python holding 3 GiB would report 3 GiB.) Elsewhere than
    Linux, ``ru_maxrss``."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def format_bytes(n: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


class MetricsLog:
    """Appends one JSON object per logging step to ``<out_dir>/metrics.jsonl``.

    ``resumed_from``: the step the run continues from (0: a fresh start). Records of later steps
    (written before the run was interrupted, and about to be written again) move to
    ``metrics.superseded.jsonl``, so ``metrics.jsonl`` always holds one curve. ``enabled=False``
    (the processes of a job other than process 0) writes nothing. ``reporter``: where each record
    goes too (TensorBoard, W&B: ``train.report_to``).
    """

    def __init__(self, out_dir: Path, resumed_from: int = 0, enabled: bool = True,
                 reporter: Optional[Reporter] = None):
        self._file: Optional[TextIO] = None
        self._reporter = reporter
        if not enabled:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / "metrics.jsonl"
        if self.path.exists():
            _supersede_after(self.path, resumed_from, out_dir / "metrics.superseded.jsonl")
        self._file: TextIO = self.path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record, sort_keys=True) + "\n")
            self._file.flush()
            if self._reporter is not None:
                self._reporter.write(record)

    def fill(self, losses: list[float], every: int) -> None:
        """A resume from the offload files (durable steps) at step ``len(losses)``: the logging
        steps (every ``every``) after the last record, whose records a kill cut before they were
        written (their update was rolled forward), get one from the journal's losses."""
        if self._file is None:
            return
        steps = [json.loads(line).get("step") for line in self.path.read_text(encoding="utf-8").splitlines()]
        last = max([s for s in steps if isinstance(s, int)], default=0)
        for step in range(last + 1, len(losses) + 1):
            if step % every == 0:
                self.write({"step": step, "loss": losses[step - 1], "from_offload_journal": True})

    def close(self) -> None:
        if self._file is not None:
            self._file.close()

    def __enter__(self) -> "MetricsLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _supersede_after(path: Path, step: int, superseded: Path) -> None:
    """Keeps the records of ``path`` up to ``step``; appends the others (and any line a kill cut
    short) to ``superseded``. The kept lines replace the file atomically."""
    kept, dropped = [], []
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        try:
            record_step = json.loads(line).get("step")
        except ValueError:
            record_step = None
        ok = line.endswith("\n") and isinstance(record_step, int) and record_step <= step
        (kept if ok else dropped).append(line if line.endswith("\n") else line + "\n")
    if not dropped:
        return
    with superseded.open("a", encoding="utf-8") as f:
        f.writelines(dropped)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)


def device_postfix(record: dict[str, Any]) -> str:
    """The progress bar's device memory: ``" dev=3.1/4.0 GiB"`` (the peak over the local devices
    and the capacity, in the capacity's unit), ``" dev=3.10 GiB"`` without a capacity, ``""``
    where the record has none (the CPU backend without JAXASCEND_DEVICE_MEM_BYTES)."""
    peak = record.get("device_mem_peak_bytes")
    if peak is None:
        return ""
    capacity = record.get("device_mem_capacity_bytes")
    if capacity is None:
        return f" dev={format_bytes(peak)}"
    unit, scale = next(((u, s) for u, s in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)) if capacity >= s), ("B", 1))
    return f" dev={peak / scale:.1f}/{capacity / scale:.1f} {unit}"


class Progress:
    """A tqdm bar showing step, loss, the last held-out loss, tokens/s, peak host memory, peak
    device memory against its capacity (where reported) and SSD throughput (or nothing when
    disabled)."""

    def __init__(self, total: int, initial: int = 0, enabled: bool = True):
        self._bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                         disable=not enabled, file=console.terminal())
        self._eval = ""  # the last held-out loss, shown until the next one

    def update(self, steps: int, record: dict[str, Any] | None = None) -> None:
        self._bar.update(steps)
        if record is not None:
            if "eval_loss" in record:
                self._eval = f" eval={record['eval_loss']:.4f}"
            ssd = f" ssd={record['ssd_gbps']:.2f}GB/s" if record.get("ssd_gbps") else ""
            self._bar.set_postfix_str(
                f"loss={record['loss']:.4f}{self._eval} tok/s={record['tokens_per_s']:.0f} "
                f"peak={format_bytes(record['peak_rss_bytes'])}{device_postfix(record)}{ssd}")

    def close(self) -> None:
        self._bar.close()


@dataclasses.dataclass(frozen=True)
class SteadyRate:
    """Tokens per second over the steps after the one that compiled (``first``..``last``)."""

    tokens_per_s: float
    first: int  # the first step measured
    last: int
    compiled: int  # the step left out: the invocation's first, which compiled the step functions

    def describe(self) -> str:
        """``"982 (steps 2-10; step 1 compiled)"``."""
        steps = f"step {self.first}" if self.first == self.last else f"steps {self.first}-{self.last}"
        return f"{self.tokens_per_s:,.0f} ({steps}; step {self.compiled} compiled)"


def describe_rate(rate: Optional[SteadyRate], compiled: int) -> str:
    """The summary's tokens/s: :meth:`SteadyRate.describe`, or why there is none (``compiled``:
    the invocation's only step)."""
    if rate is None:
        return f"not measured: this run's only step ({compiled}) compiled the step functions"
    return rate.describe()


class Throughput:
    """Tokens per second on the host clock: between two logging points (:meth:`rate`, the
    progress bar's), and from the end of the invocation's first step, which compiles the step
    functions, to the last logging point (:meth:`steady`, the summary's), evaluations left out."""

    def __init__(self):
        self._t0 = time.perf_counter()
        self._start = self._t0
        self._tokens = 0
        self._total = 0  # tokens of every step added
        self._compiled: Optional[tuple[int, float, int]] = None  # (step, time, total tokens) at its end
        self._mark: Optional[tuple[int, float, int, float]] = None  # the same at the last logging point, and
        self._excluded = 0.0  # the seconds since the compiled step that were not training (up to it)

    def add(self, tokens: int) -> None:
        self._tokens += tokens
        self._total += tokens

    def compiled(self, step: int) -> None:
        """The invocation's first step (``step``) has finished: the steady measure starts here."""
        self._compiled = (step, time.perf_counter(), self._total)

    def exclude(self, seconds: float) -> None:
        """``seconds`` of the window were no training (a held-out evaluation)."""
        self._excluded += seconds

    def mark(self, step: int) -> None:
        """A logging point after ``step`` (its result fetched): the steady measure ends here so far."""
        self._mark = (step, time.perf_counter(), self._total, self._excluded)

    def steady(self) -> Optional[SteadyRate]:
        """Tokens/s from the end of the compiled step to the last :meth:`mark`; None without a step
        after the compiled one."""
        if self._compiled is None or self._mark is None or self._mark[0] <= self._compiled[0]:
            return None
        (first, t0, tokens0), (last, t1, tokens1, excluded) = self._compiled, self._mark
        seconds = max(t1 - t0 - excluded, 1e-9)
        return SteadyRate((tokens1 - tokens0) / seconds, first + 1, last, first)

    def rate(self) -> float:
        """Tokens/s since the last call; resets the window."""
        now = time.perf_counter()
        rate = self._tokens / max(now - self._t0, 1e-9)
        self._t0, self._tokens = now, 0
        return rate

    def elapsed(self) -> float:
        return time.perf_counter() - self._start


def summary_table(rows: list[tuple[str, str]]) -> str:
    """A two-column plain-text table for the end-of-run summary."""
    width = max(len(k) for k, _ in rows)
    line = "-" * (width + 3 + max(len(v) for _, v in rows))
    return "\n".join([line] + [f"{k.ljust(width)} | {v}" for k, v in rows] + [line])
