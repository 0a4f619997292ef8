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
