"""Sum sinking for `hoist_broadcast`: a `reduce_sum` over axes along which a
compile-time factor is constant moves inside the product.

AD transposes a broadcast into a `reduce_sum` over its created axes, applied
to a linear expression of the cotangent whose coefficients may be broadcasts
along those axes: sum_g(ct_g * c) = c * sum_g(ct_g). Doing the sum first
saves the multiplies (or divides) at the broadcast size.

`plan(producer, atom, axes, value)` analyses, without emitting anything, how
`reduce_sum(atom, axes)` distributes through the producers of `atom`:

    mul/div by a safe factor constant along `axes` -> factor out (squeezed)
    neg                                        -> sink into the operand
    add / sub / add_any                        -> sink into both operands
    broadcast_in_dim with `axes` all real      -> sink into its operand
    reshape that only adds/drops size-1 dims   -> sink through it
    reshape that splits axes (a merge's transpose) -> sink into its operand,
                                                  in the split space
    reduce_sum over other axes                 -> commute, sink inside
    anything else                              -> leaf: reduce_sum here

The split space. AD transposes a merging reshape (`jnp.repeat`'s
broadcast + reshape) into a reshape that splits kv * g into (kv, g) and a
`reduce_sum` over g. The walk then continues on the merged operand, each
atom read as its split view `reshape(atom, split)` (`_plan`'s `groups`: one
run of split sizes per axis of the atom), so a factor counts as constant
along g when it is itself a merge with the same runs (`_broadcast.merged`)
or a broadcast without data along the merged axis; sums, negations,
broadcasts, size-1 reshapes and reduce_sums carry the runs to their
operands; a reshape whose operand has the split shape ends the split view;
a leaf emits the reshape to the split view, then its sum. Row-major split
and merge are bijections of indices, so a node in the split space sums the
same terms as in the merged one.

When sinking saves work. jax.jit's sum reads its N-element atom once; a
plan reads each leaf once per sum, adds work only at the reduced size, and
kills the producers it walks through if all their uses are in the plan.
`plan` counts its visits of each walked value; one with more `uses(atom)`
(None, unknown: a value this pass emitted) is marked and the plan redone,
until no new mark (at most MAX_NODES marks). Above every marked value any
node is taken: each walked full-size op becomes reduced-size work, each
leaf is read as often as before. Below a marked value only one-child nodes
(factor, neg, broadcast, reshape): one leaf of at most N elements read in
place of the N-element value. An add there (computed anyway: 2N reads for
jax.jit's N) or an inner reduce_sum (its larger operand re-read) is a leaf.
(So a LayerNorm backward sum that a weight gradient's dot also reads stays.)

A plan is a tree of the NamedTuples below (`Leaf`, `Neg`, `Add`, `Bcast`,
`Reshape`, `Reduce`, `Factor`). It returns None unless at least one factor
comes out (otherwise nothing is saved). The walk visits at most
`MAX_NODES` producers per root, so a rule call costs O(1) in the size of
the graph. `emit(ctx, plan)` builds it.
A size-1 axis counts as constant (summing it is a reshape).

When this preserves `jax.jit`'s results. The conditions, each checked in
`_plan` (a node that fails one is a leaf: the sum stays where it was):

* dtype float32 or float64, on every node. A plan has one dtype throughout
  (neg, add, broadcast, reshape and reduce_sum keep it; a mul/div whose
  operands differ in dtype or that sets an explicit result dtype is a leaf).
  - Never integers or bool: integer division does not distribute
    (sum([1, 1, 1, 1] // 2) = 0 but sum([1, 1, 1, 1]) // 2 = 2). Wrapping
    integer add and mul would be exact, but a plan is only emitted when a
    factor comes out, so integers are excluded altogether.
  - Never float16 or bfloat16: their range or precision makes a changed
    result realistic (float16: sum(t * 0.25) of 8 x 30000 is 59968, while
    sum(t) overflows, so sum(t) * 0.25 is inf).
* the factor c is known at compile time, never a runtime value: a Literal,
  a closed-over const of the top-level jaxpr (`hoist_broadcast` passes
  them), or computed from those by at most `_const_value.CONST_EQNS`
  equations of `CONST_PRIMITIVES` (exact or correctly rounded ops,
  evaluated one by one; each value at most `CONST_SIZE` elements). Every element of c must
  be finite and normal (|c| >= the dtype's smallest normal number: never 0
  and never subnormal, which flush-to-zero hardware reads as 0). Why: with
  t = [1, 0], sum(t * inf) is nan but inf * sum(t) is inf; sum(t / 0) is
  nan but sum(t) / 0 is inf. A runtime factor (e.g. the normalised values
  in the backward of the XSA expand form) may be inf or 0, so it stays.

Under these conditions the results of jax.jit are preserved as follows:

* non-finite values: exactly. With c finite and non-zero, t_g * c and
  t_g / c are nan exactly where t_g is nan and infinite exactly where t_g
  is (the sign flipped with c's), so both forms are nan iff a nan or both
  infinities occur, else an infinity of the same sign. The reassociations
  (add/sub/neg, broadcast, size-1 reshape, commuting sums) have the same
  property in any order.
* finite values: equal up to float rounding (exactly equal when c is a
  power of two), unless a partial sum or product reaches the overflow
  threshold (3.4e38 in float32) in one form only: at the edge of the range
  one form can overflow where the other does not. That is the accepted
  price of the float32/float64 rule, as for any reordering of a sum (XLA
  picks its own order too).
* sign of zero: not kept (an exactly cancelling sum times a negative c is
  -0.0 here, +0.0 in jax.jit). XLA's own simplifier rewrites sum(-x) to
  -sum(x), which does the same.
* shape, dtype, weak type: unchanged (`hoist_broadcast` declines a
  replacement whose type differs).

`plan(..., runtime=True)` (`hoist_broadcast(runtime_factors=True)`) also
takes factors whose value is not known at compile time, as if they were
finite and normal; nothing checks that. A factor known at compile time must
still pass `safe_factor`. Where a runtime factor is inf, 0 or subnormal the
results may differ from jax.jit's as described above (nan vs inf).
"""

