"""Which intermediates of a graph XLA materialises, and which of them are
live at once: the memory half of the cost model (`_cost`).

Precondition: a finished `_graph.Graph` and the layout keys of its
variables. Materialised: outputs of contractions, reductions, stacked scan
results, the state a loop carries in and out (a `while`'s; a scan's consts,
carry and whole xs, held to its last trip), and of elementwise ops
read by a non-elementwise op or by more than `FUSE_MAX_USES` ops (an
elementwise result read by one elementwise op is assumed fused into it);
dead values and constants (broadcasts of literals, iota) are not. A
temporary is live from the op that makes it to the last op that reads it
(a stacked scan result from its loop's first trip, which writes into it);
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

For the one plan a `Plan` reports (`packed_peak`), temporaries that fit
go into result buffers not yet written, as XLA's buffer assignment puts
them; the search's peak (the matrix product) leaves them out, so it is
never below the reported one: a memory budget it meets is met.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

FUSE_MAX_USES = 1   # an elementwise result read by one elementwise op is fused into it


class Liveness(NamedTuple):
    fixed_groups: list      # (keys, nbytes) of each argument and of each result not aliased
    mem_groups: list        # (keys, nbytes) of each group of temporaries
    mem_points: np.ndarray  # program points x groups: temporaries live
    temps: list             # (group, born, last read) per temporary
    results: list           # (index in fixed_groups, born) per result with a buffer of its own


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


def liveness(g, var_keys, donated=(), temp_bytes=None) -> Liveness:
    """The `Liveness` of graph `g` whose variable v has layout keys
    `var_keys[v]`; `donated`: the graph inputs whose buffers results may
    reuse; `temp_bytes(v)`: a temporary's bytes (default `g.nbytes`; XLA:CPU
    holds 16-bit float temporaries as float32: `CostModel.held_bytes`)."""
    temp_bytes = temp_bytes or g.nbytes
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
            born[v] = 0 if at_start else g.stacked_from.get(v, i)
            if at_start:
                early.add(v)
    # a `while`'s state is held in buffers for the loop (even one that runs
    # zero times, `_stacks.hold`): materialised, though its readers fuse it
    fused = fused_values(g) - g.loop_state
    ins, outs = set(g.invars), set(g.outvars)
    groups: dict = {}
    fixed_groups = [(var_keys[v], g.nbytes(v)) for v in ins]
    free: dict = {}   # (keys, nbytes) -> donated buffers no result reuses yet
    results: list = []   # (index in fixed_groups, var) per result with a buffer of its own
    for v in donated:
        free.setdefault((var_keys[v], g.nbytes(v)), []).append(v)
    for v in dict.fromkeys(w for w in g.outvars if w is not None and w not in ins):
        gk = (var_keys[v], g.nbytes(v))
        if free.get(gk):
            free[gk].pop()   # written into a donated argument's buffer
        else:
            fixed_groups.append(gk)
            results.append((len(fixed_groups) - 1, v))
    written_over = _written_over(g, fused, [v for _, v in results], born)
    # a result written over an operand holds its buffer from the operand's birth
    since = {v: born[u] for u, v in written_over.items()}
    results = [(i, since.get(v, born[v])) for i, v in results]
    events, temps = [], []
    for v in range(len(g.shapes)):
        if (v in ins or v in outs or born[v] < 0 or v in fused or not g.shapes[v]
                or v in written_over):
            continue
        end = max(g.uses[v], born[v])
        gk = (var_keys[v], temp_bytes(v))
        j = groups.setdefault(gk, len(groups))
        events.append((born[v], 1, j))
        events.append((end + 1, -1, j))
        temps.append((j, born[v], end))
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
    return Liveness(fixed_groups, list(groups), keep if len(keep) else np.zeros((1, len(groups))),
                    temps, results)


def _written_over(g, fused, results, born) -> dict:
    """The temporaries XLA writes one of `results` over: a result made by an
    element-wise fusion outside loops (its op and the elementwise ops
    fused into it) takes the buffer of an operand of the fusion that is a
    temporary of the same dim classes (so the same shape and layout under
    any plan) read last there: XLA's buffer sharing of an elementwise
    fusion with an operand that dies in it, result buffers included
    (measured: the stacked gradients a rolled AdamW step's update reads
    take no temporary memory). One operand per result: {operand: result}."""
    made = {v: i for i, op in enumerate(g.ops) for v, _ in op.outs}
    ins, outs = set(g.invars), set(g.outvars)
    taken: dict = {}
    for v in results:
        root = made.get(v)
        if root is None or g.ops[root].kind != "map" or g.ops[root].mult != 1:
            continue
        region, todo, found = set(), [root], []
        while todo:           # the fusion: ops whose results are fused into v's
            j = todo.pop()
            region.add(j)
            for w, _ in g.ops[j].ins:
                k = made.get(w)
                if w is None or k is None:
                    continue
                if w in fused and g.ops[k].kind == "map":
                    todo.append(k)
                elif (w not in ins and w not in outs and w not in taken and born[w] >= 0
                      and g.var_classes[w] == g.var_classes[v]
                      and g.itemsize[w] == g.itemsize[v]):
                    found.append(w)
        w = next((w for w in found if g.uses[w] in region), None)
        if w is not None:
            taken[w] = v
    return taken


def packed_peak(lv: Liveness, live, fixed) -> float:
    """The peak bytes of temporaries outside result buffers, for one plan
    (`live`: bytes per device per temporary group, `fixed`: per fixed
    group). A result's buffer is free until the result is written, and
    XLA's buffer assignment puts earlier temporaries in it: each
    temporary, largest first, goes into the first result buffer at least
    as large that is written after the temporary's last read and holds no
    temporary live at the same time, else into the temporary heap, whose
    peak this returns (measured: a stacked step's residuals that fit its
    parameter stacks take no temporary memory; a per-layer step's, larger
    than any one result, take their whole size). Without results to use,
    it is the peak of `mem_points @ live`."""
    slots: list[tuple[float, int, list]] = sorted(
        ((float(fixed[i]), b, []) for i, b in lv.results), key=lambda s: -s[0])
    events = []
    for j, b, e in sorted(lv.temps, key=lambda t: -float(live[t[0]])):
        size = float(live[j])
        slot = None
        for cap, written, used in slots:
            if cap < size:
                break
            if written > e and not any(b <= e2 and b2 <= e for b2, e2 in used):
                slot = used
                break
        if slot is not None:
            slot.append((b, e))
        else:
            events += [(b, size), (e + 1, -size)]
    peak = cur = 0.0
    for _, d in sorted(events):
        cur += d
        peak = max(peak, cur)
    return peak
