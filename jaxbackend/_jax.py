"""The one module that touches JAX internals.

Everything jaxbackend needs beyond JAX's stable public API is imported or
wrapped here, so a JAX upgrade is a change to this file only. Each shim says
which JAX versions it was written against ("JAX 0.10" = checked on 0.10.2,
the version this project's CI installs; GPU machines carry 0.11).

Public-but-low-level modules (`jax.extend.core`, `jax.interpreters.*`) are
preferred over `jax._src`; where `jax._src` is unavoidable the reason is
written next to the import.

What lives here, besides the imports: the closed/open jaxpr split
(`jaxpr_parts`, `jaxpr_rebuilt`, `sub_jaxprs`, `map_sub_jaxprs`), the
primitive taxonomy the passes share (`CALL_PRIMITIVES`, `ELEMENTWISE`,
`REDUCTIONS`, `NEVER_CSE`, ...), and every read of an equation's params by
name: accessors (`scan_parts`, `broadcast_dimensions`, ...) and builders of
a new equation's params (`reduce_params`, `dot_general_params`, ...). The
passes and the sharding graph index no param dict themselves.
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
# `trace_context` lives in jax._src.config only (JAX 0.10); see `trace_context`.
from jax._src import config as _config  # noqa: E402


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


def backends_created() -> bool:
    """Whether JAX has created its backends (its device clients), after which
    XLA_FLAGS are no longer read. JAX 0.10: `xla_bridge._backends`, the dict
    of created clients, filled on the first `jax.devices()` or computation;
    no public API says whether that happened."""
    from jax._src import xla_bridge

    return bool(xla_bridge._backends)


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
# `jax.checkpoint` binds "remat2" (printed `checkpoint`; "remat" in old JAX).
REMAT_PRIMITIVES = frozenset({"remat", "remat2", "checkpoint"})

# The primitive taxonomy the passes share. ELEMENTWISE: one output element
# from the same-index elements of the operands (scalars broadcast), so it
# commutes with broadcasting. REDUCTIONS: reduce `axes` of one operand.
ELEMENTWISE = frozenset("""
neg exp exp2 log log1p expm1 sqrt rsqrt cbrt tanh logistic sin cos tan asin acos atan
sinh cosh asinh acosh atanh abs sign floor ceil round integer_pow square
convert_element_type erf erfc erf_inv lgamma digamma not is_finite reduce_precision
add sub mul div max min pow atan2 rem and or xor eq ne lt le gt ge add_any nextafter
select_n
""".split())
REDUCTIONS = frozenset("reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or".split())
# params never hold a jaxpr (not scatter: its `update_jaxpr` is one)
_FLAT_PRIMITIVES = ELEMENTWISE | REDUCTIONS | frozenset(
    """reshape squeeze expand_dims broadcast_in_dim slice dynamic_slice dynamic_update_slice
    concatenate transpose dot_general iota pad rev copy copy_p gather""".split())
# Never merged even without declared effects: each call is meant to be
# distinct (remat's prevent_cse, optimization barriers, stateful RNG ops).
NEVER_CSE = REMAT_PRIMITIVES | frozenset({"optimization_barrier", "random_seed", "random_wrap",
                                          "rng_uniform", "rng_bit_generator"})


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


def is_tracer(x) -> bool:
    """A value of an enclosing trace (jb.jit runs the passes inside jax.jit's
    trace), not known at compile time (JAX 0.10: `jax.core.Tracer`)."""
    return isinstance(x, jax.core.Tracer)


def forwards(new, old) -> bool:
    """Whether the traced value `new` is `old` itself, passed through call-
    like equations (checkpoint, jit, closed_call, custom_jvp/vjp calls)
    whose bodies return that operand unchanged: a Flax NNX transform
    (`nnx.remat`) writes every Variable of its module back, so a Param
    holds a new tracer of the same value. False wherever it cannot tell.
    JAX 0.10: a `DynamicJaxprTracer` has `.val` (its Var) and `.parent`,
    the `TracingEqn` making it (`in_tracers`, `outvars`, `primitive`,
    `params`); upstream may rename these: then this says False."""
    for _ in range(64):   # nested calls; a chain this deep is not a forward
        if new is old:
            return True
        eqn = getattr(new, "parent", None)
        if eqn is None:
            return False
        try:
            body = call_body(eqn)
            if body is None:
                return False
            inner = body.jaxpr.outvars[list(eqn.outvars).index(new.val)]
            if not is_var(inner) or inner not in body.jaxpr.invars:
                return False
            new = eqn.in_tracers[body.jaxpr.invars.index(inner)]
        except (AttributeError, ValueError, IndexError, KeyError):
            return False
    return False


# The closed/open split. JAX 0.10: a ClosedJaxpr is an open Jaxpr plus the
# values of its constvars; equation params hold sub-jaxprs of either kind
# (jit, scan, cond, custom calls: ClosedJaxpr; remat's: open Jaxpr),
# directly or in a tuple (cond's branches). Upstream JAX merges the two
# kinds: these helpers are what changes then.

def is_jaxpr(x) -> bool:
    return isinstance(x, (ClosedJaxpr, Jaxpr))


def jaxpr_parts(j) -> tuple:
    """(open jaxpr, list of consts) of a ClosedJaxpr; (j, None) for an open
    Jaxpr, which has nowhere to put a const."""
    return (j.jaxpr, list(j.consts)) if isinstance(j, ClosedJaxpr) else (j, None)


def open_jaxpr(j) -> Jaxpr:
    return j.jaxpr if isinstance(j, ClosedJaxpr) else j


def jaxpr_rebuilt(j, jaxpr: Jaxpr, consts=()):
    """`jaxpr` as the kind `j` is: with `consts` if j is closed; an open j
    takes no consts."""
    if isinstance(j, ClosedJaxpr):
        return ClosedJaxpr(jaxpr, list(consts))
    assert not consts, "an open jaxpr cannot hold consts"
    return jaxpr


def as_closed(j) -> ClosedJaxpr:
    """j, or the const-free ClosedJaxpr of an open j."""
    return j if isinstance(j, ClosedJaxpr) else ClosedJaxpr(j, [])


# JAX 0.10: `partial_eval.dce_jaxpr` is the dead-code elimination jit runs
# itself (partial evaluation, remat). Its per-primitive rules (`dce_rules`)
# prune unused outputs and inputs of `scan`, `while`, `cond`, `jit` and
# custom-derivative equations, rewriting their bodies to match; the default
# rule drops an effect-free equation none of whose outputs is read.
# `instantiate=True` keeps every input of the jaxpr itself.
from jax.interpreters import partial_eval as _pe  # noqa: E402


def dce_keeping_signature(j):
    """`j` with dead code removed by JAX's own rules, sub-jaxpr signatures
    included (a `scan` output nobody reads goes, and so does its stacking in
    the body); `j`'s own inputs and outputs stay."""
    jaxpr, consts = jaxpr_parts(j)
    new, _ = _pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars), instantiate=True)
    return jaxpr_rebuilt(j, new, consts or ())


