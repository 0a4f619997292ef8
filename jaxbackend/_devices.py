"""Simulated CPU devices: the XLA flags a multi-device run on one host needs.

XLA:CPU makes N devices of the host under
`--xla_force_host_platform_device_count=N`, read once, when JAX creates its
CPU client (on first use, not at `import jax`). On such a mesh, XLA:CPU's
concurrency-optimised HLO scheduler (its default, JAX 0.10.2) can deadlock a
program whose loops hold collectives while other collectives outside them do
not depend on the loops: the rolled per-layer GPT step with Adafactor under
tensor-parallel rules (its factored moments and parameter scale are
reductions of sharded values) left the devices waiting on one another in
different all-reduces until XLA's rendezvous aborted the process (6 and 8
layers, searched or Megatron rules: 13 of 13 runs; with that scheduler off,
0 of 7; the 8-layer GPT AdamW step compiled and ran as fast either way,
within 2%: 2.7 s, 3.0 s/step). A 5-layer width-32 version ran either way:
the deadlock is a race, likelier the longer the loops run.
`cpu_device_flags` switches that scheduler off (the train CLI's `--devices`,
the benchmarks' child processes, example and notebook 04 use it): the
programs are the same, only the order XLA gives independent operations
changes, and with it XLA's buffer reuse: on three memory-model tests
(calibrated under the default scheduler, within 10-25% there) the predicted
per-device memory became 1.29x and 1.44x of `memory_analysis`'s (two
tensor-parallel plans) and 0.89x (a donation test), so the test suite's
process keeps the default scheduler (it sets only the device count).
`tests/sharding/test_collective_order.py` is the check, in a process of its
own.
"""

from __future__ import annotations

import os

COUNT = "--xla_force_host_platform_device_count"
SCHEDULER_OFF = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def cpu_device_flags(n: int, flags: str = "") -> str:
    """`flags` (an XLA_FLAGS value) with n simulated CPU devices (replacing
    any device count given there) and the concurrency-optimised scheduler
    off (unless `flags` sets that scheduler itself)."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"cpu_device_flags: n={n!r} is not a device count; pass an int >= 1.")
    kept = [f for f in flags.split() if not f.startswith(COUNT)]
    if not any(f.startswith(SCHEDULER_OFF.split("=")[0]) for f in kept):
        kept.append(SCHEDULER_OFF)
    return " ".join(kept + [f"{COUNT}={n}"])


def simulate_cpu_devices(n: int) -> None:
    """Make JAX's CPU client n devices (`cpu_device_flags` into XLA_FLAGS).

    Call it before anything asks JAX for devices (importing jax is fine);
    once the client exists the flags are read, and this raises instead of
    silently leaving the device count as it is."""
    import jax

    from jaxbackend import _jax

    current = os.environ.get("XLA_FLAGS", "")
    flags = cpu_device_flags(n, current)
    if _jax.backends_created() and flags.split() != current.split():
        raise RuntimeError(
            f"simulate_cpu_devices({n}): JAX has already created its devices "
            f"({len(jax.devices())} now); call it before the first JAX computation or "
            f"jax.devices(), e.g. at the top of the script or notebook.")
    os.environ["XLA_FLAGS"] = flags
