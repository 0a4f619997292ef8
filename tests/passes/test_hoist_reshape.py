"""`hoist_broadcast` through merging reshapes: `jnp.repeat`, the GQA
expand-and-reshape form, `jnp.tile`'s layout; AD's split-and-sum of them
(`_sink_sum`); and the merges it must leave alone."""

import re

import einops
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jaxbackend as jb
from jaxbackend import _jax, passes
from jaxbackend.passes import _broadcast, _rewrite
from jaxbackend.passes.hoist_broadcast import remaining
from jaxbackend.programs import small as P
from jaxbackend.testing import abs_scale, assert_close, check_pass


def _hoist(closed, **kw):
    return passes.dce(passes.hoist_broadcast(passes.inline_calls(closed), **kw))


def _full_size_ops(closed, size):
    """Equations that compute (not just copy) at `size` elements."""
    return sorted(e.primitive.name for e in closed.jaxpr.eqns
                  if e.primitive.name not in ("broadcast_in_dim", "reshape")
                  and e.outvars[0].aval.size == size)


def _run(closed, *args):
    return jax.jit(_jax.jaxpr_as_fun(closed))(*args)


def _loss(form):
    return lambda v, y: jnp.sum(jnp.sin(form(v, y)))


def test_merge_groups_accepts_contiguous_merges_only():
    assert _broadcast.merge_groups((2, 4, 2, 3, 8), (2, 4, 6, 8)) == ((2,), (4,), (2, 3), (8,))
    assert _broadcast.merge_groups((2, 3, 4), (24,)) == ((2, 3, 4),)
    assert _broadcast.merge_groups((2, 3, 1), (6,)) == ((2, 3, 1),)
    assert _broadcast.merge_groups((6, 4), (2, 3, 4)) is None      # a split
    assert _broadcast.merge_groups((2, 3, 4), (3, 8)) is None      # cuts through an axis
    assert _broadcast.merge_groups((2, 3, 4), (4, 6)) is None


def test_repeat_lowers_to_a_merged_broadcast():
    """The matcher reads `jnp.repeat` (static count) as broadcast + merge."""
    v, _ = P.xsa_merged_args()
    closed = jax.make_jaxpr(lambda v: jnp.repeat(v, 3, axis=2))(v)
    names = [e.primitive.name for e in closed.jaxpr.eqns]
    assert names == ["broadcast_in_dim", "reshape"]
    producer = _rewrite.Producers(closed.jaxpr.eqns)
    m = _broadcast.merged(producer, closed.jaxpr.outvars[0])
    assert m.groups == ((2,), (4,), (2, 3), (8,)) and m.x is closed.jaxpr.invars[0]


def test_reshape_form_forward_and_grad_checked_idempotent_and_counted():
    """The seed form (issue 14): passes check_pass, and afterwards no op reads
    merged copies (`remaining`), forward and value_and_grad."""
    args = P.xsa_merged_args()
    flat = passes.inline_calls(jax.make_jaxpr(_loss(P.xsa_reshape))(*args))
    assert remaining(flat) == 1           # mul(vb, vb); the rest of the chain follows it
    fwd, grad = check_pass(_hoist, _loss(P.xsa_reshape), args)
    assert remaining(fwd) == 0 and remaining(grad) == 0


def test_reshape_and_repeat_forms_do_the_unsqueeze_forms_work():
    v, ym = P.xsa_merged_args()
    _, y = P.xsa_args()
    unsq = _full_size_ops(_hoist(jax.make_jaxpr(P.xsa_unsqueeze)(v, y)), y.size)
    for form in (P.xsa_reshape, P.xsa_repeat):
        before = passes.inline_calls(jax.make_jaxpr(form)(v, ym))
        after = _hoist(before)
        assert len(_full_size_ops(before, ym.size)) > len(unsq)
        assert _full_size_ops(after, ym.size) == unsq, form.__name__
        assert _rewrite.count_eqns(after, "sqrt") == 1
        assert [e.outvars[0].aval.shape for e in after.jaxpr.eqns
                if e.primitive.name == "sqrt"] == [(2, 4, 2, 1)]      # once per KV head
        assert_close(_run(after, v, ym), jax.jit(form)(v, ym), what=form.__name__,
                     scale=lambda: abs_scale(form, v, ym))


