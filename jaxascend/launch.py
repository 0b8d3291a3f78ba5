"""Local multi-process launcher: ``python -m jaxascend.launch --nproc N [--port P] -- COMMAND ...``.

    python -m jaxascend.launch --nproc 2 -- python -m jaxascend.train --config configs/tiny.yaml
    python -m jaxascend.launch --nproc 4 --port 29500 -- my_script.py --flag

Starts N copies of COMMAND on this machine, process ``i`` with the environment of a
``jax.distributed`` job: ``JAX_COORDINATOR_ADDRESS=127.0.0.1:PORT``, ``JAX_NUM_PROCESSES=N``,
``JAX_PROCESS_ID=i`` and ``JAXASCEND_LOCAL_PROCESS=i`` (and ``PYTHONUNBUFFERED=1`` unless set, so
that the children's lines arrive as they are printed). JAX 0.10's ``jax.distributed.initialize()``
reads ``JAX_COORDINATOR_ADDRESS`` itself but not the other two: the program passes them as
``num_processes`` and ``process_id``. A COMMAND starting with ``-m`` or a
``.py`` file runs under this Python. ``--port`` defaults to a free port.

The children's stdout and stderr come out on the launcher's, line by line (``\\r`` ends a line
too, so progress bars move); with N > 1, lines of process ``i > 0`` start with ``[i] ``
(process 0 is the one that logs). The lines the native runtime prints in every job (gloo's
``[Gloo] Rank 0 is connected ...``, XLA's preemption notifier's info and warnings:
:func:`jaxascend.console.runtime_noise`) are left out, unless ``JAXASCEND_DEBUG=1``. When a child exits non-zero or is killed by a signal, the
others get SIGTERM, then SIGKILL after ``--grace-seconds``, and the launcher exits with that
child's status (128 + signal when killed) after one line on stderr,
``error: process 1 exited with status 3: <its last stderr line>``. SIGINT, SIGTERM, SIGUSR1 or
SIGHUP to the launcher is forwarded to every child, which (``jaxascend.train``) agree on a step,
checkpoint it and exit with 128 + that signal; no deadline is set, since a checkpoint may take
minutes. A second signal is forwarded too (a second SIGINT abandons the step in flight) and the
children are killed ``--grace-seconds`` later. The launcher then says in one line how the job
ended and exits with 128 + the first signal. Each child runs in its own session, so the signals reach the processes it
started too. Bad usage is one ``error: ...`` line and exit status 2. :func:`launch` is the same
as a library call.

On SLURM or Open MPI do not use it: start one process per task with ``srun`` / ``mpirun``;
``jax.distributed.initialize()`` reads those environments itself.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Callable, Sequence, TextIO

from jaxascend import console

PROG = "python -m jaxascend.launch"
MAX_NPROC = 64
_POLL_SECONDS = 0.05  # how often child exits and the grace deadline are checked
_MAX_PENDING = 1 << 16  # a longer line without an end is forwarded in pieces
_LINE_END = re.compile(rb"\r\n|\n|\r")
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)
_STOPPED = tuple(128 + s for s in _STOP_SIGNALS)  # the exit status of a child that stopped on one


class LaunchError(Exception):
    """A child could not be started (no such program, not executable)."""


def _check_nproc(nproc: object) -> int:
    if isinstance(nproc, bool) or not isinstance(nproc, int) or not 1 <= nproc <= MAX_NPROC:
        raise ValueError(f"must be an integer from 1 to {MAX_NPROC}, got {nproc!r}")
    return nproc


def _check_port(port: object) -> int:
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"must be a TCP port from 1 to 65535, got {port!r}")
    return port


def _check_grace(seconds: object) -> float:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) \
            or seconds < 0:
        raise ValueError(f"must be a number of seconds >= 0, got {seconds!r}")
    return float(seconds)


def resolve_command(command: Sequence[str]) -> list[str]:
    """``command`` as it is started: ``-m mod ...`` and ``file.py ...`` run under this Python."""
    command = list(command)
    if not command or not command[0]:
        raise ValueError("no command: give it after '--', e.g. -- python -m jaxascend.train --config x.yaml")
    if command[0] == "-m" or command[0].endswith(".py"):
        return [sys.executable] + command
    return command


def free_port() -> int:
    """A TCP port nothing listens on now (bound to port 0, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(base: dict[str, str], nproc: int, port: int, index: int) -> dict[str, str]:
    """The environment of process ``index`` of ``nproc``: ``base`` plus the jax.distributed variables."""
    env = dict(base)
    env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(nproc),
               JAX_PROCESS_ID=str(index), JAXASCEND_LOCAL_PROCESS=str(index))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


