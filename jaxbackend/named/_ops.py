"""Constructing NamedArrays (`as_named`, `full`, `zeros`, `ones`,
`arange`) and the contractions `dot` and `einsum`, the only ops that bind
the `einsum` primitive.

`dot` returns dot_general's natural dim order (batch dims, then the first
operand's free dims, then the second's), so a contraction never needs a
`transpose` when lowered. Names make the order immaterial; `transpose`
gives any other, and `einsum(..., out=dims)` asks for one up front.

Every op checks that the leaf's rank matches the dims before reading axes
(`NamedArray.check_rank`): a NamedArray whose values lost an axis to
`jax.vmap` would otherwise be read with shifted axes, a silent wrong answer.
Elementwise math lives in `_elementwise`, reductions in `_reductions`.
"""

from __future__ import annotations

from typing import NoReturn, Sequence

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike, DTypeLike

from jaxbackend.named import _einsum, _errors, _reductions
from jaxbackend.named._array import Dims, NamedArray
from jaxbackend.named._elementwise import union_sizes


# -- construction -----------------------------------------------------------

def as_named(array: NamedArray | ArrayLike, dims: Sequence[str]) -> NamedArray:
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


def _mismatch(array: NamedArray, dims: tuple) -> NoReturn:
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


def full(sizes: dict[str, int], fill_value: ArrayLike, dtype: DTypeLike | None = None
         ) -> NamedArray:
    dims, shape = _sizes_arg("full", sizes)
    return NamedArray(jnp.full(shape, fill_value, dtype=dtype), dims)


def zeros(sizes: dict[str, int], dtype: DTypeLike = jnp.float32) -> NamedArray:
    dims, shape = _sizes_arg("zeros", sizes)
    return NamedArray(jnp.zeros(shape, dtype), dims)


def ones(sizes: dict[str, int], dtype: DTypeLike = jnp.float32) -> NamedArray:
    dims, shape = _sizes_arg("ones", sizes)
    return NamedArray(jnp.ones(shape, dtype), dims)


def arange(start: ArrayLike, stop: ArrayLike | None = None, step: ArrayLike | None = None, *,
           dim: str, dtype: DTypeLike | None = None) -> NamedArray:
    """`jnp.arange(start, stop, step)` as a 1-d array with dim `dim`."""
    (dim,) = _errors.check_dims_tuple("arange", (dim,), arg="dim")
    return NamedArray(jnp.arange(start, stop, step, dtype=dtype), (dim,))


# -- contraction -----------------------------------------------------------------

def _contract_pair(a: NamedArray, b: NamedArray, contract: set, op: str,
                   out_dims=None) -> NamedArray:
    # Dims contracted but held by one operand only are summed there first, so
    # the einsum keeps its closure property (see _einsum's docstring).
    only_a = [d for d in a.dims if d in contract and d not in b.dims]
    only_b = [d for d in b.dims if d in contract and d not in a.dims]
    if only_a:
        a = _reductions.sum(a, tuple(only_a))
    if only_b:
        b = _reductions.sum(b, tuple(only_b))
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
    union_sizes(op, arrays)


def dot(*arrays: NamedArray, dim: Dims = None) -> NamedArray:
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
        return _reductions.sum(arrays[0], tuple(d for d in arrays[0].dims if d in contract))
    out = arrays[0]
    for i, b in enumerate(arrays[1:], start=1):
        later = {d for a in arrays[i + 1:] for d in a.dims}
        out = _contract_pair(out, b, contract - later, "dot")
    return out


def einsum(*arrays: NamedArray, out: Sequence[str]) -> NamedArray:
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
        return _reductions.sum(arrays[0], tuple(d for d in arrays[0].dims if d in contract)
                               ).transpose(*out)
    res = arrays[0]
    for i, b in enumerate(arrays[1:], start=1):
        later = {d for a in arrays[i + 1:] for d in a.dims}
        last = i == len(arrays) - 1
        res = _contract_pair(res, b, contract - later, "einsum", out if last else None)
    return res
