"""`dce`: dead-code elimination.

Precondition: any ClosedJaxpr.

Invariant established: in every (sub-)jaxpr, every effect-free equation has
at least one output that is read (by a later equation or as a jaxpr output),
and no `scan`/`while`/`cond`/`jit` equation has an output nobody reads or an
input its body does not read (a loop carry stays while the loop reads it).
Two steps, each linear in the number of equations:
1. JAX's own dead-code elimination (`_jax.dce_keeping_signature`: the DCE
   `jax.jit` runs in partial evaluation) prunes the signatures of loops and
   calls, with their bodies. This is what matters after `reroll`: the
   forward scan of an AD program stacks per-layer residuals for the backward
   scan, and one the backward body never reads (a broadcast constant, say)
   would otherwise stay a stacked output of L x its size, which XLA removes
   and the sharding memory model would count.
2. One backward sweep per jaxpr (a reverse walk marks what is live, so
   chains of dead code go in one sweep) counts what is still dead and drops
   unused constvars.

Leaves alone: equations with effects (kept even when unread) and the
program's own inputs and outputs (unused inputs stay: the signature is the
caller's).

When it preserves `jax.jit`'s results: always, exactly. It only removes
equations that have no effects and whose outputs nothing reads, and loop or
call outputs nothing reads together with the body code that only they
needed, so every read output is computed by the same equations from the same
inputs, with the same shapes, dtypes and weak types. (An unread equation
that would have overflowed or produced nan cannot change an output: nothing
reads it.)

Not a rule table: liveness flows backwards, which the forward rule driver
cannot express. The backward sweep runs under the shared traversal instead
(`_rewrite.transform` per jaxpr, `_rewrite.map_subjaxprs` into sub-jaxprs,
once per distinct object).
"""

from __future__ import annotations

import collections

from jaxbackend import _jax
from jaxbackend.passes import _rewrite


def _sweep(jaxpr, b, subs, stats):
    """One backward sweep over `jaxpr` into builder `b`: the new outvars, or
    None when nothing changed (no equation, sub-jaxpr or const dropped)."""
    live = {v for v in jaxpr.outvars if _jax.is_var(v)}
    kept = []
    changed = False
    for eqn in reversed(jaxpr.eqns):
        if not eqn.effects and not any(v in live for v in eqn.outvars):
            changed = True
            stats["dead removed"] += 1
            continue
        new = subs(eqn)
        changed |= new is not eqn
        kept.append(new)
        for v in new.invars:
            if _jax.is_var(v):
                live.add(v)
    if b.closed:   # an open jaxpr's constvars are its caller's
        b.dropped_constvars.update(v for v in jaxpr.constvars if v not in live)
        changed |= bool(b.dropped_constvars)
    if not changed:
        return None
    for eqn in reversed(kept):
        b.append(eqn)
    return list(jaxpr.outvars)


def dce(closed):
    """Remove dead effect-free equations everywhere (see module doc)."""
    memo: dict = {}
    stats: collections.Counter = collections.Counter()

    def sub(j):
        return _rewrite.transform(j, lambda jaxpr, b: _sweep(jaxpr, b, subs, stats))

    def subs(eqn):
        return _rewrite.map_subjaxprs(eqn, memo, sub)

    eqns, outs = _sizes(closed)
    closed = _jax.dce_keeping_signature(closed)
    eqns_after, outs_after = _sizes(closed)
    # (a body shared by two equations may come back as two copies: clamp)
    stats["dead removed"] += max(0, eqns - eqns_after)
    stats["loop/call outputs removed"] += max(0, outs - outs_after)
    out = sub(closed)
    _rewrite.record_stats(stats)
    return out


def _sizes(closed) -> tuple:
    """(equations, outputs of loop/call equations), sub-jaxprs included: one walk."""
    eqns = outs = 0
    for e in _rewrite.iter_eqns(closed):
        eqns += 1
        if _jax.has_sub_jaxprs(e):
            outs += len(e.outvars)
    return eqns, outs
