"""Seed cross-layer cotangent sums, so the first backward block is one more
copy of the others (part of `passes.reroll`).

A value that every layer reads but none makes (an encoder's output under
cross-attention, a conditioning vector, a shared table) gets its gradient
summed over the layers. JAX's backward pass writes the first contribution it
meets as it is and adds each later one to the sum (`add_any(sum, ct)`), so
the first backward block (the last layer's) has one `add_any` fewer than the
others and is no copy of them: `find_runs` rolls the rest and leaves that
block unrolled, and with it the last layer's weight gradients, which are then
no entry of the backward scan's stack (so the optimizer tail is not
vectorised either, `_reroll_vector`): compile time grows with depth again.

`seed(jaxpr, runs, keys, min_repeats)` looks at each found run for a carry
that block 0 updates as `add_any(carry, ·)` and whose initial value is an
`add_any` chain (operand 0 the running sum) whose head, the first
contribution, is made within one period before the run (the odd block). It
rewrites that head `h` as `add_any(z, h)`, `z` a broadcast -0.0 made before
everything, placed right after `h`'s producer (where the other blocks add
their first contribution to the sum), and reads the new value wherever `h`
was read. It then finds the runs again and keeps the seeded program only when
they cover more equations (else the caller keeps its runs and jaxpr).

Why the values stay the same: IEEE addition of -0.0 returns its other operand
unchanged for every real float (+0.0, -0.0, infinities and NaNs included;
+0.0 would turn a -0.0 into +0.0, which is why the seed is -0.0), so the
seeded sum is bit-identical, except that a subnormal head may be flushed to
zero where the backend flushes subnormal results (XLA:CPU does), as every
later contribution already is when added: a difference below float32's
smallest normal, within the float reassociation `reroll` allows. Only real
floating heads are seeded (a complex -0.0 seed has a +0.0 imaginary part);
the literal keeps its sign through `cse` (literals are keyed by their bytes).
"""

from __future__ import annotations

import numpy as np
from jax import lax

from jaxbackend import _jax
from jaxbackend.passes import _rewrite
from jaxbackend.passes._reroll_run import Carry, DepGraph


def _heads(jaxpr, runs) -> dict:
    """{head var: (producer index, the add_any to clone)} over all runs."""
    g = DepGraph(jaxpr)
    eqns = jaxpr.eqns
    heads: dict = {}
    for run in runs:
        lo = run.start - run.period
        for r, row in enumerate(run.template):
            link = eqns[run.start + r]
            if link.primitive.name != "add_any" or not row or type(row[0]) is not Carry:
                continue
            v = run.carry_init[row[0].c]
            d = g.defs.get(v)
            # walk the sum back to its first term, within the block before the run
            while d is not None and d[0] >= lo and eqns[d[0]].primitive.name == "add_any":
                v = eqns[d[0]].invars[0]
                d = g.defs.get(v) if _jax.is_var(v) else None
            if d is None or not lo <= d[0] < run.start or not _jax.is_var(v):
                continue
            dt = np.dtype(v.aval.dtype)
            if dt.kind != "f":
                continue
            heads.setdefault(v, (d[0], link))
    return heads


def _zero(shape, dtype):
    b = _rewrite.EqnBuilder(closed=False)
    (z,) = b.emit(lambda: lax.full(shape, -0.0, dtype), [], key=("reroll.seed", shape, dtype))
    return b.eqns, z


def seeded(jaxpr, runs):
    """(seeded jaxpr, number of heads seeded), or (None, 0) when no run has
    a cross-layer sum whose first term is made just before it."""
    heads = _heads(jaxpr, runs)
    if not heads:
        return None, 0
    zeros: dict = {}
    top: list = []
    after: dict = {}                       # producer index -> [(head, new eqn)]
    env: dict = {}
    for h, (p, link) in heads.items():
        key = (h.aval.shape, np.dtype(h.aval.dtype))
        if key not in zeros:
            eqns, zeros[key] = _zero(*key)
            top.extend(eqns)
        s = _jax.new_var(h.aval)
        after.setdefault(p, []).append(link.replace(invars=[zeros[key], h], outvars=[s]))
        env[h] = s
    new = list(top)
    for i, e in enumerate(jaxpr.eqns):
        if any(_jax.is_var(v) and v in env for v in e.invars):
            e = e.replace(invars=[env.get(v, v) if _jax.is_var(v) else v for v in e.invars])
        new.append(e)
        new.extend(after.get(i, ()))
    return _jax.jaxpr_with(jaxpr, eqns=new), len(heads)


def covered(runs) -> int:
    return sum(r.period * r.repeats for r in runs)
