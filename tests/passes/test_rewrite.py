"""The shared traversal: rule tables, recursion, untouched unknowns, linearity."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxbackend import _jax, passes
from jaxbackend.passes import _rewrite
from jaxbackend.testing import abs_scale, assert_close
from jaxbackend.programs import small as P


def _odd_program(x):
    """Primitives no pass has a rule for, plus custom derivatives and callbacks."""

    @jax.custom_vjp
    def clip_grad(v):
        return jnp.sin(v)

    clip_grad.defvjp(lambda v: (jnp.sin(v), v), lambda v, g: (jnp.clip(g * jnp.cos(v), -1, 1),))
    y = jnp.sort(x, axis=-1) + jnp.cumsum(x, axis=0) + clip_grad(x)
    y = y + jax.pure_callback(lambda a: np.asarray(a) * 2, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
    return jnp.sum(y * jnp.argmax(x, axis=-1)[:, None])


def test_unknown_primitives_pass_through_every_pass_unchanged_in_value():
    x = P.rand(0, 4, 5)
    closed = jax.make_jaxpr(_odd_program)(x)
    out, report = passes.run_pipeline(closed)
    _jax.check_closed_jaxpr(out)
    for name in ("sort", "cumsum", "custom_vjp_call", "pure_callback", "argmax"):
        assert _rewrite.count_eqns(out, name) == _rewrite.count_eqns(closed, name), name
    assert_close(_jax.eval_jaxpr(out, x)[0], _odd_program(x), what="odd program",
                 scale=lambda: abs_scale(_odd_program, x))
    assert [s.name for s in report.stats] == list(passes.DEFAULT_PIPELINE)


def test_rule_that_returns_none_leaves_the_same_object():
    closed = jax.make_jaxpr(P.attention_scan)(*P.scan_args())
    calls = collections.Counter()

    def never(ctx, eqn):
        calls[eqn.primitive.name] += 1
        return None

    assert _rewrite.rewrite(closed, {"*": never}) is closed
    # every equation, sub-jaxprs included, was offered to the rule exactly once
    assert sum(calls.values()) == _rewrite.count_eqns(closed)


def test_rules_see_the_new_graph_and_chains_compose_in_one_walk():
    def f(x):
        return jnp.exp(jnp.exp(jnp.exp(x)))

    closed = jax.make_jaxpr(f)(jnp.ones(3))

    def exp_to_tanh(ctx, eqn):
        return ctx.bind(lax.tanh_p, eqn.invars)

    out = _rewrite.rewrite(closed, {"exp": exp_to_tanh})
    assert _rewrite.count_eqns(out, "tanh") == 3 and _rewrite.count_eqns(out, "exp") == 0
    want = jnp.full(3, jnp.tanh(jnp.tanh(jnp.tanh(1.0))))
    assert_close(_jax.eval_jaxpr(out, jnp.ones(3))[0], want, what="tanh(tanh(tanh(1)))")


def test_shared_sub_jaxprs_are_rewritten_once():
    inner = jax.jit(lambda a: jnp.exp(a) * 2)

    def f(x):
        for _ in range(10):
            x = inner(x)
        return x

    closed = jax.make_jaxpr(f)(jnp.ones(3))
    subs = {id(e.params["jaxpr"]) for e in closed.jaxpr.eqns}
    assert len(subs) == 1                     # JAX shares the traced body
    seen = collections.Counter()

    def count_exp(ctx, eqn):
        seen["exp"] += 1
        return None

    _rewrite.rewrite(closed, {"exp": count_exp})
    assert seen["exp"] == 1


def test_rule_outputs_must_keep_types():
    closed = jax.make_jaxpr(lambda x: jnp.exp(x))(jnp.ones(3))

    def wrong(ctx, eqn):
        return ctx.emit(lambda a: a[:2], eqn.invars)

    try:
        _rewrite.rewrite(closed, {"exp": wrong})
    except AssertionError as e:
        assert "exp" in str(e)
    else:
        raise AssertionError("a type-changing rule was accepted")


def test_trace_cache_makes_repeated_signatures_trace_once(monkeypatch):
    traced = collections.Counter()
    real = _rewrite._trace

    def spy(fn, avals, key):
        traced[key is not None and _rewrite._TRACE_CACHE.get((key, tuple(avals))) is None] += 1
        return real(fn, avals, key)

    monkeypatch.setattr(_rewrite, "_trace", spy)
    monkeypatch.setattr(_rewrite, "_TRACE_CACHE", collections.OrderedDict())
    x, layers = P.rand(0, 2, 3, 4), [P.rand(i, 4, 4) for i in range(1, 9)]

    def f(x, ws):
        for w in ws:
            x = jnp.tanh((x.reshape(-1, 4) @ w).reshape(2, 3, 4))
        return x

    passes.fuse_projections(jax.make_jaxpr(f)(x, layers))
    assert traced[True] == 1 and traced[False] == 7   # 8 matches, one fresh trace
