"""Math on NamedArrays: construction, broadcasting by name, reductions,
softmax family, `where`, and the contractions `dot` and `einsum` (the only
ops that bind the `einsum` primitive).

Broadcasting follows xarray: the result's dims are the outer union of the
operands' dims in order of first appearance; a name means one size (no
size-1 broadcasting between equal names, as xarray). Each operand is brought
to that order the way a hand-written jnp program would: a `transpose` only if
its own dims are out of order, a rank-expanding `broadcast_in_dim` (size-1
axes) only if it lacks dims that are not leading ones (trailing-aligned
operands are left to numpy-style rank broadcasting), then the jnp/lax op
itself, which broadcasts the size-1 axes. So a named program emits the same
primitives as its jnp twin.

`dot` returns dot_general's natural dim order (batch dims, then the first
operand's free dims, then the second's), so a contraction never needs a
`transpose` when lowered. Names make the order immaterial; `transpose`
gives any other, and `einsum(..., out=dims)` asks for one up front.

Every op checks that the leaf's rank matches the dims before reading axes
(`NamedArray.check_rank`): a NamedArray whose values lost an axis to
`jax.vmap` would otherwise be read with shifted axes, a silent wrong answer.
"""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp
from jax import lax

from jaxbackend.named import _einsum, _errors
from jaxbackend.named._array import NamedArray


# -- construction -----------------------------------------------------------

def as_named(array, dims) -> NamedArray:
    """Wrap an array-like; `dims` names its axes in order."""
    dims = _errors.check_dims_tuple("as_named", dims)
    if isinstance(array, NamedArray):
        return array.transpose(*dims) if set(dims) == set(array.dims) else _mismatch(array, dims)
    values = array if isinstance(array, jax.Array) else jnp.asarray(array)
    if values.ndim != len(dims):
        raise _errors.DimError(
            f"as_named: the array has {values.ndim} axes (shape {tuple(values.shape)}) but "
            f"dims={_errors.fmt_dims(dims)} names {len(dims)}; give exactly one name per axis."
        )
    return NamedArray(values, dims)


def _mismatch(array, dims):
    raise _errors.DimError(
        f"as_named: the NamedArray already has dims {_errors.fmt_dims(array.dims)}, not "
        f"{_errors.fmt_dims(dims)}; use .rename(...) to change names."
    )


def _sizes_arg(op, sizes) -> tuple:
    if not isinstance(sizes, dict):
        raise _errors.DimError(
            f"{op}: sizes={sizes!r} must be a dict of dim name -> size, e.g. {{'batch': 2}}."
        )
    dims = _errors.check_dims_tuple(op, tuple(sizes), arg="sizes")
    return dims, tuple(int(sizes[d]) for d in dims)


def full(sizes: dict, fill_value, dtype=None) -> NamedArray:
    dims, shape = _sizes_arg("full", sizes)
    return NamedArray(jnp.full(shape, fill_value, dtype=dtype), dims)


def zeros(sizes: dict, dtype=jnp.float32) -> NamedArray:
    dims, shape = _sizes_arg("zeros", sizes)
    return NamedArray(jnp.zeros(shape, dtype), dims)


def ones(sizes: dict, dtype=jnp.float32) -> NamedArray:
    dims, shape = _sizes_arg("ones", sizes)
    return NamedArray(jnp.ones(shape, dtype), dims)


def arange(*args, dim: str, dtype=None) -> NamedArray:
    """`jnp.arange(*args)` as a 1-d array with dim `dim`."""
    (dim,) = _errors.check_dims_tuple("arange", (dim,), arg="dim")
    return NamedArray(jnp.arange(*args, dtype=dtype), (dim,))


# -- broadcasting by name -----------------------------------------------------

def _is_scalar(x) -> bool:
    return not isinstance(x, NamedArray) and jnp.ndim(x) == 0


def _union_sizes(op: str, args) -> dict:
    """dim -> size over the NamedArrays among `args`, in order of first
    appearance; one name with two sizes is a DimError naming both arguments."""
    sizes, first = {}, {}
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


