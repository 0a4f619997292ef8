"""Branch and bound over plans, and the heuristics that stand in for it.

Precondition: `Tables` of the grid (`_tables`). The branch and bound assigns
keys one at a time, most influential first, vectorised over the whole
frontier of partial plans. A partial plan's bound is, per table, the least
entry over the keys still free (a table whose keys are a subset of
another's is merged into it first, which tightens the bound). Partial plans
whose time bound exceeds an incumbent's time (a plan that fits, from a beam
search polished by coordinate descent), or whose memory bound exceeds the
budget, are dropped. Invariant: a bound never exceeds the true time
(memory) of any completion, so every plan that fits and is no slower than
the incumbent survives; the survivors, ranked as the exhaustive search
ranks (`_tables.best_of`), give its least time; a second pass with that
time plus the tolerance as the bound keeps the plans the exhaustive search
picks the fewest collective bytes among (`_tables.least_comm`).

Heuristics (stats["optimal"] False, stats["why"] says why): the incumbent,
when the frontier would outgrow `FRONTIER_LIMIT` or the deadline passes; and
`subgrid_descent`, block coordinate descent over exhaustive sub-grids (every
pair of keys, the others fixed) from the unsharded plan, which needs no
whole-grid tables. It leaves the tables alone.
"""

from __future__ import annotations

import itertools
import time

import numpy as np

from jaxbackend.sharding._tables import (GiB, NoPlanFits, Tables, best_of, least_comm, masks_of,
                                         no_plan_fits)

FRONTIER_LIMIT = 1 << 20     # partial plans the branch and bound may hold
BEAM = 256                   # partial plans per level of the incumbent's beam search
_REL = 1e-9                  # float slack between sums taken in different orders


def _merge(tables):
    """Sum tables into as few as possible without widening any: a table
    whose keys are a subset of another's is added into it."""
    scope = lambda t: frozenset(j for j, s in enumerate(t.shape) if s > 1)  # noqa: E731
    out = []
    for t in sorted(tables, key=lambda t: -t.size):
        s = scope(t)
        for i, (u, su) in enumerate(out):
            if s <= su:
                out[i] = (u + t, su)
                break
        else:
            out.append((t.copy(), s))
    return [u for u, _ in out]


def descend(plan, shape, evaluate, budget, deadline):
    """Block coordinate descent from `plan` (option indices): over every
    pair of keys, the best of their options with the others fixed, until no
    pair improves. Score: fitting first, then time (or memory, while
    nothing fits). `evaluate(candidates, (a, b))` -> (times, memories).
    Returns (plan, time, memory)."""
    def score(t, m):
        return (0, t) if m <= budget else (1, m)

    t, m = (float(x[0]) for x in evaluate(plan[:, None], None))
    n = len(shape)
    pairs = list(itertools.combinations(range(n), 2)) if n > 1 else [(j, j) for j in range(n)]
    improved = True
    while improved and time.perf_counter() < deadline:
        improved = False
        for a, b in pairs:
            cand = np.repeat(plan[:, None], shape[a] * shape[b], axis=1)
            cand[a] = np.repeat(np.arange(shape[a]), shape[b])
            cand[b] = np.tile(np.arange(shape[b]), shape[a]) if b != a else cand[a]
            times, mems = evaluate(cand, (a, b))
            fits = mems <= budget
            key = np.where(fits, times, mems)
            i = int(np.lexsort((np.arange(len(key)), key, ~fits))[0])
            new, cur = score(times[i], mems[i]), score(t, m)
            if new[0] < cur[0] or (new[0] == cur[0] and new[1] < cur[1] * (1 - _REL)):
                plan, t, m, improved = cand[:, i], float(times[i]), float(mems[i]), True
    return plan, t, m


def subgrid_descent(cm, keys, options, budget, deadline, why):
    """The heuristic without whole-grid tables: `descend` from the
    unsharded plan, each pair's sub-grid tabulated with the others fixed."""
    shape = tuple(len(o) for o in options)

    def evaluate(cand, block):
        sub = [] if block is None else list(dict.fromkeys(block))
        tab = Tables(cm, [keys[j] for j in sub], [options[j] for j in sub],
                     base=masks_of(cm, keys, options, cand[:, 0]))
        return tab.time_at(cand[sub]), tab.memory_at(cand[sub])

    plan, t, m = descend(np.zeros(len(keys), np.int64), shape, evaluate, budget, deadline)
    if m > budget:
        raise NoPlanFits(
            f"sharding.plan: found no plan within the memory budget {budget / GiB:.3f} GiB per "
            f"device (the least found needs {m / GiB:.3f} GiB; not proven: {why}); raise "
            f"memory_budget, use more devices, or shrink the batch.")
    stats = dict(method="descent", optimal=False, why=why, time=t, memory=m)
    return masks_of(cm, keys, options, plan), stats


