"""The alpha-beta ring formulas for collectives, shared by the cost model
(`_cost`, what a plan should cost) and the HLO reader (`_hlo`, what the
compiled program's collectives cost), so the two are compared under one
model.

A collective over a group of `n` devices on a buffer of `S` bytes (the full
buffer: gathered for an all-gather, unreduced for a reduction), on links of
bandwidth `B` bytes/s and latency `a` seconds:

* all-reduce: 2(n-1)/n S/B + 2(n-1) a (a reduce-scatter, then an all-gather);
* all-gather, reduce-scatter, all-to-all: (n-1)/n S/B + (n-1) a;
* collective-permute: S/B + a (one hop).

With `rendezvous` (XLA:CPU's simulated devices: the collective is a
rendezvous of device threads, `_mesh.cpu_profile`) every kind pays (n-1) a.

Every argument may be a numpy array (one entry per candidate plan); n = 1
costs nothing.
"""

from __future__ import annotations

# The collectives the cost model charges, in the order its breakdown lists them.
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")


def ring_time(kind: str, n, full_bytes, bandwidth, latency, rendezvous: bool = False):
    """Seconds of one `kind` collective over `n` devices (formulas above)."""
    frac, steps = (n - 1) / n, n - 1
    if kind == "all-reduce":
        frac, steps = 2 * frac, (1 if rendezvous else 2) * steps
    elif kind == "collective-permute":
        frac, steps = 1.0, 1
    return frac * full_bytes / bandwidth + steps * latency