def test_reshape_form_flops_match_unsqueeze_after_the_pipeline():
    """XLA cost_analysis (as benchmarks/xsa.py measures it), forward."""
    v, ym = P.xsa_merged_args()
    _, y = P.xsa_args()

    def cost(fn, *args):
        c = fn.lower(*args).compile()
        ca = c.cost_analysis()
        ca = ca[0] if isinstance(ca, (list, tuple)) else ca
        return ca["flops"], len(re.findall(r"\bfusion\(", c.as_text()))

    ref_flops, ref_fusions = cost(jax.jit(P.xsa_unsqueeze), v, y)
    before, _ = cost(jax.jit(P.xsa_reshape), v, ym)
    after, fusions = cost(jb.jit(P.xsa_reshape), v, ym)
    assert after <= 1.05 * ref_flops < before
    assert fusions <= ref_fusions


def test_tile_layout_is_hoisted_too():
    """Group index major (query head = g * kv + kv_i): broadcast + reshape and
    the `tile` primitive."""
    v, ym = P.xsa_merged_args()

    def via_reshape(v, y):
        b, t, kv, d = v.shape
        g = y.shape[2] // kv
        vb = jnp.broadcast_to(v[:, :, None], (b, t, g, kv, d)).reshape(b, t, g * kv, d)
        return P._xsa_merged(vb, y)

    def via_tile(v, y):
        return P._xsa_merged(jnp.tile(v, (1, 1, y.shape[2] // v.shape[2], 1)), y)

    for form in (via_reshape, via_tile):
        fwd, _ = check_pass(_hoist, _loss(form), (v, ym))
        assert remaining(fwd) == 0
        assert [e.outvars[0].aval.shape for e in fwd.jaxpr.eqns
                if e.primitive.name == "sqrt"] == [(2, 4, 2, 1)], form.__name__


def test_other_spellings_of_the_copy_normalise_once_per_kv_head():
    """einops (both layouts), `concatenate([v] * g)`, and `jnp.repeat` of a
    size-1 axis then a reshape: the norm runs once per KV head."""
    v, ym = P.xsa_merged_args()
    b, t, kv, d = v.shape
    g = ym.shape[2] // kv
    spellings = {
        "einops repeat": lambda v: einops.repeat(v, "b t k d -> b t (k g) d", g=g),
        "einops tile": lambda v: einops.repeat(v, "b t k d -> b t (g k) d", g=g),
        "concatenate": lambda v: jnp.concatenate([v] * g, axis=2),
        "repeat size-1": lambda v: jnp.repeat(v[:, :, :, None], g, axis=3).reshape(b, t, -1, d),
    }
    for name, copy in spellings.items():
        def form(v, y, copy=copy):
            return P._xsa_merged(copy(v), y)

        after = _hoist(jax.make_jaxpr(form)(v, ym))
        (sqrt,) = [e for e in after.jaxpr.eqns if e.primitive.name == "sqrt"]
        assert sqrt.outvars[0].aval.size == b * t * kv, name
        assert remaining(after) == 0, name
        assert_close(_run(after, v, ym), jax.jit(form)(v, ym), what=name,
                     scale=lambda: abs_scale(form, v, ym))


def test_reductions_over_the_merged_head_dim_stay():
    """sum/max over kv*g adds/compares the copies: not per source element."""
    x = P.rand(7, 2, 4, 8)

    def f(x):
        r = jnp.repeat(x, 3, axis=1)
        return jnp.sum(r * r, axis=1), jnp.max(jnp.exp(r), axis=1)

    after = _hoist(jax.make_jaxpr(f)(x))
    reds = [e for e in after.jaxpr.eqns if e.primitive.name in ("reduce_sum", "reduce_max")]
    assert [r.invars[0].aval.shape for r in reds] == [(2, 12, 8), (2, 12, 8)]
    # the elementwise work before them still runs once per source element
    assert {e.outvars[0].aval.shape for e in after.jaxpr.eqns
            if e.primitive.name in ("mul", "exp")} == {(2, 4, 8)}
    assert_close(_run(after, x), jax.jit(f)(x), what="reductions over kv*g",
                 scale=lambda: abs_scale(f, x))


def test_splits_and_misaligned_reshapes_stay():
    """A reshape that splits the broadcast axis, or whose boundaries cut an
    axis (mixing the group with a non-adjacent dim), is no merge: unchanged,
    exactly (small integers in float)."""
    x = jnp.arange(8.0).reshape(2, 4)

    def split(x):
        return jnp.exp(lax.broadcast_in_dim(x, (2, 6, 4), (0, 2)).reshape(2, 2, 3, 4))

    def cut(x):
        return jnp.exp(lax.broadcast_in_dim(x, (2, 3, 4), (0, 2)).reshape(3, 8))

    for f in (split, cut):
        closed = jax.make_jaxpr(f)(x)
        after = passes.hoist_broadcast(closed)
        assert str(after) == str(closed), f.__name__
        assert_close(_run(after, x), f(x), rtol=0, atol=0, what=f.__name__)


def test_operands_with_different_merges_stay():
    """repeat (kv, g) and tile (g, kv) copies differ element by element:
    an op on both is not an op on the sources."""
    x, z = P.rand(8, 2, 4), P.rand(9, 2, 4)

    def f(x, z):
        return jnp.repeat(x, 3, axis=0) * jnp.tile(z, (3, 1))

    closed = jax.make_jaxpr(f)(x, z)
    after = passes.hoist_broadcast(closed)
    (mul,) = [e for e in after.jaxpr.eqns if e.primitive.name == "mul"]
    assert mul.outvars[0].aval.shape == (6, 4) and remaining(after) == 0
    assert_close(_run(after, x, z), f(x, z), rtol=0, atol=0, what="repeat * tile")


def test_group_sum_sinks_past_compile_time_factors_through_the_split():
    """AD's transpose of repeat is reshape + reduce_sum over g: the constant
    factors (0.5 and a per-KV-head const) come out of it; checked against
    jax.jit of the same gradient."""
    scale = jnp.asarray(np.linspace(0.5, 2.0, 16).reshape(2, 8), jnp.float32)

    def f(v, y):
        vb = jnp.repeat(v, 3, axis=2) * 0.5 / jnp.repeat(scale, 3, axis=0)
        return jnp.sum(jnp.tanh(y * vb))

    v, y = P.xsa_merged_args()
    grad = jax.grad(f)
    with _rewrite.collect_stats() as stats:
        after = _hoist(jax.make_jaxpr(grad)(v, y))
    assert stats["sum sunk past broadcast factors"] == 1
    muls = [e for e in after.jaxpr.eqns if e.primitive.name in ("mul", "div")
            and e.outvars[0].aval.size == y.size]
    assert len(muls) == 4          # y * vb, and tanh's backward: mul, mul, mul by y
    assert_close(_run(after, v, y), jax.jit(grad)(v, y), what="sunk group sum",
                 scale=lambda: abs_scale(grad, v, y))


def test_runtime_factors_are_sunk_only_on_request():
    """Default: the normalisation's backward runs per query head (its factors
    1/|v| and v/|v| are runtime values). `runtime_factors=True` sums over the
    group first: the unsqueeze form's work, same values on finite inputs."""
    v, ym = P.xsa_merged_args()
    _, y = P.xsa_args()
    g_reshape = jax.value_and_grad(_loss(P.xsa_reshape), argnums=(0, 1))
    g_unsq = jax.value_and_grad(_loss(P.xsa_unsqueeze), argnums=(0, 1))
    unsq = _full_size_ops(_hoist(jax.make_jaxpr(g_unsq)(v, y)), y.size)
    closed = jax.make_jaxpr(g_reshape)(v, ym)
    with _rewrite.collect_stats() as stats:
        default = _hoist(closed)
    assert stats["sum sunk past broadcast factors"] == 0
    assert len(_full_size_ops(default, ym.size)) > len(unsq)
    fast = _hoist(closed, runtime_factors=True)
    assert len(_full_size_ops(fast, ym.size)) == len(unsq)
    for after in (default, fast):
        assert_close(_run(after, v, ym), g_reshape(v, ym), what="value_and_grad",
                     scale=lambda: abs_scale(g_reshape, v, ym))


def test_runtime_factors_change_results_where_a_factor_is_zero():
    """Why `runtime_factors` is opt-in: with s = 0 and cotangents of both
    signs, jax.jit sums y_g / 0 = +inf and -inf to nan; summing first gives
    sum_g(y_g) / 0 = inf. The default keeps jax.jit's nan."""
    y = jnp.asarray([[1.0, -2.0], [3.0, 4.0]])        # (kv, g) query heads, merged
    s = jnp.asarray([0.0, 2.0])

    def f(v, s, y):
        return jnp.sum(y.reshape(4) * jnp.repeat(v, 2) / jnp.repeat(s, 2))

    grad = jax.grad(f)
    v = jnp.ones(2)
    ref = jax.jit(grad)(v, s, y)
    closed = jax.make_jaxpr(grad)(v, s, y)
    (default,) = _run(_hoist(closed), v, s, y)
    (fast,) = _run(_hoist(closed, runtime_factors=True), v, s, y)
    assert np.isnan(ref[0]) and ref[1] == 3.5
    assert_close(default, ref, rtol=0, atol=0, what="default keeps jax.jit's nan")
    assert np.isneginf(fast[0]) and fast[1] == 3.5
