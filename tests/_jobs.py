"""Multi-process jobs on 127.0.0.1 for the tests: N processes with the JAX_* variables that
``jaxascend.distributed.initialize`` reads (shared by the data-parallel tests)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

TIMEOUT = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_job(code: str, processes: int, args=(), timeout: float = TIMEOUT) -> list[tuple[int, str, str]]:
    """Runs ``python -c code *args`` as ``processes`` processes of one job (a single process gets
    no JAX_* variables: no job at all); returns ``(status, stdout, stderr)`` of each, in order."""
    port, procs = free_port(), []
    for i in range(processes):
        env = dict(os.environ)
        if processes > 1:
            env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(processes),
                       JAX_PROCESS_ID=str(i))
        procs.append(subprocess.Popen([sys.executable, "-c", code, *map(str, args)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        return [(p.wait(timeout), *p.communicate()) for p in procs]
    finally:
        for p in procs:
            p.kill()
