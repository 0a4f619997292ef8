"""Values a jaxpr computes at compile time, for `_sink_sum`'s factors.

`constant_value(producer, atom, consts)` evaluates an atom that depends only
on literals and closed-over consts, through a small budget of equations
whose eager result is the compiled program's (structural ops, or one
correctly rounded IEEE operation each); anything else is unknown (None).
`safe_factor(value, dtype)` says whether every element of such a value is
finite and normal, the condition under which `_sink_sum` may move a sum
past a product with it (its module doc says why).
"""

from __future__ import annotations

import jax
import numpy as np

from jaxbackend import _jax

# Compile-time factors: ops whose eager result is the compiled program's
# (structural, or one correctly rounded IEEE operation), in a small budget.
CONST_PRIMITIVES = frozenset("""
broadcast_in_dim reshape squeeze expand_dims transpose convert_element_type iota
neg abs add sub mul div max min
""".split())
CONST_EQNS = 16
CONST_SIZE = 1 << 16


def constant_value(producer, atom, consts):
    """numpy value of `atom` when the jaxpr computes it from literals and
    `consts` (constvar -> value) alone, within the budget of the module
    doc; None when it depends on a runtime value or is out of budget."""
    return _constant(producer, atom, consts, [CONST_EQNS])


def _constant(producer, atom, consts, budget):
    if atom.aval.size > CONST_SIZE:
        return None
    lit = _jax.literal_value(atom)
    if lit is not None:
        return lit
    if atom in consts:
        value = consts[atom]
        # a const captured from an enclosing trace is a tracer: not known here
        return None if _jax.is_tracer(value) else np.asarray(value)
    eqn = producer(atom)
    budget[0] -= 1
    if (eqn is None or budget[0] < 0 or eqn.primitive.name not in CONST_PRIMITIVES
            or eqn.effects or len(eqn.outvars) != 1):
        return None
    args = []
    for v in eqn.invars:
        x = _constant(producer, v, consts, budget)
        if x is None:
            return None
        args.append(x)
    # jb.jit runs the passes inside jax.jit's trace: evaluate eagerly anyway
    with jax.ensure_compile_time_eval():
        (out,) = _jax.bind_eqn(eqn, args)
    return np.asarray(out)


def safe_factor(value, dtype) -> bool:
    """Every element finite and normal (never inf, nan, 0 or subnormal:
    `_sink_sum`'s module doc), for a factor of float dtype `dtype`."""
    if value is None:
        return False
    mag = np.abs(np.asarray(value, dtype=dtype))
    return bool(np.all(np.isfinite(mag)) and np.all(mag >= np.finfo(dtype).tiny))
