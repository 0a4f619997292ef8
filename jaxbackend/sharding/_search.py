"""Exact search over plans: one mesh-axis group per key, least modelled step
time, within a memory budget.

Precondition: a `CostModel`. The space: each key that some input argument
holds (a dim name, or a tied group of unnamed dims) of size > 1 may take any
group of mesh axes (a subset, in mesh order) whose size divides it; other
keys stay unsharded. Exactness without enumerating plans one by one: the
modelled time is a sum over distinct ops, each depending on the few keys it
touches, so each op is evaluated once, vectorised over a grid of its keys'
options, and broadcast-added into the grid of all plans (numpy does the
product). Memory is not a sum (it is a peak), so candidates are checked in
order of time, a batch at a time, and the first that fits wins. Ties break
by grid order (fewer and earlier mesh axes first): deterministic.

It leaves the graph and the model alone; `Plan` (plan.py) turns the chosen
masks into rules, shardings and a compiled function.
"""

from __future__ import annotations

import math

import numpy as np

GRID_LIMIT = 1 << 24
GiB = 1024 ** 3


class NoPlanFits(ValueError):
    """No plan fits the memory budget."""


def search_space(cm):
    """(searched keys, options per key as mask arrays)."""
    g, mesh = cm.g, cm.mesh
    held = {k for v in g.invars for k in cm.var_keys[v]}
    keys, options = [], []
    for k in range(cm.n_keys):
        if k not in held or g.key_size[k] <= 1:
            continue
        opts = [m for m in range(1 << len(mesh.axis_names))
                if mesh.group_size[m] == 1 or g.key_size[k] % int(mesh.group_size[m]) == 0]
        if len(opts) > 1:
            keys.append(k)
            options.append(np.array(opts, np.int64))
    return keys, options


def _grid_masks(cm, keys, options):
    masks = [np.zeros((1,) * len(keys), np.int64) for _ in range(cm.n_keys)]
    for j, (k, opts) in enumerate(zip(keys, options)):
        shape = [1] * len(keys)
        shape[j] = len(opts)
        masks[k] = opts.reshape(shape)
    return masks


def time_grid(cm, keys, options):
    """Modelled step time of every plan in the grid (one axis per key)."""
    shape = tuple(len(o) for o in options)
    size = math.prod(shape)
    if size > GRID_LIMIT:
        raise ValueError(f"search: {size} candidate plans ({len(keys)} dims x options {shape}) exceed "
                         f"the exhaustive limit {GRID_LIMIT}; fix some dims with rules=... or use a mesh "
                         f"with fewer axes.")
    masks = _grid_masks(cm, keys, options)
    total = np.zeros(shape)
    extras = []
    for sig, mult in cm.sigs:
        t, _, ex = cm.op_cost(sig, masks)
        extras.append(ex)
        total += mult * t
    total += cm._gathers(extras, masks, False)[0]
    return total


def _masks_at(cm, keys, options, flat_idx):
    idx = np.unravel_index(flat_idx, tuple(len(o) for o in options))
    masks = [np.zeros(len(flat_idx), np.int64) for _ in range(cm.n_keys)]
    for j, k in enumerate(keys):
        masks[k] = options[j][idx[j]]
    return masks


def search(cm, memory_budget=None, batch=4096):
    """Least-time plan under `memory_budget` (bytes per device; default: the
    profile's device memory). Returns (masks per key, stats)."""
    budget = cm.mesh.profile.memory if memory_budget is None else float(memory_budget)
    keys, options = search_space(cm)
    total = time_grid(cm, keys, options)
    flat = total.ravel()
    order = np.argsort(flat, kind="stable")
    best_mem = np.inf
    s, size = 0, 64   # the cheapest plans usually fit: check few first, then more
    while s < len(order):
        idx = order[s:s + size]
        masks = _masks_at(cm, keys, options, idx)
        fixed, temp = cm.memory(masks)
        mem = np.broadcast_to(fixed + temp, idx.shape)
        fits = np.nonzero(mem <= budget)[0]
        best_mem = min(best_mem, float(mem.min()))
        if len(fits):
            i = idx[fits[0]]
            chosen = [int(m[fits[0]]) for m in masks]
            return chosen, dict(candidates=int(flat.size), searched_keys=[cm.g.key_names[k] for k in keys],
                                rank=int(s + fits[0]), time=float(flat[i]), memory=float(mem[fits[0]]))
        s, size = s + size, min(size * 8, batch)
    raise NoPlanFits(
        f"sharding.search: no plan fits the memory budget: the smallest plan needs "
        f"{best_mem / GiB:.3f} GiB per device, budget {budget / GiB:.3f} GiB, short by "
        f"{(best_mem - budget) / GiB:.3f} GiB; raise memory_budget, use more devices, or shrink "
        f"the batch.")
