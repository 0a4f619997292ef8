"""`hoist_broadcast`: XSA "expand" normalises once per KV head afterwards."""

import jax
import jax.numpy as jnp

from jaxbackend import _jax, passes
from jaxbackend.passes import _rewrite
from jaxbackend.passes.hoist_broadcast import remaining
from jaxbackend.testing import abs_scale, assert_close
from jaxbackend.programs import small as P
from jaxbackend.testing import check_pass


def _hoist(closed):
    return passes.dce(passes.hoist_broadcast(passes.inline_calls(closed)))


def test_hoist_xsa_expand_forward_grad_idempotent_and_counted():
    flat = passes.inline_calls(jax.make_jaxpr(P.xsa_loss)(*P.xsa_args()))
    assert remaining(flat) >= 1           # mul(vb, vb) on the copies; the rest chain
    fwd, grad = check_pass(_hoist, P.xsa_loss, P.xsa_args())
    assert remaining(fwd) == 0 and remaining(grad) == 0


def test_hoisted_expand_does_the_unsqueeze_forms_work():
    v, y = P.xsa_args()
    expand = _hoist(jax.make_jaxpr(P.xsa_expand)(v, y))
    unsq = passes.dce(passes.inline_calls(jax.make_jaxpr(P.xsa_unsqueeze)(v, y)))

    def big_elementwise(closed):  # ops computed at the full (group-expanded) size
        return sum(1 for e in closed.jaxpr.eqns if e.primitive.name != "broadcast_in_dim"
                   and e.outvars[0].aval.size == y.size)

    assert big_elementwise(expand) == big_elementwise(unsq)
    assert _rewrite.count_eqns(expand, "sqrt") == 1
    assert_close(jax.core.eval_jaxpr(expand.jaxpr, expand.consts, v, y)[0],
                 P.xsa_unsqueeze(v, y), what="hoisted expand vs unsqueeze",
                 scale=lambda: abs_scale(P.xsa_unsqueeze, v, y))


def test_grad_of_expand_keeps_runtime_factors_inside_the_sum():
    """The normalisation backward's factors (1/|v|, v/|v|) are runtime values
    that may be inf or 0, where sum(c * t) and c * sum(t) differ (nan vs inf):
    sum sinking leaves them inside the sum (see passes._sink_sum)."""
    v, y = P.xsa_args()
    grad = jax.value_and_grad(P.xsa_loss, argnums=(0, 1))
    with _rewrite.collect_stats() as stats:
        expand = _hoist(jax.make_jaxpr(grad)(v, y))
    assert stats.get("sum sunk past broadcast factors", 0) == 0
    assert remaining(expand) == 0
    assert_close(jax.jit(_jax.jaxpr_as_fun(expand))(v, y), grad(v, y), what="hoisted value_and_grad",
                 scale=lambda: abs_scale(grad, v, y))


def test_hoist_leaves_reductions_over_created_axes_alone():
    def f(x):
        b = jnp.broadcast_to(x[:, None], (3, 5))
        return jnp.sum(b, axis=1)          # sums the 5 copies: not hoistable

    x = jnp.arange(3.0)
    out = passes.hoist_broadcast(jax.make_jaxpr(f)(x))
    (red,) = [e for e in out.jaxpr.eqns if e.primitive.name == "reduce_sum"]
    assert red.invars[0].aval.shape == (3, 5)    # still sums the copies
    assert_close(jax.core.eval_jaxpr(out.jaxpr, out.consts, x)[0], f(x), rtol=0, atol=0,
                 what="sums of small integers (exact)")


def _flops(closed, *args):
    cost = jax.jit(_jax.jaxpr_as_fun(closed)).lower(*args).compile().cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost)["flops"]


def _sum_then_dot(a, b, w):
    t = a + 0.5 * b                 # the sum's operand, also the dot's
    return jnp.sum(t, axis=0), t @ w


def _sum_only(a, b, w):
    return (jnp.sum(a + 0.5 * b, axis=0),)


def _args():
    k = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(k[0], (32, 16)), jax.random.normal(k[1], (32, 16)),
            jax.random.normal(k[2], (16, 8)))


def test_sum_is_not_split_through_an_add_that_another_op_also_reads():
    """sum(a + 0.5 b) where the dot also reads a + 0.5 b: the add stays, so
    sum(a) + 0.5 sum(b) would read 2N elements where jax.jit reads N. The
    sum stays; XLA counts no more flops than for jax.jit's program."""
    args = _args()
    closed = jax.make_jaxpr(_sum_then_dot)(*args)
    with _rewrite.collect_stats() as stats:
        out = _hoist(closed)
    assert stats.get("sum sunk past broadcast factors", 0) == 0
    (red,) = [e for e in out.jaxpr.eqns if e.primitive.name == "reduce_sum"]
    assert red.invars[0].aval.shape == (32, 16)
    assert _flops(out, *args) <= _flops(closed, *args)


def test_sum_is_split_through_an_add_that_only_it_reads():
    """The same sum with no other reader of a + 0.5 b: the add and the
    full-size multiply die, 0.5 multiplies the (16,) sum instead."""
    args = _args()
    closed = jax.make_jaxpr(_sum_only)(*args)
    with _rewrite.collect_stats() as stats:
        out = _hoist(closed)
    assert stats["sum sunk past broadcast factors"] == 1
    full = [e.primitive.name for e in out.jaxpr.eqns if e.outvars[0].aval.size == 32 * 16]
    assert full == []
    assert _flops(out, *args) < _flops(closed, *args)
    assert_close(jax.jit(_jax.jaxpr_as_fun(out))(*args)[0], _sum_only(*args)[0],
                 what="sunk sum", scale=lambda: abs_scale(_sum_only, *args))


def test_sum_sinks_past_a_factor_of_a_value_another_op_reads():
    """sum(0.5 a) where the dot also reads 0.5 a: one leaf, a, read once in
    place of 0.5 a (never more reads); the multiply moves to the (16,) sum."""
    def f(a, w):
        t = 0.5 * a
        return jnp.sum(t, axis=0), t @ w

    a, _, w = _args()
    with _rewrite.collect_stats() as stats:
        out = _hoist(jax.make_jaxpr(f)(a, w))
    assert stats["sum sunk past broadcast factors"] == 1
    (red,) = [e for e in out.jaxpr.eqns if e.primitive.name == "reduce_sum"]
    assert red.invars[0] is out.jaxpr.invars[0]
    assert_close(jax.jit(_jax.jaxpr_as_fun(out))(a, w)[0], f(a, w)[0], what="sunk sum",
                 scale=lambda: abs_scale(lambda a: f(a, w)[0], a))
