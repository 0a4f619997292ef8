"""Search over plans: one mesh-axis group per key, least modelled step time
within a memory budget; exact (proven optimal) unless its stats say not.

Precondition: a `CostModel`. The space: each key that some input argument
holds (a dim name, or a tied group of unnamed dims), and each named dim,
of size > 1 may take any
group of mesh axes (a subset, in mesh order) whose size divides it; other
keys stay unsharded. A plan is a point of the grid of all keys' options;
time and memory of plans are lookups in the cost model's terms tabulated
over the grid (`_tables`).

Methods, by size:
* exhaustive (grids up to `EXHAUSTIVE_LIMIT` plans): the tables are
  broadcast-added into the grid of all plans (numpy does the product), and
  candidates are checked for memory in order of time, a batch at a time; the
  first that fits gives the least time. Ties break by grid order:
  deterministic. Then the plans within `TOLERANCE` of that time are the
  model's tie, and the one with the fewest collective bytes wins.
* branch and bound (`_bound`, larger grids): returns the exhaustive
  search's plan, proven, without enumerating the grid.
* heuristics (`stats["optimal"] = False`, `stats["why"]`): the branch and
  bound's incumbent when it would hold more than `_bound.FRONTIER_LIMIT`
  partial plans or runs past `time_limit`; block coordinate descent over
  sub-grids when the tables would exceed `TABLE_LIMIT` entries.

It leaves the graph and the model alone; `Plan` (`_plan`) turns the chosen
masks into rules and shardings.
"""

from __future__ import annotations

import math
import time

import numpy as np

from jaxbackend.sharding._bound import BranchAndBound, subgrid_descent
from jaxbackend.sharding._tables import NoPlanFits as NoPlanFits
from jaxbackend.sharding._tables import Tables, first_fit, least_comm, no_plan_fits, table_entries

EXHAUSTIVE_LIMIT = 1 << 18   # larger grids: branch and bound (faster there, the same plan)
GRID_LIMIT = 1 << 24         # the largest grid the exhaustive search builds
TABLE_LIMIT = 1 << 26        # table entries, all terms together, the bound search may build
TIME_LIMIT = 10.0            # seconds before the branch and bound gives way to the heuristic
# Plans within this fraction of the least modelled time are the model's tie:
# its roofline compute is good to a few percent (it does not see XLA's fusion
# and copy decisions), its collectives are what XLA emits to within bytes, and
# collectives cannot overlap compute or each other here, so among tied plans
# the search takes the fewest collective bytes (bytes, not modelled seconds: a
# collective's latency amid compute on simulated CPU devices is the wait for
# the slowest device thread, far above its latency alone; a data-parallel
# ResNet step, 41 small all-reduces, tied with a channel-parallel plan moving
# 22x its bytes that ran 1.2x slower). The trade it guards against is sharding
# weights to split the (replicated) optimizer update, a small share of the
# step, for gathers in every layer: the GPT AdamW step on a (2, 4) mesh did it
# to save 0.2% of modelled compute for 6x data parallel's collective bytes;
# the LLaMA-style step (swiglu: three MLP weights per layer) to save 1.3% for
# 2.9x. Measured, the tie is wider: on a GPT step whose weights outweigh its
# activations (embd 256, batch 16; stacked params), plans modelled 2-4% faster
# than data parallel ran 0-17% slower in three benchmark runs (BENCHMARKS.md).
# 5% puts these in the tie; ZeRO-style sharding still wins where memory
# requires it or saves more (the same model's per-layer step: modelled ~10%
# faster, measured 9-20% faster).
TOLERANCE = 0.05


def planned_keys(cm) -> set:
    """The keys a plan chooses a layout for: those an input argument holds,
    the factors of a merged dim one holds (the per-micro-batch `batch` of a
    gradient accumulation loop: tokens (micro * batch, time) reshaped to
    (micro, batch, time)), and every named dim (a name the program gave,
    such as the `batch` of tokens a training step draws from its data inside
    the step). Other intermediate dims stay unsharded (XLA propagates from
    their neighbours)."""
    g = cm.g
    held = {k for v in g.invars for k in cm.var_keys[v]}
    return held | set(g.factor_keys) | {g.class_key[c] for c in g.class_names}


def user_layouts(cm) -> dict:
    """key -> mask for the dims the user's own `with_sharding_constraint`
    lays out (on a mesh with this mesh's axis names): the plan keeps them,
    as XLA would reshard at every constraint the plan disagreed with. A dim
    two constraints lay out differently, or whose size the axes do not
    divide, is left to the search."""
    g, mesh = cm.g, cm.mesh
    found: dict = {}
    for k, axes, names in g.constraints:
        if tuple(names) != tuple(mesh.axis_names):
            continue
        m = mesh.mask(axes)
        if g.key_size[k] % int(mesh.group_size[m]) or found.get(k, m) != m:
            found[k] = None
        else:
            found[k] = m
    return {k: m for k, m in found.items() if m is not None}


