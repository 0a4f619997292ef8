"""`fuse_projections`: flatten-dot-unflatten chains become one contraction."""

import jax
import jax.numpy as jnp

from jaxbackend import passes
from jaxbackend.passes import _rewrite
from jaxbackend.passes.fuse_projections import remaining
from jaxbackend.programs import small as P
from jaxbackend.testing import check_pass


def _fuse(closed):
    return passes.dce(passes.fuse_projections(closed))


def test_fuse_hand_written_mlp_forward_and_backward_chains():
    before = jax.make_jaxpr(jax.value_and_grad(P.hand_mlp, argnums=(0, 1, 2)))(*P.mlp_args())
    assert remaining(before) == 6   # 2 forward, 2 input-grad, 2 weight-grad
    with _rewrite.collect_stats() as stats:
        fwd, grad = check_pass(_fuse, P.hand_mlp, P.mlp_args(), argnums=(0, 1, 2))
    assert remaining(fwd) == 0 and remaining(grad) == 0
    assert stats["forward chain fused"] >= 4 and stats["weight-grad chain fused"] >= 2
    # every dot_general now sees the rank-3 activation: batch dims visible
    for eqn in grad.jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            assert max(len(v.aval.shape) for v in eqn.invars) == 3
    assert _rewrite.count_eqns(grad, "reshape") == 0


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
