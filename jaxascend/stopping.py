"""Stopping a run on a signal, at a step boundary, with a checkpoint of that step.

    with StopSignals(cfg.train.stop_signals, newest=lambda: "checkpoint 4 in runs/x") as signals:
        for step in ...:
            engine.step(batch)
            if signals.requested:                 # (a job agrees on it first: every process stops)
                with signals.protected():         # a second SIGINT waits for the save to complete
                    save(step)
                raise RunStopped(signals.requested, step, where)

The handler only records the first signal; the loop acts on it at the next step boundary: the
step in flight (and an overlapped update) finishes, a checkpoint of that step is written, one
line says so and the process exits with 128 + the signal. A second SIGINT while stopping
abandons the step in flight at once (``os._exit``; the newest complete checkpoint is intact,
since a checkpoint is either whole or absent, and one line says which it is), except while a
checkpoint is being saved: that save completes first. Handlers are installed only in the main
thread and put back on exit.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Callable, Iterator, Optional

from jaxascend import console


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class RunStopped(Exception):
    """The run stopped on ``signum`` after step ``step``, whose checkpoint is saved in ``where`` (``files``:
    durable steps, the offload files in ``where`` hold it and nothing was saved)."""

    def __init__(self, signum: int, step: int, where: str, speaks: bool = True, files: bool = False):
        self.signum, self.step, self.where, self.speaks = signum, step, where, speaks
        held = f"the offload files in {where} hold step {step}" if files else f"checkpoint {step} saved in {where}"
        super().__init__(f"stopped by {signal_name(signum)} at step {step}: {held}; the same command resumes")

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


class StopSignals:
    """Owns the handlers of ``names`` (e.g. ``["SIGINT", "SIGTERM"]``) for the run's duration
    (see the module doc). ``newest()`` names the newest complete checkpoint, for the line a
    second SIGINT prints."""

    def __init__(self, names: list[str], newest: Callable[[], str] = lambda: "the newest complete checkpoint"):
        self.signals = [signal.Signals[name] for name in names]
        self.newest = newest
        self.requested: Optional[int] = None  # the first stop signal received
        self._saving = 0  # nesting depth of protected() sections
        self._abandon_after_save = False
        self._previous: dict = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.signals}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def _handle(self, signum: int, frame) -> None:
        if self.requested is None:
            self.requested = signum
            return
        if signum != signal.SIGINT:
            return  # already stopping: the first signal's stop goes on
        if self._saving:
            self._abandon_after_save = True  # the save in progress completes first
            return
        self.abandon()

    def request(self, signum: int) -> None:
        """Records ``signum`` as if it had arrived (a job's processes agree on one signal)."""
        if self.requested is None:
            self.requested = signum

    @contextlib.contextmanager
    def protected(self) -> Iterator[None]:
        """A checkpoint save: a second SIGINT inside waits for it to complete."""
        self._saving += 1
        try:
            yield
        finally:
            self._saving -= 1
            if not self._saving and self._abandon_after_save:
                self.abandon()

    def abandon(self) -> None:
        """Leaves at once, the step in flight abandoned (a second SIGINT)."""
        print(f"stopped by a second SIGINT: the step in flight was abandoned; {self.newest()} is intact and the "
              "same command resumes from it", file=console.terminal(), flush=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + signal.SIGINT)
