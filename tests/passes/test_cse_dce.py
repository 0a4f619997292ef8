"""`cse` merges duplicate equations, `dce` drops dead ones, everywhere."""

import jax
import jax.numpy as jnp

from jaxbackend import passes
from jaxbackend.passes import _rewrite
from jaxbackend.passes.cse import remaining as cse_remaining
from jaxbackend.programs import small as P
from jaxbackend.testing import check_pass


def _dup(x, w1, w2):
    a = jnp.sum(jnp.exp(x) * 2.0)
    b = jnp.sum(jnp.exp(x) * 2.0)      # same work again
    jnp.tanh(x)                        # dead
    return a + b + P.hand_mlp(x, w1, w2)


def test_cse_removes_duplicates_forward_and_grad():
    before = jax.make_jaxpr(jax.value_and_grad(_dup))(*P.mlp_args())
    assert cse_remaining(before) > 0
    fwd, grad = check_pass(passes.cse, _dup, P.mlp_args())
    assert _rewrite.count_eqns(fwd, "exp") == 1
    assert cse_remaining(fwd) == 0 and cse_remaining(grad) == 0


def test_dce_removes_dead_code_and_keeps_signature():
    fwd, grad = check_pass(passes.dce, _dup, P.mlp_args())
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
    fwd, _ = check_pass(lambda c: passes.dce(passes.cse(c)), f, args)
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
