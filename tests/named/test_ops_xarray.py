"""Every `jaxbackend.named` op against xarray, by name, on random shapes,
dim subsets, dim orders and values (hypothesis).

Each test draws one size per dim name, arrays over random subsets/orders of
those names, runs the op on NamedArrays and on xarray DataArrays holding the
same values, then compares after transposing ours to xarray's dim order.
Arithmetic also checks the result ORDER equals xarray's (outer union in
order of first appearance). Where our order deliberately differs (dot keeps
dot_general's natural order, where leads with the values' dims) only the set
of names is compared, which is all that names make observable.
"""

from __future__ import annotations

import operator
import os
import zlib

import numpy as np
import pytest
import scipy.special
import xarray as xr
from hypothesis import given, settings
from hypothesis import strategies as st

import jax
from jaxbackend import named as nx

from ._reference import BF16, assert_same, dims_st, pair, rng_st, scale_of, sizes_st

# NX_EXAMPLES_SCALE=10 runs 10x the examples (a deeper, slower search).
SCALE = int(os.environ.get("NX_EXAMPLES_SCALE", "1"))


def _n(k):
    return settings(max_examples=k * SCALE, deadline=None)


FEW, SOME = _n(6), _n(10)


# -- construction ---------------------------------------------------------------

@FEW
@given(sizes=sizes_st(), dims=dims_st(), rng=rng_st(),
       dtype=st.sampled_from([np.float32, BF16, np.int32, np.bool_]))
def test_construction(sizes, dims, rng, dtype):
    x, xa = pair(rng, dims, sizes, dtype)
    assert_same(x, xa, check_order=True)
    assert x.dtype == np.dtype(dtype)
    sz = {d: sizes[d] for d in dims}
    shape = tuple(sz.values())
    assert_same(nx.zeros(sz), xr.DataArray(np.zeros(shape, np.float32), dims=dims),
                check_order=True)
    assert_same(nx.ones(sz, dtype=np.int32), xr.DataArray(np.ones(shape, np.int32), dims=dims),
                check_order=True)
    f = nx.full(sz, 2.5)
    assert_same(f, xr.full_like(xa, 2.5, dtype=np.float32), check_order=True)
    assert nx.zeros(sz, dtype=np.bool_).dtype == np.bool_


@FEW
@given(start=st.integers(-4, 4), stop=st.integers(-4, 9), step=st.sampled_from([1, 2, 3, -1]))
def test_arange(start, stop, step):
    assert_same(nx.arange(stop, dim="t") if stop > 0 else nx.arange(start, stop, step, dim="t"),
                xr.DataArray(np.arange(stop) if stop > 0 else np.arange(start, stop, step),
                             dims=("t",)))
    assert nx.arange(start, stop, step, dim="t").dims == ("t",)


# -- selection and layout ---------------------------------------------------------

@SOME
@given(sizes=sizes_st(), dims=dims_st(min_size=1), rng=rng_st(), data=st.data())
def test_isel_basic_and_orthogonal(sizes, dims, rng, data):
    x, xa = pair(rng, dims, sizes)
    idx = {}
    for d in data.draw(st.lists(st.sampled_from(dims), unique=True, min_size=1)):
        n = sizes[d]
        kind = data.draw(st.sampled_from(["int", "slice", "array"]))
        if kind == "int":
            idx[d] = data.draw(st.integers(-n, n - 1))
        elif kind == "slice":
            idx[d] = slice(data.draw(st.none() | st.integers(-n, n)),
                           data.draw(st.none() | st.integers(-n, n)),
                           data.draw(st.sampled_from([None, 1, 2, -1])))
        else:
            idx[d] = np.array(data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=5)))
    assert_same(x.isel(**idx), xa.isel(**idx), check_order=True)
    assert_same(x.isel(idx), xa.isel(idx), check_order=True)


@SOME
@given(sizes=sizes_st(), dims=dims_st(min_size=1), rng=rng_st(), data=st.data())
def test_isel_vectorised(sizes, dims, rng, data):
    x, xa = pair(rng, dims, sizes)
    which = data.draw(st.lists(st.sampled_from(dims), unique=True, min_size=1))
    # Indexer dims: new names (p, q) shared by all indexers, so they index
    # pointwise, as in xarray's vectorised indexing.
    idims = data.draw(st.permutations(("p", "q")).map(lambda t: t[:data.draw(st.integers(0, 2))]))
    ishape = tuple(data.draw(st.integers(1, 3)) for _ in idims)
    named, ref = {}, {}
    for d in which:
        v = rng.integers(0, sizes[d], size=ishape).astype(np.int32)
        named[d] = nx.as_named(v, idims)
        ref[d] = xr.DataArray(v, dims=idims)
    ks = sorted(dims.index(d) for d in which)
    adjacent = ks == list(range(ks[0], ks[0] + len(ks)))  # then our order is xarray's
    assert_same(x.isel(named), xa.isel(ref), check_order=adjacent)


