"""`hoist_broadcast`: do elementwise work and reductions before broadcasts.

Precondition: calls inlined (`inline_calls`), so `jnp.linalg.norm` and
friends are visible as plain equations; otherwise any ClosedJaxpr.

A broadcast `b = broadcast_in_dim(x, S, dims)` *creates* the axes of S that
do not come from a same-sized axis of x (new axes, and size-1 axes of x
stretched). Work done on b along created axes is repeated: the GQA "expand"
form of an XSA projection normalises every KV head once per query head.
GQA code usually also merges the copies into the head dim: `jnp.repeat(v,
g, axis)` and `broadcast_to(v[..., None, :], ...).reshape(..., kv * g, d)`
are a broadcast then a reshape merging the created axis with its neighbour
(`jnp.tile` and `concatenate([v] * g)` merge them the other way round).
The rules see through such a *merge* (`_broadcast.merged`: a contiguous
row-major merge of a broadcast, `tile`, or a self-concatenation) by
working in its split shape, then merging again. The rules (one walk, each
sees earlier rewrites, so whole chains move up):

* elementwise op (unary, binary, `select_n`; scalar literals allowed) whose
  operands are all broadcasts (or scalars) sharing created axes C: compute
  the op on the operands with C removed, then broadcast the result to S;
  through a merge: operands that are merges with the same runs (or scalars,
  or broadcasts without data along a merged axis), sharing a created split
  axis: the op on the sources, broadcast to the split shape, merged;
* reduction over axes that are all real (non-created) axes of its broadcast
  operand: reduce x, then broadcast to the reduced shape; through a merge:
  only when every split axis of every reduced axis is real;
* broadcast of a broadcast: one broadcast (so the chain stays visible);
  broadcast of a merge that keeps the merged axes, and a reshape of a merge
  that merges its split shape again: one broadcast, then one merge;
* `reduce_sum` over axes along which a compile-time factor of its (linear)
  operand is constant: the sum moves inside the product (`_sink_sum`), for
  float32/float64 and finite, normal factors only, and never past an add
  or inner sum whose value another op also reads (that would add work;
  `_rewrite.use_counts` gives the uses). AD transposes a
  broadcast into such a sum (cotangent * coefficient, summed over the
  created axes), and a merge into a split reshape and such a sum, which
  `_sink_sum` follows into the split space; runtime coefficients, like the
  normalised values in the backward of the XSA expand form, are not sunk
  (they may be inf or 0) unless `runtime_factors=True` (below).

Invariant established: no elementwise op or reduction above reads only
broadcasts, or merges of broadcasts, that share a created axis of size > 1
(`remaining(closed) == 0`); sum sinking is opportunistic (a bounded
look-back of `_sink_sum.MAX_NODES` producers per sum) and is not part of
the counted invariant.

Leaves alone: ops with any operand that is not a broadcast or a scalar
(e.g. `y * v_hat` where y is real data), reductions that touch a created
axis (they would need a multiply), among them a reduction over a merged
axis that holds a created split axis (a sum over the kv * g query heads adds
copies together), reshapes that split an axis or whose boundaries cut
through one (e.g. (2, 3, 4) -> (3, 8)), reshapes that transpose,
operands merged with different runs (`repeat`'s (kv, g) next to `tile`'s
(g, kv)), a merged operand next to one with data along the merged axis,
`jnp.repeat` with `total_repeat_length` (a gather), broadcasts with
dynamic shapes, ops, reductions and reshapes with an explicit output
sharding (it names the broadcast shape, not the smaller one), and
everything else.

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
* broadcast of a broadcast, of a merge, reshape of a merge: exact (the same
  copies, in the same row-major order).
* through a merge, each of the rules above: as without it. A row-major
  merge is a bijection between split and merged indices, so the split-space
  op reads, element by element, the same operand values.
* sum sinking: the conditions and what they guarantee are in `_sink_sum`
  (float32/float64 only; compile-time factors that are finite and normal).
  `runtime_factors=True` drops "compile-time": a factor whose value is
  unknown is taken as if it were finite and normal, which is not checked.
  Results then equal jax.jit's up to rounding wherever every runtime factor
  is finite and normal, and may differ where one is inf, 0 or subnormal
  (e.g. a zero-norm row of v: sum(t) / 0 is inf where sum(t / 0) is nan,
  0 * sum(t) is nan where sum(0 * t) is 0 when sum(t) overflows). Off by
  default; for callers who know their factors are finite (`jb.jit(f,
  passes=[...])` with a wrapper).

Checked for every rule: a replacement whose shape, dtype or weak type
differs from the equation it replaces is declined (`_rewrite.same_types`).

The matchers (what may move) are in `_broadcast`, shared with `remaining`;
this module emits.
"""

from __future__ import annotations

import functools

from jax import lax

from jaxbackend import _jax
from jaxbackend.passes import _broadcast, _rewrite, _sink_sum

# Re-exported: the primitive classes this pass hoists (`_jax` taxonomy).
ELEMENTWISE = _jax.ELEMENTWISE
REDUCTIONS = _jax.REDUCTIONS


