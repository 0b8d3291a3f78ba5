"""One training run in a child process, sampled from outside: RSS, page cache of its offload
files, and its metrics records (the benchmarks' shared harness).

    run = run_train_child(cmd, offload_dir, metrics_path, steps=3)
    run.peak_system, run.records, run.samples

System memory = RSS of the process tree + the page cache held by the run's offload shard files
(``mincore``): buffered I/O hides its cost in the page cache, outside RSS. Between samples the
kernel's high-water mark of the child's RSS (``VmHWM``) catches a peak the sampling missed, so
the peak is the larger of the sampled tree + cache and that mark. The child is stopped once
``steps`` metrics records are written (unless ``finish``): the end-of-run checkpoint and export
are not part of a training step's memory.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import psutil

from jaxascend.ssd import page_cache_bytes


@dataclass
class ChildRun:
    samples: list  # (seconds since start, RSS of the process tree, page cache of the offload files, VmHWM)
    records: list  # metrics.jsonl records
    first_step_at: float
    steps_done_at: float
    wall_seconds: float

    @property
    def window(self) -> list:
        return [s for s in self.samples if s[0] <= self.steps_done_at]

    @property
    def peak_rss(self) -> int:
        return max(max(s[1] for s in self.window), self.high_water)

    @property
    def high_water(self) -> int:
        """The child's own RSS high-water mark (VmHWM) at the last sample of the window."""
        return max(s[3] for s in self.window)

    @property
    def peak_page_cache(self) -> int:
        return max(s[2] for s in self.window)

    @property
    def peak_system(self) -> int:
        return max(max(s[1] + s[2] for s in self.window), self.high_water)


class OverLimit(RuntimeError):
    """The child's memory passed the limit it was given, and it was killed."""


def tree_rss(proc: psutil.Process) -> int:
    """RSS of ``proc`` and every process it started."""
    total = proc.memory_info().rss
    for child in proc.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def high_water(pid: int) -> int:
    """``VmHWM`` of ``pid`` in bytes (0 where /proc has none)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _lines(path: Path) -> int:
    try:
        return sum(1 for line in path.read_text().splitlines() if line.strip())
    except FileNotFoundError:
        return 0


def run_sampled_child(cmd: list[str], cache_glob: str, progress: Callable[[], int], log_path: Path, *,
                      steps: int, cwd: Path, interval: float = 0.1, timeout: float = 3600, finish: bool = False,
                      env: Optional[dict] = None, limit: Optional[int] = None,
                      spare: Optional[int] = None) -> ChildRun:
    """Runs ``cmd``, sampling it from outside, until ``progress()`` (steps done so far) reaches
    ``steps``. ``cache_glob`` (recursive ``**`` allowed) names the files whose page cache counts.
    The returned run has no ``records``; RuntimeError if the steps were not all done, and
    :class:`OverLimit` (the child killed) once a sample exceeds ``limit`` bytes; RuntimeError
    (the child killed) once the machine's available memory falls under ``spare`` bytes, before
    the kernel's OOM killer picks some other process."""
    log = log_path.open("w")
    start = time.perf_counter()
    child = subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, env=env)
    proc = psutil.Process(child.pid)
    samples, first_step_at, steps_done_at, done = [], None, None, 0
    try:
        while child.poll() is None:
            t = time.perf_counter() - start
            try:
                rss = tree_rss(proc)
            except psutil.NoSuchProcess:
                break
            files = [f for f in glob.glob(cache_glob, recursive=True) if os.path.isfile(f)]
            samples.append((round(t, 3), rss, page_cache_bytes(files), high_water(child.pid)))
            if limit is not None and max(samples[-1][1] + samples[-1][2], samples[-1][3]) > limit:
                child.kill()
                raise OverLimit(f"over {limit / 2**30:.1f} GiB after {t:.0f} s (killed; see {log_path})")
            if spare is not None and psutil.virtual_memory().available < spare:
                child.kill()
                raise RuntimeError(f"the machine had under {spare / 2**30:.1f} GiB available after {t:.0f} s, "
                                   f"the run at {samples[-1][1] / 2**30:.2f} GiB RSS (killed; see {log_path})")
            done = progress()
            if first_step_at is None and done >= 1:
                first_step_at = t
            if steps_done_at is None and done >= steps:
                steps_done_at = t
                if not finish:
                    child.terminate()  # the steps are measured; skip the end checkpoint and exports
            if t > timeout:
                child.kill()
                peak = max(max(s[1] + s[2], s[3]) for s in samples)
                raise RuntimeError(f"no result after {timeout} s, {done} of {steps} steps done, peak system memory "
                                   f"so far {peak / 2**30:.2f} GiB (see {log_path})")
            time.sleep(interval)
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
        log.close()
    if steps_done_at is None:
        done = max(done, progress())  # steps logged after the last sample
        tail = log_path.read_text()[-2000:]
        raise RuntimeError(f"the run did {done} of {steps} steps; its output ends with:\n{tail}")
    return ChildRun(samples, [], first_step_at, steps_done_at, time.perf_counter() - start)


def run_train_child(cmd: list[str], offload_dir: Path, metrics_path: Path, log_path: Path, *, steps: int,
                    cwd: Path, interval: float = 0.1, timeout: float = 3600, finish: bool = False,
                    limit: Optional[int] = None, spare: Optional[int] = None) -> ChildRun:
    """Runs ``cmd`` (a ``python -m jaxascend.train ...`` line) until it wrote ``steps`` records."""
    run = run_sampled_child(cmd, str(offload_dir / "*.bin"), lambda: _lines(metrics_path), log_path, steps=steps,
                            cwd=cwd, interval=interval, timeout=timeout, finish=finish, limit=limit, spare=spare)
    return dataclasses.replace(run, records=[json.loads(line) for line in metrics_path.read_text().splitlines()])
