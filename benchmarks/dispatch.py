"""Per-call dispatch cost after warm-up: jaxbackend.jit vs jax.jit.

`jb.jit` returns JAX's own jit function object (the pipeline runs inside its
traced body), so a warm call should cost exactly a `jax.jit` call: JAX's C++
fast path, no Python cache key. We measure the same function under both, in
the same process, interleaved (A, B, A, B, ...) so machine noise hits both:
2, 8 and 16 small array arguments, and a pytree of Flax NNX state (a
2-layer MLP's `nnx.split` state plus an input). Each sample is the mean of
`number` back-to-back calls (results not awaited, as a training loop
dispatches), and we report the median sample. Target (issue 3): ratio <= 1.05.

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
    t0 = time.perf_counter()
    for _ in range(number):
        f(*args)
    dt = time.perf_counter() - t0
    jax.block_until_ready(f(*args))
    return dt / number


def measure(fn, args, samples, number):
    fa, fb = jax.jit(fn), jb.jit(fn)
    ref, got = fa(*args), fb(*args)
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
        assert jnp.allclose(a, b), "jb.jit and jax.jit disagree"
    for _ in range(3):  # warm both fast paths
        _sample(fa, args, number)
        _sample(fb, args, number)
    ta, tb = [], []
    for _ in range(samples):
        ta.append(_sample(fa, args, number))
        tb.append(_sample(fb, args, number))
    assert fb.trace_count == 1, "jb.jit retraced during the benchmark"
    return statistics.median(ta) * 1e6, statistics.median(tb) * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="few samples; does not write BENCHMARKS.md")
    args = ap.parse_args(argv)
    samples, number = (5, 200) if args.quick else (41, 2000)
    rows, worst = [], 0.0
    for fn, fargs, label in cases():
        ua, ub = measure(fn, fargs, samples, number)
        worst = max(worst, ub / ua)
        rows.append([label, f"{ua:.2f}", f"{ub:.2f}", f"{ub / ua:.3f}"])
    body = (f"Median of {samples} samples, each the mean of {number} calls, interleaved.\n\n"
            + _report.table(["arguments", "jax.jit us/call", "jb.jit us/call", "ratio"], rows)
            + f"\n\n- worst ratio {worst:.3f}: {'MET' if worst <= 1.05 else 'MISSED'} (target <= 1.05)")
    print(body)
    if not args.quick:
        _report.write_section("dispatch", "Dispatch overhead: jb.jit vs jax.jit", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
