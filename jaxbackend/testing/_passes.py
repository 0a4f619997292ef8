"""Checks for ClosedJaxpr -> ClosedJaxpr passes: `assert_pass_preserves`
(any pass, any program) and `check_pass` (a scalar program: the pass also
runs on its `value_and_grad` jaxpr, and the rewritten forward jaxpr must
differentiate like the original)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxbackend import _jax
from jaxbackend.passes import run_pipeline
from jaxbackend.testing._close import assert_close
from jaxbackend.testing._scale import abs_scale, lazy_scales

def _flat(fn, args):
    leaves, tree = jax.tree.flatten(args)

    def flat_fn(*xs):
        return jax.tree.leaves(fn(*jax.tree.unflatten(tree, xs)))
    return flat_fn, leaves


def _types(closed) -> tuple:
    return (tuple((tuple(a.shape), a.dtype) for a in closed.in_avals),
            tuple((tuple(a.shape), a.dtype) for a in closed.out_avals))


def _apply(pass_fn, closed):
    # Pipelines may return (closed_jaxpr, report); plain passes the jaxpr.
    out = pass_fn(closed)
    return out[0] if isinstance(out, tuple) else out


def assert_pass_preserves(pass_fn, fn, *args, grads: bool = True, idempotent: bool = True,
                          seed: int = 0, rtol=None, atol=None) -> dict:
    """`pass_fn` (ClosedJaxpr -> ClosedJaxpr, or -> (ClosedJaxpr, report);
    None = jaxbackend's default pipeline, `jaxbackend.passes.run_pipeline`)
    preserves `fn`'s types and numerics, forward and gradient, on `args`
    (pytrees, NamedArrays included). Returns equation counts and errors."""
    pass_fn = run_pipeline if pass_fn is None else pass_fn
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
        scale_for = lazy_scales(_jax.jaxpr_as_fun(before), *leaves)
        errs = [assert_close(g, e, rtol=rtol, atol=atol, scale=scale_for(i),
                             what=f"{label} output {i}")
                for i, (g, e) in enumerate(zip(got, expect))]
        if idempotent:
            again = _apply(pass_fn, after)
            if str(again.jaxpr) != str(after.jaxpr):
                raise AssertionError(f"{label}: running the pass twice differs from running it once")
        report[label] = {"eqns_before": len(before.jaxpr.eqns), "eqns_after": len(after.jaxpr.eqns),
                         "max_abs_err": max(errs, default=0.0)}
    return report


def _run(closed, leaves):
    # one XLA compile is much faster than op-by-op eager evaluation
    return jax.jit(_jax.jaxpr_as_fun(closed))(*leaves)


def assert_same_values(before, after, leaves, what="rewritten jaxpr"):
    """ClosedJaxpr `after` computes what `before` does on the flat `leaves`,
    by the error model of `jaxbackend.testing` (entries that cancel: at
    `before`'s own abs_scale)."""
    assert_close(_run(after, leaves), _run(before, leaves), what=what,
                 scale=lambda: abs_scale(_jax.jaxpr_as_fun(before), *leaves))


def check_pass(pass_fn, fn, args, *, argnums=0) -> list:
    """The four checks every pass gets, for a scalar-valued `fn(*args)`
    (`args` a tuple of pytrees) and a ClosedJaxpr -> ClosedJaxpr `pass_fn`:

    1. the output type-checks (`_jax.check_closed_jaxpr`);
    2. before == after numerically (`assert_same_values`), on the forward
       jaxpr and on the jaxpr of `jax.value_and_grad(fn)` (the pass runs on
       AD-produced code too), and `jax.grad` of the rewritten forward jaxpr
       equals `jax.grad(fn)`;
    3. running the pass twice prints the same jaxpr as running it once.

    Returns [forward, value_and_grad] rewritten jaxprs, for counting the
    pass's invariants."""
    leaves, tree = jax.tree.flatten(args)

    def flat_fn(*xs):
        return fn(*jax.tree.unflatten(tree, xs))

    results = []
    for prog in (flat_fn, jax.value_and_grad(flat_fn, argnums=argnums)):
        before = jax.make_jaxpr(prog)(*leaves)
        after = pass_fn(before)
        _jax.check_closed_jaxpr(after)
        assert_same_values(before, after, leaves)
        again = pass_fn(after)
        assert str(again) == str(after), "pass is not idempotent"
        results.append(after)
    fwd = results[0]
    g_after = jax.jit(jax.grad(lambda *xs: _jax.eval_jaxpr(fwd, *xs)[0], argnums=argnums))(*leaves)
    g_before = jax.jit(jax.grad(flat_fn, argnums=argnums))(*leaves)
    assert_close(g_after, g_before, what="grad of the rewritten jaxpr",
                 scale=lambda: abs_scale(jax.grad(flat_fn, argnums=argnums), *leaves))
    return results
