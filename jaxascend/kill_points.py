"""Crash injection for tests: SIGKILL this process at a named point in the code.

``JAXASCEND_KILL_AT="optimizer_chunk:7"`` kills the process (``SIGKILL``, no clean-up of any
kind, as a power cut or the OOM killer would) the 7th time :func:`kill_point` is reached with
that name. Points: ``backward`` (a step's forward/backward has been dispatched and is running),
``optimizer_chunk`` (inside the streamed AdamW step, between chunks: some chunks written back,
others not), ``checkpoint_chunk`` (inside a checkpoint save, between streamed chunks). Unset, a
point costs one dictionary lookup. In a job, ``JAXASCEND_KILL_PROCESS=1`` arms the point in
process 1 alone (the ``JAX_PROCESS_ID`` the launcher gives it).
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


def kill_point(name: str) -> None:
    """SIGKILLs the process if ``JAXASCEND_KILL_AT`` names this point and occurrence."""
    if _target is None or name != _target[0]:
        return
    _counts[name] += 1
    if _counts[name] == _target[1]:
        os.kill(os.getpid(), signal.SIGKILL)
