"""`nx.take` and `nx.cross_entropy` against slow, obvious references.

* take, both cases (index dims all new: whole slices; index dims shared with
  x's other dims: pointwise), on random dims, orders and sizes (hypothesis):
  values equal xarray's vectorised `.isel(vocab=DataArray)` by name, and
  `jnp.take` / `jnp.take_along_axis` exactly; the result order is x's with
  `dim` replaced in place. Out-of-range indices equal jnp.take's default.
* cross_entropy against optax.softmax_cross_entropy_with_integer_labels,
  forward and grad, float32 and bfloat16 logits (loss in float32), against
  -take(log_softmax) on random layouts, and against a float64 formula on
  large logits (the max shift keeps float32 accurate there).
* the GPT layout emits the same primitives as its hand-written jnp twin.
* errors: one line, naming the argument, dim, dims or sizes, and the fix.
"""

from __future__ import annotations

import collections
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import scipy.special
import xarray as xr
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxbackend import _jax
from jaxbackend import named as nx
from jaxbackend.testing import assert_close

from ._reference import BF16, dims_st, pair, rng_st, sizes_st

# NX_EXAMPLES_SCALE=10 runs 10x the examples, as in test_ops_xarray.
FEW = settings(max_examples=12 * int(os.environ.get("NX_EXAMPLES_SCALE", "1")), deadline=None)
V = "v"  # the gathered dim


def _exact(ours, ref: xr.DataArray):
    """`ours` equals `ref` by name, exactly (a gather copies values)."""
    assert sorted(ours.dims) == sorted(ref.dims), (ours.dims, ref.dims)
    got = np.asarray(ours.transpose(*ref.dims).values)
    np.testing.assert_array_equal(got, np.asarray(ref.values))


@st.composite
def _x_st(draw, min_other=0):
    """(sizes, x dims): dims from (a, b, c) in random order, with V inserted
    at a random position."""
    sizes = draw(sizes_st(pool=("a", "b", "c", V, "i", "j")))
    others = draw(dims_st(pool=("a", "b", "c"), min_size=min_other))
    k = draw(st.integers(0, len(others)))
    return sizes, others[:k] + (V,) + others[k:]


def _indices(rng, n, shape):
    # In range, negatives included: -n <= i < n counts from the end (numpy).
    return rng.integers(-n, n, size=shape).astype(np.int32)


# -- take -------------------------------------------------------------------------

@FEW
@given(xs=_x_st(), idims=dims_st(pool=("i", "j", V)), nv=st.integers(1, 3), rng=rng_st(),
       dtype=st.sampled_from([np.float32, BF16, np.int32]))
def test_take_with_new_index_dims_is_jnp_take_in_place(xs, idims, nv, rng, dtype):
    # V may be an index dim too: x's V is replaced by the index's own V
    # (size nv here), as xarray does.
    sizes, xdims = xs
    x, xa = pair(rng, xdims, sizes, dtype)
    isizes = {**sizes, V: nv}
    iv = _indices(rng, sizes[V], tuple(isizes[d] for d in idims))
    idx = nx.as_named(iv, idims)
    out = nx.take(x, idx, V)
    k = xdims.index(V)
    assert out.dims == xdims[:k] + idims + xdims[k + 1:]
    assert out.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(out.values),
                                  np.asarray(jnp.take(x.values, iv, axis=k)))
    _exact(out, xa.isel({V: xr.DataArray(iv, dims=idims)}))
    _exact(x.take(idx, V), xa.isel({V: xr.DataArray(iv, dims=idims)}))


@FEW
@given(xs=_x_st(min_other=1), data=st.data(), nv=st.integers(1, 3), rng=rng_st())
def test_take_with_shared_index_dims_is_pointwise(xs, data, nv, rng):
    # Index dims shared with x's other dims pair up by name (take_along_axis);
    # x's dims the indices lack are read whole; new index dims replace V.
    sizes, xdims = xs
    x, xa = pair(rng, xdims, sizes)
    others = [d for d in xdims if d != V]
    shared = data.draw(st.lists(st.sampled_from(others), unique=True, min_size=1))
    new = data.draw(st.lists(st.sampled_from(["i", "j", V]), unique=True))
    idims = tuple(data.draw(st.permutations(shared + new)))
    isizes = {**sizes, V: nv}
    iv = _indices(rng, sizes[V], tuple(isizes[d] for d in idims))
    out = nx.take(x, nx.as_named(iv, idims), V)
    k = xdims.index(V)
    new_in_order = tuple(d for d in idims if d in new)
    assert out.dims == xdims[:k] + new_in_order + xdims[k + 1:]
    _exact(out, xa.isel({V: xr.DataArray(iv, dims=idims)}))


