"""A rolled per-layer step whose optimizer reduces sharded values outside
the layer loops (Adafactor's factored moments and parameter scale) runs on
8 simulated CPU devices: XLA:CPU's concurrency-optimised HLO scheduler let
devices reach those all-reduces and the loops' own in different orders, and
every device then waited on the others until the process aborted
(`jaxbackend.simulate_cpu_devices` switches that scheduler off; the test
suite's conftest uses it).

Reference: `jax.jit` of the same step on one device.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import jaxbackend as jb
from jaxbackend import nn, testing
from jaxbackend.models import GPT, GPTConfig

MEGATRON = {"batch": "data", "head": "model", "mlp": "model"}


def test_rolled_adafactor_step_under_tensor_parallel_rules_runs_and_equals_jax_jit(mesh24):
    cfg = GPTConfig(seq_len=64, n_layers=6, embd=64, heads=4, vocab_size=128)
    params, loss = nn.functional(GPT(cfg, rngs=nnx.Rngs(0)), "loss")
    tx = optax.adafactor(1e-3)

    def step(params, opt_state, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value, grads

    x = jax.random.randint(jax.random.key(1), (16, 64), 0, 128, jnp.int32)
    args = (params, tx.init(params), x, jnp.roll(x, -1, axis=1))
    f = jb.jit(step, mesh=mesh24, rules=MEGATRON)
    got = f(*args)
    rolled = next(s for s in f.last_report.stats if s.name == "reroll")
    assert rolled.eqns_after < rolled.eqns_before   # the layers run as loops
    want = jax.jit(step)(*args)
    # the loss and gradients (Adafactor's normalised update amplifies a
    # gradient that is zero up to rounding; the gradients are compared)
    testing.assert_close(got[2:], want[2:], what="adafactor step: loss and grads",
                         scale=lambda: testing.abs_scale(jax.value_and_grad(loss), params, *args[2:]))


def test_cpu_device_flags_set_the_count_and_switch_the_scheduler_off():
    from jaxbackend._devices import SCHEDULER_OFF, cpu_device_flags

    got = cpu_device_flags(4, "--xla_dump_to=/tmp/d --xla_force_host_platform_device_count=2")
    assert got.split() == ["--xla_dump_to=/tmp/d", SCHEDULER_OFF,
                           "--xla_force_host_platform_device_count=4"]
    mine = "--xla_cpu_enable_concurrency_optimized_scheduler=true"   # the user's own choice stays
    assert cpu_device_flags(2, mine).split() == [mine, "--xla_force_host_platform_device_count=2"]
    with pytest.raises(ValueError, match="n=0 is not a device count"):
        cpu_device_flags(0)


def test_simulate_cpu_devices_refuses_once_the_devices_exist():
    before = os.environ["XLA_FLAGS"]
    jb.simulate_cpu_devices(jax.device_count())   # what this process has: nothing to change
    assert os.environ["XLA_FLAGS"].split() == before.split()
    with pytest.raises(RuntimeError, match=r"simulate_cpu_devices\(3\): JAX has already created"):
        jb.simulate_cpu_devices(3)
    assert os.environ["XLA_FLAGS"] == before
