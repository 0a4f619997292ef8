"""Inputs that once gave a silent wrong answer or a broken array."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxbackend import named as nx


def test_boolean_isel_is_an_error_not_a_gather():
    x = nx.as_named(jnp.arange(3.0), ("t",))
    with pytest.raises(nx.DimError, match="boolean.*flatnonzero"):
        x.isel(t=[True, False, True])
    np.testing.assert_array_equal(x.isel(t=np.flatnonzero([True, False, True])).values, [0.0, 2.0])


def test_reductions_reject_keepdims():
    x = nx.ones({"a": 2, "t": 3})
    with pytest.raises(nx.DimError, match="keepdims"):
        x.sum(dim="t", keepdims=True)


def test_rename_to_itself_is_a_no_op():
    x = nx.ones({"a": 2, "t": 3})
    assert x.rename(a="a").dims == ("a", "t")
    assert x.rename(a="t", t="a").dims == ("t", "a")


def test_where_on_0d_named_arrays_stays_named():
    out = nx.where(nx.as_named(jnp.array(True), ()), nx.as_named(jnp.array(1.0), ()), 0.0)
    assert isinstance(out, nx.NamedArray) and out.dims == () and float(out.values) == 1.0
