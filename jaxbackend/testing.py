"""Equivalence helpers for users' own pytest suites.

Two checks, each the slow-obvious-reference pattern the project tests
itself with:

* `assert_modules_match(named, reference, to_reference, inputs)`: a named
  module (NamedArrays in, NamedArray out) against a positional reference
  (say, written with `nnx.Linear`) on the SAME weights. `to_reference` maps
  the named module's parameters (a pure dict, as `nnx.to_pure_dict` gives)
  to the reference's; it must be differentiable (reshapes, transposes), so
  both modules become functions of the same parameters and their gradients
  are compared leaf by leaf, with the parameter path in any failure.
* `assert_pass_preserves(pass_fn, fn, *args)`: any `ClosedJaxpr ->
  ClosedJaxpr` callable (a `jaxbackend.passes` pass or pipeline, or your
  own) keeps fn's input/output types, still type-checks, computes the same
  values and the same gradients, and (optionally) is idempotent.

Tolerances default per dtype (`TOLERANCES`, the loosest dtype among the
compared arrays wins) and can be overridden with `rtol`/`atol`; the relative tolerance is
scaled by each reference tensor's largest magnitude (see `assert_close`). Failures
raise `AssertionError` naming the leaf and the worst error; success returns
a small report dict so tests can print or assert more.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxbackend import _jax
from jaxbackend import named as nx

# (rtol, atol) per dtype: float32 matches the project's 1e-5 target.
TOLERANCES = {
    "float64": (1e-10, 1e-10),
    "float32": (1e-5, 1e-5),
    "bfloat16": (2e-2, 2e-2),
    "float16": (5e-3, 5e-3),
}


def tolerance(*dtypes) -> tuple:
    """(rtol, atol) for the loosest of `dtypes` (unknown dtypes: float32's)."""
    tols = [TOLERANCES.get(jnp.dtype(d).name, TOLERANCES["float32"]) for d in dtypes]
    return max(t[0] for t in tols), max(t[1] for t in tols)


def _values(x, out_dims=None):
    if isinstance(x, nx.NamedArray):
        return (x.transpose(*out_dims) if out_dims else x).values
    return x


def assert_close(actual, expected, *, rtol=None, atol=None, what="value") -> float:
    """max|actual - expected| <= atol + rtol * max|expected| (per-dtype
    defaults); returns the max abs error.

    The relative part is scaled by the reference tensor's largest entry, not
    entry by entry: a float32 sum of many terms is accurate to ~1e-7 of its
    operands' scale, so near-zero entries of a large gradient carry absolute,
    not relative, rounding error.
    """
    a, e = np.asarray(jnp.asarray(actual, jnp.float32)), np.asarray(jnp.asarray(expected, jnp.float32))
    if a.shape != e.shape:
        raise AssertionError(f"{what}: shape {a.shape} != reference shape {e.shape}")
    r0, a0 = tolerance(jnp.asarray(actual).dtype, jnp.asarray(expected).dtype)
    rtol, atol = (r0 if rtol is None else rtol), (a0 if atol is None else atol)
    if not a.size:
        return 0.0
    if not (np.isfinite(a).all() and np.isfinite(e).all()):
        if not np.array_equal(a, e, equal_nan=True):
            raise AssertionError(f"{what}: non-finite entries differ from the reference")
    err = float(np.max(np.abs(a - e)))
    scale = float(np.max(np.abs(e)))
    if err > atol + rtol * scale:
        raise AssertionError(f"{what}: max abs error {err:.3g} exceeds atol={atol} + "
                             f"rtol={rtol} * max|reference| ({scale:.3g})")
    return err


def assert_modules_match(named: nnx.Module, reference: nnx.Module, to_reference, inputs, *,
                         reference_inputs=None, out_dims=None, grads: bool = True, seed: int = 0,
                         rtol=None, atol=None) -> dict:
    """Outputs (and parameter gradients) of `named(*inputs)` and
    `reference(*reference_inputs)` agree when the reference's weights are
    `to_reference(named params)`.

    `out_dims`: the dim order the named output is brought to before comparing
    with the positional output (default: its own order). Gradients are those
    of sum(output * fixed random cotangent), so every output entry matters.
    Returns {"out_err": ..., "grad_err": {path: err}}.
    """
    reference_inputs = inputs if reference_inputs is None else reference_inputs
    gd_n, p_n, rest_n = nnx.split(named, nnx.Param, ...)
    gd_r, p_r, rest_r = nnx.split(reference, nnx.Param, ...)
    pure = nnx.to_pure_dict(p_n)

    def run_named(params):
        st = jax.tree.map(lambda x: x, p_n)
        nnx.replace_by_pure_dict(st, params)
        return _values(nnx.merge(gd_n, st, rest_n)(*inputs), out_dims)

    def run_reference(params):
        st = jax.tree.map(lambda x: x, p_r)
        nnx.replace_by_pure_dict(st, to_reference(params))
        return _values(nnx.merge(gd_r, st, rest_r)(*reference_inputs))

    # One compiled program per module (outputs and their VJP together): a
    # compile per program, not one per eager op, and half the compiles.
    out_shape = jax.eval_shape(run_reference, pure)
    ct = jax.random.normal(jax.random.key(seed), out_shape.shape, jnp.float32)

    def value_and_grads(run):
        def f(p):
            out, vjp = jax.vjp(lambda q: run(q).astype(jnp.float32), p)
            return out, vjp(ct)[0]
        return jax.jit(f)(pure)

    out_n, g_n = value_and_grads(run_named)
    out_r, g_r = value_and_grads(run_reference)
    r0, a0 = tolerance(jax.eval_shape(run_named, pure).dtype, out_shape.dtype)
    report = {"out_err": assert_close(out_n, out_r, rtol=r0 if rtol is None else rtol,
                                      atol=a0 if atol is None else atol, what="module output")}
    if not grads:
        return report
    report["grad_err"] = {}
    for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(g_n),
                                 jax.tree_util.tree_leaves_with_path(g_r)):
        name = jax.tree_util.keystr(path)
        report["grad_err"][name] = assert_close(a, b, rtol=rtol, atol=atol,
                                                what=f"gradient of parameter {name}")
    return report


