"""Plans as table lookups: the cost model's terms tabulated over a grid of
options, for the search (`_search`, `_bound`).

Precondition: a `CostModel` and a grid: searched keys, each with its
options (mesh-axis masks); other keys fixed (unsharded by default). The
modelled time is a sum of terms (per distinct op, per operand all-gather
group), each depending on the few keys it touches, so `CostModel.time_terms`
evaluates each term once as a table over its own keys' options (a broadcast
shape over the grid: size 1 along the keys it does not depend on). Memory is
a peak, not a sum, but splits the same way (`CostModel.memory_terms`):
summed tables plus a max over program points of sums (any one of which is a
lower bound). A plan is then a column of option indices, and its time and
memory are lookups that reproduce `CostModel.step_time` and `memory`.

Ranking, shared by every method so they agree to the bit: plans in order of
time (summed term by term in one fixed order), ties by grid order (fewer and
earlier mesh axes first); the first that fits the budget wins. Then
`least_comm`: among the plans that fit within a tolerance of that time, the
fewest collective bytes (`_search.TOLERANCE` says why). It leaves the cost
model alone.
"""

from __future__ import annotations

import math

import numpy as np

GiB = 1024 ** 3


class NoPlanFits(ValueError):
    """No plan fits the memory budget."""


def grid_masks(cm, keys, options, base=None):
    """Masks per key, broadcast over the grid: key `keys[j]` varies along
    axis j; the others are fixed at `base` (default unsharded)."""
    n = len(keys)
    masks = [np.full((1,) * n, 0 if base is None else base[k], np.int64) for k in range(cm.n_keys)]
    for j, (k, opts) in enumerate(zip(keys, options)):
        shape = [1] * n
        shape[j] = len(opts)
        masks[k] = opts.reshape(shape)
    return masks


def _as_grid(x, n):
    x = np.asarray(x, np.float64)
    return x.reshape((1,) * (n - x.ndim) + x.shape)


def _combine(tables, op) -> list:
    """One table per distinct shape: `op` (np.add, np.maximum) folded over
    the tables of that shape."""
    out: dict = {}
    for t in tables:
        out[t.shape] = t if t.shape not in out else op(out[t.shape], t)
    return list(out.values())


def _stacks(tables) -> list:
    """[(row indices, stacked tables)] grouping `tables` by shape."""
    rows: dict = {}
    for i, t in enumerate(tables):
        rows.setdefault(t.shape, []).append(i)
    return [(np.array(r), np.stack([tables[i] for i in r])) for r in rows.values()]


class Tables:
    """The time and memory terms of a cost model as tables over the grid of
    `keys`' options (axis j: key `keys[j]`; size 1 where a term does not
    depend on it); other keys fixed at `base` masks (default unsharded). A
    plan is a column of option indices, one row per key."""

    def __init__(self, cm, keys, options, base=None):
        self.cm, self.keys, self.options = cm, list(keys), list(options)
        self.base = [0] * cm.n_keys if base is None else list(base)
        self.shape = tuple(len(o) for o in options)
        n = len(keys)
        masks = grid_masks(cm, keys, options, base)
        terms, extras, comm = cm.time_terms(masks)
        self.time = [_as_grid(t, n) for t in terms]
        self.comm = [_as_grid(t, n) for t in comm]
        fixed, weights, live, transient = cm.memory_terms(masks, extras)
        self.summed = [_as_grid(t, n) for t in fixed + weights]
        self.live = [_as_grid(t, n) for t in live]
        self.transient = [_as_grid(t, n) for t in transient]
        # memory_at reads thousands of small tables per call on a large
        # program: read each distinct shape once (summed terms pre-summed,
        # transients pre-maxed, live groups stacked; same values)
        self._summed = _combine(self.summed, np.add)
        self._transient = _combine(self.transient, np.maximum)
        self._live = _stacks(self.live)

    @staticmethod
    def at(table, idx):
        """Entries of `table` at plans `idx` (keys x N option indices)."""
        return np.broadcast_to(table[tuple(i if s > 1 else 0 for i, s in zip(idx, table.shape))],
                               idx.shape[1:])

    @classmethod
    def sum_at(cls, tables, idx):
        """The sum of `tables`' entries at plans `idx`, term by term in order."""
        total = np.zeros(idx.shape[1:])
        for t in tables:
            total = total + cls.at(t, idx)
        return total

    def time_at(self, idx):
        """Modelled step time of plans `idx` (summed as `grid` sums)."""
        return self.sum_at(self.time, idx)

    def comm_at(self, idx):
        """Modelled collective bytes per device of plans `idx`."""
        return self.sum_at(self.comm, idx)

    def memory_at(self, idx):
        """Memory per device of plans `idx` (as `CostModel.memory`)."""
        total = self.sum_at(self._summed, idx)
        other = 0.0
        for t in self._transient:
            other = np.maximum(other, self.at(t, idx))
        if self.live:
            live = np.empty((len(self.live),) + idx.shape[1:])
            for rows, stack in self._live:
                sel = tuple(i if s > 1 else 0 for i, s in zip(idx, stack.shape[1:]))
                got = stack[(slice(None),) + sel]     # (groups, plans), or (groups,)
                got = got.reshape(got.shape + (1,) * (live.ndim - got.ndim))
                live[rows] = np.broadcast_to(got, (len(rows),) + idx.shape[1:])
            total = total + (self.cm.mem_points @ live).max(axis=0)
        return total + other

    def grid(self):
        """Time of every plan of the grid."""
        total = np.zeros(self.shape)
        for t in self.time:
            total += t
        return total

    def masks(self, idx):
        """Masks per key (ints) of the plan with option indices `idx`, other
        keys at `base`."""
        masks = list(self.base)
        for j, k in enumerate(self.keys):
            masks[k] = int(self.options[j][idx[j]])
        return masks


