"""`NamedArray` as a JAX pytree: one leaf (the values), dims as static data.

Checks the contract the issue states: works unchanged under jax.jit (no
retrace for the same shapes; a retrace on new sizes, because sizes are not
in the treedef, only dims are), jax.grad, jax.vmap, lax.scan, jax.tree.map,
and inside Flax NNX modules (in an nnx.Param / nnx.Variable / nnx.data
attribute, through nnx.jit, nnx.grad and an nnx.Optimizer step).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxbackend import named as nx
from jaxbackend.testing import abs_scale, assert_close


def _x(b=2, e=3):
    return nx.as_named(jnp.arange(b * e, dtype=jnp.float32).reshape(b, e), ("batch", "embd"))


def test_properties():
    x = _x()
    assert x.dims == ("batch", "embd")
    assert x.sizes == {"batch": 2, "embd": 3}
    assert x.shape == (2, 3)
    assert x.dtype == jnp.float32
    assert x.ndim == 2
    assert isinstance(x.values, jax.Array)
    np.testing.assert_array_equal(x.values, np.arange(6).reshape(2, 3))
    assert "batch: 2" in repr(x) and "embd: 3" in repr(x)


def test_one_leaf_and_dims_in_the_treedef():
    x = _x()
    leaves, treedef = jax.tree.flatten(x)
    assert len(leaves) == 1 and leaves[0] is x.values
    # Sizes are not in the treedef: same dims, other sizes -> equal treedefs.
    assert jax.tree.structure(_x(2, 3)) == jax.tree.structure(_x(5, 7))
    assert jax.tree.structure(_x()) != jax.tree.structure(_x().rename(embd="e"))
    (path, leaf), = jax.tree_util.tree_flatten_with_path(x)[0]
    assert jax.tree_util.keystr(path) == ".values" and leaf is x.values
    y = jax.tree.unflatten(treedef, [jnp.zeros((2, 3))])
    assert isinstance(y, nx.NamedArray) and y.dims == x.dims


def test_jit_retraces_only_on_new_sizes_or_dims():
    traces = []

    @jax.jit
    def f(x):
        traces.append(x.sizes)
        return (x * 2).sum("embd")

    out = f(_x())
    assert isinstance(out, nx.NamedArray) and out.dims == ("batch",)
    np.testing.assert_allclose(out.values, [6.0, 24.0])
    f(_x())
    f(nx.as_named(jnp.ones((2, 3)), ("batch", "embd")))
    assert len(traces) == 1                      # same shapes: no retrace
    f(_x(4, 3))
    assert traces[-1] == {"batch": 4, "embd": 3} and len(traces) == 2   # new size
    f(_x().rename(batch="b"))
    assert len(traces) == 3                      # new dims: new treedef


def test_grad_returns_named_cotangents():
    x = _x()
    w = nx.as_named(jnp.ones((3, 4)), ("embd", "head"))

    def loss(x, w):
        return (nx.dot(x, w, dim="embd") ** 2).sum().values

    gx, gw = jax.grad(loss, argnums=(0, 1))(x, w)
    assert gx.dims == x.dims and gw.dims == w.dims
    xv, wv = x.values, w.values
    ref = jax.grad(lambda a, b: ((a @ b) ** 2).sum(), argnums=(0, 1))
    assert_close((gx, gw), ref(xv, wv), scale=lambda: abs_scale(ref, xv, wv), what="grad")


def test_vmap_maps_a_leading_unnamed_axis():
    # jax.vmap maps the leaf's leading axis; the dims describe one slice.
    xs = nx.NamedArray(jnp.arange(24.0).reshape(4, 2, 3), ("batch", "embd"))
    out = jax.vmap(lambda x: x.sum("embd"))(xs)
    assert out.dims == ("batch",) and out.values.shape == (4, 2)
    np.testing.assert_allclose(out.values, np.arange(24.0).reshape(4, 2, 3).sum(-1))


def test_scan_over_stacked_named_arrays():
    ws = jax.tree.map(lambda *a: jnp.stack(a),
                      *[nx.as_named(jnp.eye(3) * (i + 1), ("embd", "embd_out")) for i in range(3)])

    def step(h, w):
        h = nx.dot(h, w, dim="embd").rename(embd_out="embd")
        return h, h.sum("embd")

    h, sums = jax.lax.scan(step, _x(), ws)
    assert h.dims == ("batch", "embd") and sums.dims == ("batch",)
    np.testing.assert_allclose(h.values, _x().values * 6)
    assert sums.values.shape == (3, 2)


def test_tree_map_over_mixed_trees():
    tree = {"x": _x(), "w": [nx.ones({"embd": 3}), jnp.zeros(2)], "n": None}
    doubled = jax.tree.map(lambda v: v * 2, tree)
    assert doubled["x"].dims == ("batch", "embd") and doubled["w"][0].dims == ("embd",)
    np.testing.assert_allclose(doubled["x"].values, _x().values * 2)
    summed = jax.tree.map(lambda a, b: a + b, tree, doubled)
    np.testing.assert_allclose(summed["w"][0].values, [3.0, 3.0, 3.0])
    assert len(jax.tree.leaves(tree)) == 3


# -- Flax NNX -------------------------------------------------------------------

class NamedLinear(nnx.Module):
    """What a Flax user writes: the weight in an nnx.Param, a buffer in nnx.data."""

    def __init__(self, d_in: int, d_out: int, rngs: nnx.Rngs):
        w = jax.random.normal(rngs.params(), (d_in, d_out)) / np.sqrt(d_in)
        self.w = nnx.Param(nx.as_named(w, ("embd", "head")))
        self.scale = nnx.Variable(nx.ones({"head": d_out}))
        self.mask = nnx.data(nx.as_named(jnp.arange(d_out) % 2 == 0, ("head",)))

    def __call__(self, x):
        y = nx.dot(x, self.w[...], dim="embd") * self.scale[...]
        return nx.where(self.mask, y, 0.0)


def _loss(model, x):
    return (model(x) ** 2).mean().values


def test_flax_nnx_module_holding_named_arrays():
    model = NamedLinear(3, 4, nnx.Rngs(0))
    x = _x()
    y = model(x)
    assert y.dims == ("batch", "head")
    w = model.w[...].values
    want = np.where(np.arange(4) % 2 == 0, np.asarray(x.values) @ np.asarray(w), 0.0)
    assert_close(y.values, want, scale=abs_scale(jnp.matmul, x.values, w), what="module output")
    # nnx.jit and nnx.grad see the NamedArrays as state.
    assert_close(nnx.jit(_loss)(model, x), _loss(model, x), what="nnx.jit loss")
    grads = nnx.grad(_loss)(model, x)
    gw = grads["w"][...]
    assert isinstance(gw, nx.NamedArray) and gw.dims == ("embd", "head")
    ref = jax.grad(lambda w: (jnp.where(jnp.arange(4) % 2 == 0, x.values @ w, 0.0) ** 2).mean())
    assert_close(gw.values, ref(w), scale=lambda: abs_scale(ref, w), what="grad w")
    # split / merge round-trips keep dims.
    graphdef, state = nnx.split(model)
    again = nnx.merge(graphdef, state)
    assert again.w[...].dims == ("embd", "head") and again.mask.dims == ("head",)


def test_flax_nnx_optimizer_step_on_named_params():
    model = NamedLinear(3, 4, nnx.Rngs(1))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    x = _x()
    before = _loss(model, x)

    @nnx.jit
    def step(model, opt, x):
        loss, grads = nnx.value_and_grad(_loss)(model, x)
        opt.update(model, grads)
        return loss

    step(model, opt, x)
    step(model, opt, x)
    assert model.w[...].dims == ("embd", "head")
    assert _loss(model, x) < before


def test_flax_variable_whole_replace():
    model = NamedLinear(3, 4, nnx.Rngs(2))
    new = nx.zeros({"head": 4, "embd": 3})          # other order: stored in the param's order
    model.w[...] = new
    assert model.w[...].dims == ("embd", "head")
    np.testing.assert_array_equal(model.w[...].values, np.zeros((3, 4)))
    with pytest.raises(nx.DimError, match="'head'"):
        model.w[...] = nx.zeros({"embd": 3, "head": 5})


def test_flax_plain_attribute_error_names_the_fix():
    # Flax 0.12 refuses pytrees with arrays in plain attributes; its message
    # names nnx.data, which works (see NamedLinear.mask).
    class Plain(nnx.Module):
        def __init__(self):
            self.w = nx.ones({"embd": 2})

    with pytest.raises(ValueError, match="nnx.data"):
        Plain()
