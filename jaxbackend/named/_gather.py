"""Gathers by name: `take` (xarray's vectorised isel along one dim, the
named `jnp.take` / `jnp.take_along_axis`) and `cross_entropy` on it, so a
loss needs neither `.values` nor positional axes.

Index dims are matched to x's dims by name. Index dims x lacks replace the
gathered dim in place; index dims x also has are pointwise (broadcast by
name, as xarray's vectorised indexing). With no shared dim this is
`jnp.take`; with shared dims it is one `jnp.take_along_axis`, whose indices
are laid out in x's order, so neither the array nor the result is
transposed. Both emit one `gather` with jnp's default mode: what the jnp
twin of the same program emits.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike

from jaxbackend.named import _errors
from jaxbackend.named._array import NamedArray
from jaxbackend.named._elementwise import align


def _named_arg(op: str, arg: str, x) -> NamedArray:
    if not isinstance(x, NamedArray):
        raise _errors.DimError(
            f"{op}: {arg} is {type(x).__name__}, not a NamedArray; name its axes first with "
            f"nx.as_named({arg}, dims=(...)).")
    return x.check_rank(op)


def _axis(op: str, x: NamedArray, dim) -> int:
    if not isinstance(dim, str):
        raise _errors.DimError(
            f"{op}: dim={dim!r} must be one dim name (a str); pass one of "
            f"{_errors.fmt_dims(x.dims)}.")
    return x.axis(dim, op)


def _index_array(op: str, arg: str, indices, index_dims=None) -> NamedArray:
    """`indices` as an integer NamedArray: a NamedArray, a 0-d integer, or
    (take only) an unnamed array whose axes `index_dims` names."""
    if isinstance(indices, NamedArray):
        if index_dims is not None:
            raise _errors.DimError(
                f"{op}: index_dims={index_dims!r} names an unnamed {arg} array, but {arg} is a "
                f"NamedArray with dims {_errors.fmt_dims(indices.dims)}; drop index_dims.")
        idx = indices.check_rank(op)
    else:
        v = indices if isinstance(indices, jax.Array) else jnp.asarray(indices)
        if index_dims is None and v.ndim:
            alt = " or pass index_dims=(...)" if op == "take" else ""
            raise _errors.DimError(
                f"{op}: {arg} is an unnamed array of shape {tuple(v.shape)}; name its axes with "
                f"nx.as_named({arg}, dims=(...)){alt}.")
        index_dims = _errors.check_dims_tuple(op, () if index_dims is None else index_dims,
                                              arg="index_dims")
        if v.ndim != len(index_dims):
            raise _errors.DimError(
                f"{op}: {arg} has {v.ndim} axes (shape {tuple(v.shape)}) but index_dims="
                f"{_errors.fmt_dims(index_dims)} names {len(index_dims)}; give one name per axis.")
        idx = NamedArray(v, index_dims)
    if not jnp.issubdtype(idx.dtype, jnp.integer):
        raise TypeError(
            f"{op}: {arg} has dtype {idx.dtype}, but positions must be integers; cast with "
            f".astype(jnp.int32) (rounding first if they were computed as floats).")
    return idx


def _gather(op: str, x: NamedArray, idx: NamedArray, k: int, mode, fill_value) -> NamedArray:
    rest = x.dims[:k] + x.dims[k + 1:]
    new = tuple(d for d in idx.dims if d not in rest)
    for d in idx.dims:
        if d in rest and idx.sizes[d] != x.sizes[d]:
            raise _errors.size_conflict(op, d, x.sizes[d], idx.sizes[d],
                                        f"the array (dims {_errors.fmt_dims(x.dims)})",
                                        f"the indices (dims {_errors.fmt_dims(idx.dims)})")
    dims = x.dims[:k] + new + x.dims[k + 1:]
    if len(new) == idx.ndim:  # nothing shared: whole slices, as jnp.take
        return NamedArray(jnp.take(x.values, idx.values, axis=k, mode=mode,
                                   fill_value=fill_value), dims)
    # Pointwise over the shared dims: jnp.take_along_axis, whose indices have
    # x's rank. Lay them out in x's order with the new dims merged into one
    # axis at k and size-1 axes where x has dims they lack (broadcast), so
    # neither the array nor the result is transposed, only the index array.
    iv = idx.transpose(*(d for d in dims if d in idx.sizes)).values
    if len(new) > 1:
        n = sum(d in idx.sizes for d in x.dims[:k])
        iv = iv.reshape(iv.shape[:n] + (math.prod(iv.shape[n:n + len(new)]),) +
                        iv.shape[n + len(new):])
    iv = lax.expand_dims(iv, tuple(j for j, d in enumerate(x.dims)
                                   if (j == k and not new) or (j != k and d not in idx.sizes)))
    v = jnp.take_along_axis(x.values, iv, axis=k, mode=mode, fill_value=fill_value)
    if not new:
        v = lax.squeeze(v, (k,))
    elif len(new) > 1:
        v = v.reshape(x.shape[:k] + tuple(idx.sizes[d] for d in new) + x.shape[k + 1:])
    return NamedArray(v, dims)


def take(x: NamedArray, indices: NamedArray | ArrayLike, dim: str, *,
         index_dims: Sequence[str] | None = None, mode: str | None = None,
         fill_value: ArrayLike | None = None) -> NamedArray:
    """Gather along `dim` at integer `indices`: xarray's vectorised
    `x.isel({dim: indices})`, the named `jnp.take` / `jnp.take_along_axis`.

    `indices` is an integer NamedArray, a 0-d integer (drops `dim`), or an
    unnamed integer array with `index_dims` naming its axes. The result has
    x's dims with `dim` replaced, in place, by the index dims that x lacks.
    Index dims that x also has are matched by name, so there are two cases:

    * No index dim is another dim of x: each index reads a whole slice, as
      `jnp.take(x, indices, axis)`. x (batch, vocab), indices (k,) ->
      (batch, k).
    * Index dims shared with x's other dims are pointwise, as
      `jnp.take_along_axis`: logits (batch, time, vocab), targets (batch,
      time) -> (batch, time), one logit per position. Shared dims must agree
      in size; x's dims the indices lack are read whole (broadcast).

    Values agree with xarray in both cases. Order differs only when a shared
    dim is not next to `dim`: xarray moves it beside the index dims, we keep
    x's order (no transpose of the result).

    Out-of-range indices follow jnp.take's default (`mode=None`, "fill"):
    -n <= i < 0 counts from the end; any other out-of-range index reads
    `fill_value` (default NaN for floats, the dtype's minimum for signed
    integers) and gets no gradient. `mode` and `fill_value` are jnp.take's.
    """
    x = _named_arg("take", "x", x)
    idx = _index_array("take", "indices", indices, index_dims)
    return _gather("take", x, idx, _axis("take", x, dim), mode, fill_value)


def cross_entropy(logits: NamedArray, targets: NamedArray | ArrayLike, dim: str) -> NamedArray:
    """Per-position softmax cross entropy of integer class `targets` along
    `dim`: logsumexp(logits, dim) - take(logits, targets, dim), as
    `optax.softmax_cross_entropy_with_integer_labels`.

    Computed in float32 at least, so bfloat16 logits give a float32 loss
    (and a bfloat16 gradient). The result has take's dims: usually logits'
    dims without `dim`. A target out of range gives NaN (take's fill).
    Reduce with `.mean()`; mask padding with `nx.where(mask, loss, 0.0)`.
    """
    logits = _named_arg("cross_entropy", "logits", logits)
    if not jnp.issubdtype(logits.dtype, jnp.floating):
        raise TypeError(
            f"cross_entropy: logits have dtype {logits.dtype}; they must be floating point, so "
            f"cast with .astype(jnp.float32).")
    idx = _index_array("cross_entropy", "targets", targets)
    k = _axis("cross_entropy", logits, dim)
    xv = logits.values.astype(jnp.promote_types(logits.dtype, jnp.float32))
    # Shift by the max (no gradient: the loss does not depend on it) so exp
    # cannot overflow and the loss is a difference of O(1) terms, not of two
    # large ones that cancel (optax's lse - logit loses ~1e-3 at logits ~1e4).
    shifted = NamedArray(xv - lax.stop_gradient(jnp.max(xv, axis=k, keepdims=True)), logits.dims)
    log_z = NamedArray(jnp.log(jnp.sum(jnp.exp(shifted.values), axis=k)),
                       logits.dims[:k] + logits.dims[k + 1:])
    picked = _gather("cross_entropy", shifted, idx, k, None, None)
    # In take's order: log_z (which lacks only the new index dims) is the
    # one broadcast, never the picked values transposed.
    dims, (p, z) = align("cross_entropy", picked, log_z)
    return NamedArray(z - p, dims)