@FEW
@given(sizes=sizes_st(), dims=dims_st(min_size=1), rng=rng_st(), data=st.data())
def test_rename(sizes, dims, rng, data):
    x, xa = pair(rng, dims, sizes)
    old = data.draw(st.lists(st.sampled_from(dims), unique=True, min_size=1))
    m = {d: d.upper() for d in old}
    assert_same(x.rename(m), xa.rename(m), check_order=True)
    assert_same(x.rename(**m), xa.rename(m), check_order=True)


@SOME
@given(sizes=sizes_st(), dims=dims_st(min_size=1), rng=rng_st(), data=st.data())
def test_transpose(sizes, dims, rng, data):
    x, xa = pair(rng, dims, sizes)
    order = tuple(data.draw(st.permutations(dims)))
    assert_same(x.transpose(*order), xa.transpose(*order), check_order=True)
    k = data.draw(st.integers(0, len(dims)))
    head = order[:k]
    pos = data.draw(st.integers(0, len(head)))
    spec = head[:pos] + (...,) + head[pos:]
    assert_same(x.transpose(*spec), xa.transpose(*spec), check_order=True)
    assert_same(x.transpose(), xa.transpose(), check_order=True)


@FEW
@given(sizes=sizes_st(), dims=dims_st(max_size=3), rng=rng_st(), n=st.integers(1, 3))
def test_expand_dims_and_squeeze(sizes, dims, rng, n):
    x, xa = pair(rng, dims, sizes)
    assert_same(x.expand_dims("e", n), xa.expand_dims({"e": n}), check_order=True)
    assert_same(nx.expand_dims(x, {"e": n, "f": 1}), xa.expand_dims({"e": n, "f": 1}),
                check_order=True)
    ones = tuple(d for d in dims if sizes[d] == 1)
    assert_same(x.squeeze(), xa.squeeze(), check_order=True)
    if ones:
        assert_same(x.squeeze(ones[0]), xa.squeeze(ones[0]), check_order=True)
        assert_same(nx.squeeze(x, ones), xa.squeeze(ones), check_order=True)


@SOME
@given(sizes=sizes_st(), dims=dims_st(min_size=1), rng=rng_st(), data=st.data(),
       dtype=st.sampled_from([np.float32, np.int32, np.bool_]))
def test_concat(sizes, dims, rng, data, dtype):
    along = data.draw(st.sampled_from(dims + ("new",)))
    arrays, refs = [], []
    for _ in range(data.draw(st.integers(1, 3))):
        order = data.draw(st.permutations(dims))  # operands may differ in order
        s = dict(sizes, **({along: data.draw(st.integers(1, 3))} if along in dims else {}))
        a, aa = pair(rng, order, s, dtype)
        arrays.append(a)
        refs.append(aa)
    assert_same(nx.concat(arrays, along), xr.concat(refs, along))


@SOME
@given(sizes=sizes_st(), dims=dims_st(min_size=2), rng=rng_st(), data=st.data())
def test_stack_and_unstack(sizes, dims, rng, data):
    x, xa = pair(rng, dims, sizes)
    olds = tuple(data.draw(st.permutations(dims))[:data.draw(st.integers(1, len(dims)))])
    ref = xa.stack(m=olds)  # new dim last, row-major over `olds`
    ours = nx.stack(x, m=olds)
    assert_same(ours, xr.DataArray(ref.values, dims=ref.dims))
    assert_same(x.stack({"m": olds}), xr.DataArray(ref.values, dims=ref.dims))
    # unstack is checked against xarray's own unstack of its stacked array.
    back = nx.unstack(nx.as_named(ref.values, ref.dims), m={d: sizes[d] for d in olds})
    want = ref.unstack("m")
    assert_same(back, xr.DataArray(want.values, dims=want.dims))
    assert_same(back, xa)


# -- elementwise -------------------------------------------------------------------

def _gelu(v):
    v = v.astype(np.float64)
    return 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v ** 3)))


