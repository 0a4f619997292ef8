"""`dce`: dead-code elimination.

Precondition: any ClosedJaxpr.

Invariant established: in every (sub-)jaxpr, every effect-free equation has
at least one output that is read (by a later equation or as a jaxpr output);
dead effect-free equations are removed, one backward sweep per jaxpr (a
reverse walk marks what is live, so chains of dead code go in one sweep:
linear in the number of equations).

Leaves alone: equations with effects (kept even when unread), the jaxpr's
inputs and outputs (unused inputs stay: the signature is the caller's), and
the signatures of sub-jaxprs (an unused output of a `scan` or `jit` body is
kept, since the enclosing equation's type must not change; dead equations
*inside* the body are removed). Unused constvars are dropped.

When it preserves `jax.jit`'s results: always, exactly. It only removes
equations that have no effects and whose outputs nothing reads, so every
output is computed by the same equations from the same inputs, with the
same shapes, dtypes and weak types. (An unread equation that would have
overflowed or produced nan cannot change an output: nothing reads it.)

This is not a rule table: liveness flows backwards, which the forward
traversal of `_rewrite` cannot express, so it has its own small walker that
recurses into the same sub-jaxpr parameters.
"""

from __future__ import annotations

from jaxbackend import _jax
from jaxbackend.passes import _rewrite


def _dce_open(jaxpr, memo, stats):
    live = {v for v in jaxpr.outvars if _jax.is_var(v)}
    kept = []
    changed = False
    for eqn in reversed(jaxpr.eqns):
        if not eqn.effects and not any(v in live for v in eqn.outvars):
            changed = True
            stats["dead removed"] += 1
            continue
        new_params = _dce_params(eqn.params, memo, stats)
        if new_params is not None:
            eqn = eqn.replace(params=new_params)
            changed = True
        kept.append(eqn)
        for v in eqn.invars:
            if _jax.is_var(v):
                live.add(v)
    if not changed:
        return jaxpr, live
    kept.reverse()
    return _jax.jaxpr_with(jaxpr, eqns=kept), live


def _dce_params(params, memo, stats):
    new = {}
    changed = False
    for k, p in params.items():
        q = _dce_value(p, memo, stats) if _rewrite.has_jaxpr(p) else p
        changed |= q is not p
        new[k] = q
    return new if changed else None


def _dce_value(p, memo, stats):
    if isinstance(p, tuple):
        new = tuple(_dce_value(x, memo, stats) for x in p)
        return p if all(a is b for a, b in zip(new, p)) else new
    if _jax.is_closed_jaxpr(p) or _jax.is_open_jaxpr(p):
        hit = memo.get(id(p))
        if hit is None:
            hit = (p, _dce_any(p, memo, stats))
            memo[id(p)] = hit
        return hit[1]
    return p


def _dce_any(j, memo, stats):
    if _jax.is_closed_jaxpr(j):
        return _dce_closed(j, memo, stats)
    new, _ = _dce_open(j, memo, stats)
    return new


def _dce_closed(closed, memo, stats):
    jaxpr, live = _dce_open(closed.jaxpr, memo, stats)
    keep = [i for i, v in enumerate(jaxpr.constvars) if v in live]
    if jaxpr is closed.jaxpr and len(keep) == len(jaxpr.constvars):
        return closed
    constvars = [jaxpr.constvars[i] for i in keep]
    consts = [closed.consts[i] for i in keep]
    return _jax.ClosedJaxpr(_jax.jaxpr_with(jaxpr, constvars=constvars), consts)


def dce(closed):
    """Remove dead effect-free equations everywhere (see module doc)."""
    import collections

    stats = collections.Counter()
    out = _dce_closed(closed, {}, stats)
    _rewrite.record_stats(stats)
    return out