def has_sub_jaxprs(eqn) -> bool:
    """Does a param of `eqn` hold a (Closed)Jaxpr, directly or in a tuple?"""
    # Fastest path: element-wise ops and reductions (most of a training step's
    # equations) have fixed params, none a jaxpr. Then: most params are ints,
    # dtypes or tuples of ints.
    if eqn.primitive.name in _FLAT_PRIMITIVES:
        return False
    for p in eqn.params.values():
        if isinstance(p, (ClosedJaxpr, Jaxpr)) or (
                type(p) is tuple and any(isinstance(q, (ClosedJaxpr, Jaxpr)) for q in p)):
            return True
    return False


def sub_jaxprs(eqn) -> list:
    """The open jaxprs in `eqn`'s params (a ClosedJaxpr's own `.jaxpr`)."""
    return list(jaxprs_in_params(eqn.params)) if has_sub_jaxprs(eqn) else []


def map_sub_jaxprs(eqn, fn):
    """`eqn` with each sub-jaxpr param value j (a ClosedJaxpr or Jaxpr,
    directly or in a tuple) replaced by `fn(j)`, of j's kind and types; the
    same equation object when fn returns every j itself."""
    if not has_sub_jaxprs(eqn):
        return eqn

    def sub(value):
        if isinstance(value, tuple):
            new = tuple(sub(v) for v in value)
            return value if all(a is b for a, b in zip(new, value)) else new
        return fn(value) if isinstance(value, (ClosedJaxpr, Jaxpr)) else value

    params = eqn.params
    new = {k: sub(p) for k, p in params.items()}
    return eqn if all(new[k] is params[k] for k in params) else eqn.replace(params=new)


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


