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
unrolled); calls whose input or output shardings are set (inlining would
drop the user's sharding; their bodies are still flattened); a call
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
  primitive's own impl and lowering, and it receives the equation's params
  (precision and accumulation dtype included) unchanged, so the dot is the one
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
    kw = _jax.eqn_params(eqn)  # dims, precision and accumulation dtype
    key = ("einsum_to_dot_general", _jax.params_key(kw))
    out = ctx.emit(lambda a, b: einsum_to_dot_general(a, b, **kw), eqn.invars, key)
    _rewrite.same_types(eqn, out, "dot_general result")
    ctx.count("einsum->dot_general")
    return out


def _call_rule(ctx, eqn):
    if _jax.call_has_shardings(eqn):
        return None
    body = _jax.call_body(eqn)   # a ClosedJaxpr
    if body is None or len(_jax.open_jaxpr(body).invars) != len(eqn.invars):
        return None
    out = ctx.splice(body, eqn.invars)  # may decline (RewriteDeclined): count after
    ctx.count(f"inlined {eqn.primitive.name}")
    return out


def _custom_rule(ctx, eqn):
    body = _jax.call_body(eqn)   # the primal
    # JAX 0.10: the leading const operands are ordinary leading inputs of
    # the primal body, so operands map onto inputs in order.
    if body is None or len(_jax.open_jaxpr(body).invars) != len(eqn.invars):
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
    """What `inline` must leave at zero: equations its rule table matches
    (einsums and calls), by kind."""
    rules = _rules(einsum=True, differentiated=False)
    counts = {"einsum": 0, "call": 0}
    for eqn in _rewrite.iter_eqns(closed):
        name = eqn.primitive.name
        if name in rules:
            counts["einsum" if name == "einsum" else "call"] += 1
    return counts