@pytest.mark.parametrize("ldims,tdims", [
    (("batch", "time", "vocab"), ("batch", "time")),
    (("vocab", "time", "batch"), ("time", "batch")),
    (("time", "vocab", "batch"), ("batch",)),
])
def test_take_is_take_along_axis_for_targets(ldims, tdims):
    rng = np.random.default_rng(0)
    lp = rng.standard_normal((2, 3, 5)).astype(np.float32)  # (batch, time, vocab)
    t = rng.integers(0, 5, (2, 3)).astype(np.int32)
    if tdims == ("batch",):
        t = t[:, :1].repeat(3, axis=1)  # one target per batch row, every time step
    logits = nx.as_named(lp, ("batch", "time", "vocab")).transpose(*ldims)
    targets = nx.as_named(t, ("batch", "time")).isel(time=0) if tdims == ("batch",) else \
        nx.as_named(t, ("batch", "time")).transpose(*tdims)
    out = nx.take(logits, targets, "vocab")
    assert out.dims == tuple(d for d in ldims if d != "vocab")
    want = jnp.take_along_axis(lp, t[..., None], axis=-1)[..., 0]
    np.testing.assert_array_equal(np.asarray(out.transpose("batch", "time").values),
                                  np.asarray(want))


def test_out_of_range_indices_follow_jnp_take_default():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    xn = nx.as_named(x, ("b", V))
    bad = np.array([-5, -1, 0, 3, 4, 7], np.int32)
    # Whole slices: exactly jnp.take's default (fill: NaN; -4 <= i < 0 wraps).
    out = nx.take(xn, nx.as_named(bad, ("i",)), V)
    np.testing.assert_array_equal(np.asarray(out.values), np.asarray(jnp.take(x, bad, axis=1)))
    assert np.isnan(np.asarray(out.values)[:, [0, 4, 5]]).all()
    np.testing.assert_array_equal(np.asarray(out.values)[:, 1], x[:, 3])
    # Pointwise: the same rule per position.
    tb = np.array([-1, 4, -5], np.int32)
    np.testing.assert_array_equal(np.asarray(nx.take(xn, nx.as_named(tb, ("b",)), V).values),
                                  np.array([3.0, np.nan, np.nan], np.float32))
    # Integers fill with the dtype's minimum, as jnp.take.
    xi = nx.as_named(x.astype(np.int32), ("b", V))
    np.testing.assert_array_equal(
        np.asarray(nx.take(xi, nx.as_named(tb, ("b",)), V).values),
        np.asarray(jnp.take_along_axis(x.astype(np.int32), tb[:, None], axis=1)[:, 0]))
    # mode / fill_value pass through.
    np.testing.assert_array_equal(
        np.asarray(nx.take(xn, nx.as_named(bad, ("i",)), V, mode="clip").values),
        np.asarray(jnp.take(x, bad, axis=1, mode="clip")))
    np.testing.assert_array_equal(
        np.asarray(nx.take(xn, nx.as_named(tb, ("b",)), V, fill_value=-1.0).values),
        np.array([3.0, -1.0, -1.0], np.float32))
    # Out-of-range positions get no gradient, as jnp.take's.
    g = jax.grad(lambda v: jnp.nansum(nx.take(nx.as_named(v, ("b", V)),
                                              nx.as_named(tb, ("b",)), V).values))(x)
    g_ref = jax.grad(lambda v: jnp.nansum(jnp.take_along_axis(v, tb[:, None], axis=1)))(x)
    np.testing.assert_array_equal(np.asarray(g), np.asarray(g_ref))
    assert float(np.asarray(g).sum()) == 1.0


def test_take_scalar_and_unnamed_indices():
    rng = np.random.default_rng(1)
    x, xa = pair(rng, ("b", V, "c"), {"b": 2, V: 4, "c": 3})
    _exact(nx.take(x, 2, V), xa.isel({V: 2}))  # a 0-d index drops the dim
    _exact(nx.take(x, np.int32(-1), V), xa.isel({V: -1}))
    iv = np.array([[0, 3], [1, 1], [2, 0]], np.int32)
    _exact(nx.take(x, iv, V, index_dims=("i", "j")),
           xa.isel({V: xr.DataArray(iv, dims=("i", "j"))}))
    _exact(nx.take(x, iv, V, index_dims=("c", "j")),
           xa.isel({V: xr.DataArray(iv, dims=("c", "j"))}))
    iv3 = np.arange(24, dtype=np.int32).reshape(2, 3, 4) % 4  # shared c, two new dims
    out = nx.take(x, iv3, V, index_dims=("i", "c", "j"))
    assert out.dims == ("b", "i", "j", "c")
    _exact(out, xa.isel({V: xr.DataArray(iv3, dims=("i", "c", "j"))}))


