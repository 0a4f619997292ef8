"""Sum sinking for `hoist_broadcast`: a `reduce_sum` over axes along which a
factor is constant moves inside the product.

Reverse-mode AD of broadcast code ends in `reduce_sum` over the broadcast's
created axes (the transpose of `broadcast_in_dim`), applied to a *linear*
expression of the cotangent whose coefficients are broadcasts along those
same axes: sum_g(ct_g * c) = c * sum_g(ct_g). Doing the sum first makes the
backward of the GQA "expand" XSA form as cheap as the "unsqueeze" form's.

`plan(producer, atom, axes)` analyses, without emitting anything, how
`reduce_sum(atom, axes)` distributes through the producers of `atom`:

    mul/div by a factor constant along `axes`   -> factor out (squeezed)
    neg                                        -> sink into the operand
    add / sub / add_any                        -> sink into both operands
    broadcast_in_dim with `axes` all real      -> sink into its operand
    reshape that only adds/drops size-1 dims   -> sink through it
    reduce_sum over other axes                 -> commute, sink inside
    anything else                              -> leaf: reduce_sum here

It returns None unless at least one factor comes out (otherwise nothing is
saved). The walk visits at most `MAX_NODES` producers per root, so a rule
call costs O(1) in the size of the graph. `emit(ctx, plan)` builds it.

A size-1 axis counts as constant (summing it is a reshape).
"""

from __future__ import annotations

from jax import lax

MAX_NODES = 48
_ADD = frozenset({"add", "add_any", "sub"})


def _const_along(producer, atom, axes):
    """(x, dims) if atom = broadcast(x) is constant along every axis in axes."""
    from jaxbackend.passes.hoist_broadcast import _source

    x, dims, s = _source(producer, atom)
    xs = x.aval.shape
    real = {d for j, d in enumerate(dims) if xs[j] == s[d] and s[d] > 1}
    if any(a in real for a in axes):
        return None
    return x, dims


def _size1_reshape_map(in_shape, out_shape):
    """Axis map in->out for a reshape that only inserts/removes size-1 dims."""
    big_in = [i for i, n in enumerate(in_shape) if n != 1]
    big_out = [i for i, n in enumerate(out_shape) if n != 1]
    if [in_shape[i] for i in big_in] != [out_shape[i] for i in big_out]:
        return None
    return dict(zip(big_out, big_in))


def plan(producer, atom, axes):
    budget = [MAX_NODES]
    node = _plan(producer, atom, tuple(sorted(axes)), budget)
    return node if node is not None and node[0] != "leaf" and _useful(node) else None


def _useful(node) -> bool:
    """Does the plan factor anything out (else it saves nothing)?"""
    kind = node[0]
    if kind == "factor":
        return True
    if kind == "leaf":
        return False
    if kind == "add":
        return _useful(node[2]) or _useful(node[3])
    return _useful(node[1])  # neg, bcast, reshape, reduce: one child


def _fits(op_shape, shape) -> bool:
    """Operand shape allowed in an elementwise op with result `shape`: equal,
    scalar, or equal rank with size-1 dims (implicit broadcast, JAX 0.10)."""
    return op_shape == () or (len(op_shape) == len(shape)
                              and all(n in (1, m) for n, m in zip(op_shape, shape)))


