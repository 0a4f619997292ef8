"""Elementwise math on NamedArrays: broadcasting by name (`align`), the
unary and binary functions (`exp`, `silu`, `add`, `maximum`, ...), `where`
and `clip`. NamedArray's operators delegate here.

Broadcasting follows xarray: the result's dims are the outer union of the
operands' dims in order of first appearance; a name means one size (no
size-1 broadcasting between equal names, as xarray). Each operand is brought
to that order the way a hand-written jnp program would: a `transpose` only if
its own dims are out of order, a rank-expanding `broadcast_in_dim` (size-1
axes) only if it lacks dims that are not leading ones (trailing-aligned
operands are left to numpy-style rank broadcasting), then the jnp/lax op
itself, which broadcasts the size-1 axes. So a named program emits the same
primitives as its jnp twin.

Each function is one line of the tables below: `_unary`/`_binary` wrap the
jnp/lax/jax.nn function once, at import, so a call costs one Python frame
more than the jnp function. With no NamedArray among the arguments the jnp
function runs as is and returns an unnamed array (the `Unary`/`Binary`
protocols type both cases).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, overload

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike

from jaxbackend.named import _errors
from jaxbackend.named._array import NamedArray, Operand


# -- broadcasting by name -----------------------------------------------------

def _is_scalar(x) -> bool:
    return not isinstance(x, NamedArray) and jnp.ndim(x) == 0


def union_sizes(op: str, args) -> dict[str, int]:
    """dim -> size over the NamedArrays among `args`, in order of first
    appearance; one name with two sizes is a DimError naming both arguments."""
    sizes: dict[str, int] = {}
    first: dict[str, int] = {}
    for i, a in enumerate(args):
        if not isinstance(a, NamedArray):
            continue
        a.check_rank(op)
        for d, n in zip(a.dims, a.shape):
            j = first.setdefault(d, i)
            if sizes.setdefault(d, n) != n:
                raise _errors.size_conflict(
                    op, d, sizes[d], n, f"argument {j + 1} (dims {_errors.fmt_dims(args[j].dims)})",
                    f"argument {i + 1} (dims {_errors.fmt_dims(a.dims)})")
    return sizes


def align(op: str, *args) -> tuple[tuple[str, ...], list]:
    """Bring NamedArrays (and scalars) to one dim order; returns (dims, values)."""
    for i, a in enumerate(args):
        if not isinstance(a, NamedArray) and not _is_scalar(a):
            raise _errors.DimError(
                f"{op}: argument {i + 1} is an unnamed array of shape {tuple(jnp.shape(a))}; "
                f"name its axes first with nx.as_named(x, dims=(...))."
            )
    sizes = union_sizes(op, args)
    dims = tuple(sizes)
    pos = {d: k for k, d in enumerate(dims)}
    vals = []
    for a in args:
        if not isinstance(a, NamedArray):
            vals.append(a)
            continue
        v = a.values
        order = sorted(range(a.ndim), key=lambda k: pos[a.dims[k]])
        if order != list(range(a.ndim)):
            v = lax.transpose(v, tuple(order))
        mine = [a.dims[k] for k in order]
        # Trailing dims need nothing: jnp's numpy-style rank broadcasting does
        # what a hand-written program relies on. Otherwise insert size-1 axes.
        if a.ndim < len(dims) and tuple(mine) != dims[len(dims) - a.ndim:]:
            shape = tuple(sizes[d] if d in a.sizes else 1 for d in dims)
            v = lax.broadcast_in_dim(v, shape, tuple(pos[d] for d in mine))
        vals.append(v)
    return dims, vals


# -- the functions --------------------------------------------------------------

class Unary(Protocol):
    """A named unary function: NamedArray in, NamedArray out."""

    @overload
    def __call__(self, x: NamedArray, /, **kwargs: Any) -> NamedArray: ...
    @overload
    def __call__(self, x: ArrayLike, /, **kwargs: Any) -> jax.Array: ...


class Binary(Protocol):
    """A named binary function: a NamedArray result if either operand is one."""

    @overload
    def __call__(self, x1: NamedArray, x2: Operand, /) -> NamedArray: ...
    @overload
    def __call__(self, x1: Operand, x2: NamedArray, /) -> NamedArray: ...
    @overload
    def __call__(self, x1: ArrayLike, x2: ArrayLike, /) -> jax.Array: ...


def _elementwise(fn: Callable, name: str) -> Callable[..., Any]:
    def op(*args, **kwargs):
        if not any(isinstance(a, NamedArray) for a in args):
            return fn(*args, **kwargs)
        dims, vals = align(name, *args)
        return NamedArray(fn(*vals, **kwargs), dims)
    op.__name__ = op.__qualname__ = name
    op.__doc__ = f"Named `{name}`: broadcasts by dim name (outer union, xarray order)."
    return op


def _unary(fn: Callable, name: str) -> Unary:
    return _elementwise(fn, name)


def _binary(fn: Callable, name: str) -> Binary:
    return _elementwise(fn, name)


exp = _unary(jnp.exp, "exp")
log = _unary(jnp.log, "log")
log1p = _unary(jnp.log1p, "log1p")
expm1 = _unary(jnp.expm1, "expm1")
tanh = _unary(jnp.tanh, "tanh")
sqrt = _unary(jnp.sqrt, "sqrt")
rsqrt = _unary(lax.rsqrt, "rsqrt")
abs = _unary(jnp.abs, "abs")
sin = _unary(jnp.sin, "sin")
cos = _unary(jnp.cos, "cos")
square = _unary(jnp.square, "square")
negative = _unary(jnp.negative, "negative")
sign = _unary(jnp.sign, "sign")
floor = _unary(jnp.floor, "floor")
ceil = _unary(jnp.ceil, "ceil")
round = _unary(jnp.round, "round")  # round(x, decimals=0)
reciprocal = _unary(jnp.reciprocal, "reciprocal")
erf = _unary(jax.scipy.special.erf, "erf")
sigmoid = _unary(jax.nn.sigmoid, "sigmoid")
relu = _unary(jax.nn.relu, "relu")
gelu = _unary(jax.nn.gelu, "gelu")  # gelu(x, approximate=True)
silu = _unary(jax.nn.silu, "silu")
logical_not = _unary(jnp.logical_not, "logical_not")
isnan = _unary(jnp.isnan, "isnan")
isfinite = _unary(jnp.isfinite, "isfinite")
stop_gradient = _unary(lax.stop_gradient, "stop_gradient")

add = _binary(jnp.add, "add")
subtract = _binary(jnp.subtract, "subtract")
multiply = _binary(jnp.multiply, "multiply")
divide = _binary(jnp.divide, "divide")
floor_divide = _binary(jnp.floor_divide, "floor_divide")
mod = _binary(jnp.mod, "mod")
power = _binary(jnp.power, "power")
maximum = _binary(jnp.maximum, "maximum")
minimum = _binary(jnp.minimum, "minimum")
arctan2 = _binary(jnp.arctan2, "arctan2")
logical_and = _binary(jnp.logical_and, "logical_and")
logical_or = _binary(jnp.logical_or, "logical_or")
logical_xor = _binary(jnp.logical_xor, "logical_xor")
equal = _binary(jnp.equal, "equal")
not_equal = _binary(jnp.not_equal, "not_equal")
less = _binary(jnp.less, "less")
less_equal = _binary(jnp.less_equal, "less_equal")
greater = _binary(jnp.greater, "greater")
greater_equal = _binary(jnp.greater_equal, "greater_equal")


def where(cond: Operand, x: Operand, y: Operand) -> NamedArray:
    """`jnp.where(cond, x, y)` with all three broadcast by name.

    Result order: x's dims, then y's new ones, then cond's. (xarray starts
    from cond's; leading with the values means a mask never forces a
    transpose of the data it selects from.)
    """
    dims, (xv, yv, cv) = align("where", x, y, cond)
    if not any(isinstance(a, NamedArray) for a in (cond, x, y)):
        return jnp.where(cv, xv, yv)  # type: ignore[return-value]  # unnamed in, unnamed out
    return NamedArray(jnp.where(cv, xv, yv), dims)


def clip(x: NamedArray, min: Operand | None = None, max: Operand | None = None) -> NamedArray:
    dims, (v, lo, hi) = align("clip", x, min, max)
    return NamedArray(jnp.clip(v, lo, hi), dims)