def test_take_under_jit_and_grad():
    rng = np.random.default_rng(2)
    x = nx.as_named(rng.standard_normal((2, 5)).astype(np.float32), ("b", V))
    t = nx.as_named(np.array([4, 0], np.int32), ("b",))
    out = jax.jit(lambda x, t: nx.take(x, t, V))(x, t)
    assert out.dims == ("b",)
    np.testing.assert_array_equal(np.asarray(out.values), np.asarray(x.values)[[0, 1], [4, 0]])
    g = jax.grad(lambda x: nx.take(x, t, V).sum().values)(x)
    want = np.zeros((2, 5), np.float32)
    want[0, 4] = want[1, 0] = 1.0
    assert g.dims == ("b", V)
    np.testing.assert_array_equal(np.asarray(g.values), want)


# -- cross entropy -------------------------------------------------------------------

def _optax_loss(lv, tv):
    return optax.softmax_cross_entropy_with_integer_labels(lv.astype(jnp.float32), tv)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("ldims,tdims", [
    (("batch", "time", "vocab"), ("batch", "time")),
    (("vocab", "batch", "time"), ("time", "batch")),
])
def test_cross_entropy_matches_optax_forward_and_grad(dtype, ldims, tdims):
    rng = np.random.default_rng(3)
    lv = jnp.asarray(3 * rng.standard_normal((4, 6, 11)), dtype)  # (batch, time, vocab)
    tv = jnp.asarray(rng.integers(0, 11, (4, 6)), jnp.int32)
    w = jnp.asarray(rng.standard_normal((4, 6)), jnp.float32)  # distinct weight per position

    def named(lv):
        logits = nx.as_named(lv, ("batch", "time", "vocab")).transpose(*ldims)
        targets = nx.as_named(tv, ("batch", "time")).transpose(*tdims)
        return nx.cross_entropy(logits, targets, "vocab")

    loss = named(lv)
    assert loss.dims == tuple(d for d in ldims if d != "vocab")
    assert loss.dtype == jnp.float32  # float32 even from bfloat16 logits
    # The reference runs optax in float32 on the same (upcast) logits, so
    # bfloat16 logits must match it to float32 accuracy.
    want = _optax_loss(lv, tv)
    assert_close(loss.transpose("batch", "time").values, want, what="cross_entropy")

    def ours_total(lv):
        return (named(lv).transpose("batch", "time").values * w).sum()

    def ref_total(lv):
        return (_optax_loss(lv, tv) * w).sum()

    g, g_ref = jax.grad(ours_total)(lv), jax.grad(ref_total)(lv)
    assert g.dtype == dtype
    # Each gradient entry is w * (softmax - onehot): no long sums, so the
    # default per-dtype tolerances apply (bfloat16: one rounding of each).
    assert_close(g, g_ref, what=f"grad ({jnp.dtype(dtype).name})")


@FEW
@given(xs=_x_st(min_other=1), data=st.data(), rng=rng_st(),
       dtype=st.sampled_from([np.float32, BF16]))
def test_cross_entropy_is_minus_take_of_log_softmax(xs, data, rng, dtype):
    # Any layout and either take case: the loss is -log_softmax at the targets.
    sizes, xdims = xs
    x, _ = pair(rng, xdims, sizes, dtype)
    others = [d for d in xdims if d != V]
    idims = tuple(data.draw(st.permutations(
        data.draw(st.lists(st.sampled_from(others + ["i"]), unique=True)))))
    t = nx.as_named(rng.integers(0, sizes[V], tuple(sizes[d] for d in idims)), idims)
    loss = nx.cross_entropy(x, t, V)
    want = -nx.take(nx.log_softmax(x.astype(np.float32), V), t, V)
    assert loss.dims == want.dims
    assert loss.dtype == np.float32
    assert_close(loss.values, want.values, what="cross_entropy")


def test_cross_entropy_is_accurate_for_large_logits():
    # Logits near 1e4: lse and the target logit are both ~1e4, and float32
    # resolves 1e4 to ~1e-3, so lse - logit would lose three digits. After
    # the max shift the loss is a difference of O(1) terms.
    rng = np.random.default_rng(4)
    lv = (1e4 + rng.standard_normal((8, 16))).astype(np.float32)
    tv = rng.integers(0, 16, (8,)).astype(np.int32)
    loss = nx.cross_entropy(nx.as_named(lv, ("b", "vocab")), nx.as_named(tv, ("b",)), "vocab")
    l64 = lv.astype(np.float64)
    want = scipy.special.logsumexp(l64, axis=1) - l64[np.arange(8), tv]
    # float32's error model (the default) is ~100x tighter than the 1e-3 the
    # unshifted difference would lose
    assert_close(loss.values, want, what="large-logit loss")


