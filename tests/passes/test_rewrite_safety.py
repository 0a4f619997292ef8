"""The algebraic rewrites keep `jax.jit`'s results where they must be exact.

Each pass's module docstring states when it preserves jax.jit's results
(dtype classes, integer overflow, non-finite values); these tests compare
`jb.jit(f)` and the pass functions on `jax.make_jaxpr` output against
`jax.jit(f)` exactly: values (nan and inf positions), dtypes, weak types.
The first group are regressions: sum sinking gave wrong answers for each.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxbackend as jb
from jaxbackend import _jax, passes
from jaxbackend.named._einsum import einsum_p

SUNK = "sum sunk past broadcast factors"


def _exact(got, want, what):
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got) == len(want), what
    for g, w in zip(got, want):
        assert (g.dtype, g.weak_type) == (w.dtype, w.weak_type), what
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=what)


def _same_as_jax_jit(f, *args):
    """jb.jit(f) returns exactly jax.jit(f)'s values, dtypes and weak types."""
    _exact(jb.jit(f)(*args), jax.jit(f)(*args), f"jb.jit vs jax.jit of {f.__name__}")


def _hoist(closed):
    return passes.hoist_broadcast(passes.inline_calls(closed))


def _pass_as_jax_jit(pass_fn, f, *args):
    """pass_fn on make_jaxpr(f): type-checks, same output types (weak types
    included) and exactly jax.jit(f)'s values. Returns the pass's counts."""
    closed = jax.make_jaxpr(f)(*args)
    with passes.collect_stats() as stats:
        out = pass_fn(closed)
    _jax.check_closed_jaxpr(out)
    assert [_jax.same_aval(a, b) for a, b in zip(out.out_avals, closed.out_avals)] == \
        [True] * len(closed.out_avals)
    got = jax.jit(_jax.jaxpr_as_fun(out))(*args)
    want = jax.tree.leaves(jax.jit(f)(*args))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=f.__name__)
    return dict(stats), out


# --- sum sinking: the known wrong answers -------------------------------------

