"""The one exception type for dim errors, and helpers that word messages.

Every message names the operation, the dim, the sizes or dims involved and
the argument, and ends with the fix in one sentence (DESIGN § Principles 6).
"""

from __future__ import annotations


class DimError(ValueError):
    """A dim name or size does not fit the operation (subclass of ValueError)."""


def fmt_dims(dims) -> str:
    return repr(tuple(dims))


def rank_mismatch(op: str, shape, dims) -> DimError:
    # Reached when a transform stripped an axis from the leaf but not from
    # the static dims (jax.vmap / lax.scan with in_axes over a NamedArray).
    return DimError(
        f"{op}: the NamedArray's values have {len(shape)} axes (shape {tuple(shape)}) but its "
        f"dims {fmt_dims(dims)} name {len(dims)}; jax.vmap/lax.scan over a NamedArray strip "
        f"an axis its dims still list, so map over an extra unnamed leading axis (stack "
        f"NamedArrays with jax.tree.map) or pass plain arrays and name them inside."
    )


def unknown_dim(op: str, dim, dims, arg: str = "dim") -> DimError:
    return DimError(
        f"{op}: {arg}={dim!r} is not a dim of the array, whose dims are "
        f"{fmt_dims(dims)}; use one of those names (or rename first)."
    )


def size_conflict(op: str, dim, size_a, size_b, where_a: str, where_b: str) -> DimError:
    return DimError(
        f"{op}: dim {dim!r} has size {size_a} in {where_a} but size {size_b} in "
        f"{where_b}; a dim name means one size, so make them equal or rename one "
        f"(e.g. .rename({dim}={dim + '_2'!r}))."
    )


def check_dims_tuple(op: str, dims, arg: str = "dims") -> tuple[str, ...]:
    """Validate a user-given dims sequence: not a bare string, no duplicates."""
    if isinstance(dims, str):
        raise DimError(
            f"{op}: {arg}={dims!r} is a single string, which would not be split "
            f"into dims; pass a tuple of names, e.g. {arg}=({dims!r},)."
        )
    try:
        dims = tuple(dims)
    except TypeError:
        raise DimError(
            f"{op}: {arg}={dims!r} is not a sequence of dim names; pass a tuple of strings."
        ) from None
    for d in dims:
        if not isinstance(d, str):
            raise DimError(
                f"{op}: {arg} contains {d!r} ({type(d).__name__}); every dim name "
                f"must be a str, e.g. {arg}=('batch', 'embd')."
            )
    seen = set()
    for d in dims:
        if d in seen:
            raise DimError(
                f"{op}: {arg}={fmt_dims(dims)} names {d!r} twice; every axis needs "
                f"its own dim name (rename one, e.g. {d + '_2'!r})."
            )
        seen.add(d)
    return dims