# -- passes -----------------------------------------------------------------------

def _flat(fn, args):
    leaves, tree = jax.tree.flatten(args)

    def flat_fn(*xs):
        return jax.tree.leaves(fn(*jax.tree.unflatten(tree, xs)))
    return flat_fn, leaves


def _types(closed) -> tuple:
    return (tuple((tuple(a.shape), a.dtype) for a in closed.in_avals),
            tuple((tuple(a.shape), a.dtype) for a in closed.out_avals))


def default_pipeline():
    """jaxbackend's default pass pipeline (`jaxbackend.passes.run_pipeline`)
    as a plain ClosedJaxpr -> ClosedJaxpr callable."""
    try:
        from jaxbackend.passes import run_pipeline
    except ImportError as e:
        raise ValueError("assert_pass_preserves: no pass given and jaxbackend.passes has no "
                         "run_pipeline; pass pass_fn=your ClosedJaxpr -> ClosedJaxpr callable.") from e
    return run_pipeline


def _apply(pass_fn, closed):
    # Pipelines may return (closed_jaxpr, report); plain passes the jaxpr.
    out = pass_fn(closed)
    return out[0] if isinstance(out, tuple) else out


def assert_pass_preserves(pass_fn, fn, *args, grads: bool = True, idempotent: bool = True,
                          seed: int = 0, rtol=None, atol=None) -> dict:
    """`pass_fn` (ClosedJaxpr -> ClosedJaxpr, or -> (ClosedJaxpr, report);
    None = jaxbackend's default pipeline)
    preserves `fn`'s types and numerics, forward and gradient, on `args`
    (pytrees, NamedArrays included). Returns equation counts and errors."""
    pass_fn = default_pipeline() if pass_fn is None else pass_fn
    flat_fn, leaves = _flat(fn, args)
    report = {}
    programs = [("forward", flat_fn)]
    if grads:
        outs = jax.eval_shape(flat_fn, *leaves)
        key = jax.random.key(seed)
        cts = [jax.random.normal(jax.random.fold_in(key, i), o.shape, jnp.float32)
               for i, o in enumerate(outs)]
        diff = [i for i, x in enumerate(leaves) if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)]

        def scalar(*xs):
            return sum(jnp.sum(o.astype(jnp.float32) * c) for o, c in zip(flat_fn(*xs), cts)
                       if jnp.issubdtype(o.dtype, jnp.floating))
        programs.append(("gradient", jax.grad(scalar, argnums=tuple(diff))))
    for label, f in programs:
        before = jax.make_jaxpr(f)(*leaves)
        after = _apply(pass_fn, before)
        _jax.check_jaxpr(after.jaxpr)
        if _types(after) != _types(before):
            raise AssertionError(f"{label}: the pass changed the program's types from "
                                 f"{_types(before)} to {_types(after)}")
        expect = jax.jit(_jax.jaxpr_as_fun(before))(*leaves)
        got = jax.jit(_jax.jaxpr_as_fun(after))(*leaves)
        errs = [assert_close(g, e, rtol=rtol, atol=atol, what=f"{label} output {i}")
                for i, (g, e) in enumerate(zip(got, expect))]
        if idempotent:
            again = _apply(pass_fn, after)
            if str(again.jaxpr) != str(after.jaxpr):
                raise AssertionError(f"{label}: running the pass twice differs from running it once")
        report[label] = {"eqns_before": len(before.jaxpr.eqns), "eqns_after": len(after.jaxpr.eqns),
                         "max_abs_err": max(errs, default=0.0)}
    return report
