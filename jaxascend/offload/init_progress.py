"""What the init pass says while it writes the initial state, and what it reports once done.

The initial state of a 7B model is some 60 GiB of records written in one pass, minutes of
writing: :class:`InitProgress` prints a line at most every :data:`INTERVAL_S` seconds on the
terminal, and one line at the end, and :meth:`InitProgress.finish` returns the pass's bytes and
seconds (:class:`InitialWrite`)::

    writing the initial state: 12.3 of 60.2 GiB (20%), 1.42 GB/s, about 34 s left
    wrote the initial state: 60.2 GiB in 63.1 s (0.95 GB/s)

A pass shorter than the interval prints nothing unless it wrote at least :data:`QUIET_BYTES`
(the tiny runs of the tests stay quiet); a disabled reporter (the processes of a job other than
process 0) prints nothing and still measures.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

from jaxascend import console

INTERVAL_S = 10.0  # seconds between two progress lines (read when a reporter is made)
QUIET_BYTES = 1 << 30  # a pass shorter than the interval reports its end from this size on


@dataclass(frozen=True)
class InitialWrite:
    """What one init pass wrote: every chunk's state record and a streamed leaf's compute weights."""

    bytes: int
    seconds: float  # from the pass's start until its last write was on disk

    @property
    def gbps(self) -> float:
        """Bytes per second, in GB/s (10^9 bytes per second)."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def line(self) -> str:
        """``"wrote the initial state: 60.2 GiB in 63.1 s (0.95 GB/s)"``."""
        unit, scale = _unit(self.bytes)
        return (f"wrote the initial state: {self.bytes / scale:.1f} {unit} in {self.seconds:.1f} s "
                f"({self.gbps:.2f} GB/s)")

    def to_dict(self) -> dict:
        return {"bytes": self.bytes, "seconds": self.seconds, "gbps": self.gbps}


class InitProgress:
    """Counts the bytes of an init pass of ``total`` bytes as they are written (:meth:`add`) and
    prints a progress line when ``interval`` seconds (default :data:`INTERVAL_S`) have passed
    since the last one (or the start); ``clock``: seconds, monotonic."""

    def __init__(self, total: int, *, enabled: bool = True, interval: Optional[float] = None,
                 clock: Callable[[], float] = time.monotonic):
        self.total = int(total)
        self.done = 0
        self.enabled = enabled
        self.interval = INTERVAL_S if interval is None else float(interval)
        self._clock = clock
        self._start = self._last = clock()

    def add(self, nbytes: int) -> None:
        """``nbytes`` more handed to the store; a progress line if one is due."""
        self.done += int(nbytes)
        now = self._clock()
        if self.enabled and now - self._last >= self.interval:
            self._last = now
            print(self.line(now - self._start), file=console.terminal(), flush=True)

    def line(self, elapsed: float) -> str:
        """``"writing the initial state: 12.3 of 60.2 GiB (20%), 1.42 GB/s, about 34 s left"``
        (no rate and time left before 1% is written: the source's first tensors are no rate)."""
        unit, scale = _unit(self.total)
        share = 100 * self.done / self.total if self.total else 100
        text = f"writing the initial state: {self.done / scale:.1f} of {self.total / scale:.1f} {unit} ({share:.0f}%)"
        if elapsed > 0 and self.done * 100 >= self.total > 0:
            rate = self.done / elapsed
            text += f", {rate / 1e9:.2f} GB/s, about {_duration(max(self.total - self.done, 0) / rate)} left"
        return text

    def finish(self) -> InitialWrite:
        """The pass's figures (call once its writes are on disk); its line when it took at least
        the interval or wrote at least :data:`QUIET_BYTES`."""
        written = InitialWrite(self.done, self._clock() - self._start)
        if self.enabled and (written.seconds >= self.interval or written.bytes >= QUIET_BYTES):
            print(written.line(), file=console.terminal(), flush=True)
        return written


def _unit(n: int) -> tuple[str, int]:
    """The largest unit that keeps ``n`` bytes at least 1 (bytes below a KiB)."""
    return next(((unit, scale) for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)) if n >= scale),
                ("B", 1))


def _duration(seconds: float) -> str:
    """``"34 s"``, ``"12 min"`` from two minutes on."""
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"
