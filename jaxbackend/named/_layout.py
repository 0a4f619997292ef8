"""Selection and layout: isel, rename, transpose, expand_dims, squeeze,
concat, stack (merge dims) and unstack (split a dim).

Each emits what the jnp spelling would: basic indexing for ints and slices,
a gather for integer-array indexers, `transpose` only when the order changes,
`reshape` for merge/split. `rename` emits nothing: names are static data.
Vectorised `isel` (NamedArray indexers) follows numpy's rule: indexers on
adjacent axes put their dims in place (as xarray), otherwise first.

Result orders follow xarray where that costs nothing, and keep the existing
order where xarray's would force a copy: `stack` merges adjacent, in-order
dims in place (a reshape) and otherwise moves them to the end (xarray's
place for the new dim); `unstack` splits a dim in place.
"""

from __future__ import annotations

import math
from types import EllipsisType
from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxbackend.named import _errors
from jaxbackend.named._array import NamedArray
from jaxbackend.named._elementwise import align


def _kw(op: str, mapping: dict | None, kwargs: dict) -> dict:
    if mapping is not None and not isinstance(mapping, dict):
        raise _errors.DimError(f"{op}: pass a dict of dim -> value, or keyword arguments.")
    out = dict(mapping or {})
    out.update(kwargs)
    return out


def isel(x: NamedArray, indexers: dict[str, Any] | None = None, **kwargs: Any) -> NamedArray:
    """Select by position: ints drop the dim, slices keep it, 1-d integer
    arrays gather along it (keeping its name), NamedArray indexers gather
    pointwise and replace the dim by the indexer's dims (xarray's vectorised
    indexing)."""
    idx = _kw("isel", indexers, kwargs)
    basic = [slice(None)] * x.ndim
    dims: list[str | None] = list(x.dims)
    arrays, named, any_basic = [], {}, False
    for d, i in idx.items():
        k = x.axis(d, "isel")
        if isinstance(i, (list, tuple)):
            i = np.asarray(i)
        if isinstance(i, NamedArray):
            named[d] = i
        elif isinstance(i, slice):
            # Compare fields by identity: bounds may be tracers (no ==).
            full = i.start is None and i.stop is None and i.step is None
            basic[k], any_basic = i, any_basic or not full
        elif jnp.ndim(i) == 0:
            basic[k], any_basic = i, True
            dims[k] = None
        elif jnp.ndim(i) == 1:
            if jnp.result_type(i) == jnp.bool_:
                raise _errors.DimError(
                    f"isel: the indexer for dim {d!r} is boolean; isel takes positions, so pass "
                    f"the positions of the True entries (np.flatnonzero(mask)) or use nx.where.")
            arrays.append((d, jnp.asarray(i)))
        else:
            raise _errors.DimError(
                f"isel: the indexer for dim {d!r} has shape {jnp.shape(i)}; an unnamed "
                f"indexer must be 1-d, so name its axes with nx.as_named(...)."
            )
    out = x
    if any_basic:
        out = NamedArray(x.values[tuple(basic)], tuple(d for d in dims if d is not None))
    for d, i in arrays:
        out = NamedArray(jnp.take(out.values, i, axis=out.axis(d, "isel")), out.dims)
    if named:
        out = _vectorised(out, named)
    return out


def _vectorised(x: NamedArray, named: dict) -> NamedArray:
    # One jnp advanced-indexing step, so numpy's rule places the indexer
    # dims: in place of the indexed axes when those are adjacent (xarray
    # agrees), else first (xarray would put them where the first indexed
    # axis was, at the price of a transpose; names make the order moot).
    rest = [d for d in x.dims if d not in named]
    idims, ivals = align("isel", *named.values())
    clash = set(idims) & set(rest)
    if clash:
        raise _errors.DimError(
            f"isel: indexer dims {_errors.fmt_dims(sorted(clash))} are also dims of the array "
            f"that are not being indexed; rename the indexer's dims."
        )
    key = [slice(None)] * x.ndim
    for d, v in zip(named, ivals):
        key[x.dims.index(d)] = v
    ks = sorted(x.dims.index(d) for d in named)
    if ks == list(range(ks[0], ks[0] + len(ks))):
        dims = x.dims[:ks[0]] + idims + x.dims[ks[-1] + 1:]
    else:
        dims = idims + tuple(rest)
    return NamedArray(x.values[tuple(key)], dims)


