"""`assert_modules_match`: a named Flax NNX module against a positional
reference on the same weights, outputs and parameter gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxbackend import named as nx
from jaxbackend.testing._close import assert_close, tolerance
from jaxbackend.testing._scale import lazy_scales

def _values(x, out_dims=None):
    if isinstance(x, nx.NamedArray):
        return (x.transpose(*out_dims) if out_dims else x).values
    return x


def assert_modules_match(named: nnx.Module, reference: nnx.Module, to_reference, inputs, *,
                         reference_inputs=None, out_dims=None, grads: bool = True, seed: int = 0,
                         rtol=None, atol=None) -> dict:
    """Outputs (and parameter gradients) of `named(*inputs)` and
    `reference(*reference_inputs)` agree when the reference's weights are
    `to_reference(named params)`.

    `out_dims`: the dim order the named output is brought to before comparing
    with the positional output (default: its own order). Gradients are those
    of sum(output * fixed random cotangent), so every output entry matters.
    Returns {"out_err": ..., "grad_err": {path: err}}.
    """
    reference_inputs = inputs if reference_inputs is None else reference_inputs
    gd_n, p_n, *rest_n = nnx.split(named, nnx.Param, ...)
    gd_r, p_r, *rest_r = nnx.split(reference, nnx.Param, ...)
    pure = nnx.to_pure_dict(p_n)

    def run_named(params):
        st = jax.tree.map(lambda x: x, p_n)
        nnx.replace_by_pure_dict(st, params)
        return _values(nnx.merge(gd_n, st, *rest_n)(*inputs), out_dims)

    def run_reference(params):
        st = jax.tree.map(lambda x: x, p_r)
        nnx.replace_by_pure_dict(st, to_reference(params))
        return _values(nnx.merge(gd_r, st, *rest_r)(*reference_inputs))

    # One compiled program per module (outputs and their VJP together): a
    # compile per program, not one per eager op, and half the compiles.
    out_shape = jax.eval_shape(run_reference, pure)
    ct = jax.random.normal(jax.random.key(seed), out_shape.shape, jnp.float32)

    def value_and_grads(run):
        def f(p):
            out, vjp = jax.vjp(lambda q: run(q).astype(jnp.float32), p)
            return out, vjp(ct)[0]
        return f

    out_n, g_n = jax.jit(value_and_grads(run_named))(pure)
    out_r, g_r = jax.jit(value_and_grads(run_reference))(pure)
    # entries that cancel (a gradient zero by symmetry) are judged by the
    # rounding of their terms: the reference program's own abs_scale
    scale_for = lazy_scales(value_and_grads(run_reference), pure)
    r0, a0 = tolerance(jax.eval_shape(run_named, pure).dtype, out_shape.dtype)
    report: dict = {"out_err": assert_close(out_n, out_r, rtol=r0 if rtol is None else rtol,
                                      atol=a0 if atol is None else atol, scale=scale_for(0),
                                      what="module output")}
    if not grads:
        return report
    report["grad_err"] = {}
    for k, ((path, a), (_, b)) in enumerate(zip(jax.tree_util.tree_leaves_with_path(g_n),
                                                jax.tree_util.tree_leaves_with_path(g_r))):
        name = jax.tree_util.keystr(path)
        report["grad_err"][name] = assert_close(a, b, rtol=rtol, atol=atol, scale=scale_for(1 + k),
                                                what=f"gradient of parameter {name}")
    return report

