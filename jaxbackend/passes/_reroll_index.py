"""Layers that index one array by their number: `W[i]` in a Python loop over
layers (weights kept stacked by the user, per-layer scales or flags), made
into the stacks a scan reads and writes (part of `passes.reroll`).

Forward, layer i reads `W[i]` as a static `slice` (start i on axis 0, one
row, every other axis whole) and a `squeeze` of that axis: the blocks differ
in the slice's start, so no block repeats. Where W is an input and every
row is read so, `split_rows` splits it once, at the start, by the call
`jb.stack_layers` makes (`_stacked._slices`), and the rolled layers read W
itself as their stack (`Walk.keep`), not a copy. Otherwise (an array made
in the program, some rows unread) `index_reads` says which arrays are read
by row at two or more rows, `_reroll_seed.lifted` moves those reads to
right after the array is made, as it does for per-layer dropout keys, and
each block reads its row as a per-layer input (stacked by copying).

Backward, JAX transposes each `W[i]` into a `pad` of the row's cotangent
(i rows of zeros before it, n - 1 - i after) and sums the pads with
`add_any`: inside the layers, the pads differ per block; after them (rows
taken before the loop), they are n equations more per weight.
`joined_pads` replaces such a sum, where the pads put one row at each of
the n positions and nothing else reads a pad or a partial sum, by one
`concatenate` of the rows in row order (signed zeros made +0.0, as the sum
makes them). Where each row is a value given a unit axis (the transpose of
the squeeze), the values are stacked instead, which `Walk` reads as the
backward scan's stack itself (in layer order, or reversed).

`reroll` keeps the split and the joins where the program then has runs
covering at least as many equations (`reroll._Splicer._rows`).

Why the values stay the same: piece i of a split into rows, squeezed, is
the slice of row i squeezed, and moving a pure equation earlier changes no
value. Each entry of a sum of pads that put one row at each position is
that row's entry plus zeros from every other pad: the entry itself, except
that x + 0.0 is +0.0 for x = -0.0 (infinities and NaN stay). The join
selects +0.0 where the concatenated entry equals 0 and the entry elsewhere
(not x + 0.0, which XLA folds to x), so it is bit-identical, except that a
subnormal entry, which the sum's additions flush to zero on XLA:CPU, is
kept: a difference below the smallest normal, as `_reroll_seed`'s seeds
allow. Only real float sums are joined (integer and complex ones stay).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxbackend import _jax, _stacked
from jaxbackend.passes import _rewrite, _stacks


def _row(e) -> int | None:
    """i when `e` is `x[i:i+1]` of a variable x: a slice of one row of axis
    0, every other axis whole, unit strides; else None."""
    if e.primitive.name != "slice" or not _jax.is_var(e.invars[0]):
        return None
    shape = e.invars[0].aval.shape
    start, limit, strides = (e.params["start_indices"], e.params["limit_indices"],
                             e.params["strides"])
    if not shape or limit[0] != start[0] + 1 or (strides is not None and any(s != 1 for s in strides)):
        return None
    if any(s != 0 or lim != n for s, lim, n in zip(start[1:], limit[1:], shape[1:])):
        return None
    return int(start[0])


def index_reads(jaxpr) -> set:
    """The variables read as `x[i]` (`_row`) at two or more distinct rows."""
    rows: dict = {}
    for e in jaxpr.eqns:
        i = _row(e)
        if i is not None:
            rows.setdefault(e.invars[0], set()).add(i)
    return {v for v, r in rows.items() if len(r) >= 2}


def is_index_read(e, indexed: set) -> bool:
    """A slice of one row of an array in `indexed` (`index_reads`)."""
    return _row(e) is not None and e.invars[0] in indexed


def _pad_row(e):
    """(row, the padded operand) when `e` is a `pad` of zeros that puts a
    one-row real float operand at row `row` of axis 0 and pads nothing
    else; else None."""
    if e.primitive.name != "pad":
        return None
    x, zero = e.invars
    cfg = e.params["padding_config"]
    if (not isinstance(zero, _jax.Literal) or np.asarray(_jax.literal_value(zero)) != 0
            or not jnp.issubdtype(e.outvars[0].aval.dtype, jnp.floating)
            or not x.aval.shape or x.aval.shape[0] != 1 or cfg[0][2] != 0 or cfg[0][0] < 0
            or cfg[0][1] < 0 or any(tuple(c) != (0, 0, 0) for c in cfg[1:])):
        return None
    return int(cfg[0][0]), x


def joined_pads(jaxpr):
    """(jaxpr with each complete sum of row pads a concatenate, number of
    sums joined), or (None, 0) when there is none (module docstring)."""
    eqns = jaxpr.eqns
    if not any(e.primitive.name == "pad" for e in eqns):
        return None, 0
    uses = _rewrite.own_uses(jaxpr)
    parts: dict = {}     # pad or partial sum var -> ([(row, operand)], [eqn index])
    for k, e in enumerate(eqns):
        pr = _pad_row(e)
        if pr is not None:
            parts[e.outvars[0]] = ([pr], [k])
        elif (e.primitive.name == "add_any" and all(_jax.is_var(v) and v in parts
                                                    for v in e.invars)
              and e.invars[0] is not e.invars[1]
              and all(uses.get(v, 0) == 1 for v in e.invars)):
            (ra, ka), (rb, kb) = parts.pop(e.invars[0]), parts.pop(e.invars[1])
            parts[e.outvars[0]] = (ra + rb, ka + kb + [k])
    joins: dict = {}     # index of the last add_any -> (sum var, operands in row order)
    dropped: set = set()
    for v, (rows, ks) in parts.items():
        n = v.aval.shape[0] if v.aval.shape else 0
        if len(rows) < 2 or sorted(r for r, _ in rows) != list(range(n)):
            continue
        joins[max(ks)] = (v, [x for _, x in sorted(rows, key=lambda t: t[0])])
        dropped.update(ks)
    if not joins:
        return None, 0
    made = {e.outvars[0]: (k, e) for k, e in enumerate(eqns) if len(e.outvars) == 1}
    for k, (v, xs) in list(joins.items()):
        units = [_unit_axis(made.get(x), uses) for x in xs]
        if all(u is not None for u in units):
            # rows that are values given a unit axis (a squeeze's transpose):
            # the join stacks the values, which `Walk` reads as the backward
            # scan's stack itself
            dropped.update(i for i, _ in units)
            joins[k] = (v, [y for _, y in units], True)
        else:
            joins[k] = (v, xs, False)
    b = _rewrite.EqnBuilder(closed=False)
    for k, e in enumerate(eqns):
        if k in joins:
            v, xs, values = joins[k]
            if values:
                (out,) = b.emit(_join_values, xs, key="reroll_index.join_values")
            else:
                (out,) = b.emit(_join, xs, key="reroll_index.join")
            # the sum's own variable, so its readers need no renaming
            if not (_jax.is_var(out) and b.eqns and b.eqns[-1].outvars[0] is out):
                raise AssertionError("_reroll_index: the join's last equation must make it")
            b.eqns[-1] = b.eqns[-1].replace(outvars=[v])
        elif k not in dropped:
            b.append(e)
    return _jax.jaxpr_with(jaxpr, eqns=b.eqns), len(joins)


def _join(*rows):
    """The rows in order, signed zeros +0.0 (`_as_summed`)."""
    return _as_summed(lax.concatenate(list(rows), 0))


def _as_summed(x):
    """x with -0.0 made +0.0, as the sum of pads a join replaces makes it
    (adding +0.0); a select, as XLA folds an x + 0.0 to x."""
    return lax.select(x == 0, lax.full_like(x, 0), x)


def _unit_axis(made, uses):
    """(index, y) when `made` = (index, eqn) gives y a leading unit axis (a
    `broadcast_in_dim` or `reshape` of y, rank >= 1, to (1,) + y.shape) and
    its result has one reader; else None."""
    if made is None:
        return None
    k, e = made
    out = e.outvars[0]
    y = e.invars[0]
    if (uses.get(out, 0) != 1 or not _jax.is_var(y) or not y.aval.shape
            or tuple(out.aval.shape) != (1,) + tuple(y.aval.shape)):
        return None
    if e.primitive.name == "broadcast_in_dim":
        ok = _jax.broadcast_dimensions(e) == tuple(range(1, 1 + len(y.aval.shape)))
    else:
        ok = e.primitive.name == "reshape" and not _jax.reshape_transposes(e)
    return (k, y) if ok and not _jax.has_sharding_annotation(e) else None


def _join_values(*ys):
    """`_join` of the ys given a unit axis: `_stacks.stack(ys)` (their
    concatenate on axis 0, reshaped: what `Walk` reads as a stack), signed
    zeros +0.0."""
    return _as_summed(_stacks.stack(ys))


def split_rows(jaxpr):
    """(jaxpr, number of arrays split): every input of `jaxpr` whose rows
    0..n-1 are all read as `x[i]` (a one-row `slice` read only by `squeeze`s
    of axis 0) is split once, at the start, by a call of `_stacked._slices`
    (the split `jb.stack_layers` makes), and the squeezes read its outputs.
    The rolled layers then read that input as their stack (`Walk.keep`),
    not a copy stacked from its rows. Same values: a split piece squeezed
    is the slice squeezed."""
    inputs = set(jaxpr.invars) | set(jaxpr.constvars)
    rows: dict = {}        # input -> {row: [slice index]}
    squeezes: dict = {}    # slice output -> [squeeze index]
    for k, e in enumerate(jaxpr.eqns):
        i = _row(e)
        if i is not None and e.invars[0] in inputs:
            rows.setdefault(e.invars[0], {}).setdefault(i, []).append(k)
            squeezes[e.outvars[0]] = []
        elif (e.primitive.name == "squeeze" and _jax.is_var(e.invars[0])
              and e.invars[0] in squeezes and _jax.squeeze_dimensions(e) == (0,)):
            squeezes[e.invars[0]].append(k)
    readers = _rewrite.own_uses(jaxpr)
    eqns = jaxpr.eqns
    split = []
    for v, by_row in rows.items():
        outs = [eqns[k].outvars[0] for ks in by_row.values() for k in ks]
        if (len(by_row) >= 2 and sorted(by_row) == list(range(v.aval.shape[0]))
                and all(readers.get(o, 0) == len(squeezes[o]) >= 1 for o in outs)):
            split.append(v)
    if not split:
        return jaxpr, 0
    b = _rewrite.EqnBuilder(closed=False)
    env: dict = {}
    dropped: set = set()
    for v in split:
        pieces = b.emit(lambda a: jax.jit(_stacked._slices)(a), [v], key="reroll_index.split")
        for row, ks in rows[v].items():
            for k in ks:
                dropped.add(k)
                for q in squeezes[eqns[k].outvars[0]]:
                    dropped.add(q)
                    env[eqns[q].outvars[0]] = pieces[row]
    for k, e in enumerate(eqns):
        if k in dropped:
            continue
        if any(_jax.is_var(a) and a in env for a in e.invars):
            e = e.replace(invars=[env.get(a, a) if _jax.is_var(a) else a for a in e.invars])
        b.append(e)
    outvars = [env.get(a, a) if _jax.is_var(a) else a for a in jaxpr.outvars]
    return _jax.jaxpr_with(jaxpr, eqns=b.eqns, outvars=outvars), len(split)