def align(op: str, *args):
    """Bring NamedArrays (and scalars) to one dim order; returns (dims, values)."""
    for i, a in enumerate(args):
        if not isinstance(a, NamedArray) and not _is_scalar(a):
            raise _errors.DimError(
                f"{op}: argument {i + 1} is an unnamed array of shape {tuple(jnp.shape(a))}; "
                f"name its axes first with nx.as_named(x, dims=(...))."
            )
    sizes = _union_sizes(op, args)
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


def _elementwise(fn, name):
    def op(*args, **kwargs):
        if not any(isinstance(a, NamedArray) for a in args):
            return fn(*args, **kwargs)
        dims, vals = align(name, *args)
        return NamedArray(fn(*vals, **kwargs), dims)
    op.__name__ = name
    op.__doc__ = f"Named `{name}`: broadcasts by dim name (outer union, xarray order)."
    return op


_UNARY = {
    "exp": jnp.exp, "log": jnp.log, "log1p": jnp.log1p, "expm1": jnp.expm1,
    "tanh": jnp.tanh, "sqrt": jnp.sqrt, "rsqrt": lax.rsqrt, "abs": jnp.abs,
    "sin": jnp.sin, "cos": jnp.cos, "square": jnp.square, "negative": jnp.negative,
    "sign": jnp.sign, "floor": jnp.floor, "ceil": jnp.ceil, "round": jnp.round,
    "reciprocal": jnp.reciprocal, "erf": jax.scipy.special.erf,
    "sigmoid": jax.nn.sigmoid, "relu": jax.nn.relu, "gelu": jax.nn.gelu,
    "silu": jax.nn.silu, "logical_not": jnp.logical_not, "isnan": jnp.isnan,
    "isfinite": jnp.isfinite, "stop_gradient": lax.stop_gradient,
}
_BINARY = {
    "add": jnp.add, "subtract": jnp.subtract, "multiply": jnp.multiply,
    "divide": jnp.divide, "floor_divide": jnp.floor_divide, "mod": jnp.mod,
    "power": jnp.power, "maximum": jnp.maximum, "minimum": jnp.minimum,
    "arctan2": jnp.arctan2, "logical_and": jnp.logical_and,
    "logical_or": jnp.logical_or, "logical_xor": jnp.logical_xor,
    "equal": jnp.equal, "not_equal": jnp.not_equal, "less": jnp.less,
    "less_equal": jnp.less_equal, "greater": jnp.greater,
    "greater_equal": jnp.greater_equal,
}
ELEMENTWISE = {name: _elementwise(fn, name) for name, fn in {**_UNARY, **_BINARY}.items()}


def where(cond, x, y) -> NamedArray:
    """`jnp.where(cond, x, y)` with all three broadcast by name.

    Result order: x's dims, then y's new ones, then cond's. (xarray starts
    from cond's; leading with the values means a mask never forces a
    transpose of the data it selects from.)
    """
    dims, (xv, yv, cv) = align("where", x, y, cond)
    if not any(isinstance(a, NamedArray) for a in (cond, x, y)):
        return jnp.where(cv, xv, yv)
    return NamedArray(jnp.where(cv, xv, yv), dims)


def clip(x, min=None, max=None) -> NamedArray:
    dims, (v, lo, hi) = align("clip", x, min, max)
    return NamedArray(jnp.clip(v, lo, hi), dims)


# -- reductions ---------------------------------------------------------------

def _axes(x: NamedArray, dim, op: str) -> tuple:
    if dim is None or dim is Ellipsis:
        return tuple(range(x.check_rank(op).ndim))
    names = (dim,) if isinstance(dim, str) else tuple(dim)
    return tuple(x.axis(d, op) for d in names)