from __future__ import annotations

import collections
from typing import Any, NamedTuple

import numpy as np
from jax import lax

from jaxbackend import _jax
from jaxbackend.passes import _broadcast
# Re-exported: the compile-time factor values `hoist_broadcast` hands to `plan`.
from jaxbackend.passes._const_value import constant_value as constant_value
from jaxbackend.passes._const_value import safe_factor

MAX_NODES = 48
_ADD = frozenset({"add", "add_any", "sub"})
SINK_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


# -- plan nodes ---------------------------------------------------------------

class Leaf(NamedTuple):          # reduce_sum(reshape(atom, split), axes) stays here
    atom: Any
    axes: tuple
    split: tuple                 # atom's shape, or the split view being summed


class Neg(NamedTuple):           # -sum(child)
    child: Any


class Add(NamedTuple):           # sum(a) + sum(b) (or -, by `name`)
    name: str
    a: Any
    b: Any


class Bcast(NamedTuple):         # broadcast_in_dim(child, out_shape, dims)
    child: Any
    out_shape: tuple
    dims: tuple


class Reshape(NamedTuple):       # a reshape adding/dropping size-1 dims
    child: Any
    out_shape: tuple


class Reduce(NamedTuple):        # reduce_sum(child, other): the commuted sum
    child: Any
    other: tuple


class Factor(NamedTuple):        # sum(child) * f or / f, f the factor squeezed
    name: str                    # "mul" or "div"
    child: Any
    factor: tuple                # (x, dims): f = broadcast(x); dims None: f is the scalar x
    fshape: tuple                # shape of the factor operand
    axes: tuple                  # the summed axes
    var_first: bool              # was the summed operand the left one?


class _Rules(NamedTuple):        # one `plan` attempt's settings
    accept: Any                  # (factor atom, dtype) -> may it come out?
    marked: frozenset            # values with a use outside the plan
    visits: Any                  # Counter: value -> times walked through
    shared: bool = False         # has the walk passed a marked value?