class _Sink:
    """One of the launcher's own streams, written in bytes; output stops (and the children go on)
    once its reader has gone."""

    def __init__(self, stream: TextIO):
        self._stream = stream
        self._closed = False
        stream.flush()  # what was printed to it as text comes first

    def write(self, data: bytes) -> None:
        if self._closed:
            return
        try:
            if hasattr(self._stream, "buffer"):
                self._stream.buffer.write(data)
            else:
                self._stream.write(data.decode(errors="replace"))
        except BrokenPipeError:
            self._closed = True

    def flush(self) -> None:
        if not self._closed:
            try:
                (getattr(self._stream, "buffer", None) or self._stream).flush()
            except BrokenPipeError:
                self._closed = True


class _Pipe:
    """One child stream being forwarded: its bytes not yet forwarded and its last non-empty line."""

    def __init__(self, file: IO[bytes], sink: _Sink, prefix: bytes):
        self.file = file
        self.sink = sink
        self.prefix = prefix
        self.pending = b""
        self.at_line_start = True
        self.ended_with_cr = False  # a progress bar's last state: a newline follows it at EOF
        self.last_line = ""

    def feed(self, data: bytes) -> None:
        """Forwards the complete lines of ``pending + data``; at EOF (``data == b""``) the rest too."""
        buffer = self.pending + data
        start = 0
        for end in _LINE_END.finditer(buffer):
            if data and end.group() == b"\r" and end.end() == len(buffer):
                break  # may be the first half of "\r\n"
            self._forward(buffer[start:end.end()])
            start = end.end()
        rest = buffer[start:]
        if rest and (not data or len(rest) > _MAX_PENDING):
            self._forward(rest)
            rest = b""
        if not data and (not self.at_line_start or self.ended_with_cr):
            self.sink.write(b"\n")  # the next process's line starts on a line of its own
        self.pending = rest

    def _forward(self, piece: bytes) -> None:
        if self.at_line_start and console.runtime_noise(piece):
            return  # a whole line of the runtime's (its line end included)
        self.sink.write(self.prefix + piece if self.at_line_start else piece)
        self.at_line_start = piece.endswith((b"\n", b"\r"))
        self.ended_with_cr = piece.endswith(b"\r")
        text = piece.decode(errors="replace").strip()
        if text:
            self.last_line = text


class _Child:
    def __init__(self, index: int, proc: subprocess.Popen, stdout: _Pipe, stderr: _Pipe):
        self.index = index
        self.proc = proc
        self.pipes = (stdout, stderr)
        self.stderr = stderr

    def signal(self, signum: int) -> None:
        """``signum`` to the child and everything it started (its session's process group)."""
        try:
            os.killpg(self.proc.pid, signum)
        except (ProcessLookupError, PermissionError):  # the group is gone (macOS: EPERM for zombies)
            pass

    def failure(self) -> str | None:
        """Why this exited child failed, or None when it exited with status 0."""
        rc = self.proc.returncode
        if rc == 0:
            return None
        what = f"was killed by {_signal_name(-rc)}" if rc < 0 else f"exited with status {rc}"
        line = self.stderr.last_line
        return f"process {self.index} {what}: {_strip_error(line)}" if line else f"process {self.index} {what}"


def _strip_error(line: str) -> str:
    # A jaxascend CLI's own one-line "error: ..." is not repeated as "error: ...: error: ...".
    return line[len("error: "):] if line.startswith("error: ") else line


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:  # a real-time signal has no name of its own
        return f"signal {signum}"


def _exit_status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


