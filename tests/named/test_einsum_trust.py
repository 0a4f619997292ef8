"""The `einsum` primitive under every transform combination, against jnp.

Forward-mode batching: jacfwd, hessian and vmap-of-jvp bind the primal
einsum under vmap with neither operand batched, so the batching rule must
handle (lhs, rhs) batched as (yes, no), (no, yes), (yes, yes) and (no, no).
Each is checked against the same transform of `jnp.einsum`.

Dtypes: the transpose rules must do what `lax.dot_general`'s do (contract
with the forward `preferred_element_type`, then convert to the primal
operand's dtype), so cotangents have the primal dtypes and bf16 inputs with
float32 accumulation get float32-accumulated cotangents. Forward dtypes
follow `dot_general` (which the primitive lowers to) and `nx.dot` follows
`jnp.einsum`, integers and mixed dtypes included.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jaxbackend import named as nx
from jaxbackend.named import _einsum
from jaxbackend.testing import assert_close

KX, KW = jax.random.split(jax.random.key(0))
X = jax.random.normal(KX, (2, 4))          # dims ("b", "e")
W = jax.random.normal(KW, (4, 3))          # dims ("e", "h")


def _dot(x, w):
    return nx.dot(nx.as_named(x, ("b", "e")), nx.as_named(w, ("e", "h")), dim="e").values


def _ref(x, w):
    return jnp.einsum("be,eh->bh", x, w)


def _tol(*arrays):
    # Each entry is a short sum of products: scale by the sum of |terms|.
    return 1e-6 * (1 + sum(float(jnp.sum(jnp.abs(a))) for a in arrays))


# -- forward-mode batching ---------------------------------------------------------

def test_jacfwd_with_unbatched_primal():
    named_x = nx.as_named(X, ("b", "e"))
    got = jax.jacfwd(lambda w: nx.dot(named_x, nx.as_named(w, ("e", "h")), dim="e").values)(W)
    want = jax.jacfwd(lambda w: _ref(X, w))(W)
    assert got.shape == want.shape == (2, 3, 4, 3)
    assert_close(got, want, atol=_tol(X), rtol=0, what="jacfwd wrt rhs")
    got = jax.jacfwd(_dot, argnums=(0, 1))(X, W)
    want = jax.jacfwd(_ref, argnums=(0, 1))(X, W)
    for g, w, what in zip(got, want, ("lhs", "rhs")):
        assert_close(g, w, atol=_tol(X, W), rtol=0, what=f"jacfwd wrt {what}")


def test_hessian_of_scalar_named_function():
    def named(x, w):
        h = nx.tanh(nx.dot(nx.as_named(x, ("b", "e")), nx.as_named(w, ("e", "h")), dim="e"))
        return nx.dot(h, h, dim=...).values

    def ref(x, w):
        h = jnp.tanh(_ref(x, w))
        return jnp.sum(h * h)

    for argnums in (0, 1, (0, 1)):
        got = jax.hessian(named, argnums=argnums)(X, W)
        want = jax.hessian(ref, argnums=argnums)(X, W)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert g.shape == w.shape
            assert_close(g, w, atol=10 * _tol(X, W), rtol=0, what=f"hessian argnums={argnums}")


def test_vmap_of_jvp():
    tx = jax.random.normal(jax.random.key(1), (5,) + X.shape)
    tw = jax.random.normal(jax.random.key(2), (5,) + W.shape)
    for in_axes in [(0, None), (None, 0), (0, 0)]:
        targs = tuple(t if a == 0 else jnp.zeros_like(p) for t, a, p in
                      zip((tx, tw), in_axes, (X, W)))

        def jvp(f):
            return jax.vmap(lambda a, b: jax.jvp(f, (X, W), (a, b)), in_axes=in_axes)

        (gp, gt), (wp, wt) = jvp(_dot)(*targs), jvp(_ref)(*targs)
        assert gp.shape == wp.shape and gt.shape == wt.shape == (5, 2, 3)
        assert_close(gp, wp, atol=_tol(X, W), rtol=0, what=f"primal {in_axes}")
        assert_close(gt, wt, atol=_tol(X, W, tx, tw), rtol=0, what=f"tangent {in_axes}")


@pytest.mark.parametrize("in_axes", [(0, None), (None, 1), (1, 0), (None, None)])
def test_vmap_each_operand_and_both(in_axes):
    xs = jax.random.normal(jax.random.key(3), (5,) + X.shape)          # batch axis 0
    ws = jnp.moveaxis(jax.random.normal(jax.random.key(4), (5,) + W.shape), 0, 1)
    x_arg = jnp.moveaxis(xs, 0, 1) if in_axes[0] == 1 else xs if in_axes[0] == 0 else X
    w_arg = ws if in_axes[1] == 1 else jnp.moveaxis(ws, 1, 0) if in_axes[1] == 0 else W
    got = jax.vmap(_dot, in_axes=in_axes, axis_size=5)(x_arg, w_arg)
    want = jax.vmap(_ref, in_axes=in_axes, axis_size=5)(x_arg, w_arg)
    assert got.shape == want.shape == (5, 2, 3)
    assert_close(got, want, atol=_tol(xs, ws), rtol=0, what=f"vmap in_axes={in_axes}")


def test_batching_rule_with_no_batched_operand_returns_unmapped():
    # vmap of jvp binds the primal einsum with both operands unbatched.
    jaxpr = jax.make_jaxpr(jax.jacfwd(lambda w: _dot(X, w)))(W).jaxpr
    outs = [e.outvars[0].aval.shape for e in jaxpr.eqns if e.primitive is _einsum.einsum_p]
    assert (2, 3) in outs  # the primal, not broadcast along the vmap axis


# -- dtypes of the transpose rules ---------------------------------------------------

DN = (((1,), (0,)), ((), ()))


def _raw(a, b, pet):
    return _einsum.einsum(a, b, lhs_dims=("i", "k"), rhs_dims=("k", "j"), out_dims=("i", "j"),
                          preferred_element_type=pet)


def _lax(a, b, pet):
    return lax.dot_general(a, b, DN, preferred_element_type=pet)


def _cases():
    k = jax.random.split(jax.random.key(5), 2)
    a = jax.random.normal(k[0], (3, 64))
    b = jax.random.normal(k[1], (64, 5))
    return a, b


@pytest.mark.parametrize("in_dtype,pet", [(jnp.bfloat16, jnp.float32), (jnp.float32, None),
                                          (jnp.bfloat16, None), (jnp.float16, jnp.float32),
                                          (jnp.float32, jnp.bfloat16)])
def test_grad_dtypes_and_values_match_dot_general(in_dtype, pet):
    a, b = (v.astype(in_dtype) for v in _cases())
    cot = jax.random.normal(jax.random.key(6), (3, 5))

    def loss(f):
        return lambda a, b: jnp.sum(f(a, b, pet).astype(jnp.float32) * cot)

    got = jax.grad(loss(_raw), argnums=(0, 1))(a, b)
    want = jax.grad(loss(_lax), argnums=(0, 1))(a, b)
    assert _raw(a, b, pet).dtype == _lax(a, b, pet).dtype
    for g, w, p in zip(got, want, (a, b)):
        assert g.dtype == w.dtype == p.dtype
        # Same arithmetic as lax's own rule: equal up to XLA's reassociation.
        assert_close(g, w, what=f"grad {in_dtype.__name__} pet={pet}")
    # bf16 inputs accumulated in float32: the cotangents must be accumulated
    # in float32 too (rounded once), not summed in bf16.
    if in_dtype == jnp.bfloat16 and pet == jnp.float32:
        exact = jax.grad(loss(lambda a, b, _: _lax(a.astype(jnp.float32), b.astype(jnp.float32),
                                                   None)), argnums=(0, 1))(a, b)
        for g, e in zip(got, exact):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(e.astype(jnp.bfloat16)))


def test_named_dot_grad_dtypes_with_mixed_inputs():
    a, b = _cases()
    x, w = nx.as_named(a, ("b", "e")), nx.as_named(b.astype(jnp.bfloat16), ("e", "h"))
    gx, gw = jax.grad(lambda x, w: nx.dot(x, w, dim="e").sum().values, argnums=(0, 1))(x, w)
    rx, rw = jax.grad(lambda x, w: jnp.einsum("be,eh->bh", x, w).sum(), argnums=(0, 1))(
        a, b.astype(jnp.bfloat16))
    assert (gx.dtype, gw.dtype) == (rx.dtype, rw.dtype) == (jnp.float32, jnp.bfloat16)
    assert_close(gx.values, rx, what="grad x")
    assert_close(gw.values, rw, what="grad w")


def test_backward_einsums_carry_forward_preferred_element_type():
    a, b = (v.astype(jnp.bfloat16) for v in _cases())
    jaxpr = jax.make_jaxpr(jax.grad(lambda a, b: _raw(a, b, jnp.float32).sum(),
                                    argnums=(0, 1)))(a, b).jaxpr
    pets = [e.params["preferred_element_type"] for e in jaxpr.eqns
            if e.primitive is _einsum.einsum_p]
    assert len(pets) == 3 and all(p == jnp.float32 for p in pets), pets
    # Parameters are canonical dtypes (hashable, equal to what dot_general stores).
    assert all(isinstance(p, np.dtype) for p in pets)


# -- forward dtypes: integers, mixed ------------------------------------------------

@pytest.mark.parametrize("da,db,pet", [
    (jnp.int32, jnp.int32, None), (jnp.int8, jnp.int8, jnp.int32), (jnp.int8, jnp.uint8, None),
    (jnp.float16, jnp.bfloat16, None), (jnp.float32, jnp.bfloat16, None)])
def test_primitive_forward_dtypes_follow_dot_general(da, db, pet):
    a = jnp.arange(12).reshape(3, 4).astype(da)
    b = (jnp.arange(20).reshape(4, 5) % 7).astype(db)
    want = _lax(a, b, pet)
    got = _raw(a, b, pet)
    assert jax.eval_shape(lambda a, b: _raw(a, b, pet), a, b).dtype == want.dtype
    assert jax.jit(lambda a, b: _raw(a, b, pet))(a, b).dtype == want.dtype
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)),
                                  np.asarray(want.astype(jnp.float32)))


@pytest.mark.parametrize("da,db", [(jnp.int32, jnp.int32), (jnp.int8, jnp.int8),
                                   (jnp.int8, jnp.uint8), (jnp.int32, jnp.float32),
                                   (jnp.float32, jnp.bfloat16), (jnp.float16, jnp.bfloat16)])
def test_named_dot_dtypes_match_jnp_einsum(da, db):
    a = (jnp.arange(12).reshape(3, 4) % 5).astype(da)
    b = (jnp.arange(20).reshape(4, 5) % 7).astype(db)
    got = nx.dot(nx.as_named(a, ("i", "k")), nx.as_named(b, ("k", "j")), dim="k")
    want = jnp.einsum("ik,kj->ij", a, b)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got.values.astype(jnp.float32)),
                                  np.asarray(want.astype(jnp.float32)))
    jitted = jax.jit(lambda a, b: nx.dot(nx.as_named(a, ("i", "k")),
                                         nx.as_named(b, ("k", "j")), dim="k").values)(a, b)
    assert jitted.dtype == want.dtype


def test_weak_typed_operands_keep_weak_type_like_dot_general():
    def jaxpr(f):
        return jax.make_jaxpr(lambda s: f(jnp.broadcast_to(s, (3, 4)), jnp.broadcast_to(s, (4, 5)),
                                          None))(1.0)
    got, want = jaxpr(_raw).out_avals[0], jaxpr(_lax).out_avals[0]
    assert want.weak_type  # Python-scalar operands: a weak result
    assert (got.dtype, got.weak_type) == (want.dtype, want.weak_type)