class BranchAndBound:
    """Exact search by bounds over partial plans (see the module docstring)."""

    def __init__(self, tab, budget, deadline):
        self.tab, self.budget, self.deadline = tab, budget, deadline
        n = len(tab.shape)
        self.time_tables = _merge(tab.time)   # the incumbent descends on these too
        # Memory bound: the summed parts plus the live temporaries at the
        # program point that holds the most when nothing is sharded.
        pts = tab.cm.mem_points
        p0 = int(np.argmax(pts @ np.array([t.max() for t in tab.live]))) if tab.live else 0
        mem_tables = _merge(tab.summed + [pts[p0, g] * t for g, t in enumerate(tab.live) if pts[p0, g]])
        self.order = self._key_order(self.time_tables, n)
        self.time_bounds, self.mem_bounds = self._bounds(self.time_tables), self._bounds(mem_tables)
        self.comm_bounds = None   # made by the tolerance pass
        self.nodes, self.dropped_memory, self.stopped = 0, np.inf, None

    def _bounds(self, tables):
        """bounds[d]: the tables' least entries over the keys unassigned at depth d."""
        bounds = [tables]
        for j in reversed(self.order):
            bounds.insert(0, _merge([t.min(axis=j, keepdims=True) for t in bounds[0]]))
        return bounds

    @staticmethod
    def _key_order(tables, n):
        """Keys whose choice moves the time most first: their bounds prune early."""
        spread = np.zeros(n)
        for t in tables:
            for j in range(n):
                if t.shape[j] > 1:
                    r = t.min(axis=tuple(i for i in range(n) if i != j))
                    spread[j] += r.max() - r.min()
        return [int(j) for j in np.argsort(-spread, kind="stable")]

    def _levels(self, ub, beam=None, comm_ub=None):
        """Complete plans whose bounds pass, keys assigned in `order`; with
        `beam`, only that many best-bounded partial plans per level; with
        `comm_ub`, only those whose communication bound passes it too. None
        if the frontier outgrows FRONTIER_LIMIT or the deadline passes."""
        shape = self.tab.shape
        idx = np.zeros((len(shape), 1), np.int64)
        for d, j in enumerate(self.order):
            idx = np.repeat(idx, shape[j], axis=1)
            idx[j] = np.tile(np.arange(shape[j]), idx.shape[1] // shape[j])
            self.nodes += idx.shape[1]
            lb = Tables.sum_at(self.time_bounds[d + 1], idx)
            mlb = Tables.sum_at(self.mem_bounds[d + 1], idx)
            in_time, fits = lb <= ub * (1 + _REL), mlb <= self.budget * (1 + _REL)
            if beam is None:   # for the message if nothing fits: the least memory dropped
                dropped = float(mlb[in_time & ~fits].min(initial=np.inf))
                self.dropped_memory = min(self.dropped_memory, dropped)
            keep = in_time & fits
            if comm_ub is not None:
                keep &= Tables.sum_at(self.comm_bounds[d + 1], idx) <= comm_ub * (1 + _REL)
            idx, lb = idx[:, keep], lb[keep]
            if beam is not None and idx.shape[1] > beam:
                idx = idx[:, np.sort(np.argpartition(lb, beam)[:beam])]
            if beam is None and idx.shape[1] * max(shape) > FRONTIER_LIMIT:
                self.stopped = f"over {FRONTIER_LIMIT} partial plans"
                return None
            if beam is None and time.perf_counter() > self.deadline:
                self.stopped = "past the time limit"
                return None
        return idx

    def _incumbent(self):
        """A plan within the budget: (plan, time, memory), or Nones."""
        tab = self.tab
        plan, t, m, _ = best_of(tab, self._levels(np.inf, beam=BEAM), self.budget)
        if plan is None:   # the beam kept nothing that fits: descend from the most sharded plan
            plan = np.array([len(o) - 1 for o in tab.options])
        # the merged tables (fewer, same sums up to rounding, which _levels'
        # _REL slack absorbs): the incumbent only bounds the search; the plan
        # returned is ranked by `best_of`, in the exhaustive search's order
        plan, t, m = descend(plan, tab.shape,
                             lambda c, _: (Tables.sum_at(self.time_tables, c), tab.memory_at(c)),
                             self.budget, self.deadline)
        return (plan, t, m) if m <= self.budget else (None, np.inf, None)

    def run(self, heuristic_only=False, tolerance=0.0):
        """(plan, stats): the exhaustive search's plan, `tolerance` included
        (a second pass keeps every plan within it of the least time; if that
        pass stops, the least-time plan stands, stats["tolerance"] says so)."""
        plan, t, m = self._incumbent()
        if not heuristic_only:
            idx = self._levels(t)
            if idx is not None:
                best, bt, bm, least = best_of(self.tab, idx, self.budget)
                if best is None and plan is None:
                    # proven: every plan not dropped by its memory bound was checked
                    no_plan_fits(min(least, self.dropped_memory), self.budget, at_least=True)
                if best is None:   # only float slack can drop the incumbent itself
                    best, bt, bm = plan, t, m
                stats = dict(method="branch_and_bound", optimal=True, time=bt, least_time=bt,
                             memory=bm, nodes=self.nodes, survivors=int(idx.shape[1]))
                near = idx
                if tolerance > 0:   # plans within the tolerance that communicate no more than `best`
                    self.comm_bounds = self._bounds(_merge(self.tab.comm))
                    c_best = float(self.tab.comm_at(best[:, None])[0])
                    near = self._levels(bt * (1 + tolerance), comm_ub=c_best)
                if near is None:
                    stats["tolerance"] = f"not applied: {self.stopped}"
                else:
                    best, stats["time"], stats["memory"] = least_comm(self.tab, near, self.budget,
                                                                      bt, tolerance)
                stats["nodes"] = self.nodes
                return best, stats
        why = "forced" if heuristic_only else f"branch and bound stopped: {self.stopped}"
        if plan is None:
            least = float(sum(t.min() for t in self.mem_bounds[0]))
            raise NoPlanFits(
                f"sharding.plan: found no plan within the memory budget {self.budget / GiB:.3f} GiB "
                f"per device (not proven: {why}; every plan needs at least {least / GiB:.3f} GiB); "
                f"raise memory_budget, use more devices, or shrink the batch.")
        return plan, dict(method="heuristic", optimal=False, why=why, time=t, memory=m, nodes=self.nodes)