def test_sum_does_not_sink_through_integer_division():
    def f(x):
        return (x // 2).sum()

    x = jnp.array([1, 1, 1, 1], jnp.uint32)
    _same_as_jax_jit(f, x)                       # 0, not sum(x) // 2 = 2
    stats, _ = _pass_as_jax_jit(_hoist, f, x)
    assert stats.get(SUNK, 0) == 0


def test_integer_products_are_not_sunk():
    def f(x):
        return jnp.sum(x * 3)

    x = jnp.array([2**30, 2**30, 7], jnp.int32)   # wraps: exact only in wrapping order
    _same_as_jax_jit(f, x)
    assert _pass_as_jax_jit(_hoist, f, x)[0].get(SUNK, 0) == 0


@pytest.mark.parametrize("dtype, value", [(jnp.float16, 30000), (jnp.bfloat16, 1e38)])
def test_low_precision_sums_are_not_sunk(dtype, value):
    def f(x):
        return lax.reduce_sum(x * dtype(0.25), (0,))

    x = jnp.full((8,), value, dtype)              # float16: 59968, sunk: inf
    assert np.isfinite(np.asarray(jax.jit(f)(x), np.float32))
    _same_as_jax_jit(f, x)
    assert _pass_as_jax_jit(_hoist, f, x)[0].get(SUNK, 0) == 0


@pytest.mark.parametrize("f", [lambda x: jnp.sum(x / 0.0), lambda x: jnp.sum(x * jnp.inf),
                               lambda x: jnp.sum(x * jnp.nan), lambda x: jnp.sum(x * 1e-40)],
                         ids=["div-by-zero", "times-inf", "times-nan", "times-subnormal"])
def test_non_finite_zero_or_subnormal_literal_factors_are_not_sunk(f):
    x = jnp.array([1.0, 0.0])                     # sum(x * inf) = nan; inf * sum(x) = inf
    _same_as_jax_jit(f, x)
    assert _pass_as_jax_jit(_hoist, f, x)[0].get(SUNK, 0) == 0


def test_runtime_factors_are_not_sunk():
    def times(x, c):
        return jnp.sum(x * c)

    def over(x, c):
        return jnp.sum(x / c)

    def times_broadcast(x, c):                    # c constant along the summed axis
        return jnp.sum(x * c[:, None], axis=1)

    x = jnp.array([1.0, 0.0])
    for c in (jnp.float32(jnp.inf), jnp.float32(0.0), jnp.float32(2.0)):
        _same_as_jax_jit(times, x, c)
        _same_as_jax_jit(over, x, c)
        for f in (times, over):
            assert _pass_as_jax_jit(_hoist, f, x, c)[0].get(SUNK, 0) == 0
    xb, cb = jnp.array([[1.0, 0.0], [2.0, 3.0]]), jnp.array([jnp.inf, 1.0])
    _same_as_jax_jit(times_broadcast, xb, cb)     # row 0: nan, not inf
    assert _pass_as_jax_jit(_hoist, times_broadcast, xb, cb)[0].get(SUNK, 0) == 0


def test_const_factors_sink_only_when_finite_and_normal():
    for c, sinks in ((np.array([0.5, 0.25], np.float32), True),
                     (np.array([np.inf, 0.5], np.float32), False),
                     (np.array([0.0, 0.5], np.float32), False)):
        c = jnp.asarray(c)

        def f(x, c=c):                            # c: a closed-over const
            return jnp.sum(x * c[None, :], axis=0)

        x = jnp.array([[1.0, 3.0], [0.0, 5.0], [-2.5, 7.0]])
        _same_as_jax_jit(f, x)
        stats, _ = _pass_as_jax_jit(_hoist, f, x)
        assert (stats.get(SUNK, 0) > 0) == sinks, c


def test_factor_computed_from_literals_is_evaluated_and_checked():
    def half(x):                                  # equations: broadcast 1.0, mul 0.5
        return jnp.sum(x * (jnp.ones(3) * 0.5)[None, :], axis=0)

    def inf(x):
        return jnp.sum(x * (jnp.ones(3) * jnp.inf)[None, :], axis=0)

    x = jnp.array([[1.0, 0.0, -2.0], [0.0, 0.0, 4.0]])
    for f, sinks in ((half, True), (inf, False)):
        _same_as_jax_jit(f, x)
        stats, _ = _pass_as_jax_jit(_hoist, f, x)
        assert (stats.get(SUNK, 0) > 0) == sinks, f.__name__


def test_float32_sum_still_sinks_a_power_of_two_factor_exactly():
    """A finite normal literal in float32 sinks; scaling by 2**k is exact,
    so the result is bit-identical, inf/nan inputs included."""
    def f(x):
        return jnp.sum(x * 0.25, axis=1)

    x = jax.random.normal(jax.random.key(0), (4, 64), jnp.float32)
    x = x.at[1, 3].set(jnp.inf).at[2, 5].set(jnp.nan).at[3, 0].set(jnp.inf).at[3, 1].set(-jnp.inf)
    stats, out = _pass_as_jax_jit(_hoist, f, x)
    assert stats[SUNK] == 1
    (red,) = [e for e in out.jaxpr.eqns if e.primitive.name == "reduce_sum"]
    assert red.invars[0] is out.jaxpr.invars[0]   # the sum reads x: the factor is outside
    _same_as_jax_jit(f, x)


def test_sinking_keeps_weak_types():
    def f(x):
        return lax.reduce_sum(x * 0.5, (0,))

    x = _jax.convert_element_type(jnp.arange(12.0).reshape(3, 4), np.dtype(np.float32), True)
    assert x.weak_type and jax.jit(f)(x).weak_type
    assert _pass_as_jax_jit(_hoist, f, x)[0][SUNK] == 1
    _same_as_jax_jit(f, x)


# --- hoisting above broadcasts: exact for every dtype -------------------------

def test_hoisted_integer_elementwise_ops_keep_overflow_and_division_by_zero():
    def f(x, d):
        b = jnp.broadcast_to(x[:, None], (3, 4))
        return (b * 3) // jnp.broadcast_to(d[:, None], (3, 4)), b % 5

    x = jnp.array([2**30, -7, 9], jnp.int32)
    d = jnp.array([3, 0, -2], jnp.int32)          # integer division by zero too
    stats, _ = _pass_as_jax_jit(_hoist, f, x, d)
    assert stats.get("hoisted mul", 0) >= 1
    _same_as_jax_jit(f, x, d)


def test_hoisted_float_ops_keep_non_finite_values():
    def f(x):
        b = jnp.broadcast_to(x[:, None], (5, 3))
        return jnp.exp(b) / b, jnp.max(b, axis=0), jnp.sum(b, axis=0)

    x = jnp.array([0.0, jnp.inf, -jnp.inf, jnp.nan, 1000.0])
    stats, _ = _pass_as_jax_jit(_hoist, f, x)
    assert stats.get("hoisted exp", 0) >= 1
    _same_as_jax_jit(f, x)


def test_hoisted_integer_reductions_wrap_like_jax_jit():
    def f(x):
        b = jnp.broadcast_to(x[:, None, :], (3, 4, 2))
        return jnp.sum(b, axis=0), jnp.prod(b, axis=0)

    x = jnp.array([[2**30, 3], [2**30, -5], [2**30, 2**20]], jnp.int32)
    stats, _ = _pass_as_jax_jit(_hoist, f, x)
    assert stats.get("hoisted reduce_sum", 0) >= 1
    _same_as_jax_jit(f, x)


# --- fuse_projections: integer overflow, accumulation dtype, precision -------

def _flat_dot(x, w, **kw):
    y = lax.dot_general(x.reshape(-1, x.shape[-1]), w, (((1,), (0,)), ((), ())), **kw)
    return y.reshape(*x.shape[:-1], w.shape[1])


def test_fused_integer_projection_wraps_like_jax_jit():
    def f(x, w):
        return _flat_dot(x, w)

    x = (jnp.arange(24, dtype=jnp.int32).reshape(2, 3, 4) + 1) * 2**28   # overflows int32
    w = jnp.arange(20, dtype=jnp.int32).reshape(4, 5) - 7
    stats, _ = _pass_as_jax_jit(passes.fuse_projections, f, x, w)
    assert stats["forward chain fused"] == 1
    _same_as_jax_jit(f, x, w)


def test_fused_projection_keeps_preferred_element_type_and_precision():
    def f(x, w):
        return _flat_dot(x, w, preferred_element_type=jnp.int32, precision=lax.Precision.HIGHEST)

    x = jnp.full((2, 3, 4), 100, jnp.int8)        # products overflow int8, not int32
    w = jnp.full((4, 5), 100, jnp.int8)
    stats, out = _pass_as_jax_jit(passes.fuse_projections, f, x, w)
    assert stats["forward chain fused"] == 1
    dots = [e for e in out.jaxpr.eqns if e.primitive.name == "dot_general"]
    fused = [e for e in dots if len(e.invars[0].aval.shape) == 3]
    assert len(fused) == 1
    assert fused[0].params["preferred_element_type"] == jnp.int32
    assert fused[0].params["precision"] == dots[0].params["precision"] != None  # noqa: E711
    _same_as_jax_jit(f, x, w)


def test_fused_weight_grad_chain_integer_and_non_finite():
    def f(x, g):                                   # W: contract the flattened batch dim
        x = -x      # computed in the program: free to transpose (an input is not)
        return lax.dot_general(x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1]),
                               (((0,), (0,)), ((), ())))

    xi = jnp.arange(24, dtype=jnp.int32).reshape(2, 3, 4) * 2**27
    gi = jnp.arange(30, dtype=jnp.int32).reshape(2, 3, 5) - 11
    stats, _ = _pass_as_jax_jit(passes.fuse_projections, f, xi, gi)
    assert stats["weight-grad chain fused"] == 1
    _same_as_jax_jit(f, xi, gi)
    # small integers in float32: every order sums exactly; inf/nan positions kept
    xf = xi.astype(jnp.float32) / 2**27
    xf = xf.at[0, 0, 1].set(jnp.inf).at[1, 2, 2].set(jnp.nan).at[0, 1, 3].set(jnp.inf)
    gf = gi.astype(jnp.float32)
    _pass_as_jax_jit(passes.fuse_projections, f, xf, gf)
    _same_as_jax_jit(f, xf, gf)


