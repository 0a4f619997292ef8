"""Basic named layers: Linear, Embedding, LayerNorm, RMSNorm, Dropout.

Each is a Flax NNX module taking and returning `NamedArray`s; parameters are
`nnx.Param`s with `dims` metadata (see `_params`). Layers address axes only
by name, so an input may carry any extra dims (batch, time, head, ...) in any
order: they pass through. Contractions go through `nx.dot`, so each is one
named `einsum` equation in the jaxpr, forward and backward.

Precision, as in Flax: `param_dtype` is the dtype parameters are stored in
(default float32) and `dtype` the dtype the layer computes in (default None:
the promoted dtype of the input and the parameters). So
`dtype=jnp.bfloat16` gives bfloat16 matmuls over float32 master weights
(the cast is inside the step, so gradients arrive in float32). The norms take
their mean and variance in at least float32 whatever `dtype` is, and return
`dtype`. Where every dtype is already the compute dtype, no cast is emitted.

Errors: a missing or wrongly sized input dim raises `nx.DimError` naming the
layer, the dim and both sizes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxbackend import named as nx
from jaxbackend.nn import _params
from jaxbackend.nn._params import named


def _sizes(op: str, arg: str, sizes) -> dict:
    if isinstance(sizes, str) or not isinstance(sizes, dict) or not sizes:
        raise nx.DimError(f"{op}: {arg}={sizes!r} must be a non-empty dict of dim name -> size, "
                          f"e.g. {{'embd': 64}}.")
    return {str(d): int(n) for d, n in sizes.items()}


def compute_dtype(dtype, *xs):
    """`dtype` if given, else the promoted dtype of the non-None `xs`
    (NamedArrays or arrays): Flax's `promote_dtype` rule."""
    return jnp.dtype(dtype) if dtype is not None else jnp.result_type(
        *[x.dtype for x in xs if x is not None])


def cast(x, dtype):
    """x (a NamedArray, array or None) in `dtype`; no equation when it is already."""
    return x if x is None or x.dtype == dtype else x.astype(dtype)


def check_input(op: str, x, sizes: dict) -> None:
    """x must be a NamedArray holding every dim of `sizes` at that size."""
    if not isinstance(x, nx.NamedArray):
        raise nx.DimError(f"{op}: the input must be a NamedArray, got {type(x).__name__}; "
                          f"wrap it with nx.as_named(x, dims=(...)).")
    for d, n in sizes.items():
        if d not in x.dims:
            raise nx.DimError(f"{op}: the input has dims {x.dims} but needs dim {d!r} (size {n}); "
                              f"rename or add that dim.")
        if x.sizes[d] != n:
            raise nx.DimError(f"{op}: dim {d!r} of the input has size {x.sizes[d]} but the layer "
                              f"expects {n}; build the layer with {d}={x.sizes[d]}.")


class Linear(nnx.Module):
    """Contract named input dims into named output dims.

    `Linear({"embd": 64}, {"head": 4, "hd": 16})`: kernel dims
    (embd, head, hd), bias dims (head, hd). Output dims: the input's dims not
    contracted, then the output dims (dot_general's natural order).
    """

    def __init__(self, in_sizes: dict, out_sizes: dict, *, use_bias: bool = True,
                 dtype=None, param_dtype=jnp.float32, kernel_init=None, rngs: nnx.Rngs):
        self.in_sizes = _sizes("Linear", "in_sizes", in_sizes)
        self.out_sizes = _sizes("Linear", "out_sizes", out_sizes)
        both = set(self.in_sizes) & set(self.out_sizes)
        if both:
            raise nx.DimError(f"Linear: dims {sorted(both)} are both input and output dims; "
                              f"give the output another name (e.g. {sorted(both)[0]}_out).")
        fan_in = 1
        for n in self.in_sizes.values():
            fan_in *= n
        init = kernel_init or _params.fan_in_normal(fan_in)
        self.dtype = dtype
        self.kernel = _params.param(init, rngs.params(), {**self.in_sizes, **self.out_sizes},
                                    param_dtype)
        self.bias = (_params.param(_params.zeros_init, None, self.out_sizes, param_dtype)
                     if use_bias else None)

    def __call__(self, x: nx.NamedArray) -> nx.NamedArray:
        check_input("Linear", x, self.in_sizes)
        kernel = named(self.kernel)
        bias = None if self.bias is None else named(self.bias)
        dt = compute_dtype(self.dtype, x, kernel, bias)
        y = nx.dot(cast(x, dt), cast(kernel, dt), dim=tuple(self.in_sizes))
        if bias is not None:
            y = y + cast(bias, dt)
        return y


