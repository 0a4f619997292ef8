"""nx.rearrange / nx.reduce / nx.repeat against einops on the plain array,
compared by name, and every pattern error."""

import einops
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxbackend import named as nx
from jaxbackend.named._errors import DimError
from jaxbackend.testing import abs_scale, assert_close

SIZES = {"batch": 2, "time": 3, "head": 2, "hd": 3}


def _x(dims):
    shape = tuple(SIZES[d] for d in dims)
    return nx.as_named(jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape), dims)


def _plain(x, dims):
    """x's values in the given dim order (einops' positional view)."""
    return np.asarray(x.transpose(*dims).values)


@settings(max_examples=40, deadline=None)
@given(perm=st.permutations(["batch", "time", "head", "hd"]),
       out=st.permutations(["batch", "time", "head", "hd"]), merge=st.booleans())
def test_rearrange_matches_einops_by_name(perm, out, merge):
    x = _x(tuple(perm))
    left = " ".join(perm)
    right = list(out)
    if merge:   # merge the last two output dims into one
        right = right[:2] + [f"({right[2]} {right[3]})"]
    got = nx.rearrange(x, f"{left} -> {' '.join(right)}")
    want = einops.rearrange(np.asarray(x.values), f"{left} -> {' '.join(right)}")
    np.testing.assert_array_equal(np.asarray(got.values), want)
    expected_dims = tuple(out[:2]) + ((f"{out[2]}_{out[3]}",) if merge else tuple(out[2:]))
    assert got.dims == expected_dims


@settings(max_examples=30, deadline=None)
@given(perm=st.permutations(["batch", "time", "head", "hd"]),
       keep=st.lists(st.sampled_from(["batch", "time", "head", "hd"]), unique=True, max_size=3),
       reduction=st.sampled_from(["sum", "mean", "max", "min", "prod"]))
def test_reduce_matches_einops_by_name(perm, keep, reduction):
    x = _x(tuple(perm))
    got = nx.reduce(x, "-> " + " ".join(keep), reduction)
    pattern = f"{' '.join(perm)} -> {' '.join(keep)}"
    want = einops.reduce(np.asarray(x.values), pattern, reduction)
    assert got.dims == tuple(keep)
    assert_close(got.values, want, what=f"{reduction} {pattern}",
                 scale=abs_scale(lambda v: einops.reduce(v, pattern, reduction), x.values))


def test_split_by_name_whatever_the_array_order():
    x = _x(("time", "batch", "head")).rename(head="embd")      # embd: size 2
    x = nx.as_named(jnp.arange(3 * 2 * 6.0).reshape(3, 2, 6), ("time", "batch", "embd"))
    got = nx.rearrange(x, "batch time (head hd) -> batch head time hd", head=2)
    want = einops.rearrange(_plain(x, ("batch", "time", "embd")), "b t (h d) -> b h t d", h=2)
    assert got.dims == ("batch", "head", "time", "hd")
    np.testing.assert_array_equal(np.asarray(got.values), want)
    named = nx.rearrange(x, "(embd: head hd) batch time -> batch head time hd", head=2)
    np.testing.assert_array_equal(np.asarray(named.values), want)
    back = nx.rearrange(got, "-> batch time (embd: head hd)")
    assert back.dims == ("batch", "time", "embd")
    np.testing.assert_array_equal(np.asarray(back.values), _plain(x, ("batch", "time", "embd")))


def test_ellipsis_and_shorthand():
    x = _x(("batch", "time", "head", "hd"))
    assert nx.rearrange(x, "-> ... batch").dims == ("time", "head", "hd", "batch")
    y = nx.rearrange(x, "batch ... hd -> hd ... batch")
    assert y.dims == ("hd", "time", "head", "batch")
    np.testing.assert_array_equal(np.asarray(y.values),
                                  einops.rearrange(np.asarray(x.values), "b ... d -> d ... b"))


def test_repeat_adds_named_dims():
    x = _x(("batch", "hd"))
    got = nx.repeat(x, "-> batch time hd", time=4)
    assert got.dims == ("batch", "time", "hd")
    np.testing.assert_array_equal(np.asarray(got.values),
                                  einops.repeat(np.asarray(x.values), "b d -> b t d", t=4))
    tiled = nx.repeat(x, "batch hd -> batch (hd k)", k=2)
    assert tiled.dims == ("batch", "hd_k")


def test_works_under_jit_and_grad():
    x = nx.as_named(jnp.ones((2, 6)), ("batch", "embd"))
    f = jax.jit(lambda x: nx.rearrange(x, "batch (head hd) -> head batch hd", head=3).values.sum())
    assert float(f(x)) == 12.0
    g = jax.grad(lambda v: nx.reduce(nx.as_named(v, ("batch", "embd")), "-> batch", "mean")
                 .values.sum())(x.values)
    assert_close(g, np.full((2, 6), 1 / 6, np.float32), what="grad of a mean")


@pytest.mark.parametrize("call, words", [
    (lambda x: nx.rearrange(x, "batch foo hd -> batch hd foo"), ["'foo'", "not a dim", "('batch', 'time', 'hd')"]),
    (lambda x: nx.rearrange(x, "batch time (a b) -> batch time a b", a=4), ["'hd'", "size 3", "a=4"]),
    (lambda x: nx.rearrange(x, "batch time hd -> batch time hd", batch=5), ["'batch'", "size 5", "size 2"]),
    (lambda x: nx.rearrange(x, "batch time hd -> batch time"), ["drops", "'hd'", "nx.reduce"]),
    (lambda x: nx.rearrange(x, "batch time hd -> batch time hd new"), ["'new'", "nx.repeat"]),
    (lambda x: nx.repeat(x, "batch time hd -> batch time hd new"), ["'new'", "no size"]),
    (lambda x: nx.rearrange(x, "batch time hd"), ["exactly one '->'"]),
    (lambda x: nx.rearrange(x, "batch time -> batch time"), ["('hd',)", "mention every dim"]),
    (lambda x: nx.rearrange(x, "batch time time -> batch time"), ["does not parse"]),
    (lambda x: nx.rearrange(x, "batch (a b) ... -> batch a b ...", a=1), ["unnamed group", "'...'"]),
    (lambda x: nx.rearrange(x, "-> batch (time hd) 1"), ["size-1 axis", "(new: 1)"]),
])
def test_pattern_errors_name_the_dims(call, words):
    x = _x(("batch", "time", "hd"))
    with pytest.raises(DimError) as e:
        call(x)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_plain_array_is_a_type_error():
    with pytest.raises(TypeError, match="as_named"):
        nx.rearrange(jnp.ones((2, 3)), "a b -> b a")
