"""Which intermediates of a graph XLA materialises, and which of them are
live at once: the memory half of the cost model (`_cost`).

Precondition: a finished `_graph.Graph` and the layout keys of its
variables. Materialised: outputs of contractions, reductions, stacked scan
results, the state a `while` carries in and out, and of elementwise ops
read by a non-elementwise op or by more than `FUSE_MAX_USES` ops (an
elementwise result read by one elementwise op is assumed fused into it);
dead values and constants (broadcasts of literals, iota) are not. A
temporary is live from the op that makes it to the last op that reads it;
an op outside loops that only moves data (no flops: a concatenate, a
reshape) of inputs, constants and such ops' results makes it at the start,
where XLA:CPU schedules it (the stacks a rolled per-layer step copies its
inputs into). Temporaries with the same layout keys and size form a group;
the result counts, per group, how many are live at each program point that
may hold the peak (points dominated by another are dropped), so the peak
under any plan is a max over a few rows of a matrix product. It leaves the
graph alone.

Arguments and results are held for the whole step, except that a result
reuses the buffer of a donated argument (`jax.jit(donate_argnums=)`) of
the same size and layout keys, as XLA's input/output aliasing does (same
shape, dtype and sharding): such a result costs nothing more.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

FUSE_MAX_USES = 1   # an elementwise result read by one elementwise op is fused into it


class Liveness(NamedTuple):
    fixed_groups: list      # (keys, nbytes) of each argument and of each result not aliased
    mem_groups: list        # (keys, nbytes) of each group of temporaries
    mem_points: np.ndarray  # program points x groups: temporaries live


def fused_values(g) -> set:
    """The variables of `g` XLA does not materialise (see the module
    docstring): dead values, constants, and elementwise results fused into
    their one elementwise reader. The cost model charges memory traffic only
    for the others (`_cost`)."""
    fused = set()
    consumers: dict = {}
    for op in g.ops:
        for v, _ in op.ins:
            consumers.setdefault(v, []).append(op.kind)
    ins, outs = set(g.invars), set(g.outvars)
    for op in g.ops:
        for v, _ in op.outs:
            # Dead values are removed by XLA; constants (broadcasts of
            # literals, iota) are fused into their consumers.
            if v not in outs and (v not in consumers or not op.ins):
                fused.add(v)
        if op.kind == "map":
            for v, _ in op.outs:
                readers = consumers.get(v, ())
                if (readers and v not in g.pinned and v not in outs
                        and all(k == "map" for k in readers) and len(readers) <= FUSE_MAX_USES):
                    fused.add(v)
    return fused


def liveness(g, var_keys, donated=()) -> Liveness:
    """The `Liveness` of graph `g` whose variable v has layout keys
    `var_keys[v]`; `donated`: the graph inputs whose buffers results may reuse."""
    born = [-1] * len(g.shapes)
    early: set = set()
    for i, op in enumerate(g.ops):
        # an op outside any loop that only moves data (flops 0) of inputs,
        # constants and such ops' results is ready at the start, where
        # XLA:CPU's scheduler puts it (measured: the stacks `reroll`
        # concatenates from per-layer inputs all come first in the compiled
        # schedule, though the optimizer reads some of them last). Not
        # arithmetic on inputs (a cast of the weights): measured nowhere.
        at_start = (op.mult == 1 and op.flops == 0 and op.ins
                    and all(born[v] < 0 or v in early for v, _ in op.ins))
        for v, _ in op.outs:
            born[v] = 0 if at_start else i
            if at_start:
                early.add(v)
    # a `while`'s state is held in buffers for the loop (even one that runs
    # zero times, `_stacks.hold`): materialised, though its readers fuse it
    fused = fused_values(g) - g.loop_state
    ins, outs = set(g.invars), set(g.outvars)
    groups: dict = {}
    fixed_groups = [(var_keys[v], g.nbytes(v)) for v in ins]
    free: dict = {}   # (keys, nbytes) -> donated buffers no result reuses yet
    for v in donated:
        free.setdefault((var_keys[v], g.nbytes(v)), []).append(v)
    for v in dict.fromkeys(w for w in g.outvars if w is not None and w not in ins):
        gk = (var_keys[v], g.nbytes(v))
        if free.get(gk):
            free[gk].pop()   # written into a donated argument's buffer
        else:
            fixed_groups.append(gk)
    events = []
    for v in range(len(g.shapes)):
        if v in ins or v in outs or born[v] < 0 or v in fused or not g.shapes[v]:
            continue
        end = max(g.uses[v], born[v])
        gk = (var_keys[v], g.nbytes(v))
        j = groups.setdefault(gk, len(groups))
        events.append((born[v], 1, j))
        events.append((end + 1, -1, j))
    events.sort()
    count = np.zeros(len(groups))
    i = 0
    pts = []
    while i < len(events):   # live counts after each program point
        t0 = events[i][0]
        while i < len(events) and events[i][0] == t0:
            count[events[i][2]] += events[i][1]
            i += 1
        pts.append(count.copy())
    rows = np.array(pts) if pts else np.zeros((1, len(groups)))
    # Keep only points not dominated by another (a peak is at one of
    # them); checking against the kept rows only, largest first, keeps
    # this near-linear (few rows survive).
    rows = np.unique(rows, axis=0)
    rows = rows[np.argsort(-rows.sum(axis=1), kind="stable")]
    keep = np.zeros((0, len(groups)))
    for r in rows:
        if not (keep >= r).all(axis=1).any():
            keep = np.vstack([keep, r])
    return Liveness(fixed_groups, list(groups), keep if len(keep) else np.zeros((1, len(groups))))
