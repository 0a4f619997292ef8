"""Per-call dispatch cost after warm-up: jaxbackend.jit vs jax.jit.

`jb.jit` returns JAX's own jit function object (the pipeline runs inside its
traced body), so a warm call should cost exactly a `jax.jit` call: JAX's C++
fast path, no Python cache key. We measure the same function under both, in
the same process, interleaved (A, B, A, B, ...) so machine noise hits both:
2, 8 and 16 small array arguments, and a pytree of Flax NNX state (a
2-layer MLP's `nnx.split` state plus an input). Each sample is the mean of
`number` back-to-back calls (results not awaited, as a training loop
dispatches), and we report the median sample, in thread CPU time and wall
time. Target: ratio <= 1.05.

Run: python benchmarks/dispatch.py [--quick]   (--quick: fewer samples, no BENCHMARKS.md)
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxbackend as jb  # noqa: E402
from jaxbackend import testing  # noqa: E402
from benchmarks import _report  # noqa: E402


def _sum_args(*xs):
    out = xs[0]
    for x in xs[1:]:
        out = out + x
    return out


def _nnx_case():
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(16, 32, rngs=rngs)
            self.l2 = nnx.Linear(32, 16, rngs=rngs)

        def __call__(self, x):
            return self.l2(jax.nn.relu(self.l1(x)))

    graphdef, state = nnx.split(MLP(nnx.Rngs(0)))

    def apply(state, x):
        return nnx.merge(graphdef, state)(x)

    n_leaves = len(jax.tree.leaves(state))
    return apply, (state, jnp.ones((4, 16))), f"Flax NNX state ({n_leaves} leaves) + x"


def cases():
    out = []
    for n in (2, 8, 16):
        args = tuple(jnp.full((8,), float(i)) for i in range(n))
        out.append((_sum_args, args, f"{n} array args"))
    out.append(_nnx_case())
    return out


def _sample(f, args, number):
    t0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(number):
        f(*args)
    dt, dc = time.perf_counter() - t0, time.thread_time() - c0
    jax.block_until_ready(f(*args))
    return dt / number, dc / number


def measure(fn, args, samples, number):
    fa, fb = jax.jit(fn), jb.jit(fn)
    ref, got = fa(*args), fb(*args)
    testing.assert_close(got, ref, what="jb.jit vs jax.jit",
                         scale=lambda: testing.abs_scale(fn, *args))
    for _ in range(3):  # warm both fast paths
        _sample(fa, args, number)
        _sample(fb, args, number)
    ta, tb = [], []
    for _ in range(samples):
        ta.append(_sample(fa, args, number))
        tb.append(_sample(fb, args, number))
    assert fb.trace_count == 1, "jb.jit retraced during the benchmark"
    med = lambda xs, k: statistics.median(x[k] for x in xs) * 1e6  # noqa: E731
    return med(ta, 0), med(tb, 0), med(ta, 1), med(tb, 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="few samples; does not write BENCHMARKS.md")
    args = ap.parse_args(argv)
    samples, number = (5, 200) if args.quick else (41, 2000)
    rows, worst, worst_wall = [], 0.0, 0.0
    for fn, fargs, label in cases():
        ua, ub, ca, cb = measure(fn, fargs, samples, number)
        worst, worst_wall = max(worst, cb / ca), max(worst_wall, ub / ua)
        rows.append([label, f"{ca:.2f}", f"{cb:.2f}", f"{cb / ca:.3f}",
                     f"{ua:.2f}", f"{ub:.2f}", f"{ub / ua:.3f}"])
    body = (f"Median of {samples} samples, each the mean of {number} calls, jax.jit and jb.jit "
            "interleaved. CPU = the calling thread's CPU time (`time.thread_time`), the dispatch "
            "work itself; wall = `perf_counter`, which on this shared machine also counts "
            "waiting for a core. The target is judged on CPU time; wall is shown for reference.\n\n"
            + _report.table(["arguments", "jax.jit CPU us", "jb.jit CPU us", "CPU ratio",
                             "jax.jit wall us", "jb.jit wall us", "wall ratio"], rows)
            + f"\n\n- worst CPU ratio {worst:.3f}: {'MET' if worst <= 1.05 else 'MISSED'} "
              f"(target <= 1.05); worst wall ratio {worst_wall:.3f}")
    print(body)
    if not args.quick:
        _report.write_section("dispatch", "Dispatch overhead: jb.jit vs jax.jit", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