def table_entries(cm, keys, options):
    """Entries the `Tables` of this grid would hold, from a probe grid of
    two options per key (a term's shape shows which keys it depends on)."""
    n = len(keys)
    probe = grid_masks(cm, keys, [o[:2] for o in options])
    terms, extras, _ = cm.time_terms(probe, comm=False)
    total = 0
    for t in terms + [x for part in cm.memory_terms(probe, extras) for x in part]:
        total += math.prod(len(o) for o, s in zip(options, _as_grid(t, n).shape) if s > 1)
    return total


def first_fit(tab, plans, count, budget, batch=4096):
    """The first of `count` plans (best first; `plans(start, stop)` gives
    their option indices) within the budget: (its position or None, its
    memory, the least memory seen)."""
    least, s, size = np.inf, 0, 64   # the cheapest plans usually fit: check few first
    while s < count:
        mem = tab.memory_at(plans(s, s + size))
        least = min(least, float(mem.min()))
        fits = np.nonzero(mem <= budget)[0]
        if len(fits):
            return s + int(fits[0]), float(mem[fits[0]]), least
        s, size = s + size, min(size * 8, batch)
    return None, None, least


def best_of(tab, idx, budget):
    """The least-time plan of `idx` within the budget, ties by grid order:
    (plan, time, memory, least memory seen); plan None if none fits."""
    if idx.shape[1] == 0:
        return None, None, None, np.inf
    times = tab.time_at(idx)
    order = np.lexsort(tuple(idx[::-1]) + (times,))
    idx, times = idx[:, order], times[order]
    pos, mem, least = first_fit(tab, lambda a, b: idx[:, a:b], idx.shape[1], budget)
    if pos is None:
        return None, None, None, least
    return idx[:, pos], float(times[pos]), mem, least


def least_comm(tab, idx, budget, best_time, tolerance, times=None):
    """Among plans `idx` whose time is within `tolerance` (relative) of
    `best_time` and that fit the budget: the one with the fewest modelled
    collective bytes, ties by time, then grid order. (plan, time, memory), or
    Nones if none fits. `times`: the plans' times where the caller has them
    (the exhaustive search's grid), else read from the tables."""
    times = tab.time_at(idx) if times is None else times
    near = times <= best_time * (1 + tolerance) * (1 + 1e-12)
    idx, times = idx[:, near], times[near]
    if idx.shape[1] == 0:
        return None, None, None
    comm = tab.comm_at(idx)
    order = np.lexsort(tuple(idx[::-1]) + (times, comm))
    idx, times = idx[:, order], times[order]
    pos, mem, _ = first_fit(tab, lambda a, b: idx[:, a:b], idx.shape[1], budget)
    if pos is None:
        return None, None, None
    return idx[:, pos], float(times[pos]), mem


def size_text(n: float) -> str:
    """Bytes in the largest binary unit that leaves a number >= 1, with
    three decimals (no exponent)."""
    for unit, scale in (("TiB", 2 ** 40), ("GiB", GiB), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= scale:
            return f"{n / scale:.3f} {unit}"
    return f"{n:.0f} B"


def no_plan_fits(least, budget, at_least=False):
    """Raise NoPlanFits: the least memory seen (or a lower bound on it)."""
    raise NoPlanFits(
        f"sharding.plan: no plan fits the memory budget: the smallest plan needs "
        f"{'at least ' if at_least else ''}{size_text(least)} per device, budget "
        f"{size_text(budget)}, short by {size_text(least - budget)}; raise memory_budget, use "
        f"more devices, or shrink the batch.")


def masks_of(cm, keys, options, idx):
    """Masks per key (ints) of the plan with option indices `idx`, other
    keys unsharded."""
    masks = [0] * cm.n_keys
    for j, k in enumerate(keys):
        masks[k] = int(options[j][idx[j]])
    return masks
