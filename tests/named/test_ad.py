"""Autodiff and vmap through named programs.

The backbone is equivalence: `jax.grad` / `jax.jvp` / `jax.vmap` of a named
program equals the same transform of the hand-written jnp program (the
attention twins in `models/_attention_stack.py` and a few small programs).
`jax.test_util.check_grads` checks the `einsum` primitive's own JVP and
transpose rules numerically (orders 1 and 2, forward and reverse), including
an einsum whose `out_dims` is not dot_general's natural order; the vmap tests
put the batch axis on one or both operands and at non-zero positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from jaxbackend import named as nx
from jaxbackend.programs.attention_stack import (init_attention_stack, jnp_attention_stack,
                                                 name_params, named_attention_stack)
from jaxbackend.named import _einsum
from jaxbackend.testing import abs_scale, assert_close

SMALL = dict(batch=2, time=8, embd=16, head=2, hd=8)


# -- grad of named == grad of jnp ---------------------------------------------------

@pytest.mark.parametrize("n_layers", [2])
def test_attention_stack_grad_matches_jnp(n_layers):
    x, layers = init_attention_stack(jax.random.PRNGKey(n_layers), n_layers, **SMALL)
    nxx, nl = name_params(x, layers)
    vg = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))  # noqa: E731
    (lj, _), gj = vg(jnp_attention_stack)(x, layers)
    (ln, _), gn = vg(named_attention_stack)(nxx, nl)
    # entries that cancel are judged by the jnp program's own rounding scale
    scale = lambda: abs_scale(jax.value_and_grad(jnp_attention_stack, argnums=(0, 1),  # noqa: E731
                                                 has_aux=True), x, layers)
    assert_close(ln, lj, scale=lambda: scale()[0][0], what="loss")
    # The gradient w.r.t. a NamedArray is a NamedArray with the same dims.
    assert isinstance(gn[0], nx.NamedArray) and gn[0].dims == nxx.dims
    for pn, pnamed in zip(gn[1], nl):
        assert all(pn[k].dims == pnamed[k].dims for k in pn)
    assert_close(gn, gj, scale=lambda: scale()[1], what="grad")


def _named_program(x, w, b):
    h = nx.dot(x, w, dim="embd") + b                            # batch time head
    h = nx.tanh(h).transpose("head", ...)
    m = nx.logsumexp(h, "head") - nx.log_softmax(h, "time").mean("time")
    z = nx.stack(h, bh=("batch", "head"))                       # time bh
    z = nx.unstack(z, bh={"batch": 2, "head": 3}) * h.isel(time=slice(1, None)).sum("time")
    z = nx.concat([z, z.isel(time=[0, 0])], "time")
    return (m.sum() + nx.where(z > 0, z, 0.1 * z).var() + (x * x).max()).values


def _jnp_program(x, w, b):
    h = jnp.einsum("bte,eh->bth", x, w) + b[None, None, :]
    h = jnp.transpose(jnp.tanh(h), (2, 0, 1))                   # head batch time
    m = jax.nn.logsumexp(h, axis=0) - jax.nn.log_softmax(h, axis=2).mean(axis=2)[:, :, None]
    z = jnp.transpose(h, (2, 1, 0)).reshape(h.shape[2], -1)     # time (batch*head)
    z = z.reshape(z.shape[0], 2, 3) * jnp.transpose(h[:, :, 1:].sum(2), (1, 0))[None]
    z = jnp.concatenate([z, z[jnp.array([0, 0])]], axis=0)
    return m.sum() + jnp.where(z > 0, z, 0.1 * z).var() + (x * x).max()


def test_small_program_grad_and_jvp_match_jnp():
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(k[0], (2, 5, 4))
    w = jax.random.normal(k[1], (4, 3))
    b = jax.random.normal(k[2], (3,))
    args = (nx.as_named(x, ("batch", "time", "embd")), nx.as_named(w, ("embd", "head")),
            nx.as_named(b, ("head",)))
    jargs = (x, w, b)

    @jax.jit
    def both(named_args, plain_args):
        # One compile per twin: value, grad and jvp together.
        def run(fn, a):
            t = jax.tree.map(jnp.ones_like, a)
            return (jax.value_and_grad(fn, argnums=(0, 1, 2))(*a), jax.jvp(fn, a, t))
        return run(_named_program, named_args), run(_jnp_program, plain_args)

    ((vn, gn), (pn, tn)), ((vj, gj), (pj, tj)) = both(args, jargs)
    assert all(g.dims == a.dims for a, g in zip(args, gn))

    def jnp_twin(a):
        return (jax.value_and_grad(_jnp_program, argnums=(0, 1, 2))(*a),
                jax.jvp(_jnp_program, a, jax.tree.map(jnp.ones_like, a)))
    scale = lambda: abs_scale(jnp_twin, jargs)  # noqa: E731
    assert_close(((vn, gn), (pn, tn)), ((vj, gj), (pj, tj)), scale=scale,
                 what="value, grad, primal, tangent")


# -- the einsum primitive on its own ---------------------------------------------------

CASES = [
    # lhs_dims, rhs_dims, out_dims
    (("b", "t", "d"), ("b", "s", "d"), ("b", "t", "s")),            # batch + contraction
    (("b", "t", "d"), ("b", "s", "d"), ("s", "b", "t")),            # NOT natural order
    (("b", "h", "t", "s"), ("b", "s", "h", "d"), ("b", "t", "h", "d")),  # not natural
    (("t", "e"), ("e", "t"), ("t",)),                               # batch only, contracted e
    (("a",), ("c",), ("c", "a")),                                   # outer product, swapped
]
SIZES = dict(b=2, t=3, s=2, e=3, h=2, d=2, a=3, c=2)


def _operands(lhs_dims, rhs_dims, dtype=np.float64):
    rng = np.random.default_rng(len(lhs_dims) + 7 * len(rhs_dims))
    lhs = rng.standard_normal(tuple(SIZES[d] for d in lhs_dims)).astype(dtype)
    rhs = rng.standard_normal(tuple(SIZES[d] for d in rhs_dims)).astype(dtype)
    return jnp.asarray(lhs), jnp.asarray(rhs)


def _reference(lhs, rhs, lhs_dims, rhs_dims, out_dims):
    letters = {d: chr(ord("a") + i) for i, d in enumerate(sorted(set(lhs_dims) | set(rhs_dims)))}
    spec = (f"{''.join(letters[d] for d in lhs_dims)},{''.join(letters[d] for d in rhs_dims)}"
            f"->{''.join(letters[d] for d in out_dims)}")
    return jnp.einsum(spec, lhs, rhs)


@pytest.mark.parametrize("lhs_dims,rhs_dims,out_dims", CASES)
def test_einsum_primitive_check_grads(lhs_dims, rhs_dims, out_dims):
    with jax.enable_x64(True):
        lhs, rhs = _operands(lhs_dims, rhs_dims)

        def f(a, b):
            return _einsum.einsum(a, b, lhs_dims=lhs_dims, rhs_dims=rhs_dims, out_dims=out_dims)

        assert_close(f(lhs, rhs), _reference(lhs, rhs, lhs_dims, rhs_dims, out_dims),
                     scale=abs_scale(f, lhs, rhs), check_dtype=True, what="einsum")
        assert_close(jax.jit(f)(lhs, rhs), f(lhs, rhs), scale=abs_scale(f, lhs, rhs),
                     what="jit(einsum)")
        # order=2 checks first-order JVP/VJP too, then the second order.
        check_grads(f, (lhs, rhs), order=2, modes=("fwd", "rev"))


def test_einsum_backward_equations_are_named_einsums():
    lhs_dims, rhs_dims, out_dims = CASES[1]
    lhs, rhs = _operands(lhs_dims, rhs_dims, np.float32)

    def loss(a, b):
        return _einsum.einsum(a, b, lhs_dims=lhs_dims, rhs_dims=rhs_dims, out_dims=out_dims).sum()

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(lhs, rhs).jaxpr
    triples = [(e.params["lhs_dims"], e.params["rhs_dims"], e.params["out_dims"])
               for e in jaxpr.eqns if e.primitive is nx.einsum_p]
    assert (lhs_dims, rhs_dims, out_dims) in triples
    assert sorted(t[2] for t in triples) == sorted([out_dims, lhs_dims, rhs_dims])
    assert not any(e.primitive.name == "dot_general" for e in jaxpr.eqns)


# -- vmap ------------------------------------------------------------------------------

def _named_fn(x, w):
    """Plain arrays in, named inside: x (time, embd), w (embd, head)."""
    xn, wn = nx.as_named(x, ("time", "embd")), nx.as_named(w, ("embd", "head"))
    s = nx.dot(xn, wn, dim="embd")                               # time head
    return nx.softmax(s, "time").transpose("head", "time").values


def _jnp_fn(x, w):
    return jax.nn.softmax(jnp.einsum("te,eh->ht", x, w), axis=1)


@pytest.mark.parametrize("in_axes,shapes", [
    ((0, None), ((5, 3, 4), (4, 2))),          # bdim on lhs only
    ((None, 2), ((3, 4), (4, 2, 5))),          # on rhs only, non-zero bdim
    ((1, 1), ((3, 5, 4), (4, 5, 2))),          # on both, non-zero bdims
    ((2, 0), ((3, 4, 5), (5, 4, 2))),
])
def test_vmap_matches_per_example_loop(in_axes, shapes):
    k1, k2 = jax.random.split(jax.random.PRNGKey(1))
    x = jax.random.normal(k1, shapes[0])
    w = jax.random.normal(k2, shapes[1])
    x, w = np.asarray(x), np.asarray(w)
    xs = [x if in_axes[0] is None else np.take(x, i, axis=in_axes[0]) for i in range(5)]
    ws = [w if in_axes[1] is None else np.take(w, i, axis=in_axes[1]) for i in range(5)]
    one = jax.jit(_jnp_fn)
    loop = np.stack([one(a, b) for a, b in zip(xs, ws)], axis=1)
    # out_axes=1: the mapped axis leaves in the middle of the result.
    assert_close(jax.jit(jax.vmap(_named_fn, in_axes=in_axes, out_axes=1))(x, w), loop,
                 what=f"vmap in_axes={in_axes}")


def test_vmap_of_einsum_emits_what_vmap_of_jnp_einsum_emits():
    # The batch axis sits in the middle of x: naming it in place (no
    # moveaxis) and returning it where dot_general leaves it makes the
    # batched named program the same primitives as the batched jnp one.
    x = jnp.ones((3, 5, 4))
    w = jnp.ones((4, 2))

    def named(a):
        return nx.dot(nx.as_named(a, ("t", "e")), nx.as_named(w, ("e", "h")), dim="e").values

    for out_axes in (0, 1):
        jn = jax.make_jaxpr(jax.vmap(named, in_axes=1, out_axes=out_axes))(x).jaxpr
        jj = jax.make_jaxpr(jax.vmap(lambda a: jnp.einsum("te,eh->th", a, w), in_axes=1,
                                     out_axes=out_axes))(x).jaxpr
        prims = [e.primitive.name for e in jn.eqns]
        assert prims == [{"dot_general": "einsum"}.get(e.primitive.name, e.primitive.name)
                         for e in jj.eqns]
        (eq,) = [e for e in jn.eqns if e.primitive is nx.einsum_p]
        p = eq.params
        assert p["lhs_dims"] == ("t", "__vmap0__", "e") and p["rhs_dims"] == ("e", "h")
        contract = [d for d in p["lhs_dims"] if d in p["rhs_dims"] and d not in p["out_dims"]]
        assert _einsum.natural_out_dims(p["lhs_dims"], p["rhs_dims"], contract) == p["out_dims"]


def test_nested_vmap_and_per_example_grad():
    k1, k2 = jax.random.split(jax.random.PRNGKey(2))
    x = jax.random.normal(k1, (2, 3, 5, 4))
    w = jax.random.normal(k2, (4, 2))
    got = jax.jit(jax.vmap(jax.vmap(_named_fn, (0, None)), (1, None)))(x, w)
    want = jax.jit(jax.vmap(jax.vmap(_jnp_fn, (0, None)), (1, None)))(x, w)
    assert_close(got, want, what="vmap(vmap)")
    gn = jax.jit(jax.vmap(jax.grad(lambda a, b: _named_fn(a, b)[0].sum() ** 2, argnums=1),
                          (0, None)))
    gj = jax.jit(jax.vmap(jax.grad(lambda a, b: _jnp_fn(a, b)[0].sum() ** 2, argnums=1),
                          (0, None)))
    assert_close(gn(x[0], w), gj(x[0], w), scale=lambda: abs_scale(gj, x[0], w),
                 what="vmap(grad)")


def test_vmap_over_stacked_named_arrays():
    # A stack of NamedArrays (leading unnamed axis, as nnx.vmap / lax.scan
    # build for stacked layers) maps like any pytree.
    x, layers = init_attention_stack(jax.random.PRNGKey(4), 3, **SMALL)
    nxx, nl = name_params(x, layers)
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *nl)
    assert stacked["wq"].dims == ("embd", "head", "hd") and stacked["wq"].values.shape[0] == 3
    out = jax.vmap(lambda p: nx.dot(nxx, p["wq"], dim="embd").sum("hd"))(stacked)
    assert out.dims == ("batch", "time", "head") and out.values.shape == (3, 2, 8, 2)
    for i, layer in enumerate(layers):
        def ref(x, w):
            return jnp.einsum("bte,ehd->bth", x, w)
        assert_close(out.values[i], ref(x, layer["wq"]), scale=abs_scale(ref, x, layer["wq"]),
                     what=f"layer {i}")