def rename(x: NamedArray, mapping: dict[str, str] | None = None, **kwargs: str) -> NamedArray:
    """Rename dims: `x.rename(time="time_q")` or `x.rename({"time": "time_q"})`."""
    m = {d: new for d, new in _kw("rename", mapping, kwargs).items() if d != new}
    for d, new in m.items():
        x.axis(d, "rename")
        if new in x.dims and m.get(new, new) == new:
            raise _errors.DimError(
                f"rename: renaming {d!r} to {new!r} clashes with the dim {new!r} the array "
                f"already has (dims {_errors.fmt_dims(x.dims)}); pick an unused name or rename "
                f"{new!r} too.")
    dims = _errors.check_dims_tuple("rename", tuple(m.get(d, d) for d in x.dims), arg="new dims")
    return NamedArray(x.values, dims)


def transpose(x: NamedArray, *dims: str | EllipsisType) -> NamedArray:
    """Reorder dims; `...` stands for the dims not named, in their order."""
    if not dims:
        dims = tuple(reversed(x.dims))
    for d in dims:
        if d is not Ellipsis:
            x.axis(d, "transpose")
    if dims.count(Ellipsis) > 1:
        raise _errors.DimError("transpose: use `...` at most once.")
    if Ellipsis in dims:
        k = dims.index(Ellipsis)
        rest = tuple(d for d in x.dims if d not in dims)
        dims = dims[:k] + rest + dims[k + 1:]
    order = _errors.check_dims_tuple("transpose", dims)
    if set(order) != set(x.dims):
        missing = tuple(d for d in x.dims if d not in order)
        raise _errors.DimError(
            f"transpose: dims {_errors.fmt_dims(missing)} of the array are not listed; list "
            f"every dim of {_errors.fmt_dims(x.dims)} or add `...`."
        )
    if order == x.dims:
        return x
    return NamedArray(lax.transpose(x.values, tuple(x.dims.index(d) for d in order)), order)


def expand_dims(x: NamedArray, dim: str | dict[str, int], size: int = 1) -> NamedArray:
    """Add a new leading dim (xarray's default place); `dim` may be a dict
    of several name -> size."""
    new = dict(dim) if isinstance(dim, dict) else {dim: size}
    dims = _errors.check_dims_tuple("expand_dims", tuple(new) + x.dims)
    shape = tuple(int(new[d]) for d in new) + x.shape
    vals = lax.broadcast_in_dim(x.values, shape, tuple(range(len(new), len(dims))))
    return NamedArray(vals, dims)


def squeeze(x: NamedArray, dim: str | Sequence[str] | None = None) -> NamedArray:
    """Drop size-1 dims (all of them when `dim` is None)."""
    if dim is None:
        names = tuple(d for d, n in zip(x.dims, x.shape) if n == 1)
    else:
        names = (dim,) if isinstance(dim, str) else tuple(dim)
    axes = tuple(x.axis(d, "squeeze") for d in names)
    for d, k in zip(names, axes):
        if x.shape[k] != 1:
            raise _errors.DimError(
                f"squeeze: dim {d!r} has size {x.shape[k]}, not 1; select one entry with "
                f".isel({d}=0) instead."
            )
    if not axes:
        return x
    return NamedArray(lax.squeeze(x.values, axes), tuple(d for d in x.dims if d not in names))


def concat(arrays: Sequence[NamedArray], dim: str) -> NamedArray:
    """Join along `dim`: an existing dim grows; a new dim is added in front."""
    arrays = list(arrays)
    if not arrays or not all(isinstance(a, NamedArray) for a in arrays):
        raise _errors.DimError("concat: pass a non-empty sequence of NamedArrays.")
    first = arrays[0]
    others = tuple(d for d in first.dims if d != dim)
    for i, a in enumerate(arrays[1:], start=2):
        if set(a.dims) - {dim} != set(others) or (dim in first.dims) != (dim in a.dims):
            raise _errors.DimError(
                f"concat: array {i} has dims {_errors.fmt_dims(a.dims)} but array 1 has "
                f"{_errors.fmt_dims(first.dims)}; all arrays need the same dims."
            )
        for d in others:
            if a.sizes[d] != first.sizes[d]:
                raise _errors.size_conflict("concat", d, first.sizes[d], a.sizes[d], "array 1",
                                            f"array {i}")
    vals = [a.transpose(*first.dims).values for a in arrays]
    if dim in first.dims:
        return NamedArray(jnp.concatenate(vals, axis=first.axis(dim)), first.dims)
    return NamedArray(jnp.stack(vals, axis=0), (dim,) + first.dims)


