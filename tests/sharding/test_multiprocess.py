"""The same plan on a 2-process JAX cluster (loopback, gloo collectives, 4
CPU devices per process) gives the single-process training step."""

import os
import pathlib
import socket
import subprocess
import sys

import jax
import numpy as np

from jaxbackend import testing

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKER = pathlib.Path(__file__).with_name("_mp_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_single_process(block, tmp_path):
    port, out = _free_port(), tmp_path / "result.npz"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(i), str(port), str(out)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n----\n".join(logs)[-4000:]
    got = np.load(out)
    leaves = [got[f"arr_{i}"] for i in range(len(got.files) - 1)]
    ref = jax.tree.leaves(block["reference"])
    assert len(leaves) == len(ref)
    testing.assert_close(leaves, ref, what="two-process step",
                         scale=lambda: testing.abs_scale(block["step"], *block["args"]))
    print("\nrules used by both processes:", got["rules"])
