"""`remat_residuals`: a backward scan recomputes the cheap residuals its
forward scan would stack, and reads the others as before."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxbackend import _jax, passes
from jaxbackend.passes import _rewrite
from jaxbackend.programs import small as P
from jaxbackend.programs import transformer as T
from jaxbackend.testing import assert_same_values, check_pass


def _scans(closed):
    return [e for e in closed.jaxpr.eqns if e.primitive.name == "scan"]


def _ys(eqn) -> list:
    return [str(v.aval) for v in eqn.outvars[eqn.params["num_carry"]:]]


def _ys_bytes(closed) -> int:
    return sum(v.aval.size * v.aval.dtype.itemsize
               for e in _scans(closed) for v in e.outvars[e.params["num_carry"]:])


MASK = np.tril(np.ones((4, 4), bool))


def _two_scans(x, w, v, also_return_b=False):
    """A forward scan stacking five residuals and a reverse scan reading
    them, as `reroll` and `jax.grad` of a scan leave them."""
    mask = jnp.asarray(MASK)

    def fwd(c, xs):
        wi, vi = xs
        a = jnp.sin(c) * vi                  # sin: not recomputed, so a is stored
        b = a * 2.0 + vi                     # from a (stored) and vi (an xs): recomputed
        d = c + 1.0                          # from the carry, which B never sees: stored
        m = jnp.broadcast_to(mask, (3, 4, 4))          # a broadcast const: recomputed
        k = (vi > 0).astype(jnp.int32) * 3             # integers: recomputed, exactly
        return jnp.tanh(c @ wi), (a, b, d, m, k)

    h, res = jax.lax.scan(fwd, x, (w, v))

    def bwd(carry, r):
        g, n = carry
        a, b, d, m, k = r
        g = g + a * b + d + jnp.where(m, 1.0, 0.0).sum(2) + k.astype(jnp.float32)
        return (jnp.tanh(g), n * 2 + k.sum() + m.sum()), None

    (g, n), _ = jax.lax.scan(bwd, (h @ w[0], jnp.int32(0)), res, reverse=True)
    return (g, n, res[1]) if also_return_b else (g, n)


def _args():
    return P.rand(0, 3, 4), P.rand(1, 6, 4, 4) * 0.5, P.rand(2, 6, 4)


def test_backward_scan_recomputes_cheap_residuals_and_stores_the_rest():
    args = _args()
    before = jax.make_jaxpr(_two_scans)(*args)
    after = passes.dce(passes.remat_residuals(before))
    _jax.check_closed_jaxpr(after)
    assert_same_values(before, after, args)
    f, b = _scans(after)
    # a (from sin) and d (from the carry) stay stacked; b, the mask and the
    # integer residual are recomputed in the backward body
    assert _ys(f) == ["float32[6,3,4]", "float32[6,3,4]"]
    assert _rewrite.count_eqns(b.params["jaxpr"], "broadcast_in_dim") >= 1
    assert _ys_bytes(after) < _ys_bytes(before)
    # what is computed from the integer and boolean residuals is exact
    got = jax.jit(_jax.jaxpr_as_fun(after))(*args)
    want = jax.jit(_jax.jaxpr_as_fun(before))(*args)
    assert int(got[1]) == int(want[1]) != 0


def test_a_residual_something_else_reads_stays_stored():
    args = _args()
    before = jax.make_jaxpr(lambda x, w, v: _two_scans(x, w, v, also_return_b=True))(*args)
    after = passes.dce(passes.remat_residuals(before))
    assert_same_values(before, after, args)
    f, _ = _scans(after)
    # b is a program output too: recomputing it would not free its stack
    assert _ys(f) == ["float32[6,3,4]"] * 3


def test_non_finite_values_recompute_as_they_were():
    x, w, v = _args()
    v = v.at[2, 0].set(jnp.inf).at[4, 2].set(jnp.nan)
    before = jax.make_jaxpr(_two_scans)(x, w, v)
    after = passes.dce(passes.remat_residuals(before))
    got = np.asarray(jax.jit(_jax.jaxpr_as_fun(after))(x, w, v)[0])
    want = np.asarray(jax.jit(_jax.jaxpr_as_fun(before))(x, w, v)[0])
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))


def test_grad_of_a_scan_and_idempotence():
    def f(x, w):
        def body(h, wi):
            u = h @ wi
            return h + 0.5 * u * (1.0 + jnp.tanh(u * 0.8 + u * u * u * 0.03)), None
        return jnp.sum(jax.lax.scan(body, x, w)[0] ** 2)

    args = _args()[:2]
    fwd, grad = check_pass(lambda c: passes.dce(passes.remat_residuals(c)), f, args)
    before = jax.make_jaxpr(jax.value_and_grad(f))(*args)
    assert _ys_bytes(grad) < _ys_bytes(passes.dce(before))


def test_rolled_transformer_step_stores_fewer_residuals():
    # the default pipeline against the same pipeline without this pass, on
    # value_and_grad of the 6-layer pre-LN transformer (reroll rolls it)
    x, layers = T.init_transformer(jax.random.key(0), 6, d=32, seq=8, batch=2, mlp=64)
    vg = jax.value_and_grad(T.loop_transformer, argnums=(0, 1), has_aux=True)
    closed = jax.make_jaxpr(vg)(x, layers)
    without = tuple(p for p in passes.DEFAULT_PIPELINE if p != "remat_residuals")
    on, report = passes.run_pipeline(closed)
    off, _ = passes.run_pipeline(closed, without)
    stat = {s.name: s for s in report.stats}["remat_residuals"]
    assert stat.matches.get("residuals recomputed", 0) >= 3
    assert _ys_bytes(on) < 0.85 * _ys_bytes(off)
    leaves = jax.tree.leaves((x, layers))
    assert_same_values(closed, on, leaves)


def test_a_residual_made_from_a_stored_carry_is_recomputed_from_it():
    def f(x, w):
        def fwd(c, wi):
            return jnp.tanh(c @ wi), (c, c * 3.0 - 1.0)   # the carry itself is stored

        h, res = jax.lax.scan(fwd, x, w)

        def bwd(g, r):
            c, e = r
            return jnp.tanh(g + c * e), None

        return jax.lax.scan(bwd, h, res, reverse=True)[0]

    args = _args()[:2]
    before = jax.make_jaxpr(f)(*args)
    after = passes.dce(passes.remat_residuals(before))
    assert_same_values(before, after, args)
    assert _ys(_scans(after)[0]) == ["float32[6,3,4]"]


def test_a_backward_scan_with_effects_is_left_as_it_is():
    def f(x, w, v):
        def fwd(c, xs):
            wi, vi = xs
            s = jnp.sin(c) * vi
            return jnp.tanh(c @ wi), (s, s * 2.0)      # s * 2.0 alone would be recomputed

        h, res = jax.lax.scan(fwd, x, (w, v))

        def bwd(g, r):
            jax.debug.print("{}", r[0][0, 0])
            return jnp.tanh(g + r[0] * r[1]), None

        return jax.lax.scan(bwd, h, res, reverse=True)[0]

    before = jax.make_jaxpr(f)(*_args())
    assert passes.remat_residuals(before) is before


def _invariant_scans(x, w):
    """A forward scan stacking residuals made from its consts alone (a sin
    table of iota, a causal mask, an rng_uniform draw) and one from the
    carry; a reverse scan reading them all."""
    def fwd(c, wi):
        pos = jax.lax.broadcasted_iota(jnp.float32, (3, 4), 1)
        table = jnp.sin(pos * 0.5) / 3.0                       # consts only: hoisted
        mask = (jax.lax.broadcasted_iota(jnp.int32, (4, 4), 0)
                >= jax.lax.broadcasted_iota(jnp.int32, (4, 4), 1))   # iota: hoisted
        draw = jax.lax.rng_uniform(jnp.float32(0), jnp.float32(1), (3, 4))  # never hoisted
        return jnp.tanh(c @ wi), (table, mask, draw, jnp.sin(c))

    h, res = jax.lax.scan(fwd, x, w)

    def bwd(g, r):
        table, mask, draw, s = r
        return jnp.tanh(g * table + jnp.where(mask, 1.0, 0.0).sum(0) + s * draw), None

    return jax.lax.scan(bwd, h, res, reverse=True)[0]


def _outer_prims(closed):
    return {e.primitive.name for e in closed.jaxpr.eqns}


def test_a_loop_invariant_residual_is_computed_once_before_the_backward_scan():
    x, w = _args()[:2]
    before = jax.make_jaxpr(_invariant_scans)(x, w)
    after = passes.dce(passes.remat_residuals(before))
    _jax.check_closed_jaxpr(after)
    fwd, bwd = _scans(after)
    # the sin table and the mask left the forward scan's stacks; the draw
    # (a new value each iteration) and sin(carry) stay stacked
    assert _ys(fwd) == ["float32[6,3,4]", "float32[6,3,4]"]
    assert {"sin", "iota", "ge"} <= _outer_prims(after)
    consts = bwd.invars[:bwd.params["num_consts"]]
    assert sorted(str(v.aval) for v in consts) == ["bool[4,4]", "float32[3,4]"]
    assert _ys_bytes(after) < _ys_bytes(before)
    # (values: the next test, without the draw, whose value is the RNG's)


def _no_draw(x, w, big):
    def fwd(c, wi):
        pos = jax.lax.broadcasted_iota(jnp.float32, (3, 4), 1)
        table = jnp.sin(pos * 0.5) / 3.0
        mask = (jax.lax.broadcasted_iota(jnp.int32, (4, 4), 0)
                >= jax.lax.broadcasted_iota(jnp.int32, (4, 4), 1))
        total = jnp.sin(big).sum()            # from a large const: its life would extend
        return jnp.tanh(c @ wi), (table, mask, total)

    h, res = jax.lax.scan(fwd, x, w)

    def bwd(g, r):
        table, mask, total = r
        return jnp.tanh(g * table + jnp.where(mask, 1.0, 0.0).sum(0) + total), None

    return jax.lax.scan(bwd, h, res, reverse=True)[0]


def test_hoisted_residuals_keep_the_values_and_a_large_leaf_stays_stored():
    x, w = _args()[:2]
    big = P.rand(3, 4096)          # 16 KiB, against 6 stacked scalars (24 bytes)

    def f(x, w, big):
        return _no_draw(x, w, jnp.cos(big))   # cos: the leaf is a temporary, not an input

    before = jax.make_jaxpr(f)(x, w, big)
    after = passes.dce(passes.remat_residuals(before))
    assert_same_values(before, after, (x, w, big))
    fwd, _ = _scans(after)
    assert _ys(fwd) == ["float32[6]"]          # the sum of sin(cos(big)) stays stacked
    # integer/boolean exactness: the mask's effect is exact
    x0 = jnp.zeros_like(x)
    np.testing.assert_array_equal(jax.jit(_jax.jaxpr_as_fun(after))(x0, w, big)[0],
                                  jax.jit(_jax.jaxpr_as_fun(before))(x0, w, big)[0])


def test_a_rolled_rotary_model_hoists_its_tables_and_mask_and_keeps_its_values():
    # LLaMA-style library GPT (rotary, causal mask), 4 layers: `reroll` rolls
    # the AD program; its rotary tables and mask are made from consts alone
    from flax import nnx

    from jaxbackend import nn
    from jaxbackend.models import GPT, GPTConfig

    cfg = GPTConfig(seq_len=8, n_layers=4, embd=32, heads=4, kv_heads=2, vocab_size=16,
                    activation="swiglu", norm="rmsnorm", rotary=True, use_bias=False)
    params, loss_fn = nn.functional(GPT(cfg, rngs=nnx.Rngs(0)), "loss", stacked=True)
    x = jax.random.randint(jax.random.key(1), (2, 8), 0, 16)
    args = (params, x, jnp.roll(x, -1, axis=1))
    closed = jax.make_jaxpr(jax.value_and_grad(loss_fn))(*args)
    without = tuple(p for p in passes.DEFAULT_PIPELINE if p != "remat_residuals")
    on, report = passes.run_pipeline(closed)
    off, _ = passes.run_pipeline(closed, without)
    stat = {s.name: s for s in report.stats}["remat_residuals"]
    assert stat.matches.get("residuals hoisted", 0) >= 3   # cos, sin, the mask
    assert _ys_bytes(on) < _ys_bytes(off)
    assert_same_values(closed, on, jax.tree.leaves(args))
    again, _ = passes.run_pipeline(on, ("remat_residuals",))
    assert str(again) == str(on)            # nothing left to hoist