def test_cross_entropy_of_out_of_range_target_is_nan():
    lv = np.zeros((2, 3), np.float32)
    loss = nx.cross_entropy(nx.as_named(lv, ("b", "vocab")),
                            nx.as_named(np.array([1, 3], np.int32), ("b",)), "vocab")
    np.testing.assert_array_equal(np.isnan(np.asarray(loss.values)), [False, True])


def _counts(closed):
    """Primitive names of `closed` and, recursively, its sub-jaxprs (minus
    the `jit` wrappers jnp puts around take_along_axis)."""
    out = collections.Counter()

    def walk(jaxpr):
        for e in jaxpr.eqns:
            out[e.primitive.name] += e.primitive.name != "jit"
            for v in e.params.values():
                for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                    if isinstance(sub, _jax.ClosedJaxpr):
                        walk(sub.jaxpr)
                    elif isinstance(sub, _jax.Jaxpr):
                        walk(sub)
    walk(closed.jaxpr)
    return +out


def test_gpt_loss_emits_the_primitives_of_its_jnp_twin():
    rng = np.random.default_rng(5)
    lv = jnp.asarray(rng.standard_normal((2, 8, 32)), jnp.bfloat16)
    tv = jnp.asarray(rng.integers(0, 32, (2, 8)), jnp.int32)

    def named(lv):
        return nx.cross_entropy(nx.as_named(lv, ("batch", "time", "vocab")),
                                nx.as_named(tv, ("batch", "time")), "vocab").mean().values

    def twin(lv):  # optax's formulation with the max shift, written in jnp
        x = lv.astype(jnp.float32)
        s = x - jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
        picked = jnp.take_along_axis(s, tv[..., None], axis=-1)[..., 0]
        return (jnp.log(jnp.sum(jnp.exp(s), axis=-1)) - picked).mean()

    for fn in (lambda f: f, jax.grad):
        got, want = _counts(jax.make_jaxpr(fn(named))(lv)), _counts(jax.make_jaxpr(fn(twin))(lv))
        assert got == want, (got, want)
        assert got["gather"] == 1 and "transpose" not in got


# -- errors ----------------------------------------------------------------------

X = nx.as_named(np.zeros((2, 3, 5), np.float32), ("batch", "time", "vocab"))
T = nx.as_named(np.zeros((2, 3), np.int32), ("batch", "time"))


def _message(exc_type, call, *fragments):
    with pytest.raises(exc_type) as info:
        call()
    msg = str(info.value)
    assert "\n" not in msg and msg.endswith("."), msg
    for f in fragments:
        assert f in msg, f"{f!r} not in message: {msg}"


@pytest.mark.parametrize("op", [nx.take, nx.cross_entropy])
def test_float_or_bool_targets_are_a_type_error(op):
    _message(TypeError, lambda: op(X, T.astype(np.float32), "vocab"),
             op.__name__, "float32", "integers", ".astype(jnp.int32)")
    _message(TypeError, lambda: op(X, T.astype(bool), "vocab"), op.__name__, "bool")


@pytest.mark.parametrize("op", [nx.take, nx.cross_entropy])
def test_dim_missing_from_logits(op):
    _message(nx.DimError, lambda: op(X, T, "vocb"),
             op.__name__, "'vocb'", "('batch', 'time', 'vocab')")
    _message(nx.DimError, lambda: op(X, T, ("vocab",)), op.__name__, "one dim name",
             "('batch', 'time', 'vocab')")


@pytest.mark.parametrize("op", [nx.take, nx.cross_entropy])
def test_size_mismatch_on_shared_dims(op):
    t = nx.as_named(np.zeros((2, 4), np.int32), ("batch", "time"))
    _message(nx.DimError, lambda: op(X, t, "vocab"), op.__name__, "'time'", "size 3", "size 4",
             "('batch', 'time', 'vocab')", "rename")


def test_unnamed_arguments():
    _message(nx.DimError, lambda: nx.take(X, np.zeros((2, 3), np.int32), "vocab"),
             "take", "(2, 3)", "nx.as_named", "index_dims")
    _message(nx.DimError, lambda: nx.cross_entropy(X, np.zeros((2, 3), np.int32), "vocab"),
             "cross_entropy", "targets", "(2, 3)", "nx.as_named")
    _message(nx.DimError, lambda: nx.take(X, np.zeros(2, np.int32), "vocab", index_dims=("a", "b")),
             "take", "1 axes", "('a', 'b')")
    _message(nx.DimError, lambda: nx.take(X, T, "vocab", index_dims=("batch", "time")),
             "take", "index_dims", "drop")
    _message(nx.DimError, lambda: nx.cross_entropy(X.values, T, "vocab"),
             "cross_entropy", "logits", "nx.as_named")
    _message(TypeError, lambda: nx.cross_entropy(X.astype(np.int32), T, "vocab"),
             "cross_entropy", "int32", "floating")