def _reducer(fn, name):
    def reduce(x: NamedArray, dim=None, **kwargs) -> NamedArray:
        if "keepdims" in kwargs or "axis" in kwargs:
            raise _errors.DimError(
                f"{name}: keepdims/axis are positional ideas; pass dim=<name(s)>, and to keep a "
                f"reduced dim use .expand_dims(<name>) on the result.")
        axes = _axes(x, dim, name)
        dims = tuple(d for k, d in enumerate(x.dims) if k not in axes)
        return NamedArray(fn(x.values, axis=axes, **kwargs), dims)
    reduce.__name__ = name
    reduce.__doc__ = (f"`{name}` over `dim` (a name, a tuple of names, or None for all); "
                      "the reduced dims disappear.")
    return reduce


REDUCTIONS = {name: _reducer(fn, name) for name, fn in {
    "sum": jnp.sum, "mean": jnp.mean, "max": jnp.max, "min": jnp.min,
    "prod": jnp.prod, "std": jnp.std, "var": jnp.var, "any": jnp.any,
    "all": jnp.all, "logsumexp": jax.nn.logsumexp,
}.items()}


def _one_axis(fn, name):
    def op(x: NamedArray, dim: str) -> NamedArray:
        if not isinstance(dim, str):
            raise _errors.DimError(f"{name}: dim={dim!r} must be one dim name (a str).")
        return NamedArray(fn(x.values, axis=x.axis(dim, name)), x.dims)
    op.__name__ = name
    return op


softmax = _one_axis(jax.nn.softmax, "softmax")
log_softmax = _one_axis(jax.nn.log_softmax, "log_softmax")
cumsum = _one_axis(jnp.cumsum, "cumsum")


def logsumexp(x: NamedArray, dim) -> NamedArray:
    """log(sum(exp(x))) over `dim`, computed stably (max subtracted first)."""
    return REDUCTIONS["logsumexp"](x, dim)


def argmax(x: NamedArray, dim: str) -> NamedArray:
    return NamedArray(jnp.argmax(x.values, axis=x.axis(dim, "argmax")),
                      tuple(d for d in x.dims if d != dim))


def argmin(x: NamedArray, dim: str) -> NamedArray:
    return NamedArray(jnp.argmin(x.values, axis=x.axis(dim, "argmin")),
                      tuple(d for d in x.dims if d != dim))


# -- contraction -----------------------------------------------------------------

def _contract_pair(a: NamedArray, b: NamedArray, contract: set, op: str,
                   out_dims=None) -> NamedArray:
    # Dims contracted but held by one operand only are summed there first, so
    # the einsum keeps its closure property (see _einsum's docstring).
    only_a = [d for d in a.dims if d in contract and d not in b.dims]
    only_b = [d for d in b.dims if d in contract and d not in a.dims]
    if only_a:
        a = REDUCTIONS["sum"](a, tuple(only_a))
    if only_b:
        b = REDUCTIONS["sum"](b, tuple(only_b))
    dtype = jnp.result_type(a.dtype, b.dtype)
    av, bv = a.values.astype(dtype), b.values.astype(dtype)
    shared = [d for d in a.dims if d in b.dims and d in contract]
    out = _einsum.natural_out_dims(a.dims, b.dims, shared) if out_dims is None else out_dims
    return NamedArray(
        _einsum.einsum(av, bv, lhs_dims=a.dims, rhs_dims=b.dims, out_dims=out,
                       preferred_element_type=dtype), out)


def _check_operands(op: str, arrays) -> None:
    """NamedArrays only, ranks intact, one size per dim name across them."""
    if not arrays or not all(isinstance(a, NamedArray) for a in arrays):
        raise _errors.DimError(
            f"{op}: every argument must be a NamedArray; wrap arrays with nx.as_named.")
    _union_sizes(op, arrays)