# name -> (numpy reference, dtypes, input domain)
UNARY = {
    "exp": (np.exp, "fb", None), "log": (np.log, "f", "pos"), "log1p": (np.log1p, "f", "pos"),
    "expm1": (np.expm1, "f", None), "tanh": (np.tanh, "fb", None),
    "sqrt": (np.sqrt, "fb", "pos"), "rsqrt": (lambda v: 1 / np.sqrt(v), "f", "pos"),
    "abs": (np.abs, "fbi", None), "sin": (np.sin, "f", None), "cos": (np.cos, "f", None),
    "square": (np.square, "fi", None), "negative": (np.negative, "fbi", None),
    "sign": (np.sign, "fi", None), "floor": (np.floor, "f", None), "ceil": (np.ceil, "f", None),
    "round": (np.round, "f", None), "reciprocal": (np.reciprocal, "f", "pos"),
    "erf": (scipy.special.erf, "f", None), "sigmoid": (scipy.special.expit, "f", None),
    "relu": (lambda v: np.maximum(v, 0), "fi", None), "gelu": (_gelu, "f", None),
    "silu": (lambda v: v * scipy.special.expit(v), "f", None),
    "logical_not": (np.logical_not, "o", None), "isnan": (np.isnan, "f", None),
    "isfinite": (np.isfinite, "f", None), "stop_gradient": (lambda v: v, "f", None),
}
CODES = {"f": np.float32, "b": BF16, "i": np.int32, "o": np.bool_}
UNARY_CASES = [(n, c) for n, (_, codes, _) in UNARY.items() for c in codes]


@pytest.mark.parametrize("name,code", UNARY_CASES)
def test_unary(name, code):
    ref_fn, _, domain = UNARY[name]
    rng = np.random.default_rng(zlib.crc32(f"{name}/{code}".encode()))
    sizes = {"a": 2, "b": 3, "c": 1}
    x, xa = pair(rng, ("b", "a", "c"), sizes, CODES[code], positive=domain == "pos")
    if code == "b":  # reference in float32 on the bf16 values, rounded like ours
        want = xr.apply_ufunc(lambda v: ref_fn(v.astype(np.float32)).astype(BF16), xa)
    else:
        want = xr.apply_ufunc(ref_fn, xa)
    assert_same(getattr(nx, name)(x), want, check_order=True)


BINARY = {  # name -> (operator or numpy reference, dtypes, rhs domain)
    "add": (operator.add, "fbi"), "subtract": (operator.sub, "fbi"),
    "multiply": (operator.mul, "fbi"), "divide": (operator.truediv, "fb"),
    "floor_divide": (operator.floordiv, "fi"), "mod": (operator.mod, "fi"),
    "power": (operator.pow, "f"), "maximum": (np.maximum, "fbi"), "minimum": (np.minimum, "fbi"),
    "arctan2": (np.arctan2, "f"), "logical_and": (np.logical_and, "o"),
    "logical_or": (np.logical_or, "o"), "logical_xor": (np.logical_xor, "o"),
    "equal": (operator.eq, "fio"), "not_equal": (operator.ne, "fio"), "less": (operator.lt, "fi"),
    "less_equal": (operator.le, "fi"), "greater": (operator.gt, "fi"),
    "greater_equal": (operator.ge, "fi"),
}
DUNDER = {"add": operator.add, "subtract": operator.sub, "multiply": operator.mul,
          "divide": operator.truediv, "floor_divide": operator.floordiv, "mod": operator.mod,
          "power": operator.pow, "logical_and": operator.and_, "logical_or": operator.or_,
          "logical_xor": operator.xor, "equal": operator.eq, "not_equal": operator.ne,
          "less": operator.lt, "less_equal": operator.le, "greater": operator.gt,
          "greater_equal": operator.ge}


@pytest.mark.parametrize("name", sorted(BINARY))
@_n(4)
@given(sizes=sizes_st(), rng=rng_st(), data=st.data())
def test_binary_broadcasts_by_name(name, sizes, rng, data):
    ref_fn, codes = BINARY[name]
    dtype = CODES[data.draw(st.sampled_from(codes))]
    da, db = data.draw(dims_st()), data.draw(dims_st())
    pos = name in ("power", "floor_divide", "mod", "divide")
    a, aa = pair(rng, da, sizes, dtype, positive=name == "power")
    b, bb = pair(rng, db, sizes, dtype, positive=pos and dtype != np.int32, nonzero=pos)
    want = ref_fn(aa, bb)
    if dtype == BF16:
        want = xr.apply_ufunc(lambda u, v: np.asarray(ref_fn(u.astype(np.float32), v.astype(
            np.float32))).astype(BF16), aa, bb)
    got = getattr(nx, name)(a, b)
    assert_same(got, want, check_order=True)
    if name in DUNDER:
        assert_same(DUNDER[name](a, b), want, check_order=True)


