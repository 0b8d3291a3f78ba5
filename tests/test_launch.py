"""The local launcher: each child's jax.distributed environment, forwarded output, the stop
sequence (a failing child, signals to the launcher), one-line usage errors, and a real two-process
jax.distributed psum. The children are tiny scripts written to tmp_path; only the last one imports jax."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from jaxascend.launch import _Pipe, _Sink, free_port, launch, main

REPO = Path(__file__).resolve().parents[1]


def script(tmp_path: Path, *parts: str) -> Path:
    """A child script: ``parts`` (each dedented) after the imports and ``RANK``, its process id."""
    path = tmp_path / "child.py"
    path.write_text("import os, sys, time\nRANK = int(os.environ['JAX_PROCESS_ID'])\n"
                    + "".join(textwrap.dedent(part) for part in parts))
    return path


def launcher(*args: str) -> list[str]:
    return [sys.executable, "-m", "jaxascend.launch", *args]


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(launcher(*args), capture_output=True, text=True, timeout=timeout, cwd=REPO)


def unprefixed(line: str) -> tuple[int, str]:
    """(process, text) of one forwarded line."""
    if line.startswith("["):
        index, text = line[1:].split("] ", 1)
        return int(index), text
    return 0, line


def wait_for(paths: list[Path], timeout: float = 30) -> list[int]:
    """The pids the children wrote to ``paths``, once all are there."""
    deadline = time.monotonic() + timeout
    while not all(p.exists() and p.read_text().endswith("\n") for p in paths):
        assert time.monotonic() < deadline, f"the children did not start: {paths}"
        time.sleep(0.02)
    return [int(p.read_text()) for p in paths]


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its parent to reap it does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


WRITE_PID = """
def write_pid(path, pid=None):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(f"{pid or os.getpid()}\\n")
    os.replace(tmp, path)