class Embedding(nnx.Module):
    """Integer ids -> vectors: table dims (vocab, embd) by default.

    `__call__(ids)` takes a NamedArray of ints (any dims) and returns its dims
    plus `embd`; `attend(x)` contracts `embd` with the table (tied output
    head), returning x's other dims plus `vocab`.
    """

    def __init__(self, num: int, features: int, *, vocab_dim: str = "vocab",
                 embd_dim: str = "embd", dtype=None, param_dtype=jnp.float32,
                 rngs: nnx.Rngs):
        self.vocab_dim, self.embd_dim, self.dtype = vocab_dim, embd_dim, dtype
        self.embedding = _params.param(lambda k, s, d: jax.random.normal(k, s, d) * 0.02,
                                       rngs.params(), {vocab_dim: num, embd_dim: features},
                                       param_dtype)

    def __call__(self, ids) -> nx.NamedArray:
        if not isinstance(ids, nx.NamedArray):
            raise nx.DimError("Embedding: ids must be a NamedArray of integers, e.g. "
                              "nx.as_named(tokens, dims=('batch', 'time')).")
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise nx.DimError(f"Embedding: ids have dtype {ids.dtype}; pass integer token ids.")
        table = self.embedding[...]
        rows = jnp.take(table, ids.values, axis=0)    # gather, then cast only the rows
        rows = cast(rows, compute_dtype(self.dtype, table))
        return nx.NamedArray(rows, ids.dims + (self.embd_dim,))

    def attend(self, x: nx.NamedArray) -> nx.NamedArray:
        check_input("Embedding.attend", x, {self.embd_dim: self.embedding[...].shape[1]})
        table = named(self.embedding)
        dt = compute_dtype(self.dtype, x, table)
        return nx.dot(cast(x, dt), cast(table, dt), dim=self.embd_dim)


def _moments_dims(op, sizes, eps):
    sizes = _sizes(op, "sizes", sizes)
    return sizes, float(eps)


def _stats_dtype(x):
    # mean and variance in at least float32: a bfloat16 sum of squares over
    # a few thousand entries loses most of its bits
    return jnp.promote_types(x.dtype, jnp.float32)


class LayerNorm(nnx.Module):
    """Normalize over the named dims `sizes` (mean and variance over them),
    then scale and shift with parameters of those dims."""

    def __init__(self, sizes: dict, *, eps: float = 1e-6, use_bias: bool = True,
                 use_scale: bool = True, dtype=None, param_dtype=jnp.float32,
                 rngs: nnx.Rngs | None = None):
        self.sizes, self.eps = _moments_dims("LayerNorm", sizes, eps)
        self.dtype = dtype
        self.scale = (_params.param(_params.ones_init, None, self.sizes, param_dtype)
                      if use_scale else None)
        self.bias = (_params.param(_params.zeros_init, None, self.sizes, param_dtype)
                     if use_bias else None)

    def __call__(self, x: nx.NamedArray) -> nx.NamedArray:
        check_input("LayerNorm", x, self.sizes)
        dims = tuple(self.sizes)
        scale = None if self.scale is None else named(self.scale)
        bias = None if self.bias is None else named(self.bias)
        out = compute_dtype(self.dtype, x, scale, bias)
        xf = cast(x, _stats_dtype(x))
        mean = xf.mean(dim=dims)
        xc = xf - mean
        var = nx.square(xc).mean(dim=dims)
        y = cast(xc * nx.rsqrt(var + self.eps), out)
        if scale is not None:
            y = y * cast(scale, out)
        if bias is not None:
            y = y + cast(bias, out)
        return y.transpose(*x.dims)


class RMSNorm(nnx.Module):
    """x / sqrt(mean(x^2) + eps) over the named dims, times a learned scale."""

    def __init__(self, sizes: dict, *, eps: float = 1e-6, dtype=None, param_dtype=jnp.float32,
                 rngs: nnx.Rngs | None = None):
        self.sizes, self.eps = _moments_dims("RMSNorm", sizes, eps)
        self.dtype = dtype
        self.scale = _params.param(_params.ones_init, None, self.sizes, param_dtype)

    def __call__(self, x: nx.NamedArray) -> nx.NamedArray:
        check_input("RMSNorm", x, self.sizes)
        scale = named(self.scale)
        out = compute_dtype(self.dtype, x, scale)
        xf = cast(x, _stats_dtype(x))
        ms = nx.square(xf).mean(dim=tuple(self.sizes))
        return (cast(xf * nx.rsqrt(ms + self.eps), out) * cast(scale, out)).transpose(*x.dims)


class Dropout(nnx.Module):
    """Zero entries with probability `rate` (scaled by 1/(1-rate)) in training
    mode; the identity after `model.eval()` or with `deterministic=True`.
    Delegates the RNG handling to `nnx.Dropout` (stream `dropout`)."""

    def __init__(self, rate: float, *, deterministic: bool = False, rngs: nnx.Rngs | None = None):
        if not 0.0 <= rate < 1.0:
            raise ValueError(f"Dropout: rate={rate} must be in [0, 1).")
        self.inner = nnx.Dropout(rate, deterministic=deterministic, rngs=rngs)

    def __call__(self, x: nx.NamedArray, *, deterministic: bool | None = None) -> nx.NamedArray:
        if self.inner.rate == 0.0:
            return x
        return nx.NamedArray(self.inner(x.values, deterministic=deterministic), x.dims)