@_n(5)
@given(sizes=sizes_st(hi=3), dims=dims_st(), rng=rng_st(), s=st.floats(0.5, 3.0))
def test_scalar_operands(sizes, dims, rng, s):
    x, xa = pair(rng, dims, sizes)
    for fn in (operator.add, operator.sub, operator.mul, operator.truediv, operator.lt):
        assert_same(fn(x, s), fn(xa, s), check_order=True)
        assert_same(fn(s, x), fn(s, xa), check_order=True)
    assert_same(-x, -xa, check_order=True)
    assert_same(abs(x), abs(xa), check_order=True)
    assert_same(x ** 2, xa ** 2, check_order=True)
    assert_same(nx.clip(x, -0.5, 0.5), xa.clip(-0.5, 0.5), check_order=True)


# -- reductions ---------------------------------------------------------------------

REDUCE = {"sum": "fi", "mean": "fi", "max": "fi", "min": "fi", "prod": "f", "std": "f",
          "var": "f", "any": "o", "all": "o"}


@pytest.mark.parametrize("name", sorted(REDUCE))
@_n(5)
@given(sizes=sizes_st(), dims=dims_st(min_size=1), rng=rng_st(), data=st.data())
def test_reductions(name, sizes, dims, rng, data):
    dtype = CODES[data.draw(st.sampled_from(REDUCE[name]))]
    x, xa = pair(rng, dims, sizes, dtype)
    kind = data.draw(st.sampled_from(["str", "tuple", "none"]))
    if kind == "str":
        dim = data.draw(st.sampled_from(dims))
    elif kind == "tuple":
        dim = tuple(data.draw(st.lists(st.sampled_from(dims), unique=True, min_size=1)))
    else:
        dim = None
    want = getattr(xa, name)(dim=dim)
    # the error model's scale: sum|terms| for sum and mean (the same
    # reduction of |x|), abs_scale's for var and std; max, min, any and all
    # are exact, prod relative to itself (the default, max|want|)
    scale = {"sum": lambda: abs(xa).sum(dim=dim), "mean": lambda: abs(xa).mean(dim=dim),
             "var": lambda: scale_of(lambda v: v.var(dim=dim), x),
             "std": lambda: scale_of(lambda v: v.std(dim=dim), x)}.get(name, lambda: None)()
    assert_same(getattr(x, name)(dim=dim), want, check_order=True, scale=scale)
    assert_same(getattr(nx, name)(x, dim), want, check_order=True, scale=scale)


# -- where, softmax family ---------------------------------------------------------------

@SOME
@given(sizes=sizes_st(), rng=rng_st(), data=st.data(), scalar_y=st.booleans())
def test_where(sizes, rng, data, scalar_y):
    c, cc = pair(rng, data.draw(dims_st()), sizes, np.bool_)
    a, aa = pair(rng, data.draw(dims_st()), sizes)
    if scalar_y:
        b, bb = -1e9, -1e9
    else:
        b, bb = pair(rng, data.draw(dims_st()), sizes)
    got = nx.where(c, a, b)
    if not isinstance(got, nx.NamedArray):  # all three 0-d: a plain array, as jnp.where
        got = nx.as_named(got, ())
    assert_same(got, xr.where(cc, aa, bb))


def _softmax_ref(xa, dim, fn):
    return xr.DataArray(fn(xa.values, axis=xa.get_axis_num(dim)), dims=xa.dims)


@_n(5)
@given(sizes=sizes_st(hi=3), dims=dims_st(min_size=1), rng=rng_st(), data=st.data())
def test_softmax_family(sizes, dims, rng, data):
    x, xa = pair(rng, dims, sizes)
    x, xa = x * 30, xa * 30  # large logits: only the stable formula survives
    dim = data.draw(st.sampled_from(dims))
    assert_same(nx.softmax(x, dim), _softmax_ref(xa, dim, scipy.special.softmax),
                check_order=True, scale=scale_of(lambda v: nx.softmax(v, dim), x))
    assert_same(nx.log_softmax(x, dim), _softmax_ref(xa, dim, scipy.special.log_softmax),
                check_order=True, scale=scale_of(lambda v: nx.log_softmax(v, dim), x))
    red = tuple(data.draw(st.lists(st.sampled_from(dims), unique=True, min_size=1)))
    axes = tuple(xa.get_axis_num(d) for d in red)
    want = xr.DataArray(scipy.special.logsumexp(xa.values, axis=axes),
                        dims=tuple(d for d in dims if d not in red))
    assert_same(nx.logsumexp(x, red), want, check_order=True,
                scale=scale_of(lambda v: nx.logsumexp(v, red), x))
    assert_same(nx.logsumexp(x, red[0]), xr.DataArray(
        scipy.special.logsumexp(xa.values, axis=xa.get_axis_num(red[0])),
        dims=tuple(d for d in dims if d != red[0])), check_order=True,
        scale=scale_of(lambda v: nx.logsumexp(v, red[0]), x))
    big = nx.as_named(np.array([1000.0, 0.0], np.float32), ("z",))
    assert np.all(np.isfinite(np.asarray(nx.softmax(big, "z").values)))


