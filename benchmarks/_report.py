"""Shared benchmark helpers: timing medians and BENCHMARKS.md sections.

Each benchmark owns one section of BENCHMARKS.md, delimited by
`<!-- BEGIN name -->` / `<!-- END name -->`, and rewrites only that section,
stamped with the exact command and the machine it ran on.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import pathlib
import platform
import re
import statistics
import subprocess
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


def step_seconds(step, state: tuple, batch: tuple, steps: int) -> float:
    """Median seconds per training step of `step(*state, *batch)`, whose
    results begin with the new state, fed back: `steps` timed steps after
    one warm-up step."""
    import jax

    n = len(state)
    state = step(*state, *batch)[:n]
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        state = jax.block_until_ready(step(*state, *batch))[:n]
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def compiled_cost(fn, args, *, repeat: int) -> dict:
    """`fn` (a jit object) compiled for `args`: XLA `cost_analysis()` flops
    and bytes accessed, `fusion(` instructions in the compiled HLO, and the
    median wall time of the compiled call in microseconds (3 calls, median
    of `repeat` runs, after one warm-up call)."""
    import jax

    compiled = fn.lower(*args).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    run = lambda: jax.block_until_ready(compiled(*args))  # noqa: E731
    run()
    t = median_time(run, repeat=repeat, number=3)
    return dict(flops=float(cost.get("flops", 0.0)), bytes=float(cost.get("bytes accessed", 0.0)),
                fusions=len(re.findall(r"\bfusion\(", compiled.as_text())), us=t * 1e6)


def sized_main(argv, *, doc: str, sizes, quick_sizes, run, render, section: str, title: str) -> int:
    """The command line of a benchmark over one size tuple: `--quick` runs
    `quick_sizes` (3 timing runs) and writes nothing; otherwise `sizes`
    (7 runs), and the table goes to section `{section}_{platform}` of
    BENCHMARKS.md under `{title} ({platform}: {device kind})`."""
    import argparse

    import jax

    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes; does not write BENCHMARKS.md")
    args = ap.parse_args(argv)
    chosen = quick_sizes if args.quick else sizes
    body = render(run(chosen, repeat=3 if args.quick else 7), chosen)
    print(body)
    if not args.quick:
        dev = jax.devices()[0]
        write_section(f"{section}_{dev.platform}", f"{title} ({dev.platform}: {dev.device_kind})", body)
    return 0


def compile_dp_or_planned(step, params, tx, batch: tuple, hand: bool, **jb_jit_kw):
    """`step(params, opt_state, *batch)` (an optax `tx` step) compiled on a
    (2, 4) mesh of 8 devices: by `jax.jit` on inputs placed for data
    parallelism (`hand`: the batch on both mesh axes, weights replicated;
    placed before the clock, placement is not compile time), else by
    `jb.jit(step, mesh=, **jb_jit_kw)`. Returns (compiled, the jitted
    function, (params, opt_state) and the batch as compiled, a dict of
    `seconds` from trace to executable and the per-device collective `mib`)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    import jaxbackend as jb
    from jaxbackend import sharding

    mesh = sharding.auto_mesh((2, 4), ("data", "model"))
    if hand:
        params = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
        batch = jax.device_put(batch, NamedSharding(mesh, PartitionSpec(("data", "model"))))
        opt_state = jax.jit(tx.init)(params)
        f = jax.jit(step)
    else:
        opt_state = tx.init(params)
        f = jb.jit(step, mesh=mesh, **jb_jit_kw)
    t0 = time.perf_counter()
    compiled = f.lower(params, opt_state, *batch).compile()
    out = {"seconds": time.perf_counter() - t0}
    col = sharding.hlo_collectives(compiled.as_text())
    out["mib"] = sum(v["bytes"] for v in col.values()) / 2**20
    return compiled, f, (params, opt_state), batch, out


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


def depth_cli(doc: str, run_point, quick_help: str) -> argparse.Namespace:
    """The command line of a benchmark that runs each point in a fresh
    process: `--quick`, `--repeat N` (default 3) and the hidden `--child
    VARIANT LAYERS`, which runs `run_point(variant, layers)`, prints it as
    one `RESULT {json}` line and exits (`spawn_point` reads it)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print("RESULT " + json.dumps(run_point(a.child[0], int(a.child[1]))))
        sys.exit(0)
    return a


def _run_child(cmd: list, what: str, **run) -> tuple[dict, str]:
    """`python *cmd` (`subprocess.run` keywords in `run`): the dict of its
    one `RESULT {json}` line, and its stderr."""
    p = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, **run)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode or not line:
        raise RuntimeError(f"{what} failed:\n{p.stderr[-3000:]}")
    return json.loads(line[-1][len("RESULT "):]), p.stderr


def spawn_on_8_devices(script: str, args: list, what: str, count: str) -> dict:
    """`python script *args` in a fresh process on 8 simulated CPU devices,
    run from the repository root: its RESULT dict, plus `warnings`, how
    many times `count` occurs on its stderr (XLA's partitioner warnings)."""
    from jaxbackend._devices import cpu_device_flags

    env = dict(os.environ, XLA_FLAGS=cpu_device_flags(8), JAX_PLATFORMS="cpu")
    res, err = _run_child([script, *args], what, env=env, cwd=ROOT)
    res["warnings"] = err.count(count)
    return res


def spawn_point(script: str, variant: str, layers: int, env=None) -> dict:
    """`script --child variant layers` in a fresh process (no JAX cache
    shared): its RESULT dict."""
    return _run_child([script, "--child", variant, str(layers)], f"{variant} at {layers} layers",
                      env=env or dict(os.environ), timeout=1200)[0]