def search_space(cm):
    """(searched keys, options per key as mask arrays); a dim the user's
    own sharding constraints lay out has that layout as its one option."""
    g, mesh = cm.g, cm.mesh
    planned = planned_keys(cm)
    fixed = user_layouts(cm)
    keys, options = [], []
    for k in range(cm.n_keys):
        if k in fixed and g.key_size[k] > 1:
            keys.append(k)
            options.append(np.array([fixed[k]], np.int64))
            continue
        if k not in planned or g.key_size[k] <= 1:
            continue
        opts = [m for m in range(1 << len(mesh.axis_names))
                if mesh.group_size[m] == 1 or g.key_size[k] % int(mesh.group_size[m]) == 0]
        if len(opts) > 1:
            keys.append(k)
            options.append(np.array(opts, np.int64))
    return keys, options


def time_grid(cm, keys, options):
    """Modelled step time of every plan in the grid (one axis per key)."""
    size = math.prod(len(o) for o in options)
    if size > GRID_LIMIT:
        raise ValueError(f"time_grid: {size} candidate plans ({len(keys)} dims) exceed the grid "
                         f"limit {GRID_LIMIT}; search() bounds such grids instead of enumerating them.")
    return Tables(cm, keys, options).grid()


def check_budget(memory_budget) -> float:
    """`memory_budget` as a float, or a one-line error: bytes per device, a
    positive real number (a Python or NumPy number or 0-d array; inf: no
    limit)."""
    try:
        ok = not isinstance(memory_budget, (bool, np.bool_, str, bytes)) and np.ndim(
            memory_budget) == 0 and float(memory_budget) > 0     # NaN too
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"memory_budget={memory_budget!r}: give the bytes per device a plan may "
                         f"use, a positive number (e.g. 16 * 2**30 for 16 GiB; inf: no limit), or "
                         f"None for the device's memory.")
    return float(memory_budget)


def search(cm, memory_budget=None, *, method="auto", time_limit=TIME_LIMIT, tolerance=TOLERANCE):
    """Least-time plan under `memory_budget` (bytes per device; default: the
    profile's device memory), or among the plans within `tolerance` of its
    time, the fewest collective bytes (exact methods only; stats["least_time"]
    is the least time). `method`: "auto" (exhaustive up to
    `EXHAUSTIVE_LIMIT` plans, else branch and bound, or the sub-grid descent
    where the tables would exceed `TABLE_LIMIT`), "exhaustive",
    "branch_and_bound", "heuristic" (the branch and bound's incumbent) or
    "descent" (the sub-grid heuristic); the last two are for testing.
    Returns (masks per key, stats): stats["optimal"] says whether the plan
    is proven optimal under the model, stats["method"] how it was found,
    stats["why"] why not proven."""
    methods = ("auto", "exhaustive", "branch_and_bound", "heuristic", "descent")
    if method not in methods:
        raise ValueError(f"search: method {method!r} is not one of {', '.join(map(repr, methods))}.")
    t0 = time.perf_counter()
    deadline = t0 + time_limit
    budget = cm.mesh.profile.memory if memory_budget is None else check_budget(memory_budget)
    keys, options = search_space(cm)
    if not keys:   # no dim divides the mesh (scalars, odd sizes): the one plan replicates all
        masks = [0] * cm.n_keys
        cost = cm.evaluate(masks)
        if cost.memory > budget:
            no_plan_fits(cost.memory, budget)
        return masks, dict(candidates=1, searched_keys=[], method="exhaustive", optimal=True,
                           rank=0, time=cost.time, least_time=cost.time, memory=cost.memory,
                           seconds=time.perf_counter() - t0)
    size = math.prod(len(o) for o in options)
    why = None
    if method == "auto":
        method = "exhaustive" if size <= EXHAUSTIVE_LIMIT else "branch_and_bound"
        if method == "branch_and_bound" and table_entries(cm, keys, options) > TABLE_LIMIT:
            method, why = "descent", f"cost tables over {TABLE_LIMIT} entries"
    if method == "descent":
        masks, stats = subgrid_descent(cm, keys, options, budget, deadline, why or "forced")
    else:
        tab = Tables(cm, keys, options)
        if method == "exhaustive":
            idx, stats = _exhaustive(tab, budget, tolerance)
        else:
            idx, stats = BranchAndBound(tab, budget, deadline).run(method == "heuristic", tolerance)
        masks = tab.masks(idx)
    stats = dict(candidates=size, searched_keys=[cm.g.key_names[k] for k in keys], **stats,
                 seconds=time.perf_counter() - t0)
    return masks, stats


def _exhaustive(tab, budget, tolerance):
    if math.prod(tab.shape) > GRID_LIMIT:
        raise ValueError(f"search: {math.prod(tab.shape)} candidate plans exceed the exhaustive "
                         f"limit {GRID_LIMIT}; use method='auto' (branch and bound).")
    flat = tab.grid().ravel()
    order = np.argsort(flat, kind="stable")
    pos, mem, least = first_fit(tab, lambda a, b: np.array(np.unravel_index(order[a:b], tab.shape)),
                                len(order), budget)
    if pos is None:
        no_plan_fits(least, budget)
    least = float(flat[order[pos]])
    near = order[pos:np.searchsorted(flat[order], least * (1 + tolerance) * (1 + 1e-12), "right")]
    idx, t, mem = least_comm(tab, np.array(np.unravel_index(near, tab.shape)), budget, least,
                             tolerance, flat[near])
    return idx, dict(method="exhaustive", optimal=True, rank=pos, time=t, least_time=least, memory=mem)
