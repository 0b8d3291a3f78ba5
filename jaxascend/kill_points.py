"""Crash injection for tests: SIGKILL this process at a named point in the code.

``JAXASCEND_KILL_AT="optimizer_chunk:7"`` kills the process (``SIGKILL``, no clean-up of any
kind, as a power cut or the OOM killer would) the 7th time :func:`kill_point` is reached with
that name. Points: ``backward`` (a step's forward/backward has been dispatched and is running),
``optimizer_chunk`` (inside the streamed AdamW step, between chunks: some chunks written back,
others not), ``checkpoint_chunk`` (inside a checkpoint save, between streamed chunks), ``final_outputs``
(after the final checkpoint, before the run's weights are written), ``export_tensor`` (inside a
Hugging Face export, before each tensor); durable steps' ``durable_sync`` (before the store's
fdatasync), ``journal_write`` / ``journal_fsync`` and ``durable_barrier`` (an update journaled,
before the job's processes agree on it). Unset, a
point costs one dictionary lookup. In a job, ``JAXASCEND_KILL_PROCESS=1`` arms the point in
process 1 alone (the ``JAX_PROCESS_ID`` the launcher gives it).

``JAXASCEND_SIGNAL_AT="backward:3:SIGTERM"`` sends this process SIGTERM instead (a user's Ctrl-C,
a scheduler's preemption, at a known point), and may list several, comma-separated, each counted
from the start or, written ``+n``, from the one before it firing: ``"backward:3:SIGINT,
optimizer_chunk:+1:SIGINT"`` is a second SIGINT during the update of the step the first
interrupted. ``step_end`` is the trainer's step boundary. ``SIGTERM@parent`` sends it to the
parent process instead (a job's launcher). ``JAXASCEND_SIGNAL_PROCESS`` arms them
in one process of a job, like ``JAXASCEND_KILL_PROCESS``.
"""

from __future__ import annotations

import os
import signal
from collections import Counter

_counts: Counter = Counter()
_spec = os.environ.get("JAXASCEND_KILL_AT")
_target = None
_process = os.environ.get("JAXASCEND_KILL_PROCESS")
if _spec and (_process is None or _process == os.environ.get("JAX_PROCESS_ID")):
    _name, _, _nth = _spec.partition(":")
    _target = (_name, int(_nth or 1))



def _signal_specs() -> list[tuple[str, str, str]]:
    spec = os.environ.get("JAXASCEND_SIGNAL_AT")
    process = os.environ.get("JAXASCEND_SIGNAL_PROCESS")
    if not spec or (process is not None and process != os.environ.get("JAX_PROCESS_ID")):
        return []
    return [tuple(part.strip().split(":")) for part in spec.split(",")]


_signals = _signal_specs()  # (point, "n" or "+n", signal name), fired in order
_signal_counts: Counter = Counter()


def kill_point(name: str) -> None:
    """SIGKILLs the process if ``JAXASCEND_KILL_AT`` names this point and occurrence, or sends it
    the signal ``JAXASCEND_SIGNAL_AT`` names there."""
    if _signals and _signals[0][0] == name:
        _signal_counts[name] += 1
        point, nth, signame = _signals[0]
        if _signal_counts[name] == int(nth.lstrip("+")):
            _signals.pop(0)
            if _signals and _signals[0][1].startswith("+"):
                _signal_counts.clear()  # the next one counts from here
            signame, _, whom = signame.partition("@")
            os.kill(os.getppid() if whom == "parent" else os.getpid(), signal.Signals[signame])
    if _target is None or name != _target[0]:
        return
    _counts[name] += 1
    if _counts[name] == _target[1]:
        os.kill(os.getpid(), signal.SIGKILL)
