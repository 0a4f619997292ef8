"""Matchers of `group_heads`: which operands are repeated K/V heads and
which sums add up a contraction's per-query-head results, shared by its
rules and its `remaining` count.

* `repeated(producer, atom, axes)`: `atom` is g copies of each of kv heads
  along one of `axes`, made by a `broadcast_in_dim` chain and a `reshape`
  merging the created axis with its neighbour (`jnp.repeat`,
  `broadcast_to(...).reshape(...)`), by `tile` along one axis, or (kv = 1)
  by a plain broadcast of a size-1 axis, then view ops. Returns a
  `Repeat`: where the heads are, the layout (copy index minor for repeat,
  major for tile) and how to build the un-repeated operand from the source.
* `group_sum(producer, uses, eqn)`: `eqn` is a `reduce_sum` over the group
  axis (and size-1 axes) of a reshape, or a chain of reshapes, splitting a
  batch dim (kv*g) of a `dot_general`, or (kv = 1) over one batch dim
  itself, through view ops, each value on the way read once.
* view ops (`transpose`, `squeeze`, a `broadcast_in_dim` inserting size-1
  axes) reorder or drop/insert size-1 axes only: `views` walks them,
  `moved` maps an axis through them, `apply` replays them on an array whose
  head axis has another size.

Each walk looks at most `MAX_CHAIN` equations back, so a pass using them
stays linear in the number of equations.
"""

from __future__ import annotations

import dataclasses

from jax import lax

from jaxbackend import _jax

MAX_CHAIN = 8   # broadcasts / transposes looked through per operand: keeps the pass linear


@dataclasses.dataclass(frozen=True)
class Repeat:
    """An operand x = transpose(merge(copies of src)): x's `axis` (size kv*g)
    holds g copies of each of kv heads; `minor`: copy index minor (repeat
    layout), else major (tile). `small` rebuilds the un-repeated operand
    (x with axis of size kv) from src: (kept shape, grouped shape without
    g, broadcast dims, merged shape, view ops after the merge)."""
    src: object
    axis: int
    kv: int
    g: int
    minor: bool
    small: tuple


def find_split(whole, parts):
    """(i, j): `parts` is `whole` with size-1 axes added or dropped and axis
    i split into parts[j], parts[j+1] (both > 1); None otherwise."""
    i = j = 0
    found = None
    while i < len(whole) or j < len(parts):
        if i < len(whole) and whole[i] == 1:
            i += 1
        elif j < len(parts) and parts[j] == 1:
            j += 1
        elif i < len(whole) and j < len(parts) and whole[i] == parts[j]:
            i, j = i + 1, j + 1
        elif (found is None and i < len(whole) and j + 1 < len(parts)
              and parts[j] * parts[j + 1] == whole[i] and parts[j + 1] > 1):
            found, i, j = (i, j), i + 1, j + 2
        else:
            return None
    return found


def find_same(whole, parts, j):
    """The axis of `whole` that is parts[j] (> 1) when the two shapes differ
    only by size-1 axes, else None."""
    if parts[j] == 1 or [n for n in whole if n != 1] != [n for n in parts if n != 1]:
        return None
    k = sum(1 for n in parts[:j] if n != 1)
    return [a for a, n in enumerate(whole) if n != 1][k]


def _view(eqn):
    """("transpose", perm) / ("squeeze", axes) / ("expand", new axes) when
    `eqn` only reorders axes or drops or inserts size-1 axes, else None."""
    name = eqn.primitive.name
    if name == "transpose":
        return "transpose", _jax.transpose_permutation(eqn)
    if name == "squeeze":
        rank = len(eqn.invars[0].aval.shape)
        return "squeeze", tuple(sorted(d % rank for d in _jax.squeeze_dimensions(eqn)))
    if (name == "broadcast_in_dim" and len(eqn.invars) == 1
            and not _jax.has_sharding_annotation(eqn)):
        x, y = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
        dims = _jax.broadcast_dimensions(eqn)
        new = tuple(j for j in range(len(y)) if j not in dims)
        if all(x[i] == y[j] for i, j in enumerate(dims)) and all(y[j] == 1 for j in new):
            return "expand", new
    return None


