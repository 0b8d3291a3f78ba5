"""The CLIs' output discipline: after an ``error:`` line, the libraries' late reports of the same
failure (from threads and callbacks that outlive the command) stay off the terminal."""

import asyncio
import gc
import logging
import sys
import threading

import pytest

from jaxascend import console


@pytest.fixture
def hooks(monkeypatch):
    """Puts the process-wide report channels back after the test."""
    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(threading, "excepthook", threading.excepthook)
    late = logging.getLogger("asyncio")
    monkeypatch.setattr(late, "propagate", late.propagate)
    monkeypatch.setattr(late, "handlers", list(late.handlers))


def _late_reports() -> None:
    """What a failed background save's leftovers do after the command returned."""
    loop = asyncio.new_event_loop()
    future = loop.create_future()
    future.set_exception(OSError(28, "No space left on device"))
    del future  # "Future exception was never retrieved", logged when collected
    loop.close()
    gc.collect()
    thread = threading.Thread(target=lambda: 1 / 0)
    thread.start()
    thread.join()
    sys.unraisablehook(type("U", (), {"exc_type": RuntimeError, "exc_value": RuntimeError("Event loop is closed"),
                                      "exc_traceback": None, "err_msg": None, "object": None})())
    try:
        raise ValueError("RESOURCE_EXHAUSTED")
    except ValueError:
        sys.excepthook(*sys.exc_info())


def _failing_command() -> int:
    raise OSError(28, "No space left on device")


def test_after_an_error_line_the_late_reports_stay_off_the_terminal(hooks, capfd, monkeypatch):
    monkeypatch.delenv("JAXASCEND_DEBUG", raising=False)
    with console.one_line_output():
        status = console.report_errors(_failing_command, (OSError,))
    _late_reports()
    err = capfd.readouterr().err
    assert status == 2
    assert err == "error: [Errno 28] No space left on device\n"
    print("the caller's stderr is its own again", file=sys.stderr)
    assert capfd.readouterr().err == "the caller's stderr is its own again\n"


def test_a_command_that_succeeds_leaves_the_report_channels_alone(hooks, monkeypatch):
    monkeypatch.delenv("JAXASCEND_DEBUG", raising=False)
    before = sys.unraisablehook, sys.excepthook, threading.excepthook, logging.getLogger("asyncio").propagate
    with console.one_line_output():
        assert console.report_errors(lambda: 0, (OSError,)) == 0
    assert (sys.unraisablehook, sys.excepthook, threading.excepthook,
            logging.getLogger("asyncio").propagate) == before
