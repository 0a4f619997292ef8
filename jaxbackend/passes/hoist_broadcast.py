"""`hoist_broadcast`: do elementwise work and reductions before broadcasts.

Precondition: calls inlined (`inline_calls`), so `jnp.linalg.norm` and
friends are visible as plain equations; otherwise any ClosedJaxpr.

A broadcast `b = broadcast_in_dim(x, S, dims)` *creates* the axes of S that
do not come from a same-sized axis of x (new axes, and size-1 axes of x
stretched). Work done on b along created axes is repeated: the GQA "expand"
form of an XSA projection normalises every KV head once per query head. The
rules (one walk, each sees earlier rewrites, so whole chains move up):

* elementwise op (unary, binary, `select_n`; scalar literals allowed) whose
  operands are all broadcasts (or scalars) sharing created axes C: compute
  the op on the operands with C removed, then broadcast the result to S;
* reduction over axes that are all real (non-created) axes of its broadcast
  operand: reduce x, then broadcast to the reduced shape;
* broadcast of a broadcast: one broadcast (so the chain stays visible);
* `reduce_sum` over axes along which a compile-time factor of its (linear)
  operand is constant: the sum moves inside the product (`_sink_sum`), for
  float32/float64 and finite, normal factors only. AD transposes a
  broadcast into such a sum (cotangent * coefficient, summed over the
  created axes); runtime coefficients, like the normalised values in the
  backward of the XSA expand form, are not sunk (they may be inf or 0).

Invariant established: no elementwise op or reduction above reads only
broadcasts that share a created axis of size > 1 (`remaining(closed) == 0`);
sum sinking is opportunistic (a bounded look-back of `_sink_sum.MAX_NODES`
producers per sum) and is not part of the counted invariant.

Leaves alone: ops with any operand that is not a broadcast or a scalar
(e.g. `y * v_hat` where y is real data), reductions that touch a created
axis (they would need a multiply), broadcasts with dynamic shapes, ops and
reductions with an explicit `sharding`/`out_sharding` parameter (it names
the broadcast shape, not the smaller one), and everything else.

When it preserves `jax.jit`'s results, rule by rule:

* elementwise hoist: for every dtype (integers, bool and floats of every
  width), exactly: the same primitive with the same parameters runs on the
  same operand values, once per distinct value instead of once per copy.
  Integer overflow, division by zero and nan/inf are per element, so they
  come out the same. (The program XLA then compiles is smaller and may be
  fused differently; that is XLA's freedom in either program.)
* reduction hoist: each output element reduces the same elements of x.
  reduce_max/min/and/or: exact. reduce_sum/prod: integers exact (wrapping
  add and mul are associative and commutative); floats up to rounding of
  XLA's summation order, nan/inf pattern the same (nan iff a nan or both
  infinities occur, in any order); at the edge of the range a reordered
  float sum or product can overflow or underflow differently, as in any
  XLA reduction.
* broadcast of a broadcast: exact (the same copies).
* sum sinking: the conditions and what they guarantee are in `_sink_sum`
  (float32/float64 only; compile-time factors that are finite and normal).

Checked for every rule: a replacement whose shape, dtype or weak type
differs from the equation it replaces is declined (`_rewrite.same_types`).
"""

from __future__ import annotations

import functools

from jax import lax

from jaxbackend import _jax
from jaxbackend.passes import _rewrite, _sink_sum

ELEMENTWISE = frozenset("""
neg exp exp2 log log1p expm1 sqrt rsqrt cbrt tanh logistic sin cos tan asin acos atan
sinh cosh asinh acosh atanh abs sign floor ceil round integer_pow square
convert_element_type erf erfc erf_inv lgamma digamma not is_finite reduce_precision
add sub mul div max min pow atan2 rem and or xor eq ne lt le gt ge add_any nextafter
select_n
""".split())
REDUCTIONS = frozenset("reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or".split())