"""


# The environment of each child.

def test_every_child_sees_its_jax_distributed_environment(tmp_path, capfd):
    child = script(tmp_path, """
        import json
        keys = ["JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAXASCEND_LOCAL_PROCESS"]
        print(json.dumps({k: os.environ[k] for k in keys}))
    """)
    assert launch([str(child)], nproc=3) == 0
    lines = [unprefixed(line) for line in capfd.readouterr().out.splitlines()]
    seen = {i: json.loads(text) for i, text in lines}
    assert sorted(seen) == [0, 1, 2] and len(lines) == 3
    coordinators = {env["JAX_COORDINATOR_ADDRESS"] for env in seen.values()}
    assert len(coordinators) == 1
    host, port = coordinators.pop().rsplit(":", 1)
    assert host == "127.0.0.1" and 1 <= int(port) <= 65535
    for i, env in seen.items():
        assert env["JAX_NUM_PROCESSES"] == "3"
        assert env["JAX_PROCESS_ID"] == env["JAXASCEND_LOCAL_PROCESS"] == str(i)  # and printed under [i]


def test_a_given_port_is_the_coordinators_and_env_is_the_base(tmp_path, capfd):
    child = script(tmp_path, "print(os.environ['JAX_COORDINATOR_ADDRESS'], os.environ['EXTRA'])\n")
    port = free_port()
    assert launch([str(child)], nproc=2, port=port, env={**os.environ, "EXTRA": "yes"}) == 0
    assert sorted(capfd.readouterr().out.splitlines()) == [f"127.0.0.1:{port} yes", f"[1] 127.0.0.1:{port} yes"]


def test_a_module_command_runs_under_this_python(tmp_path, capfd):
    (tmp_path / "childmod.py").write_text("import sys\nprint(sys.executable)\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    assert launch(["-m", "childmod"], nproc=1, env=env) == 0
    assert capfd.readouterr().out.splitlines() == [sys.executable]


# Forwarded output.

def test_process_0_is_unprefixed_and_the_others_are_prefixed(tmp_path, capfd):
    child = script(tmp_path, """
        if RANK == 1:
            time.sleep(0.5)  # keeps the two processes' lines in order for the comparison
        print(f"out {RANK}")
        print(f"err {RANK}", file=sys.stderr)
        sys.stderr.write(f"bar {RANK} 1\\rbar {RANK} 2\\r")  # a progress bar: "\\r" ends a line too
        sys.stdout.write(f"no newline {RANK}")
    """)
    assert launch([str(child)], nproc=2) == 0
    out, err = capfd.readouterr()
    assert out.splitlines() == ["out 0", "no newline 0", "[1] out 1", "[1] no newline 1"]
    assert err == "err 0\nbar 0 1\rbar 0 2\r\n[1] err 1\n[1] bar 1 1\r[1] bar 1 2\r\n"


def test_one_process_is_unprefixed(tmp_path, capfd):
    child = script(tmp_path, "print('only', RANK)\n")
    assert launch([str(child)], nproc=1) == 0
    assert capfd.readouterr().out == "only 0\n"


def test_a_line_longer_than_a_read_is_one_prefixed_line(tmp_path, capfd):
    child = script(tmp_path, """
        if RANK == 1:
            for _ in range(50):
                sys.stdout.write("x" * 10_000)
                sys.stdout.flush()
            print()
    """)
    assert launch([str(child)], nproc=2) == 0
    assert capfd.readouterr().out == "[1] " + "x" * 500_000 + "\n"


def test_a_line_end_split_between_two_reads_is_one_line_end():
    out = io.TextIOWrapper(io.BytesIO())
    pipe = _Pipe(io.BytesIO(), _Sink(out), b"[1] ")
    for data in (b"a\r", b"\nb\r", b"c", b""):  # "b\rc" at EOF: a progress bar, then the end
        pipe.feed(data)
    assert out.buffer.getvalue() == b"[1] a\r\n[1] b\r[1] c\n"
    assert pipe.last_line == "c"


RUNTIME_LINES = [
    b"[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n",
    b"W1203 07:45:00.123456    4242 preemption_notifier.cc:89] SIGTERM caught at 2026-12-03T07:45:00\n",
    b"I0000 00:00:1733212345.123456   12345 preemption_sync_manager.cc:170] Shutting down PreemptionSyncManager...\n",
    b"2026-12-03 07:45:00.123456: W external/xla/xla/tsl/distributed_runtime/preemption/preemption_notifier.cc:89] "
    b"Cancelled call to retrieve preemption notice. This is expected upon program shutdown.\n",
]


def test_the_runtimes_lines_of_every_job_are_left_out(monkeypatch):
    monkeypatch.delenv("JAXASCEND_DEBUG", raising=False)
    out = io.TextIOWrapper(io.BytesIO())
    pipe = _Pipe(io.BytesIO(), _Sink(out), b"[1] ")
    kept = [b"loss 3.2\n", b"E1203 07:45:00.123456    4242 preemption_notifier.cc:95] an error stays\n",
            b"note: [Gloo] Rank 0 is connected ... quoted is no runtime line\n"]
    pipe.feed(b"".join(RUNTIME_LINES[:2] + kept[:1] + RUNTIME_LINES[2:] + kept[1:]))
    pipe.feed(b"")
    assert out.buffer.getvalue() == b"".join(b"[1] " + line for line in kept)
    monkeypatch.setenv("JAXASCEND_DEBUG", "1")  # everything, as printed
    out = io.TextIOWrapper(io.BytesIO())
    pipe = _Pipe(io.BytesIO(), _Sink(out), b"")
    pipe.feed(b"".join(RUNTIME_LINES))
    pipe.feed(b"")
    assert out.buffer.getvalue() == b"".join(RUNTIME_LINES)


def test_large_output_on_both_pipes_does_not_deadlock(tmp_path):
    # Each child fills one pipe, then the other, in turns: a launcher reading one pipe at a time
    # would wait on it forever while the child waits on the other, full one.
    child = script(tmp_path, """
        for block in range(5):
            for stream in (sys.stdout, sys.stderr):
                name = "out" if stream is sys.stdout else "err"
                stream.write("".join(f"{name} {RANK} {block * 10000 + k}\\n" for k in range(10000)))
                stream.flush()
    """)
    proc = run_cli("--nproc", "2", "--", str(child), timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for name, text in (("out", proc.stdout), ("err", proc.stderr)):
        lines = text.splitlines()
        assert len(lines) == 100_000
        for rank in (0, 1):
            mine = [t for i, t in map(unprefixed, lines) if i == rank]
            assert mine == [f"{name} {rank} {k}" for k in range(50_000)]


# A child that fails.

def test_a_failing_child_stops_its_sleeping_sibling_and_is_reported(tmp_path, capfd):
    pid0 = tmp_path / "pid0"
    child = script(tmp_path, WRITE_PID, f"""
        if RANK == 0:
            write_pid({str(pid0)!r})
            time.sleep(60)
        while not os.path.exists({str(pid0)!r}):
            time.sleep(0.01)
        print("step 1", file=sys.stderr)
        print("boom: disk full", file=sys.stderr)
        print("  ", file=sys.stderr)
        sys.exit(3)
    """)
    start = time.monotonic()
    assert launch([str(child)], nproc=2, grace_seconds=10) == 3
    assert time.monotonic() - start < 5  # far below the sibling's 60 s and the 10 s grace period
    err = capfd.readouterr().err.splitlines()
    assert err[-1] == "error: process 1 exited with status 3: boom: disk full"
    assert [line for line in err if line.startswith("error:")] == [err[-1]]
    assert err[:2] == ["[1] step 1", "[1] boom: disk full"]
    assert not alive(int(pid0.read_text()))


def test_a_sibling_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path, capfd):
    pid0 = tmp_path / "pid0"
    child = script(tmp_path, WRITE_PID, f"""
        import signal
        if RANK == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            write_pid({str(pid0)!r})
            time.sleep(60)
        while not os.path.exists({str(pid0)!r}):
            time.sleep(0.01)
        sys.exit(5)
    """)
    start = time.monotonic()
    assert launch([str(child)], nproc=2, grace_seconds=0.5) == 5
    assert 0.5 <= time.monotonic() - start < 5
    assert capfd.readouterr().err.splitlines() == ["error: process 1 exited with status 5"]
    assert not alive(int(pid0.read_text()))


def test_a_child_killed_by_a_signal_is_reported_as_killed(tmp_path, capfd):
    child = script(tmp_path, """
        import signal
        if RANK == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    """)
    start = time.monotonic()
    assert launch([str(child)], nproc=2) == 128 + signal.SIGKILL
    assert time.monotonic() - start < 5
    assert capfd.readouterr().err.splitlines() == ["error: process 1 was killed by SIGKILL"]


def test_a_failing_cli_child_is_not_reported_as_error_error(tmp_path, capfd):
    child = script(tmp_path, "print('error: config.yaml does not exist', file=sys.stderr)\nsys.exit(2)\n")
    assert launch([str(child)], nproc=1) == 2
    assert capfd.readouterr().err.splitlines() == [
        "error: config.yaml does not exist", "error: process 0 exited with status 2: config.yaml does not exist"]


# Signals to the launcher.

@pytest.mark.parametrize("signum,ignore_term", [(signal.SIGTERM, False), (signal.SIGINT, False),
                                                (signal.SIGTERM, True)],
                         ids=["sigterm", "sigint", "sigterm-ignored-by-children"])
def test_a_signal_to_the_launcher_stops_every_child_and_what_they_started(tmp_path, signum, ignore_term):
    # Each child also starts a process of its own: the stop signals reach it too.
    child = script(tmp_path, WRITE_PID, f"""
        import signal, subprocess
        signal.signal(signal.SIGINT, lambda *_: sys.exit(130))  # a stop on SIGINT, as jaxascend.train's
        if {ignore_term}:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        # the grandchild writes its pid once its handler is installed: a signal before would kill it
        # by Python's default SIGINT handling, not stop it (under load its start-up takes a while)
        ready = os.path.join({str(tmp_path)!r}, f"sub{{RANK}}")
        sub = subprocess.Popen([sys.executable, "-c", "import os, signal, sys, time; "
                                "signal.signal(signal.SIGINT, lambda *_: sys.exit(130)); "
                                f"open({{ready + '.tmp'!r}}, 'w').write(str(os.getpid()) + chr(10)); "
                                f"os.replace({{ready + '.tmp'!r}}, {{ready!r}}); time.sleep(60)"])
        write_pid(os.path.join({str(tmp_path)!r}, f"pid{{RANK}}"))
        time.sleep(60)
    """)
    grace = 1.0
    proc = subprocess.Popen(launcher("--nproc", "2", "--grace-seconds", str(grace), "--", str(child)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        pids = wait_for([tmp_path / f"{kind}{i}" for kind in ("pid", "sub") for i in (0, 1)])
        start = time.monotonic()
        proc.send_signal(signum)  # forwarded; a child that ignores it runs on: no deadline yet
        if ignore_term:
            with pytest.raises(subprocess.TimeoutExpired):
                proc.communicate(timeout=grace + 1)
            start = time.monotonic()
            proc.send_signal(signum)  # the second is forwarded too, and the kill follows the grace period
        _, err = proc.communicate(timeout=grace + 10)
    finally:
        proc.kill()
    elapsed = time.monotonic() - start
    assert elapsed < grace + 3
    name = signal.Signals(signum).name
    if ignore_term:
        assert elapsed >= grace
        assert err.splitlines() == [f"error: stopped by {name}; process 0 was killed by SIGKILL"]
    else:
        assert err.splitlines() == [f"job stopped by {name}: its 2 process(es) stopped on it; the same command resumes "
                                    "from the step process 0 named (its checkpoint, or with offload.durable the offload "
                                    "files)"]
    assert proc.returncode == 128 + signum
    assert not [pid for pid in pids if alive(pid)]


# Bad usage: one line, exit status 2.

def _main(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as stop:  # argparse's errors
        return stop.code


@pytest.mark.parametrize("argv,message", [
    (["--nproc", "0", "--", "x.py"], "argument --nproc: must be an integer from 1 to 64, got 0"),
    (["--nproc", "65", "--", "x.py"], "argument --nproc: must be an integer from 1 to 64, got 65"),
    (["--nproc", "two", "--", "x.py"], "argument --nproc: not a number: 'two'"),
    (["--", "x.py"], "the following arguments are required: --nproc"),
    (["--nproc", "2"], "no command: give it after '--', e.g. -- python -m jaxascend.train --config x.yaml"),
    (["--nproc", "2", "--"], "no command: give it after '--', e.g. -- python -m jaxascend.train --config x.yaml"),
    (["--nproc", "2", "x.py"], "unrecognized arguments: x.py"),
    (["--nproc", "2", "--port", "70000", "--", "x.py"],
     "argument --port: must be a TCP port from 1 to 65535, got 70000"),
    (["--nproc", "2", "--grace-seconds", "-1", "--", "x.py"],
     "argument --grace-seconds: must be a number of seconds >= 0, got -1.0"),
    (["--nproc", "2", "--", "/nonexistent/prog"], "cannot start /nonexistent/prog: No such file or directory"),
])
def test_bad_usage_is_one_error_line(argv, message, capsys):
    assert _main(argv) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", f"error: {message}\n")


def test_cli_bad_usage_is_one_error_line():
    proc = run_cli("--nproc", "0", "--", "x.py")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["error: argument --nproc: must be an integer from 1 to 64, got 0"]


@pytest.mark.parametrize("kwargs,message", [
    (dict(nproc=True), "nproc must be an integer from 1 to 64, got True"),
    (dict(nproc=2, port=0), "port must be a TCP port from 1 to 65535, got 0"),
    (dict(nproc=2, grace_seconds=float("nan")), "grace_seconds must be a number of seconds >= 0, got nan"),
])
def test_launch_names_the_bad_argument(kwargs, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        launch(["x.py"], **kwargs)


# What jax.distributed makes of the environment.

def test_two_processes_psum_over_jax_distributed(tmp_path):
    child = tmp_path / "psum.py"
    child.write_text(textwrap.dedent("""
        import os
        os.environ["JAX_PLATFORMS"] = "cpu"
        import jax
        import numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

        jax.config.update("jax_num_cpu_devices", 1)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        # jax 0.10 reads JAX_COORDINATOR_ADDRESS itself, not the process count or id.
        jax.distributed.initialize(num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
                                   process_id=int(os.environ["JAX_PROCESS_ID"]))
        mesh = Mesh(np.array(jax.devices()), ("p",))
        sharding = NamedSharding(mesh, P("p"))
        x = jax.make_array_from_process_local_data(sharding, np.full((1,), jax.process_index() + 1, np.int32))
        total = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "p"), mesh=mesh, in_specs=P("p"),
                                      out_specs=P("p")))(x)
        print("psum", jax.process_count(), int(np.asarray(total.addressable_data(0))[0]))
        jax.distributed.shutdown()
    """))
    proc = run_cli("--nproc", "2", "--grace-seconds", "2", "--", str(child), timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(line for line in proc.stdout.splitlines() if "psum" in line) == ["[1] psum 2 3", "psum 2 3"]
    assert "[Gloo]" not in proc.stdout + proc.stderr  # gloo's connection lines are left out
