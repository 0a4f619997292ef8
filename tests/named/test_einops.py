"""nx.rearrange / nx.reduce / nx.repeat against einops on the plain array,
compared by name, and every pattern error."""

import math

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
    if reduction == "prod":
        # A product of n factors carries up to n relative roundings: the
        # scale is |product| times the factors per entry (not a sum of terms).
        n = x.values.size // max(want.size, 1)
        scale = np.abs(want) * n
    else:
        scale = abs_scale(lambda v: einops.reduce(v, pattern, reduction), x.values)
    assert_close(got.values, want, what=f"{reduction} {pattern}", scale=scale)


POOL = ["batch", "time", "embd", "head", "vocab", "layer"]


@st.composite
def _rearrangement(draw):
    """A random array (dims drawn from POOL, in random order, sizes 1-3 or a
    product of two when a dim is split) and a rearrange pattern over it."""
    names = draw(st.lists(st.sampled_from(POOL), min_size=1, max_size=4, unique=True))
    splits = {d: (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
              for d in names if draw(st.booleans())}
    sizes = {d: math.prod(splits[d]) if d in splits else draw(st.integers(1, 3)) for d in names}
    parts = {d: [f"{d}0", f"{d}1"] if d in splits else [d] for d in names}
    named_groups = len(splits) > 1 or draw(st.booleans())   # two unnamed groups would be ambiguous
    left = [f"({d}: {' '.join(parts[d])})" if d in splits and named_groups
            else f"({' '.join(parts[d])})" if d in splits else d
            for d in draw(st.permutations(names))]
    right = draw(st.permutations([p for d in names for p in parts[d]]))
    right = [[p] for p in right]
    if len(right) > 1 and draw(st.booleans()):      # merge two neighbours into one dim
        i = draw(st.integers(0, len(right) - 2))
        right[i:i + 2] = [right[i] + right[i + 1]]
    kwargs = {f"{d}0": splits[d][0] for d in splits}
    dims = tuple(draw(st.permutations(names)))
    x = nx.as_named(jnp.asarray(np.random.default_rng(len(dims)).normal(
        size=[sizes[d] for d in dims]), jnp.float32), dims)
    return x, parts, left, right, kwargs


@settings(max_examples=30, deadline=None)
@given(case=_rearrangement())
def test_random_splits_merges_permutations_match_einops_by_name(case):
    x, parts, left, right, kwargs = case
    pattern = " ".join(left) + " -> " + " ".join(
        f"({' '.join(g)})" if len(g) > 1 else g[0] for g in right)
    got = nx.rearrange(x, pattern, **kwargs)
    want_dims = tuple("_".join(g) for g in right)
    assert got.dims == want_dims, pattern
    # Oracle: einops on the plain values, its left side the array's own axis order.
    oracle_left = " ".join(f"({' '.join(parts[d])})" if len(parts[d]) > 1 else d for d in x.dims)
    want = einops.rearrange(np.asarray(x.values), oracle_left + " -> " + pattern.split("->")[1],
                            **kwargs)
    np.testing.assert_array_equal(np.asarray(got.transpose(*want_dims).values), want)


def test_split_by_name_whatever_the_array_order():
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


def test_ellipsis_inside_a_group_joins_its_dims():
    x = _x(("batch", "time", "head", "hd"))
    y = nx.rearrange(x, "batch ... -> batch (...)")
    assert y.dims == ("batch", "time_head_hd")
    np.testing.assert_array_equal(np.asarray(y.values),
                                  einops.rearrange(np.asarray(x.values), "b ... -> b (...)"))
    assert nx.rearrange(x, "-> hd (rest: ...)").dims == ("hd", "rest")


def test_examples_from_the_docstrings():
    x = nx.as_named(jnp.arange(24.0).reshape(2, 3, 4), ("batch", "time", "embd"))
    m = nx.reduce(x, "batch time embd -> batch embd", "mean")
    assert m.dims == ("batch", "embd")
    assert_close(m.values, np.asarray(x.values).mean(1), what="mean over time")
    r = nx.repeat(nx.reduce(x, "-> batch embd"), "batch embd -> batch copy embd", copy=3)
    assert r.dims == ("batch", "copy", "embd") and r.shape == (2, 3, 4)


def test_rearrange_is_one_reshape_transpose_reshape():
    """No gather, no einsum, and no transpose back and forth when the array's
    order differs from the pattern's: einops sees the array's own order."""
    x = nx.as_named(jnp.ones((3, 2, 8)), ("time", "batch", "embd"))
    for pattern, sizes, most in [("batch time (head hd) -> batch head time hd", {"head": 2}, 2),
                                 ("time batch embd -> (batch time) embd", {}, 2),
                                 ("time batch embd -> time batch embd", {}, 0)]:
        jaxpr = jax.make_jaxpr(lambda x: nx.rearrange(x, pattern, **sizes))(x).jaxpr
        prims = [e.primitive.name for e in jaxpr.eqns]
        assert set(prims) <= {"reshape", "transpose"} and len(prims) <= most, (pattern, prims)


def test_works_under_jit_and_grad():
    x = nx.as_named(jnp.ones((2, 6)), ("batch", "embd"))
    f = jax.jit(lambda x: nx.rearrange(x, "batch (head hd) -> head batch hd", head=3).values.sum())
    assert float(f(x)) == 12.0
    g = jax.grad(lambda v: nx.reduce(nx.as_named(v, ("batch", "embd")), "-> batch", "mean")
                 .values.sum())(x.values)
    assert_close(g, np.full((2, 6), 1 / 6, np.float32), what="grad of a mean")


@pytest.mark.parametrize("call, words", [
    (lambda x: nx.rearrange(x, "batch foo hd -> batch hd foo"),
     ["'foo'", "not a dim", "('batch', 'time', 'hd')"]),
    (lambda x: nx.rearrange(x, "batch time (a b) -> batch time a b", a=4),
     ["'hd'", "size 3", "a=4"]),
    (lambda x: nx.rearrange(x, "batch time hd -> batch time hd", batch=5),
     ["'batch'", "size 5", "size 2"]),
    (lambda x: nx.rearrange(x, "batch time hd -> batch time"), ["drops", "'hd'", "nx.reduce"]),
    (lambda x: nx.rearrange(x, "batch time hd -> batch time hd new"), ["'new'", "nx.repeat"]),
    (lambda x: nx.repeat(x, "batch time hd -> batch time hd new"), ["'new'", "no size"]),
    (lambda x: nx.rearrange(x, "batch time hd"), ["exactly one '->'"]),
    (lambda x: nx.rearrange(x, "batch time -> batch time"), ["('hd',)", "mention every dim"]),
    (lambda x: nx.rearrange(x, "batch time time -> batch time"), ["does not parse"]),
    (lambda x: nx.rearrange(x, "batch (a b) ... -> batch a b ...", a=1),
     ["unnamed group", "'...'"]),
    (lambda x: nx.rearrange(x, "-> batch (time hd) 1"), ["size-1 axis", "(new: 1)"]),
    (lambda x: nx.rearrange(x, "-> batch (hd_time: hd) hd_time time"), ["'hd_time' twice"]),
    (lambda x: nx.rearrange(x, "batch time hd -> batch time hd", head=2), ["head=2", "no axis"]),
    (lambda x: nx.rearrange(x, "(batch ...) time hd -> batch time hd"), ["inside a group"]),
    (lambda x: nx.rearrange(x, "batch (time -> time batch"), ["'batch (time'", "does not parse"]),
    (lambda x: nx.reduce(x, "-> batch", "median"), ["reduction='median'", "'mean'", "callable"]),
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
