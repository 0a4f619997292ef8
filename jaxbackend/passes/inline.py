"""`inline`: flatten a jaxpr for XLA: no `einsum`, no nested call.

Precondition: any ClosedJaxpr (named or plain).

Invariant established: no `einsum` equation and no call equation (`jit`,
`closed_call`, `core_call`) remains anywhere: at top level, inside loop and
branch bodies (`scan`, `while`, `cond`), inside `remat` and inside the
primal bodies of custom-derivative calls. Each einsum becomes the
`dot_general` (+ `transpose` only when its dim order needs it) that
`named._einsum.einsum_to_dot_general` builds; each call's body is spliced in
with fresh variables, at any depth (the sub-jaxpr is flattened first).

Leaves alone: loops, branches and `remat` (rewritten inside, never
unrolled); calls whose `in_shardings`/`out_shardings` are set (inlining
would drop the user's sharding; their bodies are still flattened); a call
with array constants inside a `remat` body, whose open jaxpr has nowhere to
put them (the splice declines; the body is still flattened);
`custom_jvp_call` / `custom_vjp_call` unless `differentiated=True`: inlining
them before AD would make AD differentiate the primal code instead of the
custom rule, so they are inlined only where differentiation is done.

`inline_calls` is the same pass with einsums kept, for the start of the
pipeline: later passes (fusion, sharding) want flat code that still has
names.

When it preserves `jax.jit`'s results: always, exactly.

* einsum -> dot_general: `einsum_to_dot_general` is also the einsum
  primitive's own impl and lowering, and it receives the equation's
  `precision` and `preferred_element_type` unchanged, so the dot is the one
  XLA would have run: same accumulation dtype (integer overflow included),
  same algorithm class. Checked: a replacement whose shape, dtype or weak
  type differs from the einsum's declared result is declined (the einsum
  then stays and is lowered by its own rule; this never happens for the
  einsums `named` builds, whose abstract eval is dot_general's).
* call inlining: the body's equations run on the same operands; nothing
  is recomputed, converted or reordered.
"""

from __future__ import annotations

from jaxbackend import _jax
from jaxbackend.named._einsum import einsum_to_dot_general
from jaxbackend.passes import _rewrite


def _einsum_rule(ctx, eqn):
    params = dict(eqn.params)  # precision and preferred_element_type included
    key = ("einsum_to_dot_general", tuple(sorted(params.items())))
    out = ctx.emit(lambda a, b: einsum_to_dot_general(a, b, **params), eqn.invars, key)
    _rewrite.same_types(eqn, out, "dot_general result")
    ctx.count("einsum->dot_general")
    return out


def _call_rule(ctx, eqn):
    params = eqn.params
    for k in ("in_shardings", "out_shardings"):
        if not all(_jax.sharding_is_unspecified(s) for s in params.get(k, ())):
            return None
    body = params.get("jaxpr", params.get("call_jaxpr"))
    if body is None:
        return None
    if _jax.is_open_jaxpr(body):
        body = _jax.ClosedJaxpr(body, ())
    if len(body.jaxpr.invars) != len(eqn.invars):
        return None
    out = ctx.splice(body, eqn.invars)  # may decline (RewriteDeclined): count after
    ctx.count(f"inlined {eqn.primitive.name}")
    return out


def _custom_rule(ctx, eqn):
    body = eqn.params.get("call_jaxpr")
    # JAX 0.10: the first `num_consts` operands are consts that call_jaxpr
    # takes as ordinary leading inputs, so operands map onto inputs in order.
    if body is None or len(body.jaxpr.invars) != len(eqn.invars):
        return None
    out = ctx.splice(body, eqn.invars)
    ctx.count(f"inlined {eqn.primitive.name}")
    return out


def _rules(*, einsum: bool, differentiated: bool) -> dict:
    rules = {name: _call_rule for name in _jax.CALL_PRIMITIVES}
    if einsum:
        rules["einsum"] = _einsum_rule
    if differentiated:
        rules.update({name: _custom_rule for name in _jax.CUSTOM_DERIVATIVE_PRIMITIVES})
    return rules


def inline(closed, *, differentiated: bool = False):
    """einsum -> dot_general and calls inlined, everywhere (see module doc)."""
    return _rewrite.rewrite(closed, _rules(einsum=True, differentiated=differentiated))


def inline_calls(closed, *, differentiated: bool = False):
    """Only the call inlining of `inline`: einsums (and their names) stay."""
    return _rewrite.rewrite(closed, _rules(einsum=False, differentiated=differentiated))


def remaining(closed) -> dict:
    """What `inline` must leave at zero: einsum and call equations, by kind."""
    counts = {"einsum": 0, "call": 0}
    for eqn in _rewrite.iter_eqns(closed):
        if eqn.primitive.name == "einsum":
            counts["einsum"] += 1
        elif eqn.primitive.name in _jax.CALL_PRIMITIVES:
            counts["call"] += 1
    return counts