def views(producer, atom, uses=None):
    """(a, ops): atom is `a` through view ops (`_view`, innermost first);
    with `uses`, only through values read once."""
    ops: list = []
    for _ in range(MAX_CHAIN):
        eqn = producer(atom)
        op = None if eqn is None else _view(eqn)
        if op is None or (uses is not None and uses.get(atom, 0) != 1):
            break
        ops.insert(0, op)
        atom = eqn.invars[0]
    return atom, tuple(ops)


def moved(axis: int, ops) -> int:
    """Where `axis` of a view chain's input ends up in its output."""
    for kind, arg in ops:
        if kind == "transpose":
            axis = list(arg).index(axis)
        elif kind == "squeeze":
            axis -= sum(d < axis for d in arg)
        else:
            axis = [j for j in range(axis + len(arg) + 1) if j not in arg][axis]
    return axis


def apply(y, ops):
    """The view chain `ops` applied to `y` (one of any head-axis size)."""
    for kind, arg in ops:
        if kind == "transpose":
            y = lax.transpose(y, arg) if tuple(arg) != tuple(range(len(arg))) else y
        elif kind == "squeeze":
            y = lax.squeeze(y, arg)
        else:
            y = lax.expand_dims(y, arg)
    return y


def transposes_result(ops) -> bool:
    """Does the chain move data (a non-identity transpose)?"""
    return any(k == "transpose" and tuple(a) != tuple(range(len(a))) for k, a in ops)


def _broadcasts(producer, atom):
    """(src, origin): atom = broadcast_in_dim chain of src; origin[j] = the
    src axis atom's axis j copies (same size), None where created."""
    origin = list(range(len(atom.aval.shape)))
    seen = 0
    for _ in range(MAX_CHAIN):
        eqn = producer(atom)
        if (eqn is None or eqn.primitive.name != "broadcast_in_dim" or len(eqn.invars) != 1
                or _jax.has_sharding_annotation(eqn)):
            break
        x = eqn.invars[0]
        inner = [None] * len(atom.aval.shape)
        for i, j in enumerate(_jax.broadcast_dimensions(eqn)):
            if x.aval.shape[i] == atom.aval.shape[j]:
                inner[j] = i
        origin = [None if o is None else inner[o] for o in origin]
        atom, seen = x, seen + 1
    return (atom, origin) if seen else None


def _merged_repeat(producer, merged, head):
    """Repeat fields (src, axis, kv, g, minor, small without view ops) of
    a repeat before any transpose or squeeze, or None. `head(axis)`: may
    this axis of `merged` be the head axis (one KV head, where the copies
    are a plain broadcast and any created axis could be)?"""
    eqn = producer(merged)
    shape = tuple(merged.aval.shape)
    if eqn is not None and eqn.primitive.name == "tile":
        reps = _jax.tile_reps(eqn)
        big = [a for a, r in enumerate(reps) if r != 1]
        if len(big) != 1 or not head(big[0]):
            return None
        src = eqn.invars[0]
        s = tuple(src.aval.shape)
        return src, big[0], s[big[0]], reps[big[0]], False, (s, s, tuple(range(len(s))), s)
    if eqn is None or _jax.has_sharding_annotation(eqn):
        return None
    if eqn.primitive.name == "reshape" and not _jax.reshape_transposes(eqn):
        copies = eqn.invars[0]
    elif eqn.primitive.name == "broadcast_in_dim":
        copies = merged                       # one KV head broadcast to all (MQA)
    else:
        return None
    chain = _broadcasts(producer, copies)
    if chain is None:
        return None
    src, origin = chain
    grouped = tuple(copies.aval.shape)
    split = find_split(shape, grouped)
    if split is not None:
        axis, j = split
        if origin[j + 1] is None:             # copies minor: jnp.repeat's layout
            gx, kv, g, minor = j + 1, grouped[j], grouped[j + 1], True
        elif origin[j] is None:               # copies major: tile's layout
            gx, kv, g, minor = j, grouped[j + 1], grouped[j], False
        else:
            return None
    else:                                     # one KV head: a created axis is x's head axis
        gx = next((j for j, o in enumerate(origin) if o is None and grouped[j] > 1
                   and head(find_same(shape, grouped, j))), None)
        if gx is None:
            return None
        axis, kv, g, minor = find_same(shape, grouped, gx), 1, grouped[gx], True
    if src.aval.dtype != merged.aval.dtype:
        return None
    origin = origin[:gx] + origin[gx + 1:]
    kept = tuple(d for d in range(len(src.aval.shape)) if d in origin)
    if any(src.aval.shape[d] != 1 for d in range(len(src.aval.shape)) if d not in kept):
        return None                           # a real src axis would be lost
    bdims = tuple(k for k, o in enumerate(origin) if o is not None)
    small = (tuple(src.aval.shape[d] for d in kept), grouped[:gx] + grouped[gx + 1:], bdims,
             shape[:axis] + (kv,) + shape[axis + 1:])
    return src, axis, kv, g, minor, small


