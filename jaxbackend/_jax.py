"""The one module that touches JAX internals.

Everything jaxbackend needs beyond JAX's stable public API is imported or
wrapped here, so a JAX upgrade is a change to this file only. Each shim says
which JAX versions it was written against ("JAX 0.10" = checked on 0.10.2,
the version this project's CI installs; GPU machines carry 0.11).

Public-but-low-level modules (`jax.extend.core`, `jax.interpreters.*`) are
preferred over `jax._src`; where `jax._src` is unavoidable the reason is
written next to the import.
"""

from __future__ import annotations

import jax
from jax.extend import core as jex_core
from jax.interpreters import ad, batching, mlir


Primitive = jex_core.Primitive
ClosedJaxpr = jex_core.ClosedJaxpr
Jaxpr = jex_core.Jaxpr
JaxprEqn = jex_core.JaxprEqn
Literal = jex_core.Literal
Var = jex_core.Var
jaxpr_as_fun = jex_core.jaxpr_as_fun
check_jaxpr = jex_core.check_jaxpr

# `ShapedArray` is public via jax.core in JAX 0.10 (jax.extend.core lacks it).
from jax.core import ShapedArray  # noqa: E402


def define_primitive(name: str) -> Primitive:
    """A new primitive with a plain `bind`; rules are attached by the caller."""
    return Primitive(name)


def register_bilinear_ad(prim: Primitive, lhs_transpose, rhs_transpose) -> None:
    """JVP and transpose rules for a primitive linear in each of two operands.

    JAX 0.10: `ad.defbilinear(prim, lhs_rule, rhs_rule)`; each rule is called
    as `rule(cotangent, lhs, rhs, **params)` where the operand being
    transposed is an `UndefinedPrimal` carrying `.aval`.
    """
    ad.defbilinear(prim, lhs_transpose, rhs_transpose)


def register_batching(prim: Primitive, rule) -> None:
    """vmap rule `rule(axis_size, vals, dims, **params) -> (out, out_dim)`.

    JAX 0.10 changed batching-rule signatures: `fancy_primitive_batchers`
    rules receive `(axis_data, vals, dims, **params)`; the older
    `primitive_batchers` table is a shim marked for deletion, so we register
    with the new table and adapt here. Under vmap with no batched operand JAX
    never calls the rule.
    """

    def wrapped(axis_data, vals, dims, **params):
        return rule(axis_data.size, vals, dims, **params)

    batching.fancy_primitive_batchers[prim] = wrapped


def register_lowering_from_fun(prim: Primitive, fun) -> None:
    """MLIR lowering for `prim` by tracing `fun` (a jnp/lax function)."""
    mlir.register_lowering(prim, mlir.lower_fun(fun, multiple_results=False))


# ---------------------------------------------------------------------------
# passes / jit: jaxpr traversal internals (owner: passes, jaxbackend.jit).
# Checked on JAX 0.10.2. `Var(aval)` takes only the aval since JAX 0.7
# (JAX < 0.7: `Var(suffix, aval)`); `DropVar(aval)` likewise.
# ---------------------------------------------------------------------------

DropVar = jex_core.DropVar

# The `jit` primitive (named "pjit" before JAX 0.7) and the other call
# primitives whose body is a plain sub-jaxpr that may be inlined.
CALL_PRIMITIVES = frozenset({"jit", "pjit", "closed_call", "core_call"})
CUSTOM_DERIVATIVE_PRIMITIVES = frozenset({"custom_jvp_call", "custom_vjp_call"})


def new_var(aval) -> Var:
    """A fresh jaxpr variable of type `aval` (JAX 0.10: `Var(aval)`)."""
    return Var(aval)


def new_literal(value, aval) -> Literal:
    return Literal(value, aval)


def is_var(x) -> bool:
    return isinstance(x, Var)


def is_dropvar(x) -> bool:
    return isinstance(x, DropVar)