def test_fused_projection_keeps_weak_type():
    def f(x, w):
        xw = _jax.convert_element_type(x, np.dtype(np.float32), True)   # weakly typed
        ww = _jax.convert_element_type(w, np.dtype(np.float32), True)
        return _flat_dot(xw, ww)

    x, w = jnp.ones((2, 3, 4)), jnp.ones((4, 5))
    stats, _ = _pass_as_jax_jit(passes.fuse_projections, f, x, w)
    assert stats["forward chain fused"] == 1
    _same_as_jax_jit(f, x, w)


def test_fuse_leaves_a_dot_with_an_explicit_out_sharding_alone():
    """The out_sharding names the 2-D shape; the fused contraction has another."""
    mesh = jax.make_mesh((2,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,),
                         devices=jax.devices()[:2])
    P = jax.sharding.PartitionSpec

    def f(x, w):
        return jnp.matmul(x.reshape(-1, 4), w, out_sharding=P(None, "d")).reshape(2, 3, 6)

    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.arange(24.0).reshape(2, 3, 4), jax.NamedSharding(mesh, P()))
        w = jax.device_put(jnp.ones((4, 6)), jax.NamedSharding(mesh, P()))
        closed = jax.make_jaxpr(f)(x, w)
        assert str(passes.fuse_projections(closed)) == str(closed)
        want, got = jax.jit(f)(x, w), jb.jit(f)(x, w)
        assert got.sharding.spec == want.sharding.spec
        _exact(got, want, "explicitly sharded projection")


# --- inline: einsum -> dot_general keeps precision and accumulation dtype -----

def test_inlined_einsum_keeps_preferred_element_type_and_precision():
    def f(a, b):
        return einsum_p.bind(a, b, lhs_dims=("i", "k"), rhs_dims=("k", "j"), out_dims=("j", "i"),
                             precision=lax.Precision.HIGHEST, preferred_element_type=jnp.int32)

    a = jnp.full((3, 4), 100, jnp.int8)           # int8 products overflow; int32 sums do not
    b = jnp.full((4, 2), -100, jnp.int8)
    stats, out = _pass_as_jax_jit(passes.inline, f, a, b)
    assert stats["einsum->dot_general"] == 1
    (dot,) = [e for e in out.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert dot.params["preferred_element_type"] == jnp.int32
    assert dot.params["precision"] == (lax.Precision.HIGHEST, lax.Precision.HIGHEST)
    assert out.out_avals[0].dtype == jnp.int32
    _same_as_jax_jit(f, a, b)