def stack(x: NamedArray, dims: dict[str, Sequence[str]] | None = None,
          **kwargs: Sequence[str]) -> NamedArray:
    """Merge dims into one: `nx.stack(x, embd=("head", "hd"))` (row-major)."""
    spec = _kw("stack", dims, kwargs)
    for new, olds in spec.items():
        olds = _errors.check_dims_tuple("stack", olds, arg=new)
        ks = [x.axis(d, "stack") for d in olds]
        rest = [d for d in x.dims if d not in olds]
        if new in rest:
            raise _errors.DimError(f"stack: new dim {new!r} already exists; pick another name.")
        if ks != list(range(ks[0], ks[0] + len(ks))):
            x = x.transpose(*rest, *olds)
            ks = list(range(len(rest), x.ndim))
        size = math.prod(x.shape[k] for k in ks)
        dims_out = x.dims[:ks[0]] + (new,) + x.dims[ks[-1] + 1:]
        shape = x.shape[:ks[0]] + (size,) + x.shape[ks[-1] + 1:]
        x = NamedArray(x.values.reshape(shape), dims_out)
    return x


def unstack(x: NamedArray, dims: dict[str, dict[str, int]] | None = None,
            **kwargs: dict[str, int]) -> NamedArray:
    """Split a dim in place: `nx.unstack(x, embd={"head": 4, "hd": 16})`."""
    spec = _kw("unstack", dims, kwargs)
    for old, new in spec.items():
        k = x.axis(old, "unstack")
        if not isinstance(new, dict):
            raise _errors.DimError(
                f"unstack: {old}={new!r} must be a dict of new dim -> size, e.g. "
                f"{old}={{'head': 4, 'hd': 16}}.")
        names = _errors.check_dims_tuple("unstack", tuple(new), arg=old)
        sizes = tuple(int(new[d]) for d in names)
        if math.prod(sizes) != x.shape[k]:
            raise _errors.DimError(
                f"unstack: dim {old!r} has size {x.shape[k]} but the new sizes "
                f"{dict(zip(names, sizes))} multiply to {math.prod(sizes)}; give sizes "
                f"whose product is {x.shape[k]}.")
        dims_out = _errors.check_dims_tuple("unstack", x.dims[:k] + names + x.dims[k + 1:])
        x = NamedArray(x.values.reshape(x.shape[:k] + sizes + x.shape[k + 1:]), dims_out)
    return x


def getitem(x: NamedArray, key: dict[str, Any] | EllipsisType) -> NamedArray:
    if key is Ellipsis:  # x[...] is x itself, as Flax's `variable[...]` reads it
        return x
    if isinstance(key, dict):
        return isel(x, key)
    raise _errors.DimError(
        f"isel: NamedArray[...] takes a dict of dim -> index, e.g. x[{{'time': 0}}], not "
        f"{key!r}; positions are ambiguous with names, so use .isel(...).")


def setitem(x: NamedArray, key: EllipsisType, value: NamedArray) -> None:
    # Only the whole-array replace that Flax's `variable[...] = new` performs:
    # the new values must carry the same dims and sizes (any order).
    if key is not Ellipsis:
        raise _errors.DimError(
            f"NamedArray[{key!r}] = ...: only x[...] = new (a whole replace) is supported; "
            f"build a new array with nx.where or .isel + nx.concat instead.")
    if not isinstance(value, NamedArray) or set(value.dims) != set(x.dims):
        got = value.dims if isinstance(value, NamedArray) else "an unnamed array"
        raise _errors.DimError(
            f"NamedArray[...] = new: new has dims {got} but the array has "
            f"{_errors.fmt_dims(x.dims)}; pass a NamedArray with the same dims.")
    for d in x.dims:
        if value.sizes[d] != x.sizes[d]:
            raise _errors.size_conflict("NamedArray[...] = new", d, x.sizes[d], value.sizes[d],
                                        "the array", "the new value")
    x.values = value.transpose(*x.dims).values