def is_closed_jaxpr(x) -> bool:
    return isinstance(x, ClosedJaxpr)


def is_open_jaxpr(x) -> bool:
    return isinstance(x, Jaxpr)


def check_closed_jaxpr(closed: ClosedJaxpr) -> None:
    """Type-check a ClosedJaxpr, sub-jaxprs included; raises JaxprTypeError.

    JAX 0.10: `jax.extend.core.check_jaxpr` checks the open jaxpr (constvars
    typed by their avals); we also check that each const matches its var.
    """
    check_jaxpr(closed.jaxpr)
    _check_scopes(closed.jaxpr, set())
    for v, c in zip(closed.jaxpr.constvars, closed.consts):
        shape, dtype = getattr(c, "shape", ()), getattr(c, "dtype", None)
        if tuple(shape) != tuple(v.aval.shape) or (dtype is not None and dtype != v.aval.dtype):
            raise TypeError(f"const for {v} has shape {shape} dtype {dtype}, expected {v.aval}")


def _check_scopes(jaxpr: Jaxpr, seen: set) -> None:
    """Every var read is bound earlier in its own jaxpr, every sub-jaxpr
    included (JAX 0.10's check_jaxpr leaves some sub-jaxprs to the typecheck
    rule of their primitive, which not all primitives have)."""
    if id(jaxpr) in seen:
        return
    seen.add(id(jaxpr))
    bound = set(jaxpr.constvars) | set(jaxpr.invars)
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if isinstance(v, Var) and v not in bound:
                raise TypeError(f"variable {v} read by {eqn.primitive} before it is bound")
        bound.update(eqn.outvars)
        for sub in jex_core.jaxprs_in_params(eqn.params):
            _check_scopes(sub, seen)
    for v in jaxpr.outvars:
        if isinstance(v, Var) and v not in bound:
            raise TypeError(f"output variable {v} is never bound")


def eval_jaxpr(closed: ClosedJaxpr, *args):
    """Evaluate `closed` by binding each equation in the current trace."""
    return jaxpr_as_fun(closed)(*args)


def sharding_is_unspecified(s) -> bool:
    """True for jit's `UnspecifiedValue` placeholder (JAX 0.10:
    `jax._src.named_sharding.UnspecifiedValue`; no public alias exists)."""
    return type(s).__name__ == "UnspecifiedValue"


def jaxpr_with(jaxpr: Jaxpr, *, eqns=None, outvars=None, constvars=None) -> Jaxpr:
    """`jaxpr` with new equations / outputs / constvars, same inputs, effects
    and debug info (JAX 0.10: `Jaxpr.replace`; changing outvars resets debug
    result names, which we do not use)."""
    kw = {}
    if eqns is not None:
        kw["eqns"] = eqns
    if outvars is not None:
        kw["outvars"] = outvars
    if constvars is not None:
        kw["constvars"] = constvars
    return jaxpr.replace(**kw)
jaxprs_in_params = jex_core.jaxprs_in_params


# --- passes.reroll (helper E) -------------------------------------------------
# JAX 0.10: `DropVar` (an unused equation output) is public in jax.extend.core.


def bind_eqn(eqn, invals):
    """Re-bind one jaxpr equation on new operands, as `jax.core.eval_jaxpr` does.

    JAX 0.10: `Primitive.get_bind_params(params)` returns the bind keyword
    params (call-like primitives convert their stored sub-jaxprs there; older
    JAX returned a (subfuns, params) pair). `eqn.ctx.manager` restores the
    equation's context (e.g. its compute type), as eval_jaxpr does."""
    params = eqn.primitive.get_bind_params(eqn.params)
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


# -- sharding (helper C): evaluate a jaxpr with a hook after each equation ------
# JAX 0.10: this is `jax._src.core.eval_jaxpr` (Primitive.get_bind_params +
# bind under the equation's context manager) with a callback, used to place
# `with_sharding_constraint` on named intermediates.