def _source(producer, atom):
    """(x, dims, S) with atom = broadcast_in_dim(x, S, dims), else (atom, id, shape)."""
    eqn = producer(atom)
    shape = tuple(atom.aval.shape)
    if (eqn is not None and eqn.primitive.name == "broadcast_in_dim"
            and len(eqn.invars) == 1):
        return eqn.invars[0], tuple(int(d) for d in eqn.params["broadcast_dimensions"]), shape
    return atom, tuple(range(len(shape))), shape


def _real_axes(x, dims, shape) -> set:
    xs = x.aval.shape
    return {d for j, d in enumerate(dims) if xs[j] == shape[d]}


def _broadcast(x, shape, dims):
    if tuple(x.shape) == tuple(shape) and tuple(dims) == tuple(range(len(shape))):
        return x
    return lax.broadcast_in_dim(x, shape, dims)


def _squeeze_to(x, dims, keep_axes, shape):
    """x broadcast over `shape` restricted to `keep_axes` (sorted S axes)."""
    pos = {a: i for i, a in enumerate(keep_axes)}
    kept = [j for j, d in enumerate(dims) if d in pos]
    if len(kept) != len(dims):  # dropped dims are size 1 (created axes)
        x = lax.reshape(x, tuple(x.shape[j] for j in kept))
    return _broadcast(x, tuple(shape[a] for a in keep_axes), tuple(pos[dims[j]] for j in kept))


def _sharded(params) -> bool:
    """An explicit output sharding, which is for the full (broadcast) shape."""
    return any(params.get(k) is not None for k in ("sharding", "out_sharding"))



def _elementwise_rule(ctx, eqn):
    shape = tuple(eqn.outvars[0].aval.shape)
    if len(eqn.outvars) != 1 or not shape or _sharded(eqn.params):
        return None
    sources = []
    for a in eqn.invars:
        if not a.aval.shape:  # scalar operand (literal or rank 0)
            sources.append(None)
            continue
        x, dims, s = _source(ctx.producer, a)
        if s != shape and len(s) != len(shape):
            return None
        # an operand of equal rank may rely on implicit size-1 broadcasting
        sources.append((x, dims, s))
    real = set()
    for src in sources:
        if src is not None:
            x, dims, s = src
            real |= {d for d in _real_axes(x, dims, s) if s[d] == shape[d]}
    created = [a for a in range(len(shape)) if a not in real and shape[a] > 1]
    if not created:
        return None
    keep = tuple(a for a in range(len(shape)) if a not in created)
    prim, params = eqn.primitive, dict(eqn.params)
    args = [a if src is None else src[0] for a, src in zip(eqn.invars, sources)]
    layout = tuple(None if src is None else src[1] for src in sources)

    def fn(*xs):
        ops = [x if lay is None else _squeeze_to(x, lay, keep, shape)
               for x, lay in zip(xs, layout)]
        return _broadcast(prim.bind(*ops, **params), shape, keep)

    try:
        key = ("hoist", prim, tuple(sorted(params.items())), layout, shape)
        hash(key)
    except TypeError:
        key = None
    out = _rewrite.same_types(eqn, ctx.emit(fn, args, key))
    ctx.count(f"hoisted {prim.name}")
    return out


def _reduction_rule(ctx, eqn, consts=None):
    if _sharded(eqn.params):
        return None
    out = _hoist_reduction(ctx, eqn)
    if out is None and eqn.primitive.name == "reduce_sum":
        consts = {} if consts is None else consts
        node = _sink_sum.plan(ctx.producer, eqn.invars[0], _jax.reduce_axes(eqn),
                              lambda a: _sink_sum.constant_value(ctx.producer, a, consts))
        if node is not None:
            out = _rewrite.same_types(eqn, [_sink_sum.emit(ctx, node)])
            ctx.count("sum sunk past broadcast factors")
    return out


