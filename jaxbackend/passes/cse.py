"""`cse`: common-subexpression elimination.

Precondition: any ClosedJaxpr.

Invariant established: within each (sub-)jaxpr, no two effect-free equations
have the same primitive, the same parameters and the same inputs (after
earlier duplicates were merged); a later duplicate's outputs are replaced by
the first one's. AD of named code repeats work this removes (e.g. the same
`broadcast_in_dim` of a mask or the same transposed weight, once per use).

"Same parameters" is decided structurally (`_rewrite.StructuralKeys`):
sub-jaxprs by structure and const values, function-valued parameters
(custom_vjp rules, callbacks) by identity, never by printed text, so two
calls that print alike but run different Python functions stay apart.

Leaves alone: equations with effects (random state, I/O, ordered effects),
`remat` bodies' duplicates of the outer program (a sub-jaxpr is its own
scope: nothing crosses a sub-jaxpr boundary, so rematerialisation stays
intact), the number and type of the jaxpr's outputs. Dead duplicates are
left for `dce`.

Linear: one dict lookup per equation; each distinct sub-jaxpr is keyed once.
Literal inputs are keyed by value, so `mul x 2.0` twice is one equation.
"""

from __future__ import annotations

import functools

from jaxbackend import _jax
from jaxbackend.passes import _rewrite



def _key(keys, eqn):
    """Hashable identity of what an equation computes, or None. Parameters
    and sub-jaxprs are keyed by structure (`_rewrite.StructuralKeys`: a
    function-valued parameter, such as a custom_vjp `bwd` or a callback, by
    identity), never by printed text; inputs are the variables themselves,
    literals by aval and bytes (0.0 and -0.0, NaN payloads, differ)."""
    # `_jax.NEVER_CSE`: each call meant to be distinct (remat's prevent_cse,
    # optimization barriers; random key splits are pure and may merge)
    if eqn.effects or eqn.primitive.name in _jax.NEVER_CSE:
        return None
    return (eqn.primitive, tuple(keys.atom(a) for a in eqn.invars), keys.params(eqn))


def _rule(keys, ctx, eqn):
    key = _key(keys, eqn)
    if key is None:
        return None
    # `ctx.local` belongs to one walk of one (sub-)jaxpr: each is its own scope
    seen = ctx.local.setdefault("cse", {})
    first = seen.get(key)
    if first is None:
        seen[key] = eqn.outvars
        return None
    if any(_jax.is_dropvar(v) for v in first):
        seen[key] = eqn.outvars  # the first's outputs were dropped: keep this one
        return None
    ctx.count("duplicate removed")
    return list(first)


def cse(closed):
    """Merge duplicate effect-free equations (see module doc)."""
    return _rewrite.rewrite(closed, {"*": functools.partial(_rule, _rewrite.StructuralKeys())})


def remaining(closed) -> int:
    """Duplicate equations left (same `_key` as an earlier one in its jaxpr)."""
    n, keys = 0, _rewrite.StructuralKeys()
    for jaxpr in _rewrite.iter_jaxprs(closed):
        seen = set()
        for eqn in jaxpr.eqns:
            key = _key(keys, eqn)
            if key is not None and not any(_jax.is_dropvar(v) for v in eqn.outvars):
                n += key in seen
                seen.add(key)
    return n
