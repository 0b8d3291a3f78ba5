"""What the command-line tools print: one line per error or note, and nothing else on stderr.

The libraries under a run (Orbax, tensorstore, asyncio, JAX) report a failure in their own
background threads with tracebacks, log records and "coroutine was never awaited" warnings,
then hand the same error back to the caller, which the CLI prints as one ``error: ...`` line.
:func:`one_line_output` keeps that second copy only: while it is active, ``sys.stderr`` is a
small in-memory buffer (dropped at the end), jaxascend's own log records and Python warnings
become one-line ``note: ...`` messages, and :func:`terminal` is where the progress bar, notes and
errors go. After an error, the libraries' late reports of it stay hidden too (see
:func:`_drop_late_reports`). ``JAXASCEND_DEBUG=1`` turns all of it off and shows everything, tracebacks included.

The native runtime of a job writes to the process's own file descriptors, past ``sys.stderr``:
gloo's ``[Gloo] Rank 0 is connected to 1 peer ranks...`` and XLA's preemption notifier's info and
warning lines, in every job. :func:`runtime_noise` recognises them; ``jaxascend.launch`` leaves
them out of the children's forwarded output (all of it under ``JAXASCEND_DEBUG=1``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import logging
import os
import re
import sys
import threading
import warnings
from typing import Callable, Iterator, NoReturn, TextIO

_terminal: TextIO | None = None  # the real stderr while one_line_output is active
_errors_reported = 0  # error lines printed so far (one_line_output tells a failed command by it)
# gloo's connection line, and the info/warning lines of XLA's preemption notifier and sync manager
# ("Cancelled call to retrieve preemption notice. This is expected upon program shutdown."), as absl
# writes them ("W1203 07:45:00.123456  1234 preemption_notifier.cc:89] ...") or TSL's own logging
# ("2026-12-03 07:45:00.123456: W external/xla/.../preemption_notifier.cc:89] ...").
_RUNTIME_NOISE = re.compile(rb"^(?:\[Gloo\] Rank \d+ is connected to \d+ peer ranks"
                            rb"|(?:[IW]\d{4} [\d:.]+\s+\d+ |\d{4}-\d\d-\d\d [\d:.]+: [IW] )"
                            rb"\S*?\b(?:preemption_notifier|preemption_sync_manager)\.cc:\d+\])")


def debugging() -> bool:
    """True when ``JAXASCEND_DEBUG`` asks for full tracebacks and library output."""
    return bool(os.environ.get("JAXASCEND_DEBUG"))


def runtime_noise(line: bytes) -> bool:
    """Whether ``line`` (as a child process wrote it) is one of the native runtime's lines that
    every job prints (see the module doc); never under ``JAXASCEND_DEBUG``."""
    return not debugging() and _RUNTIME_NOISE.match(line) is not None


def terminal() -> TextIO:
    """The user's stderr (also while :func:`one_line_output` hides the libraries' output)."""
    return _terminal or sys.stderr


def first_line(err: BaseException) -> str:
    """``err``'s message as one line (its type when it has none)."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def error(message: str) -> None:
    global _errors_reported
    _errors_reported += 1
    print(f"error: {message}", file=terminal(), flush=True)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose usage errors are one ``error:`` line and exit status 2, as every
    other error of the CLIs (argparse's own prints the usage first)."""

    def error(self, message: str) -> NoReturn:
        error(message)
        sys.exit(2)


def report_errors(fn: Callable[[], int], errors: tuple[type[BaseException], ...]) -> int:
    """A CLI's exit status: ``fn()``'s, or 2 after one ``error:`` line when it raises one of
    ``errors`` (``JAXASCEND_DEBUG=1`` lets the exception through, traceback and all)."""
    try:
        return fn()
    except errors as err:
        if debugging():
            raise
        error(first_line(err))
        return 2


def note(message: str) -> None:
    print("note: " + " ".join(message.split()), file=terminal(), flush=True)


class _NoteHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        note(record.getMessage())


class _Tail(io.StringIO):
    """Keeps only the last ``limit`` characters written (what the libraries printed)."""

    def __init__(self, limit: int = 1 << 16):
        super().__init__()
        self._limit = limit

    def write(self, s: str) -> int:
        n = super().write(s)
        if self.tell() > 2 * self._limit:
            tail = self.getvalue()[-self._limit:]
            self.seek(0)
            self.truncate()
            super().write(tail)
        return n


def _stderr_handlers() -> list[logging.StreamHandler]:
    """Log handlers made before the CLI started (``logging.basicConfig``'s on the root logger,
    absl's) that write to the real stderr: they hold the stream object itself."""
    loggers = [logging.getLogger()] + [log for log in logging.Logger.manager.loggerDict.values()
                                       if isinstance(log, logging.Logger)]
    found = []
    for log in loggers:
        for h in log.handlers:
            inner = getattr(h, "python_handler", h)  # absl wraps a StreamHandler
            if isinstance(inner, logging.StreamHandler) and inner.stream in (sys.stderr, sys.__stderr__):
                found.append(inner)
    return found


@contextlib.contextmanager
def one_line_output() -> Iterator[None]:
    """The CLI's output discipline (see the module doc); does nothing under ``JAXASCEND_DEBUG``."""
    global _terminal
    if debugging():
        yield
        return
    buffer = _Tail()
    package_log = logging.getLogger("jaxascend")
    note_handler = _NoteHandler()
    handlers = _stderr_handlers()
    saved_streams = [h.stream for h in handlers]
    saved = sys.stderr, package_log.propagate
    _terminal = sys.stderr
    sys.stderr = buffer
    for h in handlers:
        h.setStream(buffer)
    package_log.addHandler(note_handler)
    package_log.propagate = False
    with warnings.catch_warnings():
        # Left behind by a background save that failed; the failure itself is reported.
        warnings.filterwarnings("ignore", message=r"coroutine .* was never awaited", category=RuntimeWarning)
        warnings.showwarning = lambda message, category, *args, **kwargs: note(str(message))
        errors_before = _errors_reported
        try:
            yield
        finally:
            # A failed background save leaves tasks whose "exception was never retrieved" records
            # would be logged when they are collected: collect them while stderr is the buffer.
            gc.collect()
            failed = _errors_reported > errors_before
            sys.stderr, package_log.propagate = saved
            for h, stream in zip(handlers, saved_streams):
                if not failed:
                    h.setStream(stream)
            package_log.removeHandler(note_handler)
            _terminal = None
            if failed:
                _drop_late_reports(buffer)


def _drop_late_reports(buffer: TextIO) -> None:
    """After an ``error:`` line, the libraries' late reports of the same failure stay off the
    terminal until the process ends: a background save's threads and tensorstore's callbacks can
    outlive the command (a future whose exception nobody retrieved, an exception in a thread or in
    a callback on a closed event loop). Only those channels are redirected; ``sys.stderr`` is the
    caller's again."""
    late = logging.getLogger("asyncio")
    late.addHandler(logging.StreamHandler(buffer))
    late.propagate = False  # else logging's last-resort handler writes to the real stderr
    sys.unraisablehook = lambda unraisable: None
    threading.excepthook = lambda args: None
    sys.excepthook = lambda *exc_info: None  # tensorstore's callbacks report with PyErr_Print