def _hoist_reduction(ctx, eqn):
    x, dims, s = _source(ctx.producer, eqn.invars[0])
    if x is eqn.invars[0]:
        return None
    axes = tuple(int(a) for a in eqn.params["axes"])
    real = _real_axes(x, dims, s)
    if not all(a in real for a in axes):
        return None
    if not any(a not in real and s[a] > 1 for a in range(len(s))):
        return None  # nothing repeated: no work to save
    inv = {d: j for j, d in enumerate(dims)}
    x_axes = tuple(sorted(inv[a] for a in axes))
    out_axes = [a for a in range(len(s)) if a not in axes]
    out_shape = tuple(s[a] for a in out_axes)
    remaining_dims = tuple(out_axes.index(d) for j, d in enumerate(dims) if j not in x_axes)
    prim, params = eqn.primitive, dict(eqn.params, axes=x_axes)

    def fn(x):
        return _broadcast(prim.bind(x, **params), out_shape, remaining_dims)

    key = ("hoist-reduce", prim, tuple(sorted(params.items())), dims, s)
    out = _rewrite.same_types(eqn, ctx.emit(fn, [x], key))
    ctx.count(f"hoisted {prim.name}")
    return out


def _compose_rule(ctx, eqn):
    if len(eqn.invars) != 1:
        return None
    inner = ctx.producer(eqn.invars[0])
    if inner is None or inner.primitive.name != "broadcast_in_dim" or len(inner.invars) != 1:
        return None
    outer_dims = tuple(int(d) for d in eqn.params["broadcast_dimensions"])
    dims = tuple(outer_dims[d] for d in inner.params["broadcast_dimensions"])
    shape = tuple(eqn.params["shape"])
    out = _rewrite.same_types(eqn, ctx.bind(lax.broadcast_in_dim_p, [inner.invars[0]], shape=shape,
                                    broadcast_dimensions=dims, sharding=eqn.params.get("sharding")))
    ctx.count("broadcasts composed")
    return out


RULES = {**{p: _elementwise_rule for p in ELEMENTWISE},
         **{p: _reduction_rule for p in REDUCTIONS},
         "broadcast_in_dim": _compose_rule}


def hoist_broadcast(closed):
    """Move elementwise work and reductions above broadcasts (module doc)."""
    # Sum sinking may factor out values computed from the program's consts.
    consts = dict(zip(closed.jaxpr.constvars, closed.consts))
    reduction = functools.partial(_reduction_rule, consts=consts)
    return _rewrite.rewrite(closed, {**RULES, **{p: reduction for p in REDUCTIONS}})


def remaining(closed) -> int:
    """Ops that still compute on broadcast copies (what the pass removes)."""
    n = 0
    for jaxpr in [closed.jaxpr] + [s for e in _rewrite.iter_eqns(closed)
                                   for s in _jax.jaxprs_in_params(e.params)]:
        producer = {v: e for e in jaxpr.eqns for v in e.outvars}
        get = lambda a, p=producer: p.get(a) if _jax.is_var(a) else None  # noqa: E731
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if name in ELEMENTWISE and _hoistable_elementwise(get, eqn):
                n += 1
            elif name in REDUCTIONS:
                x, dims, s = _source(get, eqn.invars[0])
                real = _real_axes(x, dims, s)
                if (x is not eqn.invars[0] and all(a in real for a in eqn.params["axes"])
                        and any(a not in real and s[a] > 1 for a in range(len(s)))):
                    n += 1
    return n


def _hoistable_elementwise(get, eqn):
    shape = tuple(eqn.outvars[0].aval.shape)
    if not shape:
        return False
    real = set()
    for a in eqn.invars:
        if a.aval.shape:
            x, dims, s = _source(get, a)
            if len(s) != len(shape):
                return False
            real |= {d for d in _real_axes(x, dims, s) if s[d] == shape[d]}
    return any(a not in real and shape[a] > 1 for a in range(len(shape)))

