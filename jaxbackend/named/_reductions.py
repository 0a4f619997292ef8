"""Reductions and one-axis ops on NamedArrays: `sum`, `mean`, `max`, ...
over dims given by name, `logsumexp`, `argmax`/`argmin`, and the softmax
family and `cumsum` along one named dim.

A reduction takes `dim`: one name, a tuple of names, or None (or `...`) for
every dim; the reduced dims disappear from the result and the rest keep
their order, so the jnp function runs on the values with the matching
`axis` and nothing else is emitted. Positional ideas (`axis=`,
`keepdims=`) are refused with the named spelling in the error.

Each reduction is one line of the table below: `_reduction` wraps the jnp
function once, at import. This module defines `sum`, `max`, `min`, `any`
and `all`, so it must not use those builtins.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp

from jaxbackend.named import _errors
from jaxbackend.named._array import Dims, NamedArray


def _axes(x: NamedArray, dim: Dims, op: str) -> tuple[int, ...]:
    if dim is None or dim is Ellipsis:
        return tuple(range(x.check_rank(op).ndim))
    names = (dim,) if isinstance(dim, str) else tuple(dim)
    return tuple(x.axis(d, op) for d in names)


class Reduction(Protocol):
    """A named reduction: `f(x, dim=None, **jnp_kwargs)`."""

    def __call__(self, x: NamedArray, dim: Dims = None, **kwargs: Any) -> NamedArray: ...


def _reduction(fn: Callable, name: str) -> Reduction:
    def reduce(x: NamedArray, dim: Dims = None, **kwargs: Any) -> NamedArray:
        if "keepdims" in kwargs or "axis" in kwargs:
            raise _errors.DimError(
                f"{name}: keepdims/axis are positional ideas; pass dim=<name(s)>, and to keep a "
                f"reduced dim use .expand_dims(<name>) on the result.")
        axes = _axes(x, dim, name)
        dims = tuple(d for k, d in enumerate(x.dims) if k not in axes)
        return NamedArray(fn(x.values, axis=axes, **kwargs), dims)
    reduce.__name__ = reduce.__qualname__ = name
    reduce.__doc__ = (f"`{name}` over `dim` (a name, a tuple of names, or None for all); "
                      "the reduced dims disappear.")
    return reduce


sum = _reduction(jnp.sum, "sum")
mean = _reduction(jnp.mean, "mean")
max = _reduction(jnp.max, "max")
min = _reduction(jnp.min, "min")
prod = _reduction(jnp.prod, "prod")
std = _reduction(jnp.std, "std")
var = _reduction(jnp.var, "var")
any = _reduction(jnp.any, "any")
all = _reduction(jnp.all, "all")
_logsumexp = _reduction(jax.nn.logsumexp, "logsumexp")


def logsumexp(x: NamedArray, dim: Dims, **kwargs: Any) -> NamedArray:
    """log(sum(exp(x))) over `dim`, computed stably (max subtracted first)."""
    return _logsumexp(x, dim, **kwargs)


class AlongDim(Protocol):
    """A named op along one dim that keeps every dim: `f(x, dim)`."""

    def __call__(self, x: NamedArray, dim: str) -> NamedArray: ...


def _one_axis(fn: Callable, name: str) -> AlongDim:
    def op(x: NamedArray, dim: str) -> NamedArray:
        if not isinstance(dim, str):
            raise _errors.DimError(f"{name}: dim={dim!r} must be one dim name (a str).")
        return NamedArray(fn(x.values, axis=x.axis(dim, name)), x.dims)
    op.__name__ = op.__qualname__ = name
    return op


softmax = _one_axis(jax.nn.softmax, "softmax")
log_softmax = _one_axis(jax.nn.log_softmax, "log_softmax")
cumsum = _one_axis(jnp.cumsum, "cumsum")


def argmax(x: NamedArray, dim: str) -> NamedArray:
    return NamedArray(jnp.argmax(x.values, axis=x.axis(dim, "argmax")),
                      tuple(d for d in x.dims if d != dim))


def argmin(x: NamedArray, dim: str) -> NamedArray:
    return NamedArray(jnp.argmin(x.values, axis=x.axis(dim, "argmin")),
                      tuple(d for d in x.dims if d != dim))
