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
    reduce_sum over other axes                 -> commute, sink inside
    anything else                              -> leaf: reduce_sum here

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
  them), or computed from those by at most `CONST_EQNS` equations of
  `CONST_PRIMITIVES` (exact or correctly rounded ops, evaluated here one by
  one; each value at most `CONST_SIZE` elements). Every element of c must
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
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np
from jax import lax

from jaxbackend import _jax
from jaxbackend.passes import _broadcast

MAX_NODES = 48
_ADD = frozenset({"add", "add_any", "sub"})
SINK_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))

# Compile-time factors: ops whose eager result is the compiled program's
# (structural, or one correctly rounded IEEE operation), in a small budget.
CONST_PRIMITIVES = frozenset("""
broadcast_in_dim reshape squeeze expand_dims transpose convert_element_type iota
neg abs add sub mul div max min
""".split())
CONST_EQNS = 16
CONST_SIZE = 1 << 16


# -- plan nodes ---------------------------------------------------------------

class Leaf(NamedTuple):          # reduce_sum(atom, axes) stays here
    atom: Any
    axes: tuple


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
    """Every element finite and normal (module doc: never inf, nan, 0 or
    subnormal), for a factor of float dtype `dtype`."""
    if value is None:
        return False
    mag = np.abs(np.asarray(value, dtype=dtype))
    return bool(np.all(np.isfinite(mag)) and np.all(mag >= np.finfo(dtype).tiny))


def _size1_reshape_map(in_shape, out_shape):
    """Axis map in->out for a reshape that only inserts/removes size-1 dims."""
    big_in = [i for i, n in enumerate(in_shape) if n != 1]
    big_out = [i for i, n in enumerate(out_shape) if n != 1]
    if [in_shape[i] for i in big_in] != [out_shape[i] for i in big_out]:
        return None
    return dict(zip(big_out, big_in))


def plan(producer, atom, axes, value=None):
    """The sinking of `reduce_sum(atom, axes)`, or None. `value(atom)` is
    the compile-time value of an atom or None (`constant_value`); without
    it no factor is known, so nothing sinks."""
    budget = [MAX_NODES]
    node = _plan(producer, atom, tuple(sorted(axes)), budget, value or (lambda a: None))
    return node if not isinstance(node, Leaf) and _useful(node) else None


def _useful(node) -> bool:
    """Does the plan factor anything out (else it saves nothing)?"""
    if isinstance(node, Factor):
        return True
    if isinstance(node, Leaf):
        return False
    if isinstance(node, Add):
        return _useful(node.a) or _useful(node.b)
    return _useful(node.child)  # Neg, Bcast, Reshape, Reduce: one child


def _fits(op_shape, shape) -> bool:
    """Operand shape allowed in an elementwise op with result `shape`: equal,
    scalar, or equal rank with size-1 dims (implicit broadcast, JAX 0.10)."""
    return op_shape == () or (len(op_shape) == len(shape)
                              and all(n in (1, m) for n, m in zip(op_shape, shape)))


def _plan(producer, atom, axes, budget, value):
    leaf = Leaf(atom, axes)
    budget[0] -= 1
    dtype = atom.aval.dtype
    if budget[0] <= 0 or not axes or dtype not in SINK_DTYPES:
        return leaf
    eqn = producer(atom)
    if eqn is None:
        return leaf
    name, shape = eqn.primitive.name, tuple(atom.aval.shape)
    ones = tuple(a for a in axes if shape[a] == 1)
    if ones:  # summing a size-1 axis is a reshape: sum the others, then drop these
        big = tuple(a for a in axes if shape[a] != 1)
        out_shape = tuple(n for a, n in enumerate(shape) if a not in axes)
        return Reshape(_plan(producer, atom, big, budget, value), out_shape)
    if (name in ("mul", "div") and not _jax.has_out_dtype(eqn)
            and all(_fits(v.aval.shape, shape) and v.aval.dtype == dtype for v in eqn.invars)):
        a, b = eqn.invars
        sides = [(a, b)] if name == "div" else [(a, b), (b, a)]
        for var, fac in sides:
            if var.aval.shape != shape:
                continue
            c = ((fac, None) if fac.aval.shape == ()
                 else _broadcast.const_along(producer, fac, axes))
            # only a compile-time, finite, normal factor (module doc)
            if c is not None and safe_factor(value(c[0]), dtype):
                return Factor(name, _plan(producer, var, axes, budget, value), c,
                              tuple(fac.aval.shape), axes, var is eqn.invars[0])
        return leaf
    if name == "neg":
        return Neg(_plan(producer, eqn.invars[0], axes, budget, value))
    if name in _ADD and all(v.aval.shape == shape for v in eqn.invars):
        return Add(name, _plan(producer, eqn.invars[0], axes, budget, value),
                   _plan(producer, eqn.invars[1], axes, budget, value))
    if name == "broadcast_in_dim" and len(eqn.invars) == 1:
        x = eqn.invars[0]
        dims = _jax.broadcast_dimensions(eqn)
        inv = {d: j for j, d in enumerate(dims)}
        if all(a in inv and x.aval.shape[inv[a]] == shape[a] for a in axes):
            x_axes = tuple(sorted(inv[a] for a in axes))
            out_axes = [a for a in range(len(shape)) if a not in axes]
            out_shape = tuple(shape[a] for a in out_axes)
            new_dims = tuple(out_axes.index(d) for j, d in enumerate(dims) if j not in x_axes)
            return Bcast(_plan(producer, x, x_axes, budget, value), out_shape, new_dims)
        return leaf
    if name == "reshape" and not _jax.reshape_transposes(eqn) and len(eqn.invars) == 1:
        x = eqn.invars[0]
        m = _size1_reshape_map(tuple(x.aval.shape), shape)
        if m is not None and all(a in m or shape[a] == 1 for a in axes):
            x_axes = tuple(sorted(m[a] for a in axes if a in m))
            out_shape = tuple(n for a, n in enumerate(shape) if a not in axes)
            return Reshape(_plan(producer, x, x_axes, budget, value), out_shape)
        return leaf
    if name == "reduce_sum":
        x = eqn.invars[0]
        other = tuple(int(a) for a in _jax.reduce_axes(eqn))
        kept = [a for a in range(len(x.aval.shape)) if a not in other]
        x_axes = tuple(sorted(kept[a] for a in axes))
        # after summing x_axes first, the `other` axes shift down
        rest = [a for a in range(len(x.aval.shape)) if a not in x_axes]
        return Reduce(_plan(producer, x, x_axes, budget, value),
                      tuple(rest.index(a) for a in other))
    return leaf


def _op(ctx, name, fn, args, *key):
    # lax functions (not raw binds): they fill every parameter a primitive
    # expects in this JAX version (e.g. the result dtype of binary ops).
    return ctx.emit(fn, args, ("sink", name) + key)[0]


def emit(ctx, node):
    """Build the plan `node` with `ctx`'s builder; returns its atom."""
    if isinstance(node, Leaf):
        atom, axes = node
        if not axes:
            return atom
        shape = tuple(n for a, n in enumerate(atom.aval.shape) if a not in axes)
        if all(atom.aval.shape[a] == 1 for a in axes):
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
