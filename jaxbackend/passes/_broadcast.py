"""Broadcast analysis shared by `hoist_broadcast` and its sum sinking
(`_sink_sum`): which axes of a value are copies made by a broadcast.

A broadcast `b = broadcast_in_dim(x, S, dims)` *creates* the axes of S that
do not come from a same-sized axis of x (new axes, and size-1 axes of x
stretched); the others are *real*. `source(producer, atom)` looks one
equation back for the broadcast; `real_axes` names the real axes;
`broadcast` and `squeeze_to` are the jnp-level helpers the rewrites trace.
Nothing here rewrites: these are pure functions of the graph and shapes.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from jax import lax

from jaxbackend import _jax


class Source(NamedTuple):
    """atom = broadcast_in_dim(x, shape, dims); for an atom that is no
    broadcast, x is the atom itself and dims the identity."""

    x: Any
    dims: tuple
    shape: tuple


def source(producer, atom) -> Source:
    """The broadcast defining `atom` (module doc), or atom itself."""
    eqn = producer(atom)
    shape = tuple(atom.aval.shape)
    if (eqn is not None and eqn.primitive.name == "broadcast_in_dim"
            and len(eqn.invars) == 1):
        return Source(eqn.invars[0], _jax.broadcast_dimensions(eqn), shape)
    return Source(atom, tuple(range(len(shape))), shape)


def real_axes(x, dims, shape) -> set:
    """Axes of `shape` that come from a same-sized axis of x."""
    xs = x.aval.shape
    return {d for j, d in enumerate(dims) if xs[j] == shape[d]}


def const_along(producer, atom, axes):
    """(x, dims) if atom = broadcast(x) is constant along every axis in
    `axes` (none of them real), else None."""
    x, dims, s = source(producer, atom)
    xs = x.aval.shape
    real = {d for j, d in enumerate(dims) if xs[j] == s[d] and s[d] > 1}
    if any(a in real for a in axes):
        return None
    return x, dims


def broadcast(x, shape, dims):
    """`lax.broadcast_in_dim`, or x itself when that is the identity."""
    if tuple(x.shape) == tuple(shape) and tuple(dims) == tuple(range(len(shape))):
        return x
    return lax.broadcast_in_dim(x, shape, dims)


def squeeze_to(x, dims, keep_axes, shape):
    """x broadcast over `shape` restricted to `keep_axes` (sorted S axes)."""
    pos = {a: i for i, a in enumerate(keep_axes)}
    kept = [j for j, d in enumerate(dims) if d in pos]
    if len(kept) != len(dims):  # dropped dims are size 1 (created axes)
        x = lax.reshape(x, tuple(x.shape[j] for j in kept))
    return broadcast(x, tuple(shape[a] for a in keep_axes), tuple(pos[dims[j]] for j in kept))


# ---------------------------------------------------------------------------
# matchers of `hoist_broadcast` (its rules and its `remaining` count)

class ElementwiseHoist(NamedTuple):
    """An elementwise op whose operands all broadcast along `created` axes."""

    args: list      # each operand before its broadcast (a scalar as it is)
    layout: tuple   # per operand: its broadcast dims, None for a scalar
    keep: tuple     # result axes some operand has for real
    shape: tuple    # result shape


def match_elementwise(producer, eqn) -> ElementwiseHoist | None:
    """The hoist of an elementwise `eqn` whose operands are all broadcasts
    (or scalars) sharing a created axis of size > 1, else None."""
    shape = tuple(eqn.outvars[0].aval.shape)
    if len(eqn.outvars) != 1 or not shape or _jax.has_sharding_annotation(eqn):
        return None
    sources: list = []
    for a in eqn.invars:
        if not a.aval.shape:  # scalar operand (literal or rank 0)
            sources.append(None)
            continue
        src = source(producer, a)
        if src.shape != shape and len(src.shape) != len(shape):
            return None
        # an operand of equal rank may rely on implicit size-1 broadcasting
        sources.append(src)
    real = set()
    for src in sources:
        if src is not None:
            x, dims, s = src
            real |= {d for d in real_axes(x, dims, s) if s[d] == shape[d]}
    created = [a for a in range(len(shape)) if a not in real and shape[a] > 1]
    if not created:
        return None
    keep = tuple(a for a in range(len(shape)) if a not in created)
    args = [a if src is None else src.x for a, src in zip(eqn.invars, sources)]
    layout = tuple(None if src is None else src.dims for src in sources)
    return ElementwiseHoist(args, layout, keep, shape)


class ReductionHoist(NamedTuple):
    """A reduction over real axes of a broadcast: reduce x, then broadcast."""

    x: Any
    x_axes: tuple       # the reduced axes, as axes of x
    out_shape: tuple
    out_dims: tuple     # broadcast dims of the reduced x into out_shape
    source: Source


def match_reduction(producer, eqn) -> ReductionHoist | None:
    """The hoist of a reduction `eqn` over axes that are all real axes of its
    broadcast operand, which also has a created axis of size > 1."""
    if _jax.has_sharding_annotation(eqn):
        return None
    src = source(producer, eqn.invars[0])
    x, dims, s = src
    if x is eqn.invars[0]:
        return None
    axes = tuple(int(a) for a in _jax.reduce_axes(eqn))
    real = real_axes(x, dims, s)
    if not all(a in real for a in axes):
        return None
    if not any(a not in real and s[a] > 1 for a in range(len(s))):
        return None  # nothing repeated: no work to save
    inv = {d: j for j, d in enumerate(dims)}
    x_axes = tuple(sorted(inv[a] for a in axes))
    out_axes = [a for a in range(len(s)) if a not in axes]
    out_dims = tuple(out_axes.index(d) for j, d in enumerate(dims) if j not in x_axes)
    return ReductionHoist(x, x_axes, tuple(s[a] for a in out_axes), out_dims, src)
