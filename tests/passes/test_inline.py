"""`inline`: no einsum and no call equation left, anywhere; values kept."""

import jax
import jax.numpy as jnp

from jaxbackend import passes
from jaxbackend.passes import _rewrite
from jaxbackend.passes.inline import remaining
from jaxbackend.programs import small as P
from jaxbackend.testing import check_pass


def test_inline_named_mlp_forward_grad_idempotent_and_no_einsum_left():
    before = jax.make_jaxpr(jax.value_and_grad(P.named_mlp))(*P.mlp_args())
    assert remaining(before)["einsum"] > 0 and remaining(before)["call"] > 0
    fwd, grad = check_pass(passes.inline, P.named_mlp, P.mlp_args())
    for out in (fwd, grad):
        assert remaining(out) == {"einsum": 0, "call": 0}
        assert _rewrite.count_eqns(out, "dot_general") > 0


def test_inline_reaches_into_scan_cond_while_and_remat_without_unrolling():
    fwd, grad = check_pass(passes.inline, P.attention_scan, P.scan_args())
    for out in (fwd, grad):
        assert remaining(out) == {"einsum": 0, "call": 0}
        names = [e.primitive.name for e in out.jaxpr.eqns]
        assert "scan" in names                      # the loop is still a loop
        assert _rewrite.count_eqns(out, "cond") >= 1
        assert _rewrite.count_eqns(out, "while") >= 1


def test_inline_keeps_custom_jvp_unless_differentiated():
    def f(x):
        return jnp.sum(jax.nn.relu(x) * 2.0)

    x = jnp.linspace(-1.0, 1.0, 7)
    closed = jax.make_jaxpr(f)(x)
    kept = passes.inline(closed)
    assert _rewrite.count_eqns(kept, "custom_jvp_call") == 1
    assert remaining(kept)["call"] == 0        # the jit inside its body is inlined
    flat = passes.inline(closed, differentiated=True)
    assert _rewrite.count_eqns(flat, "custom_jvp_call") == 0
    assert float(jax.core.eval_jaxpr(flat.jaxpr, flat.consts, x)[0]) == float(f(x))


def test_inline_calls_keeps_einsums():
    closed = jax.make_jaxpr(P.attention_scan)(*P.scan_args())
    out = passes.inline_calls(closed)
    assert remaining(out) == {"einsum": _rewrite.count_eqns(closed, "einsum"), "call": 0}
