"""`fuse_projections`: flatten-dot-unflatten chains become one contraction,
and never a contraction XLA compiles into more work than the 2-D dot."""

import jax
import jax.numpy as jnp

from jaxbackend import _jax, passes
from jaxbackend.passes import _rewrite
from jaxbackend.passes.fuse_projections import remaining
from jaxbackend.programs import small as P
from jaxbackend.testing import check_pass


def _fuse(closed):
    return passes.dce(passes.fuse_projections(closed))


def _cost(closed, args):
    compiled = jax.jit(lambda *a: _jax.eval_jaxpr(closed, *a)).lower(*args).compile()
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, list) else ca
    return ca["flops"], ca["bytes accessed"]


def _port_mlp_args():   # the shapes of the corpus's port_mlp: (B, T, E) = (2, 8, 16)
    return (P.rand(0, 2, 8, 16), P.rand(1, 16, 64) * 0.25, P.rand(2, 64, 16) * 0.125)


def test_fuse_hand_written_mlp_forward_and_input_grad_chains():
    before = jax.make_jaxpr(jax.value_and_grad(P.hand_mlp, argnums=(0, 1, 2)))(*P.mlp_args())
    # 2 forward, 2 input-grad; both weight-grad chains read a cotangent that
    # an input-grad chain reads too, so neither is fused
    assert remaining(before) == 4
    with _rewrite.collect_stats() as stats:
        fwd, grad = check_pass(_fuse, P.hand_mlp, P.mlp_args(), argnums=(0, 1, 2))
    assert remaining(fwd) == 0 and remaining(grad) == 0
    assert stats["forward chain fused"] >= 4 and stats["weight-grad chain fused"] == 0
    # the forward and input-grad dots see the rank-3 activation
    ranks = sorted(max(len(v.aval.shape) for v in e.invars)
                   for e in grad.jaxpr.eqns if e.primitive.name == "dot_general")
    assert ranks == [2, 2, 3, 3, 3, 3]


def test_weight_grad_fused_when_its_cotangent_is_read_once():
    # grads of the weights only: layer 1's cotangent (tanh's backward,
    # element-wise) feeds its weight gradient alone; layer 2's feeds the
    # input-grad chain of layer 1 as well
    args = _port_mlp_args()
    before = jax.make_jaxpr(jax.value_and_grad(P.hand_mlp, argnums=(1, 2)))(*args)
    with _rewrite.collect_stats() as stats:
        _, grad = check_pass(_fuse, P.hand_mlp, args, argnums=(1, 2))
    assert stats["weight-grad chain fused"] == 1
    w1_grad = [e for e in grad.jaxpr.eqns if e.primitive.name == "dot_general"
               and tuple(e.outvars[0].aval.shape) in ((64, 16), (16, 64))
               and len(e.invars[0].aval.shape) == 3]
    assert len(w1_grad) == 1   # the fused contraction over (batch, time)
    assert remaining(before) == 3 + 1 and remaining(grad) == 0


def test_fused_gradient_costs_no_more_than_the_flat_program():
    # XLA transposes the lhs of a dot contracting several dims; fusing a
    # weight-grad chain whose cotangent is also read elsewhere made XLA
    # recompute and copy it (+256 flops, +2 kB on these shapes)
    args = _port_mlp_args()
    for argnums in ((1, 2), (0, 1, 2)):
        before = jax.make_jaxpr(jax.value_and_grad(P.hand_mlp, argnums=argnums))(*args)
        after = _fuse(before)
        (f0, b0), (f1, b1) = _cost(before, args), _cost(after, args)
        assert f1 <= f0 and b1 <= b0, (argnums, f0, f1, b0, b1)


def test_fuse_leaves_non_canonical_reshapes_alone():
    def f(x, w):  # flattens the *last* two dims: not [*batch, K] -> [M, K]
        y = x.reshape(x.shape[0], -1) @ w
        return jnp.sum(y.reshape(x.shape[0], w.shape[1]))

    x, w = P.rand(0, 2, 3, 4), P.rand(1, 12, 5)
    closed = jax.make_jaxpr(f)(x, w)
    assert str(passes.fuse_projections(closed)) == str(closed)


def test_fuse_rank2_input_is_not_a_match():
    def f(x, w):
        return jnp.sum((x.reshape(-1, x.shape[-1]) @ w).reshape(x.shape[0], -1))

    closed = jax.make_jaxpr(f)(P.rand(0, 6, 4), P.rand(1, 4, 5))
    assert remaining(closed) == 0
    assert passes.fuse_projections(closed) is closed