class _Launch:
    """The children of one launch, their forwarded pipes and the stop sequence."""

    def __init__(self, command: list[str], nproc: int, port: int, grace_seconds: float, base_env: dict[str, str]):
        self.command, self.nproc, self.port, self.grace = command, nproc, port, grace_seconds
        self.base_env = base_env
        self.children: list[_Child] = []
        self.selector = selectors.DefaultSelector()
        self.out, self.err = _Sink(sys.stdout), _Sink(sys.stderr)
        self.signals: list[int] = []  # the stop signals received, in order
        self.forwarded = 0  # how many of them went to the children
        self.stop_at: float | None = None  # when the children were told to stop for good (the kill deadline's start)
        self.killed = False

    def start(self) -> None:
        for i in range(self.nproc):
            try:
                proc = subprocess.Popen(self.command, env=child_env(self.base_env, self.nproc, self.port, i),
                                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, start_new_session=True)
            except OSError as err:
                raise LaunchError(f"cannot start {self.command[0]}: {err.strerror or err}") from err
            prefix = f"[{i}] ".encode() if self.nproc > 1 and i > 0 else b""
            child = _Child(i, proc, _Pipe(proc.stdout, self.out, prefix), _Pipe(proc.stderr, self.err, prefix))
            self.children.append(child)
            for pipe in child.pipes:
                self.selector.register(pipe.file, selectors.EVENT_READ, pipe)

    def on_signal(self, signum: int, frame) -> None:
        self.signals.append(signum)

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """Sends ``signum`` to every running child and starts the kill deadline."""
        self.forward(signum)
        if self.stop_at is None:
            self.stop_at = time.monotonic()

    def forward(self, signum: int) -> None:
        for child in self.children:
            if child.proc.poll() is None:
                child.signal(signum)

    def kill(self) -> None:
        if not self.killed:
            self.killed = True
            for child in self.children:
                child.signal(signal.SIGKILL)

    def _forward_ready(self) -> int:
        """Forwards what the pipes hold (waiting up to one poll interval); how many were ready."""
        if not self.selector.get_map():
            time.sleep(_POLL_SECONDS)  # the children closed their pipes but still run
            return 0
        ready = self.selector.select(_POLL_SECONDS)
        for key, _ in ready:
            pipe: _Pipe = key.data
            data = os.read(key.fd, 1 << 16)
            pipe.feed(data)
            if not data:
                self.selector.unregister(pipe.file)
                pipe.file.close()
        self.out.flush()
        self.err.flush()
        return len(ready)

    def wait(self) -> int:
        """Forwards output until every child has exited and closed its pipes; the launch's status."""
        failed: _Child | None = None
        while True:
            self._forward_ready()
            while self.forwarded < len(self.signals):  # the first checkpoints, the second ends it
                if self.forwarded == 0:
                    self.forward(self.signals[0])
                else:
                    self.stop(self.signals[self.forwarded])
                self.forwarded += 1
            exited = [c for c in self.children if c.proc.poll() is not None]
            if failed is None and self.stop_at is None and not self.signals:
                # The first to fail (the lowest index among those found together) is the one reported.
                # A child that stopped on a signal (128 + a stop signal: it saved a checkpoint) is not a
                # failure: the others stop at the same step by themselves.
                failed = next((c for c in exited if c.proc.returncode not in (0, *_STOPPED)), None)
                if failed is not None:
                    self.stop()
            if self.stop_at is not None and time.monotonic() - self.stop_at >= self.grace:
                self.kill()
            if len(exited) == len(self.children):
                break
        # The pipes of exited children hold their last output and then EOF, ready at once. One that
        # is open with nothing in it, or still written to after a while, is held by a process a
        # child left behind: stop reading it.
        drain_until = time.monotonic() + max(self.grace, 1.0)
        while self.selector.get_map() and self._forward_ready() and time.monotonic() < drain_until:
            pass
        codes = {c.proc.returncode for c in self.children}
        if failed is None and not self.signals and len(codes) == 1 and codes <= set(_STOPPED):
            return self._stopped(codes.pop() - 128)  # the job stopped on a signal one of its processes got
        if failed is not None:
            self._error(failed.failure())
            return _exit_status(failed.proc.returncode)
        if self.signals:
            return self._stopped(self.signals[0])
        return 0

    def _stopped(self, signum: int) -> int:
        """The one line of a job stopped by ``signum``: every child stopped on it (a
        ``jaxascend.train`` child after the checkpoint of the step it stopped at, exiting with
        128 + ``signum``), or how one of them ended instead."""
        self.err.flush()
        name, stopped = _signal_name(signum), (128 + signum, -signum)
        if all(c.proc.returncode in stopped for c in self.children):
            print(f"job stopped by {name}: its {len(self.children)} process(es) stopped on it; the same command "
                  "resumes from the step process 0 named (its checkpoint, or with offload.durable the offload files)",
                  file=sys.stderr, flush=True)
        else:
            other = next(c for c in self.children if c.proc.returncode not in stopped)
            self._error(f"stopped by {name}; " + (other.failure() or f"process {other.index} exited with status 0"))
        return 128 + signum

    def _error(self, message: str) -> None:
        self.err.flush()
        console.error(message)

    def close(self) -> None:
        """Kills and reaps whatever still runs (after an exception in the launcher itself)."""
        for child in self.children:
            if child.proc.poll() is None:
                child.signal(signal.SIGKILL)
                child.proc.wait()
            for pipe in child.pipes:
                pipe.file.close()
        self.selector.close()