def _size1_reshape_map(in_shape, out_shape):
    """Axis map in->out for a reshape that only inserts/removes size-1 dims."""
    big_in = [i for i, n in enumerate(in_shape) if n != 1]
    big_out = [i for i, n in enumerate(out_shape) if n != 1]
    if [in_shape[i] for i in big_in] != [out_shape[i] for i in big_out]:
        return None
    return dict(zip(big_out, big_in))


def plan(producer, atom, axes, value=None, *, runtime=False, uses=None):
    """The sinking of `reduce_sum(atom, axes)`, or None. `value(atom)`: an
    atom's compile-time value or None (`constant_value`; without it nothing
    sinks). `uses(atom)`: its number of uses, None if unknown (module doc:
    when sinking saves work; without it all uses count as in the plan).
    `runtime=True` also takes unknown factors (the caller's promise)."""
    value = value or (lambda a: None)
    known: dict = {}   # id(atom) -> value (Literals are unhashable): each re-plan asks again

    def accept(atom, dtype):
        if id(atom) not in known:   # atoms live in the jaxpr: ids stay theirs
            known[id(atom)] = value(atom)
        v = known[id(atom)]
        return runtime if v is None else safe_factor(v, dtype)

    marked: frozenset = frozenset()   # values with a use outside the plan
    while True:
        budget, visits = [MAX_NODES], collections.Counter()
        node = _plan(producer, atom, tuple(sorted(axes)), budget, _Rules(accept, marked, visits),
                     _identity(atom.aval.shape))
        more = {a for a, n in visits.items() if uses and (uses(a) is None or uses(a) > n)} - marked
        if not more:
            return node if not isinstance(node, Leaf) and _useful(node) else None
        marked |= more


def _useful(node) -> bool:
    """Does the plan factor anything out (else it saves nothing)?"""
    if isinstance(node, (Factor, Leaf)):
        return isinstance(node, Factor)
    return any(map(_useful, (node.a, node.b) if isinstance(node, Add) else (node.child,)))


def _fits(op_shape, shape) -> bool:
    """Operand shape allowed in an elementwise op with result `shape`: equal,
    scalar, or equal rank with size-1 dims (implicit broadcast, JAX 0.10)."""
    return op_shape == () or (len(op_shape) == len(shape)
                              and all(n in (1, m) for n, m in zip(op_shape, shape)))


def _identity(shape) -> tuple:
    return tuple((n,) for n in shape)


def _factor_source(producer, fac, groups, shape):
    """The broadcast behind factor `fac`, in the split space of `groups`."""
    if any(len(g) > 1 for g in groups):
        m = _broadcast.merged(producer, fac)
        if m is not None and _broadcast.same_groups(m.groups, groups, fac.aval.shape, shape):
            return _broadcast.Source(m.x, m.dims, m.split)
    src = _broadcast.source(producer, fac)
    return _broadcast.split_source(src, groups, shape)