def _plan(producer, atom, axes, budget):
    leaf = ("leaf", atom, axes)
    budget[0] -= 1
    if budget[0] <= 0 or not axes:
        return leaf
    eqn = producer(atom)
    if eqn is None:
        return leaf
    name, shape = eqn.primitive.name, tuple(atom.aval.shape)
    ones = tuple(a for a in axes if shape[a] == 1)
    if ones:  # summing a size-1 axis is a reshape: sum the others, then drop these
        big = tuple(a for a in axes if shape[a] != 1)
        out_shape = tuple(n for a, n in enumerate(shape) if a not in axes)
        return ("reshape", _plan(producer, atom, big, budget), out_shape)
    if name in ("mul", "div") and all(_fits(v.aval.shape, shape) for v in eqn.invars):
        a, b = eqn.invars
        sides = [(a, b)] if name == "div" else [(a, b), (b, a)]
        for var, fac in sides:
            if var.aval.shape != shape:
                continue
            c = (fac, None) if fac.aval.shape == () else _const_along(producer, fac, axes)
            if c is not None:
                return ("factor", name, _plan(producer, var, axes, budget), c,
                        tuple(fac.aval.shape), axes, var is eqn.invars[0])
        return leaf
    if name == "neg":
        return ("neg", _plan(producer, eqn.invars[0], axes, budget))
    if name in _ADD and all(v.aval.shape == shape for v in eqn.invars):
        return ("add", name, _plan(producer, eqn.invars[0], axes, budget),
                _plan(producer, eqn.invars[1], axes, budget))
    if name == "broadcast_in_dim" and len(eqn.invars) == 1:
        x = eqn.invars[0]
        dims = tuple(int(d) for d in eqn.params["broadcast_dimensions"])
        inv = {d: j for j, d in enumerate(dims)}
        if all(a in inv and x.aval.shape[inv[a]] == shape[a] for a in axes):
            x_axes = tuple(sorted(inv[a] for a in axes))
            out_axes = [a for a in range(len(shape)) if a not in axes]
            out_shape = tuple(shape[a] for a in out_axes)
            new_dims = tuple(out_axes.index(d) for j, d in enumerate(dims) if j not in x_axes)
            return ("bcast", _plan(producer, x, x_axes, budget), out_shape, new_dims)
        return leaf
    if name == "reshape" and eqn.params.get("dimensions") is None and len(eqn.invars) == 1:
        x = eqn.invars[0]
        m = _size1_reshape_map(tuple(x.aval.shape), shape)
        if m is not None and all(a in m or shape[a] == 1 for a in axes):
            x_axes = tuple(sorted(m[a] for a in axes if a in m))
            out_shape = tuple(n for a, n in enumerate(shape) if a not in axes)
            return ("reshape", _plan(producer, x, x_axes, budget), out_shape)
        return leaf
    if name == "reduce_sum":
        x = eqn.invars[0]
        other = tuple(int(a) for a in eqn.params["axes"])
        kept = [a for a in range(len(x.aval.shape)) if a not in other]
        x_axes = tuple(sorted(kept[a] for a in axes))
        # after summing x_axes first, the `other` axes shift down
        rest = [a for a in range(len(x.aval.shape)) if a not in x_axes]
        return ("reduce", _plan(producer, x, x_axes, budget), tuple(rest.index(a) for a in other))
    return leaf


def _op(ctx, name, fn, args, *key):
    # lax functions (not raw binds): they fill every parameter a primitive
    # expects in this JAX version (e.g. `out_dtype` of binary ops in 0.10).
    return ctx.emit(fn, args, ("sink", name) + key)[0]


def emit(ctx, node):
    kind = node[0]
    if kind == "leaf":
        _, atom, axes = node
        if not axes:
            return atom
        shape = tuple(n for a, n in enumerate(atom.aval.shape) if a not in axes)
        if all(atom.aval.shape[a] == 1 for a in axes):
            return _op(ctx, "reshape", lambda x: lax.reshape(x, shape), [atom], shape)
        return _op(ctx, "sum", lambda x: lax.reduce_sum(x, axes), [atom], axes)
    if kind == "neg":
        return _op(ctx, "neg", lax.neg, [emit(ctx, node[1])])
    if kind == "add":
        _, name, a, b = node
        fn = lax.sub if name == "sub" else lax.add
        return _op(ctx, fn.__name__, fn, [emit(ctx, a), emit(ctx, b)])
    if kind == "bcast":
        _, child, out_shape, dims = node
        x = emit(ctx, child)
        if tuple(x.aval.shape) == out_shape and dims == tuple(range(len(out_shape))):
            return x
        return _op(ctx, "bcast", lambda v: lax.broadcast_in_dim(v, out_shape, dims), [x],
                   out_shape, dims)
    if kind == "reshape":
        _, child, out_shape = node
        x = emit(ctx, child)
        if tuple(x.aval.shape) == out_shape:
            return x
        return _op(ctx, "reshape", lambda v: lax.reshape(v, out_shape), [x], out_shape)
    if kind == "reduce":
        _, child, other = node
        x = emit(ctx, child)
        return _op(ctx, "sum", lambda v: lax.reduce_sum(v, other), [x], other) if other else x
    _, name, child, (fx, fdims), fshape, axes, var_first = node
    from jaxbackend.passes.hoist_broadcast import _squeeze_to

    s = emit(ctx, child)
    keep = tuple(a for a in range(len(fshape)) if a not in axes)
    if fdims is None:  # a scalar factor
        f = fx
    else:  # the factor without the summed axes (its own size-1 dims kept)
        f = _op(ctx, "factor", lambda x: _squeeze_to(x, fdims, keep, fshape), [fx],
                fdims, keep, fshape)
    fn = lax.mul if name == "mul" else lax.div
    args = [s, f] if var_first or name == "div" else [f, s]
    return _op(ctx, name, fn, args)