def trace_context() -> tuple:
    """The JAX config values a trace depends on (x64, matmul precision, ...),
    hashable: what JAX's own trace caches key on besides the arguments
    (`jax._src.config.trace_context`, JAX 0.10: no public alias)."""
    return _config.trace_context()


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


# --- re-binding an equation (passes, testing) -----------------------------------


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


# --- sharding: evaluate a jaxpr with a hook after each equation -----------------
# JAX 0.10: this is `jax._src.core.eval_jaxpr` (Primitive.get_bind_params +
# bind under the equation's context manager) with a callback, used to place
# `with_sharding_constraint` on named intermediates.

def eval_jaxpr_hooked(jaxpr, consts, args, hook, enter=None, instead=None):
    """Evaluate `jaxpr`; `hook(eqn, outs) -> outs` runs after each equation.
    A `scan` equation for which `enter(eqn)` is true is bound with its body
    re-traced through this evaluator, so the hook runs inside the body too
    (once per body equation, at trace time; the loop stays a loop).
    `instead(eqn, invals)`, where it returns a list, gives the equation's
    outputs in place of binding it."""
    env = {}

    def read(v):
        return v.val if isinstance(v, Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        outs = None if instead is None else instead(eqn, invals)
        if outs is not None:
            pass
        elif enter is not None and eqn.primitive.name == "scan" and enter(eqn):
            outs = _scan_hooked(eqn, invals, hook, enter, instead)
        else:
            outs = bind_eqn(eqn, invals)
        env.update(zip(eqn.outvars, hook(eqn, outs)))
    return [read(v) for v in jaxpr.outvars]


def _scan_hooked(eqn, invals, hook, enter, instead=None):
    body, n_consts, n_carry, length, reverse = scan_parts(eqn)
    inner, inner_consts = jaxpr_parts(body)
    specs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type)
             for v in inner.invars]
    new = jax.make_jaxpr(lambda *xs: eval_jaxpr_hooked(inner, inner_consts, xs, hook, enter,
                                                     instead))(
        *specs)
    return list(scan_bind(new, invals, length=length, reverse=reverse, n_consts=n_consts,
                          n_carry=n_carry))


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
    names_in, names_out = (None,) * len(invars), (None,) * len(outvars)
    info = jex_core.DebugInfo("scan", "jaxbackend.passes.reroll block",
                              names_in, names_out)  # type: ignore[arg-type]
    return Jaxpr([], list(invars), list(outvars), list(eqns), debug_info=info)


def scan_bind(body: ClosedJaxpr, args, *, length: int, reverse: bool, n_consts: int,
              n_carry: int):
    """`scan_p.bind` of `body` on args = n_consts consts + n_carry carry + xs
    (no re-trace of body)."""
    from jax.extend.core.primitives import scan_p

    if not _SCAN_DEFAULTS:
        import jax.numpy as jnp

        j = jax.make_jaxpr(lambda c, xs: jax.lax.scan(lambda c, x: (c + x, x), c, xs))(
            jnp.float32(0), jnp.zeros(2, jnp.float32))
        _SCAN_DEFAULTS.update(j.jaxpr.eqns[0].params)
    params = dict(_SCAN_DEFAULTS, jaxpr=body, length=length, reverse=reverse,
                  num_consts=n_consts, num_carry=n_carry)
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
    if name not in CALL_PRIMITIVES | CUSTOM_DERIVATIVE_PRIMITIVES | REMAT_PRIMITIVES:
        return None
    body = eqn.params["call_jaxpr" if "call_jaxpr" in eqn.params else "jaxpr"]
    return body if is_closed_jaxpr(body) else ClosedJaxpr(body, ())


def constraint_axes(eqn) -> tuple | None:
    """A `sharding_constraint` equation's layout as (the mesh's axis names,
    {operand axis: its PartitionSpec entry (None, a mesh axis name or a
    tuple of them)} for every axis it constrains), or None when it is no
    NamedSharding (a layout the plan cannot read). JAX 0.10:
    params["sharding"] is the NamedSharding given to
    `with_sharding_constraint`; `PartitionSpec.UNCONSTRAINED` marks an
    axis left to XLA, and a spec shorter than the operand's rank leaves the
    rest unsharded."""
    s = eqn.params.get("sharding")
    spec, mesh = getattr(s, "spec", None), getattr(s, "mesh", None)
    if spec is None or mesh is None:
        return None
    entries = tuple(spec) + (None,) * (len(eqn.invars[0].aval.shape) - len(spec))
    return tuple(mesh.axis_names), {a: e for a, e in enumerate(entries)
                                    if e is not jax.sharding.PartitionSpec.UNCONSTRAINED}


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