# -- contraction ----------------------------------------------------------------------

@SOME
@given(sizes=sizes_st(), rng=rng_st(), data=st.data(), n=st.integers(2, 3),
       dtype=st.sampled_from([np.float32, np.int32]))
def test_dot(sizes, rng, data, n, dtype):
    arrays, refs = [], []
    for _ in range(n):
        a, aa = pair(rng, data.draw(dims_st(min_size=1, max_size=3)), sizes, dtype)
        arrays.append(a)
        refs.append(aa)
    union = sorted({d for a in arrays for d in a.dims})
    kind = data.draw(st.sampled_from(["none", "ellipsis", "str", "tuple"]))
    if kind == "none":
        dim = None
    elif kind == "ellipsis":
        dim = ...
    elif kind == "str":
        dim = data.draw(st.sampled_from(union))
    else:
        dim = tuple(data.draw(st.lists(st.sampled_from(union), unique=True, min_size=1)))
    want = xr.dot(*refs, dim=dim)
    scale = xr.dot(*map(abs, refs), dim=dim)      # sum|terms| of each entry
    assert_same(nx.dot(*arrays, dim=dim), want, scale=scale)
    assert_same(arrays[0].dot(*arrays[1:], dim=dim), want, scale=scale)
    if n == 2:
        assert_same(arrays[0] @ arrays[1], refs[0] @ refs[1], scale=abs(refs[0]) @ abs(refs[1]))


@SOME
@given(sizes=sizes_st(), rng=rng_st(), data=st.data(), n=st.integers(1, 3))
def test_einsum_contracts_every_dim_not_in_out(sizes, rng, data, n):
    arrays, refs = [], []
    for _ in range(n):
        a, aa = pair(rng, data.draw(dims_st(min_size=1, max_size=3)), sizes)
        arrays.append(a)
        refs.append(aa)
    union = sorted({d for a in arrays for d in a.dims})
    out = tuple(data.draw(st.permutations(union))[:data.draw(st.integers(0, len(union)))])
    want = xr.dot(*refs, dim=[d for d in union if d not in out]).transpose(*out)
    got = nx.einsum(*arrays, out=out)
    scale = xr.dot(*map(abs, refs), dim=[d for d in union if d not in out])
    assert_same(got, want, check_order=True, scale=scale)
    if n > 1:  # the last contraction is one einsum equation that yields `out`
        jaxpr = jax.make_jaxpr(lambda *a: nx.einsum(*a, out=out))(*arrays).jaxpr
        assert jaxpr.eqns[-1].primitive is nx.einsum_p
        assert jaxpr.eqns[-1].params["out_dims"] == out


def test_dot_bfloat16_matches_float32_reference():
    rng = np.random.default_rng(0)
    sizes = dict(a=3, b=4, c=2)
    x, xa = pair(rng, ("a", "b"), sizes, BF16)
    y, ya = pair(rng, ("c", "b"), sizes, BF16)
    got = nx.dot(x, y, dim="b")
    assert got.dtype == BF16
    assert_same(got, xr.dot(xa.astype(np.float32), ya.astype(np.float32), dim="b"))


def test_ops_work_under_jit():
    rng = np.random.default_rng(1)
    sizes = dict(a=3, b=4, c=2)
    x, xa = pair(rng, ("a", "b"), sizes)
    y, ya = pair(rng, ("c", "b"), sizes)

    @jax.jit
    def f(x, y, i):
        s = nx.softmax(x + y, "b")
        return nx.dot(s, y, dim="b").isel(a=i).sum("c"), x.isel(b=i)

    o1, o2 = f(x, y, 2)
    xy = xa + ya
    s = xr.DataArray(scipy.special.softmax(xy.values, axis=xy.get_axis_num("b")), dims=xy.dims)
    assert_same(o1, xr.dot(s, ya, dim="b").isel(a=2).sum("c"),
                scale=scale_of(lambda x, y: f(x, y, 2)[0], x, y))
    assert_same(o2, xa.isel(b=2))

