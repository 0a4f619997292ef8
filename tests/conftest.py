"""Test setup: 8 simulated CPU devices and LLVM at -O0 (both must precede
the first jax import; subprocesses the tests start inherit them).

-O0 (`--xla_backend_optimization_level=0`; XLA's default is 3) because the
suite's programs run for microseconds, so LLVM's optimisation of each kernel
is most of each compile and none of what the tests check: the level steers
only LLVM's code generation, after XLA's HLO passes, so fusion, SPMD
partitioning, collectives and buffer assignment are the same at both levels
(`test_suite_setup.py::test_the_suites_llvm_level_changes_no_hlo` checks
that). Values may differ by rounding, which the error model of
`jaxbackend.testing` covers; a test that fails at one level and passes at
the other compares tighter than float32 rounding, as it would on another
CPU. Measured on 2 cores, same machine and hour: the suite took 7:18 at -O0
against 12:06 at 3 (a fresh venv later: 7:29). A level given in XLA_FLAGS
is kept: `XLA_FLAGS=--xla_backend_optimization_level=3` tests with the code
users' programs get.
"""

import os

_flags = os.environ.get("XLA_FLAGS", "").split()
for _flag, _key in (("--xla_force_host_platform_device_count=8", None),
                    ("--xla_backend_optimization_level=0", "--xla_backend_optimization_level")):
    if not any(f == _flag or (_key and f.startswith(_key + "=")) for f in _flags):
        _flags.append(_flag)
os.environ["XLA_FLAGS"] = " ".join(_flags)

import jax  # noqa: E402

jax.config.update("jax_platforms", "cpu")


def pytest_addoption(parser):
    parser.addoption("--long", action="store_true", default=False,
                     help="run many more seeds of the differential fuzzer (tests/test_fuzz.py)")
