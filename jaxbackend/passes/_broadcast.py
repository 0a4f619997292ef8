"""Broadcast analysis shared by `hoist_broadcast` and its sum sinking
(`_sink_sum`): which axes of a value are copies made by a broadcast.

A broadcast `b = broadcast_in_dim(x, S, dims)` *creates* the axes of S that
do not come from a same-sized axis of x (new axes, and size-1 axes of x
stretched); the others are *real*. `source(producer, atom)` looks one
equation back for the broadcast; `real_axes` names the real axes;
`broadcast` and `squeeze_to` are the jnp-level helpers the rewrites trace.
Nothing here rewrites: these are pure functions of the graph and shapes.

Merged copies. `jnp.repeat(x, g, axis=h)` (static g) and the GQA expand form
`broadcast_to(x[:, :, :, None, :], (b, t, kv, g, d)).reshape(b, t, kv*g, d)`
lower to a broadcast followed by a reshape that merges the created axis with
its neighbour (repeat's layout: (kv, g) -> kv*g; `jnp.tile`'s layout, also
its own `tile` primitive and `concatenate([v] * g)`: (g, kv) -> g*kv).
`merged(producer, atom)` sees through that reshape: a `Merged` gives x, its
broadcast dims into the *split* shape (the reshape's operand) and, per atom
axis, the run of split sizes it merges (`merge_groups`; only contiguous runs
in row-major order, so a reshape that splits an axis, or whose boundaries
cut through an axis, is no merge; `jnp.repeat` with `total_repeat_length`
is a gather, no merge). The matchers below work in the split space: an op on merged
copies is the split-space op followed by the same merge, and there the
ordinary rules apply. What may move, exactly:

* an elementwise op whose operands are merges with the *same* groups (or
  scalars, or broadcasts that carry no real data along a merged axis:
  those are constant along the whole run), sharing a created split axis;
* a reduction over merged-space axes whose split axes are all real. A
  reduction over a merged axis that contains a created split axis (a sum
  over the query heads kv*g) adds the copies together: it is left alone;
* a broadcast of a merge (size-1 axes added, the merged axes kept as they
  are): one broadcast into the outer split shape, then the merge;
* a reshape of a merge that merges the split shape again (a flatten of
  kv*g*d): one broadcast, then one merge.
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


def constant_along(src, axes):
    """(x, dims) if the broadcast `src` is constant along every axis in
    `axes` (none of them real), else None."""
    x, dims, s = src
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
    shape: tuple    # result shape (the split shape for a merged match)
    merged: tuple | None = None   # the op's result shape when matched split


def match_elementwise(producer, eqn) -> ElementwiseHoist | None:
    """The hoist of an elementwise `eqn` whose operands are all broadcasts
    (or scalars) sharing a created axis of size > 1, or all merges of such
    broadcasts with the same groups (module doc), else None."""
    shape = tuple(eqn.outvars[0].aval.shape)
    if len(eqn.outvars) != 1 or not shape or _jax.has_sharding_annotation(eqn):
        return None
    # an operand of equal rank may rely on implicit size-1 broadcasting
    sources = [None if not a.aval.shape else source(producer, a) for a in eqn.invars]
    if any(src is not None and len(src.shape) != len(shape) for src in sources):
        return None
    hoist = _elementwise_hoist(eqn.invars, sources, shape)
    if hoist is not None:
        return hoist
    merges = [None if src is None else merged(producer, a) for a, src in zip(eqn.invars, sources)]
    groups = next((m.groups for m, a in zip(merges, eqn.invars)
                   if m is not None and tuple(a.aval.shape) == shape), None)
    if groups is None:
        return None
    split: list = []
    for a, src, m in zip(eqn.invars, sources, merges):
        if m is not None and same_groups(m.groups, groups, a.aval.shape, shape):
            split.append(Source(m.x, m.dims, m.split))
        elif src is None:
            split.append(None)
        else:
            split.append(split_source(src, groups, shape))
            if split[-1] is None:
                return None
    return _elementwise_hoist(eqn.invars, split, flat_groups(groups), merged=shape)


def same_groups(own, groups, op_shape, shape) -> bool:
    """Does a merge with `own` groups split like `groups`? An axis where the
    operand has size 1 (implicit broadcast) only needs a run as long."""
    return all(g == h if n == m else len(g) == len(h)
               for g, h, n, m in zip(own, groups, op_shape, shape))


def _elementwise_hoist(invars, sources, shape, merged=None):
    real = set()
    for src in sources:
        if src is not None:
            x, dims, s = src
            real |= {d for d in real_axes(x, dims, s) if s[d] == shape[d]}
    created = [a for a in range(len(shape)) if a not in real and shape[a] > 1]
    if not created:
        return None
    keep = tuple(a for a in range(len(shape)) if a not in created)
    args = [a if src is None else src.x for a, src in zip(invars, sources)]
    layout = tuple(None if src is None else src.dims for src in sources)
    return ElementwiseHoist(args, layout, keep, shape, merged)


class ReductionHoist(NamedTuple):
    """A reduction over real axes of a broadcast: reduce x, then broadcast."""

    x: Any
    x_axes: tuple       # the reduced axes, as axes of x
    out_shape: tuple    # (the split shape for a merged match)
    out_dims: tuple     # broadcast dims of the reduced x into out_shape
    source: Source
    merged: tuple | None = None   # the reduction's result shape when matched split


def match_reduction(producer, eqn) -> ReductionHoist | None:
    """The hoist of a reduction `eqn` over axes that are all real axes of its
    broadcast operand (or of the broadcast under its merge: every split axis
    of a reduced merged axis real), which also has a created axis of size > 1."""
    if _jax.has_sharding_annotation(eqn):
        return None
    atom = eqn.invars[0]
    axes = tuple(int(a) for a in _jax.reduce_axes(eqn))
    src = source(producer, atom)
    if src.x is not atom:
        return _reduction_hoist(src, axes)
    m = merged(producer, atom)
    if m is None:
        return None
    starts = group_starts(m.groups)
    split_axes = tuple(s for a in axes for s in range(starts[a], starts[a] + len(m.groups[a])))
    out = tuple(n for a, n in enumerate(atom.aval.shape) if a not in axes)
    return _reduction_hoist(Source(m.x, m.dims, m.split), split_axes, out)


def _reduction_hoist(src, axes, merged=None):
    x, dims, s = src
    real = real_axes(x, dims, s)
    if not all(a in real for a in axes):
        return None
    if not any(a not in real and s[a] > 1 for a in range(len(s))):
        return None  # nothing repeated: no work to save
    inv = {d: j for j, d in enumerate(dims)}
    x_axes = tuple(sorted(inv[a] for a in axes))
    out_axes = [a for a in range(len(s)) if a not in axes]
    out_dims = tuple(out_axes.index(d) for j, d in enumerate(dims) if j not in x_axes)
    return ReductionHoist(x, x_axes, tuple(s[a] for a in out_axes), out_dims, src, merged)


# ---------------------------------------------------------------------------
# merged copies (module doc): a broadcast seen through a merging reshape

class Merged(NamedTuple):
    """atom = reshape(broadcast_in_dim(x, split, dims), atom shape), the
    reshape merging, for each atom axis a, the split run `groups[a]`."""

    x: Any
    dims: tuple
    split: tuple
    groups: tuple


def flat_groups(groups) -> tuple:
    return tuple(n for g in groups for n in g)


def group_starts(groups) -> list:
    out, pos = [], 0
    for g in groups:
        out.append(pos)
        pos += len(g)
    return out


def merge_groups(split, shape):
    """Per axis of `shape`, the run of `split` sizes it merges (a row-major
    reshape split -> shape), or None when the reshape is no merge of
    contiguous runs. A size-1 split axis between runs starts the next run
    (after the last run, it joins it)."""
    if 0 in split or 0 in shape:
        return None
    groups, i = [], 0
    for k, n in enumerate(shape):
        if i == len(split):
            return None
        run, prod = [split[i]], split[i]
        i += 1
        while i < len(split) and (prod < n or (split[i] == 1 and k == len(shape) - 1)):
            run.append(split[i])
            prod *= split[i]
            i += 1
        if prod != n:
            return None
        groups.append(tuple(run))
    return tuple(groups) if i == len(split) else None


def merged(producer, atom) -> Merged | None:
    """The broadcast under a merging reshape (or a `tile`, or a `concatenate`
    of one operand with itself) defining `atom`, when some atom axis merges
    more than one split axis; else None."""
    eqn = producer(atom)
    if eqn is None or not eqn.invars or _jax.has_sharding_annotation(eqn):
        return None
    shape, x, name = tuple(atom.aval.shape), eqn.invars[0], eqn.primitive.name
    if name == "concatenate" and all(v is x for v in eqn.invars) and _jax.is_var(x):
        reps = [1] * len(shape)
        reps[_jax.concatenate_dimension(eqn)] = len(eqn.invars)
        return _tiled(x, tuple(reps))
    if len(eqn.invars) != 1:
        return None
    if name == "tile":
        return _tiled(x, _jax.tile_reps(eqn))
    if name != "reshape" or _jax.reshape_transposes(eqn):
        return None
    src = source(producer, x)
    if src.x is x:
        return None
    groups = merge_groups(src.shape, shape)
    if groups is None or all(len(g) == 1 for g in groups):
        return None
    return Merged(src.x, src.dims, src.shape, groups)


def _tiled(x, reps) -> Merged | None:
    """x tiled `reps[a]` times along each axis a (copy index major)."""
    xs = tuple(x.aval.shape)
    if len(reps) != len(xs) or all(r == 1 for r in reps):
        return None
    groups = tuple((r, n) if r != 1 else (n,) for r, n in zip(reps, xs))
    dims = tuple(s + len(g) - 1 for s, g in zip(group_starts(groups), groups))
    return Merged(x, dims, flat_groups(groups), groups)


def split_source(src, groups, shape) -> Source | None:
    """Operand `src` (its broadcast in the merged space of an op with result
    `shape`) in the split space of `groups`; None when x has data along a
    merged axis (that would need a reshape of x itself)."""
    x, dims, s = src
    xs, starts = x.aval.shape, group_starts(groups)
    if any(len(groups[d]) > 1 and xs[j] != 1 for j, d in enumerate(dims)):
        return None
    # a size-1 axis of x on a merged axis goes to the first split axis of its run
    split = tuple(n if s[a] == shape[a] else 1 for a, g in enumerate(groups) for n in g)
    return Source(x, tuple(starts[d] for d in dims), split)


def merged_broadcast(producer, eqn) -> Merged | None:
    """`eqn` = broadcast_in_dim(atom) with atom a merge whose merged axes the
    broadcast keeps (no size-1 merged axis stretched): the same copies as one
    broadcast of x into the outer split shape, merged; else None."""
    if len(eqn.invars) != 1 or _jax.has_sharding_annotation(eqn):
        return None
    atom = eqn.invars[0]
    m = merged(producer, atom)
    if m is None:
        return None
    inner, out = tuple(atom.aval.shape), tuple(eqn.outvars[0].aval.shape)
    outer = _jax.broadcast_dimensions(eqn)
    if any(len(g) > 1 and out[o] != inner[a] for a, (g, o) in enumerate(zip(m.groups, outer))):
        return None
    at = {o: a for a, o in enumerate(outer)}
    groups = tuple(m.groups[at[o]] if o in at and out[o] == inner[at[o]] else (out[o],)
                   for o in range(len(out)))
    # split axis of the inner split -> (its atom axis, offset in the run)
    owner = [(a, k) for a, g in enumerate(m.groups) for k in range(len(g))]
    starts = group_starts(groups)
    # (a stretched size-1 axis had a run of one: its offset is 0)
    dims = tuple(starts[outer[owner[d][0]]] + owner[d][1] for d in m.dims)
    return Merged(m.x, dims, flat_groups(groups), groups)


def merged_reshape(producer, eqn) -> Merged | None:
    """`eqn` = reshape(atom) with atom a merge, whose result merges the split
    shape again: one broadcast and one merge (groups of the result); else None."""
    if len(eqn.invars) != 1 or _jax.has_sharding_annotation(eqn) or _jax.reshape_transposes(eqn):
        return None
    m = merged(producer, eqn.invars[0])
    if m is None:
        return None
    groups = merge_groups(m.split, tuple(eqn.outvars[0].aval.shape))
    return None if groups is None else Merged(m.x, m.dims, m.split, groups)
