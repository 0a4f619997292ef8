"""Test setup: 8 simulated CPU devices (must precede the first jax import)."""

import os

_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

import jax  # noqa: E402

jax.config.update("jax_platforms", "cpu")


def pytest_addoption(parser):
    parser.addoption("--long", action="store_true", default=False,
                     help="run many more seeds of the differential fuzzer (tests/test_fuzz.py)")