def eval_jaxpr_hooked(jaxpr, consts, args, hook):
    """Evaluate `jaxpr`; `hook(eqn, outs) -> outs` runs after each equation."""
    env = {}

    def read(v):
        return v.val if isinstance(v, Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        env.update(zip(eqn.outvars, hook(eqn, bind_eqn(eqn, [read(v) for v in eqn.invars]))))
    return [read(v) for v in jaxpr.outvars]


# --- passes.reroll: a scan equation around an existing block of equations ------
# JAX 0.10: `scan_p` is public in jax.extend.core.primitives. Its bind params
# are reverse, length, num_consts, num_carry, unroll, jaxpr (ClosedJaxpr over
# consts + carry + xs -> carry + ys); older JAX also had `linear` (one bool
# per operand) and `_split_transpose`. Rather than spell the set out, we copy
# the params of a scan JAX traces itself (once) and override the ones we set,
# so a param added by a later JAX keeps its default.
_SCAN_DEFAULTS: dict = {}


def new_jaxpr(invars, outvars, eqns) -> Jaxpr:
    """A constvar-free jaxpr over existing equations (JAX 0.10 constructor;
    effects: none, as rolled blocks never hold effectful equations)."""
    info = jex_core.DebugInfo("scan", "jaxbackend.passes.reroll block", (None,) * len(invars),
                              (None,) * len(outvars))
    return Jaxpr([], list(invars), list(outvars), list(eqns), debug_info=info)


def scan_bind(body: ClosedJaxpr, args, *, length: int, reverse: bool, num_consts: int,
              num_carry: int):
    """`scan_p.bind` of `body` on args = consts + carry + xs (no re-trace of body)."""
    from jax.extend.core.primitives import scan_p

    if not _SCAN_DEFAULTS:
        import jax.numpy as jnp

        j = jax.make_jaxpr(lambda c, xs: jax.lax.scan(lambda c, x: (c + x, x), c, xs))(
            jnp.float32(0), jnp.zeros(2, jnp.float32))
        _SCAN_DEFAULTS.update(j.jaxpr.eqns[0].params)
    params = dict(_SCAN_DEFAULTS, jaxpr=body, length=length, reverse=reverse,
                  num_consts=num_consts, num_carry=num_carry)
    if "linear" in params:
        params["linear"] = (False,) * len(args)
    return scan_p.bind(*args, **params)


# --- named.einsum: dot_general's dtype rule and its transpose's cast --------------
# The einsum primitive lowers to dot_general, so its result dtype and weak type
# must be dot_general's. JAX 0.10: `dot_general_p` is public in
# jax.extend.core.primitives; its `abstract_eval(lhs, rhs, **params)` returns
# `(aval, effects)` and takes the params dimension_numbers, precision,
# preferred_element_type and out_sharding.

def dot_general_out_aval(lhs_aval, rhs_aval, *, dimension_numbers, precision,
                         preferred_element_type):
    """The aval `lax.dot_general` gives for operands of these avals."""
    from jax.extend.core.primitives import dot_general_p

    aval, _ = dot_general_p.abstract_eval(
        lhs_aval, rhs_aval, dimension_numbers=dimension_numbers, precision=precision,
        preferred_element_type=preferred_element_type, out_sharding=None)
    return aval


def convert_element_type(x, dtype, weak_type: bool):
    """`x` cast to `dtype` with the given weak type, as dot_general's transpose
    rule casts a cotangent to its primal's type (JAX 0.10:
    `jax._src.lax.lax._convert_element_type`; the public
    `lax.convert_element_type` always clears weak_type)."""
    from jax._src.lax import lax as lax_internal

    return lax_internal._convert_element_type(x, dtype, weak_type,
                                              warn_on_complex_to_real_cast=False)


# --- testing.abs_scale: the sub-jaxprs and params of the equations it evaluates --
# JAX 0.10 param names: jit "jaxpr" (ClosedJaxpr); closed_call/core_call,
# custom_jvp_call, custom_vjp_call "call_jaxpr" (ClosedJaxpr, the primal);
# checkpoint ("remat2") "jaxpr" (open Jaxpr); scan "jaxpr" (ClosedJaxpr over
# consts + carry + xs) with num_consts, num_carry, length, reverse; cond
# "branches" (its first operand is the branch index).

def call_body(eqn) -> ClosedJaxpr | None:
    """The ClosedJaxpr a call-like equation (jit, closed_call, the primal of a
    custom_jvp/custom_vjp call, checkpoint) runs on its operands, else None."""
    name = eqn.primitive.name
    if name not in CALL_PRIMITIVES | CUSTOM_DERIVATIVE_PRIMITIVES | {"remat2", "checkpoint"}:
        return None
    body = eqn.params["call_jaxpr" if "call_jaxpr" in eqn.params else "jaxpr"]
    return body if is_closed_jaxpr(body) else ClosedJaxpr(body, ())


def scan_parts(eqn) -> tuple:
    """(body, num_consts, num_carry, length, reverse) of a `scan` equation."""
    p = eqn.params
    return p["jaxpr"], p["num_consts"], p["num_carry"], p["length"], p["reverse"]


def cond_branches(eqn) -> tuple:
    """The branch ClosedJaxprs of a `cond` equation (operand 0 picks one)."""
    return tuple(eqn.params["branches"])


def while_parts(eqn) -> tuple:
    """(cond, cond_nconsts, body, body_nconsts) of a `while` equation; its
    operands are cond consts + body consts + carry."""
    p = eqn.params
    return p["cond_jaxpr"], p["cond_nconsts"], p["body_jaxpr"], p["body_nconsts"]


def reduce_axes(eqn) -> tuple:
    """The reduced axes of a reduce_* / argmax / argmin equation."""
    return tuple(eqn.params["axes"])


def bind_eqn_as(eqn, invals, dtype):
    """`bind_eqn` on operands of float dtype `dtype` where the equation had
    others: a `preferred_element_type` (dot_general, einsum, conv) becomes
    `dtype` too, so the operands are accepted."""
    params = dict(eqn.params)
    if params.get("preferred_element_type") is not None:
        params["preferred_element_type"] = dtype
    params = eqn.primitive.get_bind_params(params)
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


# --- passes (structural keys, reroll + cse): function-valued params ------------
# JAX 0.10: functions stored in equation params are `lu.WrappedFun`s
# (custom_jvp_call's `jvp_jaxpr_fun`, custom_vjp_call's `fwd_jaxpr_thunk` and
# `bwd`; not callable, and their `__eq__` compares static args with `==`, so
# 1 == 1.0 == True) or plain callables (custom_vjp_call's `out_trees`, the
# callback primitives' `callback`). Printed, both show only a name.
# `JaxprEqn.ctx` (compute type, threefry mode, mesh, XLA metadata) is
# interned by JAX, so identity is equality.

from jax.extend import linear_util as _lu  # noqa: E402


def is_function_param(x) -> bool:
    """Is this equation parameter a function (comparable only by identity)?"""
    return callable(x) or isinstance(x, _lu.WrappedFun)


def eqn_context(eqn):
    """The equation's interned context object (part of what it computes)."""
    return eqn.ctx


def custom_jvp_rule(eqn):
    """(jvp Jaxpr, consts, out_zeros) of a `custom_jvp_call` equation's JVP
    rule traced with a nonzero tangent for every float operand, or None
    when that does not pin the rule down (`symbolic_zeros=True`: the rule may
    branch on which tangents are zero) or tracing fails.

    JAX 0.10: `jvp_jaxpr_fun.call_wrapped(*in_zeros)` (one bool per non-const
    operand) is what `custom_derivatives.lift_jvp` calls when differentiating
    the equation, and JAX's own dce rule calls it too; it is memoised, so AD
    later reuses this very trace."""
    import jax.numpy as jnp

    p = eqn.params
    if p.get("symbolic_zeros", True):
        return None
    avals = [v.aval for v in eqn.invars[p["num_consts"]:]]
    zeros = [not jnp.issubdtype(a.dtype, jnp.inexact) for a in avals]
    try:
        jaxpr, consts, out_zeros = p["jvp_jaxpr_fun"].call_wrapped(*zeros)
    except Exception:  # noqa: BLE001 -- any failure: the caller falls back to identity
        return None
    return jaxpr, list(consts), tuple(bool(z) for z in out_zeros)


# --- passes._sink_sum: values known at compile time ---------------------------
# JAX 0.10: a jaxpr `Literal` holds its value in `.val` (a numpy or Python
# scalar, for weak-typed literals too); its aval says the dtype.

def literal_value(atom):
    """The value of a jaxpr Literal as a numpy array of its aval's dtype;
    None for anything else (a variable)."""
    import numpy as np

    if not isinstance(atom, Literal):
        return None
    return np.asarray(atom.val, dtype=atom.aval.dtype)


def same_aval(a, b) -> bool:
    """Same shape, dtype and weak type (JAX 0.10: `ShapedArray.weak_type`;
    a weak type decides how a program's output promotes in later code)."""
    return (tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype
            and getattr(a, "weak_type", False) == getattr(b, "weak_type", False))


# --- primitive params read by the passes and the sharding graph ---------------
# JAX 0.10 names: transpose "permutation"; broadcast_in_dim "shape",
# "broadcast_dimensions", "sharding"; squeeze "dimensions"; reshape
# "new_sizes", "dimensions" (None unless the reshape also transposes),
# "sharding"; dot_general "dimension_numbers" ((lc, rc), (lb, rb)),
# "precision", "preferred_element_type", "out_sharding"; gather
# "dimension_numbers" (GatherDimensionNumbers: offset_dims,
# collapsed_slice_dims, operand_batching_dims, ...) and "slice_sizes"; scatter
# "dimension_numbers" (ScatterDimensionNumbers: update_window_dims,
# inserted_window_dims, operand_batching_dims, ...); concatenate "dimension".

def transpose_permutation(eqn) -> tuple:
    """The permutation of a `transpose` equation."""
    return tuple(int(d) for d in eqn.params["permutation"])


def broadcast_dimensions(eqn) -> tuple:
    """For `broadcast_in_dim`: the output axis of each operand axis."""
    return tuple(int(d) for d in eqn.params["broadcast_dimensions"])


def squeeze_dimensions(eqn) -> tuple:
    """The removed axes of a `squeeze` equation (may be negative)."""
    return tuple(int(d) for d in eqn.params["dimensions"])


def reshape_transposes(eqn) -> bool:
    """Does this `reshape` also permute its operand (`dimensions` set)?"""
    return eqn.params.get("dimensions") is not None


def dot_dimension_numbers(eqn) -> tuple:
    """((lhs_contract, rhs_contract), (lhs_batch, rhs_batch)) of a dot_general."""
    return eqn.params["dimension_numbers"]


def gather_parts(eqn) -> tuple:
    """(GatherDimensionNumbers, slice_sizes) of a `gather` equation."""
    return eqn.params["dimension_numbers"], tuple(eqn.params["slice_sizes"])


def scatter_dimension_numbers(eqn):
    """The ScatterDimensionNumbers of a scatter / scatter-add equation."""
    return eqn.params["dimension_numbers"]


def concatenate_dimension(eqn) -> int:
    """The axis a `concatenate` equation joins along."""
    return int(eqn.params["dimension"])


def has_sharding_annotation(eqn) -> bool:
    """Does the equation carry an explicit output sharding (JAX 0.10:
    `sharding` on broadcast_in_dim/reshape/iota, `out_sharding` on
    dot_general)? Rewriting it could drop that annotation."""
    return any(eqn.params.get(k) is not None for k in ("sharding", "out_sharding"))
