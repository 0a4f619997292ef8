"""The suite's own XLA setup (`tests/conftest.py`) is what its docstring says.

The suite compiles with LLVM at -O0 to spend less of its time in code
generation. That is sound only while the level changes nothing the tests
check: XLA's HLO passes (fusion, SPMD partitioning, collectives, buffer
assignment) must not read it. This checks that on a rolled, sharded program
under `jb.jit(mesh=)`, compiled at -O0 and at XLA's default (3), so a JAX
upgrade that starts reading the level fails here, not as drift elsewhere.
"""

import os

import jax
import jax.numpy as jnp

import jaxbackend as jb
from jaxbackend import sharding
from jaxbackend.testing import abs_scale, assert_close

LEVEL = "--xla_backend_optimization_level"


def test_the_suite_runs_on_8_devices_at_one_llvm_level():
    flags = os.environ["XLA_FLAGS"].split()
    assert "--xla_force_host_platform_device_count=8" in flags and len(jax.devices()) == 8
    assert sum(f.startswith(LEVEL + "=") for f in flags) == 1, flags


def test_the_suites_llvm_level_changes_no_hlo():
    def loss(ws, x):
        for w in ws:               # 6 alike layers: rolled into a scan
            x = jnp.tanh(x @ w) + x
        return (x ** 2).sum()

    step = jax.value_and_grad(loss)
    ws = [jnp.eye(64) * 0.1 + 0.01 * k for k in range(6)]
    x = jnp.linspace(-1, 1, 1024 * 64).reshape(1024, 64)
    lowered = jb.jit(step, mesh=sharding.auto_mesh((2, 4), ("data", "model"))).lower(ws, x)
    at0 = lowered.compile(compiler_options={"xla_backend_optimization_level": 0})
    at3 = lowered.compile(compiler_options={"xla_backend_optimization_level": 3})
    hlo = at0.as_text()   # the optimized HLO: with the fusion pass off, it differs
    assert "while" in hlo and "all-reduce" in hlo   # rolled and sharded, as the suite's programs
    assert hlo == at3.as_text()
    m0, m3 = at0.memory_analysis(), at3.memory_analysis()
    for field in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes"):
        assert getattr(m0, field) == getattr(m3, field), field
    # the same values, up to the rounding the error model allows
    scale = abs_scale(step, ws, x)
    assert_close(at0(ws, x), at3(ws, x), scale=scale, what="value_and_grad at -O0 vs -O3")
