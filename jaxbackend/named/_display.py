"""How a NamedArray shows itself in Jupyter: `NamedArray._repr_html_`.

A box titled with the dtype, a table of dims and sizes and, for an array
laid out by a `NamedSharding`, which mesh axes split each dim and how big
its piece is on one device (read from the PartitionSpec, the same layout
`jax.debug.visualize_array_sharding` draws). Small concrete arrays add a
preview of their values.

A repr must never raise, whatever the leaf holds, so the leaf is sorted
into what can be said about it before anything is read:

* a tracer (inside jit, grad, vmap): dims, sizes and dtype; no values, and
  no sharding (a tracer has a layout only once compiled);
* a deleted buffer (donated to a jitted call, or `.delete()`d): its shape,
  dtype and sharding are metadata and stay readable; no values;
* an extended dtype (PRNG keys): no numeric preview exists;
* an array not fully addressable from this process (multi-process): no
  preview, which would need the other hosts' shards;
* a placeholder leaf (`None`, `jax.ShapeDtypeStruct`, anything JAX or Flax
  put there while rebuilding the pytree): whatever shape and dtype it has.

A preview copies the array to the host, so only arrays of at most
`PREVIEW_MAX` elements get one; numpy summarises it beyond `_THRESHOLD`.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxbackend import _html, _jax

PREVIEW_MAX = 4096        # elements copied to the host for a preview, at most
_THRESHOLD = 64           # numpy prints "..." beyond this many elements


def html(x) -> str:
    """The HTML of NamedArray `x` (see the module docstring)."""
    v = x.values
    shape = getattr(v, "shape", None)
    dtype = getattr(v, "dtype", None)
    traced = _jax.is_tracer(v)
    sharding = None if traced else getattr(v, "sharding", None)
    notes, preview = _values(v, shape, dtype, traced)

    sizes = list(shape) if shape is not None and len(shape) == len(x.dims) else None
    if shape is not None and sizes is None:
        notes.append(f"dims {x.dims} do not match the leaf's shape {tuple(shape)}")
    header = ["dim", "size"]
    rows = [[d, "?" if sizes is None else sizes[i]] for i, d in enumerate(x.dims)]
    if isinstance(sharding, NamedSharding) and x.dims:
        header += ["mesh axes", "per device"]
        for row, axes in zip(rows, _spec_axes(sharding, len(x.dims))):
            ways = math.prod(sharding.mesh.shape[a] for a in axes)
            per = row[1] if sizes is None else -(-row[1] // ways)   # ceil: XLA pads the last piece
            row += [" × ".join(axes) or "replicated", per]
    where = _placement(sharding)

    title = f"NamedArray · {dtype if dtype is not None else type(v).__name__}"
    title += f" · {len(x.dims)}-d" if x.dims else " · 0-d (a scalar)"
    parts = [_html.table(header, rows)] if x.dims else []
    parts += [_html.note(n) for n in ([where] if where else []) + notes]
    if preview is not None:
        parts.append(_html.pre(preview))
    return _html.box(title, *parts)


def _values(v, shape, dtype, traced) -> tuple[list, str | None]:
    """(notes, preview text or None) about the leaf's values."""
    if traced:
        return ["traced: values are known only when the function runs"], None
    if shape is None or dtype is None:
        return [f"no array here: the leaf is {type(v).__name__}"], None
    if getattr(v, "is_deleted", lambda: False)():
        return ["buffer deleted (donated to a call or deleted): no values"], None
    if not isinstance(v, (jax.Array, np.ndarray, np.generic)):
        return [f"abstract ({type(v).__name__}): no values"], None
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return [f"{dtype} values have no numeric preview"], None
    if not getattr(v, "is_fully_addressable", True):
        return ["shards live on other processes: no preview"], None
    size = math.prod(shape)
    if size > PREVIEW_MAX:
        return [f"{size:,} elements: no preview (more than {PREVIEW_MAX:,})"], None
    a = np.asarray(v)
    if a.dtype.kind == "V":
        # ml_dtypes' bfloat16, float8 and int4 print as bare objects ("1.5 -2");
        # float32 / int32 hold each of their values exactly and print as numbers.
        a = a.astype(np.float32 if jax.dtypes.issubdtype(a.dtype, np.floating) else np.int32)
    return [], np.array2string(a, precision=4, threshold=_THRESHOLD, edgeitems=2, separator=" ")


def _spec_axes(sharding: NamedSharding, ndim: int) -> list:
    """Per dim, the tuple of mesh axes its PartitionSpec entry splits it over."""
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    out = []
    for entry in spec[:ndim]:
        if entry is None or entry is jax.sharding.PartitionSpec.UNCONSTRAINED:
            out.append(())
        else:
            out.append((entry,) if isinstance(entry, str) else tuple(entry))
    return out


def _placement(sharding) -> str | None:
    """One line saying where the array lives, or None if it does not say."""
    if isinstance(sharding, NamedSharding):
        mesh = ", ".join(f"{a}={n}" for a, n in sharding.mesh.shape.items())
        return f"on a mesh ({mesh}) of {sharding.mesh.size} devices"
    devices = getattr(sharding, "device_set", None)
    if devices is not None and len(devices) == 1:
        return f"on {next(iter(devices))}"
    return None if sharding is None else f"laid out by {type(sharding).__name__}"