def _plan(producer, atom, axes, budget, rules, groups):
    """Plan `reduce_sum(reshape(atom, split), axes)`, split = the sizes of
    `groups` (one run per axis of atom; runs of one: atom itself)."""
    shape, ashape = _broadcast.flat_groups(groups), tuple(atom.aval.shape)
    leaf = Leaf(atom, axes, shape)
    budget[0] -= 1
    dtype = atom.aval.dtype
    if budget[0] <= 0 or not axes or dtype not in SINK_DTYPES:
        return leaf
    eqn = producer(atom)
    if eqn is None:
        return leaf
    name = eqn.primitive.name
    ones = tuple(a for a in axes if shape[a] == 1)
    if ones:  # summing a size-1 axis is a reshape: sum the others, then drop these
        big = tuple(a for a in axes if shape[a] != 1)
        out_shape = tuple(n for a, n in enumerate(shape) if a not in axes)
        return Reshape(_plan(producer, atom, big, budget, rules, groups), out_shape)
    if not rules.shared:   # module doc: when sinking saves work
        rules.visits[atom] += 1
        rules = rules._replace(shared=atom in rules.marked)
    if (name in ("mul", "div") and not _jax.has_out_dtype(eqn)
            and all(_fits(v.aval.shape, ashape) and v.aval.dtype == dtype for v in eqn.invars)):
        a, b = eqn.invars
        sides = [(a, b)] if name == "div" else [(a, b), (b, a)]
        for var, fac in sides:
            if var.aval.shape != ashape:
                continue
            if fac.aval.shape == ():
                c, fshape = (fac, None), ()
            else:
                src = _factor_source(producer, fac, groups, ashape)
                c = None if src is None else _broadcast.constant_along(src, axes)
                fshape = None if src is None else src.shape
            # only a compile-time, finite, normal factor (module doc)
            if c is not None and rules.accept(c[0], dtype):
                return Factor(name, _plan(producer, var, axes, budget, rules, groups), c,
                              fshape, axes, var is eqn.invars[0])
        return leaf
    if name == "neg":
        return Neg(_plan(producer, eqn.invars[0], axes, budget, rules, groups))
    if rules.shared and (name in _ADD or name == "reduce_sum"):
        return leaf   # below a value with another use: one-child nodes only (module doc)
    if name in _ADD and all(v.aval.shape == ashape for v in eqn.invars):
        return Add(name, _plan(producer, eqn.invars[0], axes, budget, rules, groups),
                   _plan(producer, eqn.invars[1], axes, budget, rules, groups))
    if name == "broadcast_in_dim" and len(eqn.invars) == 1:
        return _plan_broadcast(producer, eqn, axes, budget, rules, groups) or leaf
    if name == "reshape" and not _jax.reshape_transposes(eqn) and len(eqn.invars) == 1:
        return _plan_reshape(producer, eqn, axes, budget, rules, groups) or leaf
    if name == "reduce_sum":
        x = eqn.invars[0]
        other = tuple(int(a) for a in _jax.reduce_axes(eqn))
        kept = iter(groups)   # x's axes: the kept ones split as atom's, the summed whole
        xg = tuple((n,) if a in other else next(kept) for a, n in enumerate(x.aval.shape))
        starts = _broadcast.group_starts(xg)
        other = tuple(starts[a] for a in other)
        kept_s = [a for a in range(len(_broadcast.flat_groups(xg))) if a not in other]
        x_axes = tuple(sorted(kept_s[a] for a in axes))
        # after summing x_axes first, the `other` axes shift down
        rest = [a for a in range(len(kept_s) + len(other)) if a not in x_axes]
        return Reduce(_plan(producer, x, x_axes, budget, rules, xg),
                      tuple(rest.index(a) for a in other))
    return leaf


def _plan_broadcast(producer, eqn, axes, budget, rules, groups):
    """Sink through `broadcast_in_dim` when every summed axis comes from a
    same-sized axis of its operand (else None)."""
    x, shape = eqn.invars[0], _broadcast.flat_groups(groups)
    xshape, ashape = tuple(x.aval.shape), tuple(eqn.outvars[0].aval.shape)
    odims = _jax.broadcast_dimensions(eqn)
    # x's axis j splits like atom axis odims[j] (a stretched size-1 axis: into 1s)
    xg = tuple(groups[d] if xshape[j] == ashape[d] else (1,) * len(groups[d])
               for j, d in enumerate(odims))
    starts = _broadcast.group_starts(groups)
    dims = tuple(starts[d] + k for d in odims for k in range(len(groups[d])))
    xs = _broadcast.flat_groups(xg)
    inv = {d: j for j, d in enumerate(dims)}
    if not all(a in inv and xs[inv[a]] == shape[a] for a in axes):
        return None
    x_axes = tuple(sorted(inv[a] for a in axes))
    out_axes = [a for a in range(len(shape)) if a not in axes]
    out_shape = tuple(shape[a] for a in out_axes)
    new_dims = tuple(out_axes.index(d) for j, d in enumerate(dims) if j not in x_axes)
    return Bcast(_plan(producer, x, x_axes, budget, rules, xg), out_shape, new_dims)


