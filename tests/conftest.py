"""Test setup: 8 simulated CPU devices (before JAX creates its CPU client),
with the flags `jaxbackend.simulate_cpu_devices` sets."""

import jaxbackend as jb

jb.simulate_cpu_devices(8)

import jax  # noqa: E402

jax.config.update("jax_platforms", "cpu")


def pytest_addoption(parser):
    parser.addoption("--long", action="store_true", default=False,
                     help="run many more seeds of the differential fuzzer (tests/test_fuzz.py)")
