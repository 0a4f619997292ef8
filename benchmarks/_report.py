"""Shared benchmark helpers: timing medians and BENCHMARKS.md sections.

Each benchmark owns one section of BENCHMARKS.md, delimited by
`<!-- BEGIN name -->` / `<!-- END name -->`, and rewrites only that section,
stamped with the exact command and the machine it ran on.
"""

from __future__ import annotations

import fcntl
import os
import pathlib
import platform
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCHMARKS_MD = ROOT / "BENCHMARKS.md"


def machine() -> str:
    import jax

    devs = jax.devices()
    kinds = sorted({d.device_kind for d in devs})
    return (f"{platform.machine()} {platform.system()}, {os.cpu_count()} cores, "
            f"Python {platform.python_version()}, JAX {jax.__version__}, "
            f"devices: {len(devs)} x {'/'.join(kinds)} ({devs[0].platform})")


def median_time(fn, *, repeat: int = 5, number: int = 1) -> float:
    """Median seconds of `number` calls to fn, over `repeat` runs."""
    runs = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        runs.append((time.perf_counter() - t0) / number)
    return statistics.median(runs)


def table(headers, rows) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for r in rows:
        out.append("| " + " | ".join(str(c) for c in r) + " |")
    return "\n".join(out)


def write_section(name: str, title: str, body: str, command: str | None = None) -> None:
    """Replace (or append) section `name` of BENCHMARKS.md."""
    command = command or "python " + " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])
    block = (f"<!-- BEGIN {name} -->\n## {title}\n\n"
             f"Command: `{command}`  \nMachine: {machine()}  \n"
             f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n\n{body.strip()}\n"
             f"<!-- END {name} -->")
    with open(str(BENCHMARKS_MD) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # benchmarks may run side by side
        _replace(name, block)
    print(f"wrote section {name!r} of {BENCHMARKS_MD}")


def _replace(name: str, block: str) -> None:
    text = BENCHMARKS_MD.read_text() if BENCHMARKS_MD.exists() else (
        "# Benchmarks\n\nEvery table below was produced by the command written above it; "
        "each compares against its reference in the same run.\n")
    begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
    if begin in text and end in text:
        pre, rest = text.split(begin, 1)
        _, post = rest.split(end, 1)
        text = pre + block + post
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    BENCHMARKS_MD.write_text(text)
