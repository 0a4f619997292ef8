"""The same plan on a 2-process JAX cluster (loopback, gloo collectives, 4
CPU devices per process) gives the single-process training step."""

import pathlib

import jax
import numpy as np

from jaxbackend import testing
from tests._cluster import run_two

WORKER = pathlib.Path(__file__).with_name("_mp_worker.py")


def test_two_processes_match_single_process(block, tmp_path):
    out = tmp_path / "result.npz"
    run_two(WORKER, lambda i, port: [str(i), str(port), str(out)])
    got = np.load(out)
    leaves = [got[f"arr_{i}"] for i in range(len(got.files) - 1)]
    ref = jax.tree.leaves(block["reference"])
    assert len(leaves) == len(ref)
    testing.assert_close(leaves, ref, what="two-process step",
                         scale=lambda: testing.abs_scale(block["step"], *block["args"]))
    print("\nrules used by both processes:", got["rules"])
