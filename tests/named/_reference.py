"""Shared helpers for the named front-end tests: random named arrays paired
with their xarray twins, and a comparison by name.

The oracle is xarray (plus numpy/scipy formulas applied to xarray values):
every test builds the same data twice, runs the op both ways, transposes our
result to the reference's dim order and compares values. Sizes stay tiny
(1..4 per dim) so each hypothesis example costs milliseconds.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import xarray as xr
from hypothesis import strategies as st

from jaxbackend import named as nx
from jaxbackend.testing import abs_scale, assert_close

POOL = ("a", "b", "c", "d")
BF16 = ml_dtypes.bfloat16


@st.composite
def sizes_st(draw, pool=POOL, lo=1, hi=4):
    """One size per dim name: a name means one size across all arrays."""
    return {d: draw(st.integers(lo, hi)) for d in pool}


@st.composite
def dims_st(draw, pool=POOL, min_size=0, max_size=None):
    """A random subset of `pool` in a random order."""
    perm = draw(st.permutations(pool))
    k = draw(st.integers(min_size, len(pool) if max_size is None else max_size))
    return tuple(perm[:k])


def values(rng, shape, dtype):
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    if dtype.kind in "iu":
        return rng.integers(-5, 6, size=shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def pair(rng, dims, sizes, dtype=np.float32, positive=False, nonzero=False):
    """(NamedArray, DataArray) holding the same values."""
    v = values(rng, tuple(sizes[d] for d in dims), dtype)
    if positive:
        v = (np.abs(v.astype(np.float32)) + 0.5).astype(dtype)
    if nonzero:
        v = np.where(v == 0, np.ones_like(v), v)
    return nx.as_named(v, dims), xr.DataArray(v, dims=dims)


def assert_same(ours, ref, *, check_order=False, rtol=None, atol=None, scale=None):
    """`ours` (NamedArray) equals `ref` (DataArray) by name, by
    `jaxbackend.testing.assert_close` (scale: a DataArray, e.g. the same
    reduction of |x| or `scale_of`, or a number; default max|ref|; atol: the
    subnormal flush, below)."""
    assert isinstance(ours, nx.NamedArray), type(ours)
    assert isinstance(ref, xr.DataArray), type(ref)
    assert sorted(ours.dims) == sorted(ref.dims), (ours.dims, ref.dims)
    if check_order:
        assert ours.dims == tuple(ref.dims), (ours.dims, ref.dims)
    got = np.asarray(ours.transpose(*ref.dims).values)
    want = np.asarray(ref.values)
    assert got.shape == want.shape, (got.shape, want.shape)
    if got.dtype == np.bool_ or want.dtype == np.bool_:
        np.testing.assert_array_equal(got, want)
        return
    # the project's error model: per-dtype rtol, integers exact, non-finite
    # patterns exact (xarray computes in the same dtype, or wider). XLA:CPU
    # flushes subnormal results to 0 where numpy keeps them: a value below
    # the smallest normal of the type our ops ran in may move by itself
    if isinstance(scale, xr.DataArray):
        scale = np.asarray(scale.transpose(*ref.dims).values)
    if atol is None:
        atol = float(np.finfo(np.float64 if got.dtype == np.float64 else np.float32).tiny)
    assert_close(got, want, rtol=rtol, atol=atol, scale=scale, what=f"{ours.dims}")


def scale_of(fn, *args) -> xr.DataArray:
    """The error model's scale of `fn(*args)` (a NamedArray function):
    `jaxbackend.testing.abs_scale`, as a DataArray for `assert_same`."""
    s = abs_scale(fn, *args)
    return xr.DataArray(np.asarray(s.values), dims=s.dims)


def rng_st():
    return st.integers(0, 2**32 - 1).map(np.random.default_rng)
