"""A rolled per-layer step whose optimizer reduces sharded values outside
the layer loops (Adafactor's factored moments and parameter scale) runs on
8 simulated CPU devices: XLA:CPU's concurrency-optimised HLO scheduler let
devices reach those all-reduces and the loops' own in different orders, and
every device then waited on the others until the process aborted
(`jaxbackend.simulate_cpu_devices` switches that scheduler off; the step
runs in a process set up by it, `_collective_worker.py`: the suite's own
process keeps XLA's default scheduler, which the memory model's checks
against XLA's buffer assignment were measured under).

Reference: `jax.jit` of the same step on one device.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import jax
import pytest

import jaxbackend as jb
from tests._cluster import worker_env

WORKER = pathlib.Path(__file__).with_name("_collective_worker.py")


def test_rolled_adafactor_step_under_tensor_parallel_rules_runs_and_equals_jax_jit():
    # its own process: the scheduler flag is read when JAX creates its devices
    done = subprocess.run([sys.executable, str(WORKER)], env=worker_env(), capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.split()[-1:] == ["equal"], done.stderr[-3000:]


def test_cpu_device_flags_set_the_count_and_switch_the_scheduler_off():
    from jaxbackend._devices import SCHEDULER_OFF, cpu_device_flags

    got = cpu_device_flags(4, "--xla_dump_to=/tmp/d --xla_force_host_platform_device_count=2")
    assert got.split() == ["--xla_dump_to=/tmp/d", SCHEDULER_OFF,
                           "--xla_force_host_platform_device_count=4"]
    mine = "--xla_cpu_enable_concurrency_optimized_scheduler=true"   # the user's own choice stays
    assert cpu_device_flags(2, mine).split() == [mine, "--xla_force_host_platform_device_count=2"]
    with pytest.raises(ValueError, match="n=0 is not a device count"):
        cpu_device_flags(0)


def test_simulate_cpu_devices_refuses_once_the_devices_exist(monkeypatch):
    from jaxbackend._devices import cpu_device_flags

    have = cpu_device_flags(jax.device_count())
    monkeypatch.setenv("XLA_FLAGS", have)
    jb.simulate_cpu_devices(jax.device_count())   # the flags this process has: nothing to do
    assert os.environ["XLA_FLAGS"] == have
    with pytest.raises(RuntimeError, match=r"simulate_cpu_devices\(3\): JAX has already created"):
        jb.simulate_cpu_devices(3)
    assert os.environ["XLA_FLAGS"] == have