def half_float_name(dtype):
    """"bfloat16" or "float16" for those dtypes, else None (by name: PRNG
    keys' extended dtypes and NumPy's alike have one)."""
    name = getattr(dtype, "name", None)
    return name if name in ("bfloat16", "float16") else None


# Primitives whose every result entry reads the whole of some axes of the
# operands, and the param naming them (JAX 0.10; `top_k` took the last axis
# before its `axis` param existed; `fft` works on its trailing
# len(fft_lengths) axes).
_ALONG = {"cumsum": "axis", "cumprod": "axis", "cummax": "axis", "cummin": "axis",
          "cumlogsumexp": "axis", "top_k": "axis", "approx_top_k": "reduction_dimension",
          "sort": "dimension", "rev": "dimensions", "fft": "fft_lengths"}
ALONG_AXES = frozenset(_ALONG)


def along_axes(eqn) -> tuple:
    """The axes an `ALONG_AXES` equation works along (non-negative)."""
    rank = len(eqn.invars[0].aval.shape)
    if eqn.primitive.name == "fft":
        return tuple(range(rank - len(eqn.params["fft_lengths"]), rank))
    a = eqn.params.get(_ALONG[eqn.primitive.name], -1)
    return tuple(x % rank for x in (a if isinstance(a, (tuple, list)) else (a,)))


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


def conv_dims(eqn) -> tuple:
    """(lhs, rhs, out) axis specs and (feature_group_count, batch_group_count)
    of a conv_general_dilated: lhs (batch, feature, spatial...), rhs
    (out feature, in feature, window...), out (batch, feature, spatial...)
    (`lax.ConvDimensionNumbers`, always bound as one)."""
    dn = eqn.params["dimension_numbers"]
    return ((tuple(dn.lhs_spec), tuple(dn.rhs_spec), tuple(dn.out_spec)),
            (eqn.params["feature_group_count"], eqn.params["batch_group_count"]))


def gather_parts(eqn) -> tuple:
    """(GatherDimensionNumbers, slice_sizes) of a `gather` equation."""
    return eqn.params["dimension_numbers"], tuple(eqn.params["slice_sizes"])


def scatter_dimension_numbers(eqn):
    """The ScatterDimensionNumbers of a scatter / scatter-add equation."""
    return eqn.params["dimension_numbers"]


def split_parts(eqn) -> tuple:
    """(sizes, axis) of a `split` equation (`lax.split`, JAX >= 0.4.36)."""
    return tuple(int(n) for n in eqn.params["sizes"]), int(eqn.params["axis"])


def concatenate_dimension(eqn) -> int:
    """The axis a `concatenate` equation joins along."""
    return int(eqn.params["dimension"])


def has_sharding_annotation(eqn) -> bool:
    """Does the equation carry an explicit output sharding (JAX 0.10:
    `sharding` on broadcast_in_dim/reshape/iota, `out_sharding` on
    dot_general)? Rewriting it could drop that annotation."""
    return any(eqn.params.get(k) is not None for k in ("sharding", "out_sharding"))


# --- params the passes read or rebuild -------------------------------------
# Passes never spell a param name: they read through the accessors above and
# build new equations' params with these (JAX 0.10 names: reduce_* "axes",
# "out_sharding"; mul/div "out_dtype"; call "in_shardings"/"out_shardings";
# custom_jvp_call "jvp_jaxpr_fun"; names above for the others).

def eqn_params(eqn) -> dict:
    """A copy of `eqn`'s params, to bind its primitive again unchanged
    (`eqn.primitive.bind(*args, **eqn_params(eqn))`)."""
    return dict(eqn.params)


def params_key(params: dict):
    """A hashable key of bind params, or None when a value is unhashable."""
    key = tuple(sorted(params.items()))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def param_items(eqn) -> list:
    """(name, value) of every param of `eqn`, sorted by name."""
    return sorted(eqn.params.items())