def launch(command: Sequence[str], nproc: int, port: int | None = None, grace_seconds: float = 10.0,
           env: dict[str, str] | None = None) -> int:
    """Runs ``nproc`` copies of ``command`` as one jax.distributed job (see the module doc) and
    returns the launcher's exit status: 0 when every child exited 0, else the first failure's.

    ``env`` is the children's environment before the launcher's variables (default: this
    process's). Stop signals are handled while it runs when it is called from the main thread.

        status = launch(["python", "-m", "jaxascend.train", "--config", "x.yaml"], nproc=2)
    """
    for name, check, value in (("nproc", _check_nproc, nproc), ("grace_seconds", _check_grace, grace_seconds),
                               ("port", _check_port, port)):
        try:
            if value is not None:
                check(value)
        except ValueError as err:
            raise ValueError(f"{name} {err}") from None
    command = resolve_command(command)
    run = _Launch(command, nproc, port if port is not None else free_port(), grace_seconds,
                  dict(os.environ if env is None else env))
    handlers = {}
    try:
        if threading.current_thread() is threading.main_thread():
            handlers = {s: signal.signal(s, run.on_signal) for s in _STOP_SIGNALS}
        run.start()
        return run.wait()
    finally:
        run.close()
        for s, handler in handlers.items():
            signal.signal(s, handler)



def _arg(convert: Callable[[str], object], check: Callable[[object], object]) -> Callable[[str], object]:
    """An argparse type: ``convert`` then ``check``, errors as argparse's one-line messages."""
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        try:
            return check(value)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    return parse


def _parser(prog: str = PROG) -> console.ArgumentParser:
    p = console.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                usage=f"{prog} --nproc N [--port P] [--grace-seconds S] -- COMMAND [ARG ...]")
    p.add_argument("--nproc", type=_arg(int, _check_nproc), required=True, metavar="N",
                   help=f"number of processes, 1 to {MAX_NPROC}")
    p.add_argument("--port", type=_arg(int, _check_port), metavar="P", help="coordinator port (default: a free one)")
    p.add_argument("--grace-seconds", type=_arg(float, _check_grace), default=10.0, metavar="S",
                   help="from SIGTERM to SIGKILL when the children are stopped (default: 10)")
    return p


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    """The CLI (``prog``: the name its usage line shows): the children's status (see
    :func:`launch`), 2 after one ``error:`` line for bad usage."""
    argv = list(sys.argv[1:] if argv is None else argv)
    own, command = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = _parser(prog).parse_args(own)
    return console.report_errors(lambda: launch(command, args.nproc, args.port, args.grace_seconds),
                                 (ValueError, LaunchError))


if __name__ == "__main__":
    sys.exit(main())