def _elementwise_rule(ctx, eqn):
    m = _broadcast.match_elementwise(ctx.producer, eqn)
    if m is None:
        return None
    prim, kw = eqn.primitive, _jax.eqn_params(eqn)
    keep, shape, layout, merged = m.keep, m.shape, m.layout, m.merged

    def fn(*xs):
        ops = [x if lay is None else _broadcast.squeeze_to(x, lay, keep, shape)
               for x, lay in zip(xs, layout)]
        return _merge(_broadcast.broadcast(prim.bind(*ops, **kw), shape, keep), merged)

    pk = _jax.params_key(kw)
    key = None if pk is None else ("hoist", prim, pk, layout, shape, merged)
    out = _rewrite.same_types(eqn, ctx.emit(fn, m.args, key))
    ctx.count(f"hoisted {prim.name}")
    return out


def _reduction_rule(ctx, eqn, consts=None, runtime=False, uses=None):
    if _jax.has_sharding_annotation(eqn):
        return None
    out = _hoist_reduction(ctx, eqn)
    if out is None and eqn.primitive.name == "reduce_sum":
        consts = {} if consts is None else consts
        node = _sink_sum.plan(ctx.producer, eqn.invars[0], _jax.reduce_axes(eqn),
                              lambda a: _sink_sum.constant_value(ctx.producer, a, consts),
                              runtime=runtime, uses=None if uses is None else uses.get)
        if node is not None:
            out = _rewrite.same_types(eqn, [_sink_sum.emit(ctx, node)])
            ctx.count("sum sunk past broadcast factors")
    return out


def _hoist_reduction(ctx, eqn):
    m = _broadcast.match_reduction(ctx.producer, eqn)
    if m is None:
        return None
    prim, kw = eqn.primitive, _jax.reduce_params(eqn, m.x_axes)
    out_shape, out_dims, merged = m.out_shape, m.out_dims, m.merged

    def fn(x):
        return _merge(_broadcast.broadcast(prim.bind(x, **kw), out_shape, out_dims), merged)

    key = ("hoist-reduce", prim, _jax.params_key(kw), m.source.dims, m.source.shape, merged)
    out = _rewrite.same_types(eqn, ctx.emit(fn, [m.x], key))
    ctx.count(f"hoisted {prim.name}")
    return out


def _merge(x, shape):
    """x reshaped to the merged `shape` (None: x is the result as it is)."""
    return x if shape is None or tuple(x.shape) == tuple(shape) else lax.reshape(x, shape)


def _remerge(ctx, eqn, m, what):
    """`eqn` replaced by one broadcast of m.x into m.split, then the merge."""
    x, dims, split, out = m.x, m.dims, m.split, tuple(eqn.outvars[0].aval.shape)

    def fn(v):
        return _merge(_broadcast.broadcast(v, split, dims), out)

    res = _rewrite.same_types(eqn, ctx.emit(fn, [x], ("remerge", dims, split, out)))
    ctx.count(what)
    return res


def _reshape_rule(ctx, eqn):
    m = _broadcast.merged_reshape(ctx.producer, eqn)
    return None if m is None else _remerge(ctx, eqn, m, "merges composed")


def _compose_rule(ctx, eqn):
    if len(eqn.invars) != 1:
        return None
    inner = ctx.producer(eqn.invars[0])
    if inner is not None and inner.primitive.name in ("reshape", "tile", "concatenate"):
        m = _broadcast.merged_broadcast(ctx.producer, eqn)
        return None if m is None else _remerge(ctx, eqn, m, "broadcast of a merge composed")
    if inner is None or inner.primitive.name != "broadcast_in_dim" or len(inner.invars) != 1:
        return None
    outer_dims = _jax.broadcast_dimensions(eqn)
    dims = tuple(outer_dims[d] for d in _jax.broadcast_dimensions(inner))
    out = _rewrite.same_types(eqn, ctx.bind(eqn.primitive, [inner.invars[0]],
                                            **_jax.broadcast_params(eqn, dims)))
    ctx.count("broadcasts composed")
    return out


RULES = {**{p: _elementwise_rule for p in ELEMENTWISE},
         **{p: _reduction_rule for p in REDUCTIONS},
         "broadcast_in_dim": _compose_rule, "reshape": _reshape_rule}


def hoist_broadcast(closed, *, runtime_factors: bool = False):
    """Move elementwise work and reductions above broadcasts (module doc).
    `runtime_factors=True` also sinks sums past runtime factors: results
    then match jax.jit's only where those are finite and normal (module doc)."""
    # Sum sinking may factor out values computed from the program's consts.
    jaxpr, values = _jax.jaxpr_parts(closed)
    consts = dict(zip(jaxpr.constvars, values))
    reduction = functools.partial(_reduction_rule, consts=consts, runtime=runtime_factors,
                                  uses=_rewrite.use_counts(closed))
    return _rewrite.rewrite(closed, {**RULES, **{p: reduction for p in REDUCTIONS}})


def remaining(closed) -> int:
    """Ops that still compute on broadcast copies (what the pass removes):
    equations its elementwise and reduction matchers accept."""
    n = 0
    for jaxpr in _rewrite.iter_jaxprs(closed):
        producer = _rewrite.Producers(jaxpr.eqns)
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if name in ELEMENTWISE:
                n += _broadcast.match_elementwise(producer, eqn) is not None
            elif name in REDUCTIONS:
                n += _broadcast.match_reduction(producer, eqn) is not None
    return n
