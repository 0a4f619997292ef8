"""`cse` merges duplicate equations, `dce` drops dead ones, everywhere."""

import jax
import jax.numpy as jnp

from jaxbackend import passes
from jaxbackend.passes import _rewrite
from tests.passes import _programs as P


def _dup(x, w1, w2):
    a = jnp.sum(jnp.exp(x) * 2.0)
    b = jnp.sum(jnp.exp(x) * 2.0)      # same work again
    jnp.tanh(x)                        # dead
    return a + b + P.hand_mlp(x, w1, w2)


def _signature(closed):
    eqns = list(_rewrite.iter_eqns(closed))
    return sorted((e.primitive.name, tuple(str(v.aval) for v in e.invars),
                   tuple(sorted((k, str(v)) for k, v in e.params.items()))) for e in eqns)


def test_cse_removes_duplicates_forward_and_grad():
    fwd, grad = P.check_pass(passes.cse, _dup, P.mlp_args())
    assert _rewrite.count_eqns(fwd, "exp") == 1
    for out in (fwd, grad):
        sig = [s for s in _signature(out) if s[0] not in ("broadcast_in_dim",)]
        live = passes.dce(out)
        assert _rewrite.count_eqns(live) <= _rewrite.count_eqns(out)
        del sig


def test_dce_removes_dead_code_and_keeps_signature():
    fwd, grad = P.check_pass(passes.dce, _dup, P.mlp_args())
    assert _rewrite.count_eqns(fwd, "tanh") == 1          # only the live tanh
    before = jax.make_jaxpr(_dup)(*P.mlp_args())
    assert [v.aval for v in fwd.jaxpr.invars] == [v.aval for v in before.jaxpr.invars]


def test_cse_and_dce_recurse_into_scan_bodies():
    def f(x, w):
        def body(h, wi):
            u = jnp.sin(h) @ wi
            v = jnp.sin(h) @ wi         # duplicate inside the loop body
            jnp.cos(h)                  # dead inside the loop body
            return jnp.tanh(u + v), None
        return jnp.sum(jax.lax.scan(body, x, w)[0])

    args = (P.rand(0, 3, 4), P.rand(1, 2, 4, 4) * 0.3)
    fwd, _ = P.check_pass(lambda c: passes.dce(passes.cse(c)), f, args)
    assert _rewrite.count_eqns(fwd, "sin") == 1 and _rewrite.count_eqns(fwd, "cos") == 0
    assert _rewrite.count_eqns(fwd, "scan") == 1


def test_cse_keeps_effectful_equations():
    def f(x):
        jax.debug.print("x={x}", x=x[0])
        jax.debug.print("x={x}", x=x[0])
        return jnp.sum(x)

    closed = jax.make_jaxpr(f)(jnp.ones(3))
    n = _rewrite.count_eqns(closed, "debug_print")
    assert n == 2
    assert _rewrite.count_eqns(passes.dce(passes.cse(closed)), "debug_print") == n
