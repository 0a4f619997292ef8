"""Layers that index one array by their number: `W[i]` in a Python loop over
layers (weights kept stacked by the user, per-layer scales or flags), seeded
so that the layers repeat (part of `passes.reroll`).

Forward, layer i reads `W[i]` as a static `slice` (start i on axis 0, one
row, every other axis whole) and a `squeeze` of that axis: the blocks differ
in the slice's start, so no block repeats. `index_reads(jaxpr)` says which
arrays are read that way at two or more rows; `_reroll_seed.lifted` moves
those reads to right after the array is made, as it does for per-layer
dropout keys, and each block then reads its row as a per-layer input.

Backward, JAX transposes each `W[i]` into a `pad` of the row's cotangent
(i rows of zeros before it, n - 1 - i after) and sums the pads with
`add_any` as the layers' contributions arrive: the pads differ per block
too. `joined_pads(jaxpr)` replaces such a sum, where the pads put one row at
each of the n positions and nothing else reads a pad or a partial sum, by
one `concatenate` of the rows in row order (signed zeros made +0.0, as the
sum makes them); the blocks then end at their row, which the backward scan
stacks.

Why the values stay the same: moving a pure equation earlier changes no
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

import collections

import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxbackend import _jax
from jaxbackend.passes import _rewrite


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
    # uses within this jaxpr (a sub-jaxpr reads an outer value only as an
    # operand of its equation, counted here)
    uses = collections.Counter(v for e in eqns for v in e.invars if _jax.is_var(v))
    uses.update(v for v in jaxpr.outvars if _jax.is_var(v))
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
    b = _rewrite.EqnBuilder(closed=False)
    for k, e in enumerate(eqns):
        if k in joins:
            v, xs = joins[k]
            (out,) = b.emit(_join, xs, key="reroll_index.join")
            # the sum's own variable, so its readers need no renaming
            if not (_jax.is_var(out) and b.eqns and b.eqns[-1].outvars[0] is out):
                raise AssertionError("_reroll_index: the join's last equation must make it")
            b.eqns[-1] = b.eqns[-1].replace(outvars=[v])
        elif k not in dropped:
            b.append(e)
    return _jax.jaxpr_with(jaxpr, eqns=b.eqns), len(joins)


def _join(*rows):
    """The rows in order, with -0.0 made +0.0 (as the sum of pads it
    replaces does, adding +0.0; XLA folds an x + 0.0, so a select)."""
    cat = lax.concatenate(list(rows), 0)
    return lax.select(cat == 0, lax.full_like(cat, 0), cat)
