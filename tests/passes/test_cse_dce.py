"""`cse` merges duplicate equations, `dce` drops dead ones, everywhere."""

import jax
import jax.numpy as jnp

from jaxbackend import _jax, passes
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


def _unread_loop_values(closed):
    """(scan outputs nobody reads, scan inputs its body never reads), everywhere."""
    def read(jaxpr):
        return {v for v in [*(x for e in jaxpr.eqns for x in e.invars), *jaxpr.outvars]
                if _jax.is_var(v)}

    unread_out = unread_in = 0
    for jaxpr in _rewrite.iter_jaxprs(closed):
        outer = read(jaxpr)
        for e in jaxpr.eqns:
            if e.primitive.name == "scan":
                body = _jax.open_jaxpr(_jax.scan_parts(e)[0])
                body_read = read(body)
                unread_out += sum(v not in outer for v in e.outvars)
                unread_in += sum(v not in body_read for v in body.invars)
    return unread_out, unread_in


def test_dce_prunes_scan_outputs_nobody_reads_and_inputs_the_body_ignores():
    def f(x, w, unused):
        def body(h, xs):
            wi, ui = xs
            big = jnp.broadcast_to(jnp.float32(-1.0), (16, 16)) + 0 * h.sum()   # stacked, dead
            return jnp.tanh(h @ wi), big
        h, _ = jax.lax.scan(body, x, (w, unused))
        return jnp.sum(h)

    args = (P.rand(0, 3, 4), P.rand(1, 5, 4, 4) * 0.3, P.rand(2, 5, 7))
    before = jax.make_jaxpr(f)(*args)
    assert _unread_loop_values(before) == (1, 1)
    fwd, grad = check_pass(passes.dce, f, args)
    assert _unread_loop_values(fwd) == (0, 0)
    assert _unread_loop_values(grad) == (0, 0)
    assert [v.aval for v in fwd.jaxpr.invars] == [v.aval for v in before.jaxpr.invars]


def test_dce_drops_the_dead_residual_a_rolled_gpt_step_stacks(monkeypatch):
    # reroll's forward scan stacks, per layer, a broadcast constant that the
    # backward scan never reads; XLA drops it, and so must dce (the sharding
    # memory model reads the program after dce). The constant is the causal
    # mask's fill as a plain select saves it; the library's attention now
    # applies the mask under jax.checkpoint (no such residual), so the plain
    # select is put back here: a user's own attention may well be written so.
    from flax import nnx

    from jaxbackend import named as nx
    from jaxbackend import nn
    from jaxbackend.models import GPT, GPTConfig
    from jaxbackend.nn import _attention

    monkeypatch.setattr(_attention, "_causal",
                        lambda s, keep: nx.where(keep, s, jnp.finfo(s.dtype).min))
    # the block's call is traced once per shape (`jb.layer`): without clearing
    # JAX's caches before and after, a block of these shapes traced by another
    # test in this process would keep (or get) the other mask
    jax.clear_caches()
    try:
        model = GPT(GPTConfig(n_layers=4, embd=16, heads=2, seq_len=8), rngs=nnx.Rngs(0))
        params, loss = nn.functional(model, "loss")
        x = jnp.zeros((2, 8), jnp.int32)
        closed = jax.make_jaxpr(jax.value_and_grad(loss))(params, x, x)
    finally:
        jax.clear_caches()
    rolled = closed
    for name in ("reroll", "inline_calls", "fuse_projections", "hoist_broadcast", "cse"):
        rolled = getattr(passes, name)(rolled)    # the pipeline up to dce
    assert _rewrite.count_eqns(rolled, "scan") >= 2
    assert _unread_loop_values(rolled) != (0, 0)
    assert _unread_loop_values(passes.dce(rolled)) == (0, 0)