def reduce_params(eqn, axes) -> dict:
    """The params of a reduction like `eqn` (a reduce_*) over `axes`."""
    return dict(eqn.params, axes=tuple(axes))


def broadcast_params(eqn, dims) -> dict:
    """The params of `eqn` (a broadcast_in_dim: its shape and sharding) with
    operand axes mapped to output axes `dims`."""
    p = eqn.params
    return dict(shape=tuple(p["shape"]), broadcast_dimensions=tuple(dims),
                sharding=p.get("sharding"))


def dot_options(eqn) -> dict:
    """Precision and accumulation dtype of a dot_general / einsum `eqn`, as
    keywords of `lax.dot_general` and of `named._einsum.einsum`."""
    p = eqn.params
    return dict(precision=p.get("precision"),
                preferred_element_type=p.get("preferred_element_type"))


def dot_general_params(eqn, dimension_numbers) -> dict:
    """The params of a dot_general like `eqn` (its precision, accumulation
    dtype and output sharding) contracting per `dimension_numbers`."""
    return dict(dot_options(eqn), dimension_numbers=dimension_numbers,
                out_sharding=eqn.params.get("out_sharding"))


def has_out_dtype(eqn) -> bool:
    """Does a binary op `eqn` set an explicit result dtype (`out_dtype`)?"""
    return eqn.params.get("out_dtype") is not None


def call_has_shardings(eqn) -> bool:
    """Are a call's `in_shardings`/`out_shardings` set (not jit's default)?"""
    return not all(sharding_is_unspecified(s)
                   for k in ("in_shardings", "out_shardings") for s in eqn.params.get(k, ()))


def custom_vjp_bwd_function(eqn):
    """The Python function a `custom_vjp_call` equation's backward rule is
    (compare by identity), else None. JAX 0.10: `params["bwd"]` is a
    `linear_util.WrappedFun` whose `.f` is the function given to `defvjp`."""
    if eqn.primitive.name != "custom_vjp_call":
        return None
    return getattr(eqn.params.get("bwd"), "f", None)


def custom_jvp_rule_fun(eqn):
    """The JVP rule function stored in a `custom_jvp_call` equation's params
    (compared via `custom_jvp_rule`), else None."""
    return eqn.params.get("jvp_jaxpr_fun") if eqn.primitive.name == "custom_jvp_call" else None


def einsum_dims(eqn) -> tuple:
    """(lhs_dims, rhs_dims, out_dims) of a `named._einsum` einsum equation.
    The einsum primitive is ours; its params are read here so that no pass
    or sharding rule indexes an equation's param dict."""
    p = eqn.params
    return tuple(p["lhs_dims"]), tuple(p["rhs_dims"]), tuple(p["out_dims"])


# --- where an equation came from (plan names, explain) -------------------------
# JAX 0.10: `eqn.source_info.traceback` is the traceback at trace time;
# `source_info_util.user_frame` skips JAX's own frames. No public accessor.

def source_frame(eqn) -> tuple[str, str, int] | None:
    """(full path, function name, line) of the user code that made the
    equation, or None: the path tells an equation one of jaxbackend's own
    passes emitted."""
    from jax._src import source_info_util

    frame = source_info_util.user_frame(getattr(eqn.source_info, "traceback", None))
    return None if frame is None else (frame.file_name, frame.function_name, frame.start_line)


# --- passes.group_heads: jnp.tile's primitive ------------------------------------
# JAX 0.10: `jnp.tile` binds a `tile` primitive whose param "reps" is one
# repeat count per operand axis (out axis a = reps[a] copies of the operand,
# copy index major).

def tile_reps(eqn) -> tuple:
    """The per-axis repeat counts of a `tile` equation."""
    return tuple(int(r) for r in eqn.params["reps"])


# --- explain: every user frame of an equation ------------------------------------
# JAX 0.10: `source_info_util.user_frames(traceback)` yields Frame records
# (file_name, function_name, start_line, ...) innermost first, lazily, with
# JAX's own and the stdlib's frames left out.

def user_frames(eqn):
    """(file path, line, function) of each frame outside JAX and the stdlib
    that was on the stack when `eqn` was traced, innermost first (lazily)."""
    from jax._src import source_info_util

    tb = getattr(eqn.source_info, "traceback", None)
    return ((f.file_name, f.start_line, f.function_name)
            for f in source_info_util.user_frames(tb))
