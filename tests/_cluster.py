"""A 2-process JAX cluster on this machine, for the multi-process tests:
each process runs `worker` with its process index and a free loopback port
for the coordinator (the worker calls `jax.distributed.initialize`)."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def worker_env() -> dict:
    """This environment, with this checkout importable and no XLA_FLAGS: a
    worker sets its own device count before it imports JAX."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two(worker, args_for, timeout: float = 240) -> list:
    """Run `python worker *args_for(i, port)` as processes 0 and 1 side by
    side; their logs (stdout and stderr) once both have exited 0. A process
    still running when the other fails or times out is killed."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(worker), *args_for(i, port)], env=worker_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n----\n".join(logs)[-4000:]
    return logs