def _plan_reshape(producer, eqn, axes, budget, rules, groups):
    """Sink through a reshape that only adds/drops size-1 axes, that undoes
    the split being summed (its operand has the split shape), or that splits
    merged axes (AD's transpose of a merge: the sum enters the split space of
    its operand). Else None."""
    x, shape = eqn.invars[0], _broadcast.flat_groups(groups)
    xshape, ashape = tuple(x.aval.shape), tuple(eqn.outvars[0].aval.shape)
    out_shape = tuple(n for a, n in enumerate(shape) if a not in axes)
    m = _size1_reshape_map(xshape, ashape)
    if m is not None:
        xg = [(1,)] * len(xshape)
        for a, j in m.items():
            xg[j] = groups[a]
        s_at, x_at = _broadcast.group_starts(groups), _broadcast.group_starts(xg)
        smap = {s_at[a] + k: x_at[j] + k for a, j in m.items() for k in range(len(groups[a]))}
        if not all(a in smap for a in axes):
            return None
        x_axes = tuple(sorted(smap[a] for a in axes))
        return Reshape(_plan(producer, x, x_axes, budget, rules, tuple(xg)), out_shape)
    if xshape == shape:   # x is the split view itself
        return _plan(producer, x, axes, budget, rules, _identity(xshape))
    if all(len(g) == 1 for g in groups):
        xg = _broadcast.merge_groups(ashape, xshape)
        if xg is not None:
            return _plan(producer, x, axes, budget, rules, xg)
    return None


def _op(ctx, name, fn, args, *key):
    # lax functions (not raw binds): they fill every parameter a primitive
    # expects in this JAX version (e.g. the result dtype of binary ops).
    return ctx.emit(fn, args, ("sink", name) + key)[0]


def emit(ctx, node):
    """Build the plan `node` with `ctx`'s builder; returns its atom."""
    if isinstance(node, Leaf):
        atom, axes, split = node
        if split != tuple(atom.aval.shape):
            atom = _op(ctx, "reshape", lambda x: lax.reshape(x, split), [atom], split)
        if not axes:
            return atom
        shape = tuple(n for a, n in enumerate(split) if a not in axes)
        if all(split[a] == 1 for a in axes):
            return _op(ctx, "reshape", lambda x: lax.reshape(x, shape), [atom], shape)
        return _op(ctx, "sum", lambda x: lax.reduce_sum(x, axes), [atom], axes)
    if isinstance(node, Neg):
        return _op(ctx, "neg", lax.neg, [emit(ctx, node.child)])
    if isinstance(node, Add):
        fn = lax.sub if node.name == "sub" else lax.add
        return _op(ctx, fn.__name__, fn, [emit(ctx, node.a), emit(ctx, node.b)])
    if isinstance(node, Bcast):
        out_shape, dims = node.out_shape, node.dims
        x = emit(ctx, node.child)
        if tuple(x.aval.shape) == out_shape and dims == tuple(range(len(out_shape))):
            return x
        return _op(ctx, "bcast", lambda v: lax.broadcast_in_dim(v, out_shape, dims), [x],
                   out_shape, dims)
    if isinstance(node, Reshape):
        out_shape = node.out_shape
        x = emit(ctx, node.child)
        if tuple(x.aval.shape) == out_shape:
            return x
        return _op(ctx, "reshape", lambda v: lax.reshape(v, out_shape), [x], out_shape)
    if isinstance(node, Reduce):
        other = node.other
        x = emit(ctx, node.child)
        return _op(ctx, "sum", lambda v: lax.reduce_sum(v, other), [x], other) if other else x
    name, fshape, axes = node.name, node.fshape, node.axes   # a Factor
    (fx, fdims) = node.factor
    s = emit(ctx, node.child)
    keep = tuple(a for a in range(len(fshape)) if a not in axes)
    if fdims is None:  # a scalar factor
        f = fx
    else:  # the factor without the summed axes (its own size-1 dims kept)
        f = _op(ctx, "factor", lambda x: _broadcast.squeeze_to(x, fdims, keep, fshape), [fx],
                fdims, keep, fshape)
    fn = lax.mul if name == "mul" else lax.div
    args = [s, f] if node.var_first or name == "div" else [f, s]
    return _op(ctx, name, fn, args)