def dot(*arrays: NamedArray, dim=None) -> NamedArray:
    """Contract `arrays` over the named `dim`(s), as `xarray.dot`.

    `dim=None` contracts every dim held by more than one array; `dim=...`
    contracts every dim. Shared dims not contracted are batch dims. Each
    pairwise contraction is one `einsum` equation.
    """
    _check_operands("dot", arrays)
    all_dims = [d for a in arrays for d in a.dims]
    if dim is None:
        contract = {d for d in all_dims if all_dims.count(d) > 1}  # as xarray
    elif dim is Ellipsis:
        contract = set(all_dims)
    else:
        names = (dim,) if isinstance(dim, str) else tuple(dim)
        for d in names:
            if d not in all_dims:
                raise _errors.unknown_dim("dot", d, tuple(dict.fromkeys(all_dims)))
        contract = set(names)
    if len(arrays) == 1:
        return REDUCTIONS["sum"](arrays[0], tuple(d for d in arrays[0].dims if d in contract))
    out = arrays[0]
    for i, b in enumerate(arrays[1:], start=1):
        later = {d for a in arrays[i + 1:] for d in a.dims}
        out = _contract_pair(out, b, contract - later, "dot")
    return out


def einsum(*arrays: NamedArray, out) -> NamedArray:
    """Contract every dim not named in `out`; the result has dims `out`, in
    that order: `nx.einsum(x, w, out=("batch", "head"))`.

    Like `dot(..., dim=<all dims not in out>)` followed by a transpose, but
    the last pairwise `einsum` equation asks for `out` directly, so the
    transpose (if any) is part of that equation's lowering.
    """
    _check_operands("einsum", arrays)
    out = _errors.check_dims_tuple("einsum", out, arg="out")
    union = tuple(dict.fromkeys(d for a in arrays for d in a.dims))
    for d in out:
        if d not in union:
            raise _errors.unknown_dim("einsum", d, union, arg="out")
    contract = set(union) - set(out)
    if len(arrays) == 1:
        return REDUCTIONS["sum"](arrays[0], tuple(d for d in arrays[0].dims if d in contract)
                                 ).transpose(*out)
    res = arrays[0]
    for i, b in enumerate(arrays[1:], start=1):
        later = {d for a in arrays[i + 1:] for d in a.dims}
        last = i == len(arrays) - 1
        res = _contract_pair(res, b, contract - later, "einsum", out if last else None)
    return res


def _matmul(a, b):
    return dot(a, b)


# -- operators ---------------------------------------------------------------------

def _bind_methods():
    E = ELEMENTWISE

    def binop(name, reflected=False):
        fn = E[name]
        if reflected:
            return lambda self, other: fn(other, self)
        return lambda self, other: fn(self, other)

    for dunder, name in [("add", "add"), ("sub", "subtract"), ("mul", "multiply"),
                         ("truediv", "divide"), ("floordiv", "floor_divide"),
                         ("mod", "mod"), ("pow", "power"), ("and", "logical_and"),
                         ("or", "logical_or"), ("xor", "logical_xor")]:
        setattr(NamedArray, f"__{dunder}__", binop(name))
        setattr(NamedArray, f"__r{dunder}__", binop(name, reflected=True))
    for dunder, name in [("lt", "less"), ("le", "less_equal"), ("gt", "greater"),
                         ("ge", "greater_equal"), ("eq", "equal"), ("ne", "not_equal")]:
        setattr(NamedArray, f"__{dunder}__", binop(name))
    NamedArray.__hash__ = None
    NamedArray.__neg__ = lambda self: E["negative"](self)
    NamedArray.__pos__ = lambda self: self
    NamedArray.__abs__ = lambda self: E["abs"](self)
    NamedArray.__invert__ = lambda self: NamedArray(operator.invert(self.values), self.dims)
    NamedArray.__matmul__ = _matmul
    NamedArray.__rmatmul__ = lambda self, other: _matmul(other, self)
    for name, fn in REDUCTIONS.items():
        setattr(NamedArray, name, fn)
    NamedArray.argmax, NamedArray.argmin, NamedArray.cumsum = argmax, argmin, cumsum
    NamedArray.dot = lambda self, *others, dim=None: dot(self, *others, dim=dim)
    NamedArray.clip = clip


_bind_methods()
