"""Differential fuzzer: `jb.jit` (the pass pipeline, then XLA) against
`jax.jit` on seeded random programs (`tests/_fuzz_programs.py`).

Each case runs one program through every transform that applies to it:

    forward     f(*args)
    vjp         the VJP of f's float outputs (cotangents drawn from the seed)
    jvp         primal and tangent outputs
    vmap        over a stacked copy of the first input and of some others
                (the rest unbatched: in_axes None)
    jacfwd      forward-mode Jacobian of the first float output w.r.t. the
                first float input (vmap of jvp: batched tangents,
                unbatched primals)
    *_of_jb     the same transform applied outside `jb.jit(f)`

`jb.jit(transform(f))` (the passes see the AD / batched jaxpr) and
`transform(jb.jit(f))` are compared with `jax.jit(transform(f))`: the same
output structure, shapes, dtypes and weak types exactly; integer outputs and
the nan/inf pattern exactly; float values by `jaxbackend.testing`'s error
model (at max|expected|, and where that fails at the reference program's own
`abs_scale`). For speed, a case bundles its transforms: one reference and
one `jb.jit` program for the direct transforms, one pair for the `*_of_jb`
ones (four compiles); a bundle that raises is split per transform, and a
failure is re-run alone, saying whether it reproduces so.

Every failure prints the seed and the program's source (what ran, exactly).
The default run takes `SEEDS` seeds; `pytest --long` takes `LONG_SEEDS`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxbackend as jb
from jaxbackend import testing
from tests._fuzz_programs import make, x64_enabled

SEEDS = 20
LONG_SEEDS = 1000
# float16 programs multiply by literals past its range on purpose
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")


def pytest_generate_tests(metafunc):
    if metafunc.function.__name__ == "test_fuzz":
        n = LONG_SEEDS if metafunc.config.getoption("--long") else SEEDS
        metafunc.parametrize("seed", range(n), ids=[f"seed{s}" for s in range(n)])


# -- the transforms ----------------------------------------------------------------

def _is_float(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _floats(xs) -> list:
    return [x for x in xs if _is_float(x)]


def _with(leaves, idx, new):
    out = list(leaves)
    for i, x in zip(idx, new):
        out[i] = x
    return out


def _apply(name, f, ls, e, axes):
    """Transform `name` of f (leaves -> output leaves) at leaves ls."""
    fidx = [i for i, x in enumerate(ls) if _is_float(x)]
    d = [ls[i] for i in fidx]

    def float_f(*new):                # float outputs as a function of the float inputs
        return _floats(f(*_with(ls, fidx, new)))

    if name == "forward":
        return f(*ls)
    if name == "vjp":
        return jax.vjp(float_f, *d)[1](e["ct"])
    if name == "jvp":
        return jax.jvp(float_f, d, e["tangents"])
    if name == "vmap":
        return jax.vmap(f, in_axes=axes)(*e["batched"])
    if name == "jacfwd":
        return jax.jacfwd(lambda d0: float_f(d0, *d[1:])[0])(d[0])
    raise ValueError(f"unknown transform {name!r}")


def _extras(leaves, outs, rng):
    """Cotangents, tangents and the vmap batch, drawn from the seed (numpy:
    no eager XLA op, so no compile per shape)."""
    def normal(x):
        return np.asarray(rng.standard_normal(np.shape(x))).astype(jnp.result_type(x))
    axes, batched = [], []
    for i, x in enumerate(leaves):
        mapped = i == 0 or rng.random() < 0.5
        axes.append(0 if mapped else None)
        x = np.asarray(x)
        other = (x + normal(x) * 0.1 if _is_float(x) else x + 1).astype(x.dtype)
        batched.append(np.stack([x, other]) if mapped else x)
    return {"ct": [normal(o) for o in _floats(outs)],
            "tangents": [normal(x) for x in _floats(leaves)], "batched": batched}, axes


# -- the check ---------------------------------------------------------------------

def _types(tree):
    return [(tuple(x.shape), jnp.dtype(x.dtype).name, bool(getattr(x, "weak_type", False)))
            for x in jax.tree.leaves(tree)]


def _compare(got, want, scale, what):
    if jax.tree.structure(got) != jax.tree.structure(want):
        raise AssertionError(f"{what}: output structure {jax.tree.structure(got)} != "
                             f"{jax.tree.structure(want)}")
    if _types(got) != _types(want):
        raise AssertionError(f"{what}: (shape, dtype, weak_type) {_types(got)} != "
                             f"reference {_types(want)}")
    testing.assert_close(got, want, scale=scale, what=what)


def _run_case(prog, names=None, bundle=True):
    """Compare every transform in `names` (default: the program's), several
    per compiled program if `bundle`; returns the failures as (transform,
    message)."""
    names = tuple(prog.transforms if names is None else names)
    f0 = prog.fn
    leaves, tree = jax.tree.flatten(prog.args)

    def f(*ls):
        return tuple(jax.tree.leaves(f0(*jax.tree.unflatten(tree, ls))))

    rng = np.random.default_rng(prog.seed + 10_000)
    extra, axes = _extras(leaves, jax.eval_shape(f, *leaves), rng)

    def program(fn, chosen):
        return lambda ls, e: {n: _apply(n, fn, ls, e, axes) for n in chosen}

    def group(chosen, outer):
        """Failures of `chosen` computed by one reference and one jb program."""
        suffix = "_of_jb" if outer else ""
        ref_fn = program(f, chosen)
        try:
            want = jax.jit(ref_fn)(leaves, extra)
            ref_error = None
        except Exception as e:  # jaxbackend.named code runs in the reference too
            ref_error = e
        try:
            got = (jax.jit(program(jb.jit(f), chosen)) if outer
                   else jb.jit(program(f, chosen)))(leaves, extra)
            jb_error = None
        except Exception as e:  # a pass that crashes is a failure like any other
            jb_error = e
        if (ref_error or jb_error) and len(chosen) > 1:  # which transform, exactly
            return [fail for n in chosen for fail in group([n], outer)]
        if ref_error:
            return [(n + suffix, f"the reference jax.jit({n}(f)) raised "
                     f"{type(ref_error).__name__}: {ref_error}") for n in chosen]
        if jb_error:
            return [(n + suffix, f"raised {type(jb_error).__name__}: {jb_error}") for n in chosen]
        scales = functools.cache(lambda: testing.abs_scale(ref_fn, leaves, extra))
        failures = []
        for n in chosen:
            try:
                _compare(got[n], want[n], lambda n=n: scales()[n], what=n + suffix)
            except AssertionError as e:
                failures.append((n + suffix, str(e)))
        return failures

    direct = [n for n in names if not n.endswith("_of_jb")]
    outer = [n[: -len("_of_jb")] for n in names if n.endswith("_of_jb")]
    batches = ([(direct, False), (outer, True)] if bundle else
               [([n], False) for n in direct] + [([n], True) for n in outer])
    return [fail for chosen, is_outer in batches if chosen for fail in group(chosen, is_outer)]


def test_fuzz(seed):
    prog = make(seed)
    with x64_enabled(prog.x64):
        failures = _run_case(prog)
        if failures:
            alone = {n for n, _ in _run_case(prog, [n for n, _ in failures], bundle=False)}
    if failures:
        lines = [f"- {n} ({'also fails alone' if n in alone else 'passes alone'}): {m}"
                 for n, m in failures]
        pytest.fail(f"jb.jit differs from jax.jit on fuzz program {prog.describe()}\n"
                    + "\n".join(lines), pytrace=False)


@pytest.mark.parametrize("api_seed", [0, 1])
def test_jit_object_keeps_jax_jit_api(api_seed):
    """`jb.jit(f)` is JAX's own jit object (README): its `trace` returns what
    `jax.jit(f).trace` returns (a `Traced` with `.jaxpr`, `.lower()`)."""
    prog = make(api_seed)
    leaves, tree = jax.tree.flatten(prog.args)

    def f(*ls):
        return prog.fn(*jax.tree.unflatten(tree, ls))

    with x64_enabled(prog.x64):
        want = jax.jit(f).trace(*leaves)
        got = jb.jit(f).trace(*leaves)
        assert type(got) is type(want), (
            f"jb.jit(f).trace(...) returned {type(got).__name__}, jax.jit(f).trace(...) a "
            f"{type(want).__name__}; program: {prog.describe()}")
        assert [(a.shape, a.dtype) for a in jax.tree.leaves(got.out_info)] == \
            [(a.shape, a.dtype) for a in jax.tree.leaves(want.out_info)]