def repeated(producer, atom, axes) -> Repeat | None:
    """The repeat `atom` is along one of its `axes` (see `Repeat`), or None."""
    merged, ops = views(producer, atom)
    found = _merged_repeat(producer, merged,
                           lambda a: a is not None and moved(a, ops) in axes)
    if found is None:
        return None
    src, axis, kv, g, minor, small = found
    if moved(axis, ops) not in axes:
        return None
    return Repeat(src, moved(axis, ops), kv, g, minor, small + (ops,))


def _reshaped(producer, uses, atom):
    """The input of the chain of single-use row-major `reshape`s ending in
    `atom` (atom itself when there is none). Row-major reshapes compose:
    the chain is one reshape from that input's shape to atom's. einops'
    transpose of a repeat is two (split the heads, then insert size-1 axes)."""
    for _ in range(MAX_CHAIN):
        eqn = producer(atom)
        if (eqn is None or eqn.primitive.name != "reshape" or _jax.reshape_transposes(eqn)
                or _jax.has_sharding_annotation(eqn) or uses.get(atom, 0) != 1):
            break
        atom = eqn.invars[0]
    return atom


def group_sum(producer, uses, eqn):
    """(dot, view ops, kv, g, minor, q) when `eqn` (a reduce_sum) sums the
    group axis of a split batch dim q of a single-use contraction (through
    single-use reshapes, then single-use view ops), else None."""
    if _jax.has_sharding_annotation(eqn) or len(eqn.invars) != 1:
        return None
    parts = eqn.invars[0]
    if uses.get(parts, 0) != 1 or producer(parts) is None:
        return None
    whole = _reshaped(producer, uses, parts)
    shape, axes = tuple(parts.aval.shape), set(_jax.reduce_axes(eqn))
    found = find_split(tuple(whole.aval.shape), shape)
    if found is not None:
        h, j = found
        if (j + 1 in axes) == (j in axes):
            return None
        minor = j + 1 in axes
        gx, kv, g = (j + 1, shape[j], shape[j + 1]) if minor else (j, shape[j + 1], shape[j])
    else:                                     # one KV head: the sum is over the head axis
        big = [a for a in axes if shape[a] > 1]
        if len(big) != 1:
            return None
        gx, kv, g, minor = big[0], 1, shape[big[0]], True
        h = find_same(tuple(whole.aval.shape), shape, gx)
    if any(shape[a] != 1 for a in axes - {gx}):
        return None                           # sums more than the copies: left alone
    # single readers from the contraction to the sum: no work is duplicated
    d, ops = views(producer, whole, uses)
    dot = producer(d)
    if (uses.get(d, 0) != 1 or dot is None or dot.primitive.name != "dot_general"
            or _jax.has_sharding_annotation(dot) or dot.outvars[0].aval.dtype != parts.aval.dtype):
        return None
    (_, _), (lb, _) = _jax.dot_dimension_numbers(dot)
    q = next((a for a in range(len(lb)) if d.aval.shape[a] > 1 and moved(a, ops) == h), None)
    if q is None:
        return None                           # not a batch dim of the contraction
    return dot, ops, kv, g, minor, q
