"""`fuse_projections`: undo `reshape -> dot_general -> reshape` flattening.

Precondition: calls inlined (`inline_calls`) so a chain split across a `jit`
boundary is visible; otherwise any ClosedJaxpr.

Hand-written models (`x.reshape(-1, d) @ w`) and Flax layers that flatten
emit, forward and backward,

    F  (forward / input grad)  y = reshape(dot_general(reshape(x, [M, K]), w), [*batch, N])
    W  (weight grad)           dw = dot_general(reshape(x, [M, K]), reshape(g, [M, N]),
                                                contracting M with M)

with M = prod(batch). Both hide the batch dims (e.g. `batch`, `time`) from
the sharding search. This pass replaces F by one contraction of `x` (rank >=
3) with `w` over K whose result keeps `*batch`, and W by one contraction of
`x` and `g` over all batch dims. Where the names are known (both operands
are outputs of named `einsum` equations) the contraction is emitted as a
named `einsum`; otherwise as a `dot_general` (jnp code has no names).

Invariant established: `remaining(closed) == 0`: no F chain and no W chain
whose `x` is free to transpose (below) anywhere (sub-jaxprs included). The flattening reshapes become dead when
nothing else reads them; `dce` removes them.

Leaves alone (conservative matchers): reshapes that also transpose, any
flatten that is not exactly `[*batch, K] -> [prod(batch), K]` with rank >= 3,
an unflatten whose batch dims differ from the flatten's, dot_generals with
batch dimensions or a weight that is not rank 2, an F chain whose dot or
unflatten carries an explicit output sharding (it names the 2-D shape,
which the fused contraction does not have), and everything else.

Never costs more than the 2-D dot: a W chain is declined unless its `x`
can be transposed for free (`_free_to_transpose`). The fused W contracts
several dims of its lhs, so XLA compiles it with `x` transposed to
[K, *batch]; the 2-D dot contracts dim 0 of the flat `x` in place. The
transpose is free only when it fuses into x's producer: `x` comes, through
non-transposing reshapes, from an element-wise equation or a transpose,
and each value on that path (the flat `x` included) has no other reader.
Otherwise (x a jaxpr input, a dot output, or read again, as the output
cotangent is by the input-gradient chain) XLA writes a second, transposed
copy of x: flops and bytes the 2-D dot does not spend. `g`, the rhs, is
already in XLA's canonical [contracting, free] order. F chains cost nothing:
the rank-3 operand of the fused contraction is a bitcast of the flat one.

When it preserves `jax.jit`'s results. The fused contraction multiplies the
same pairs of elements and sums, for each output element, the same K (F) or
M (W) products as the 2-D dot did: the reshapes only regroup indices and
never convert. It takes the dot's precision and accumulation dtype
unchanged (`_jax.dot_options`) (so the same algorithm class and accumulation dtype) and the
same operand dtypes (x, w, g themselves). Hence:

* integers (int8 accumulated in int32 included): exactly,
  overflow included: the sum is accumulated in the same dtype, and
  wrapping addition is associative and commutative, so the order XLA picks
  for either dot does not matter;
* floats: up to rounding of the summation order, which XLA chooses per dot
  shape; the nan/inf pattern is the same (nan iff a product is nan or
  products of both infinite signs occur), except where a reordered partial
  sum reaches the overflow threshold in one order only, as for any dot;
* dtype and weak type: the same, and checked: a replacement whose shape,
  dtype or weak type differs from the equation it replaces is declined.
"""

from __future__ import annotations

import functools
import math

from jaxbackend import _jax
from jaxbackend.named._einsum import einsum
from jaxbackend.passes import _rewrite


def _flattened(ctx_producer, atom):
    """x if `atom = reshape(x, [prod(x.shape[:-1]), x.shape[-1]])`, rank(x) >= 3."""
    eqn = ctx_producer(atom)
    if eqn is None or eqn.primitive.name != "reshape" or len(eqn.invars) != 1:
        return None
    if _jax.reshape_transposes(eqn):
        return None
    x = eqn.invars[0]
    shape = tuple(x.aval.shape)
    if len(shape) < 3:
        return None
    if tuple(atom.aval.shape) != (math.prod(shape[:-1]), shape[-1]):
        return None
    return x


def _is_plain_2d_dot(eqn, lhs_contract, rhs_contract):
    (lc, rc), (lb, rb) = _jax.dot_dimension_numbers(eqn)
    return (tuple(lb) == () and tuple(rb) == () and tuple(lc) == (lhs_contract,)
            and len(eqn.invars[0].aval.shape) == 2 and len(eqn.invars[1].aval.shape) == 2
            and tuple(rc) == (rhs_contract,))


def _match_forward(producer, eqn):
    """F: eqn is the unflattening reshape. Returns (x, w, c, dot) or None."""
    if (_jax.reshape_transposes(eqn) or len(eqn.invars) != 1
            or _jax.has_sharding_annotation(eqn)):
        return None
    dot = producer(eqn.invars[0])
    if (dot is None or dot.primitive.name != "dot_general"
            or _jax.has_sharding_annotation(dot)):
        return None
    w = dot.invars[1]
    c = next((c for c in (0, 1) if _is_plain_2d_dot(dot, 1, c)), None)
    if c is None:
        return None
    x = _flattened(producer, dot.invars[0])
    if x is None:
        return None
    batch = tuple(x.aval.shape[:-1])
    n = w.aval.shape[1 - c]
    if tuple(eqn.outvars[0].aval.shape) != batch + (n,):
        return None
    return x, w, c, dot


def _match_weight_grad(producer, readers, eqn):
    """W: eqn is dot_general(flat x, flat g) contracting the flat dim, where
    x's layout change is free (`_free_to_transpose`)."""
    if eqn.primitive.name != "dot_general" or not _is_plain_2d_dot(eqn, 0, 0):
        return None
    x = _flattened(producer, eqn.invars[0])
    g = _flattened(producer, eqn.invars[1])
    if x is None or g is None or tuple(x.aval.shape[:-1]) != tuple(g.aval.shape[:-1]):
        return None
    if not _free_to_transpose(producer, readers, x, eqn.invars[0]):
        return None
    return x, g


def _free_to_transpose(producer, readers, x, flat):
    """Whether XLA can lay `x` out as [K, *batch] at no cost.

    A dot contracting several dims of its lhs is compiled with the lhs
    transposed to [free, contracting] (XLA's dot canonicalisation), while the
    2-D dot it replaces contracts dim 0 in place. That transpose is free when
    it fuses into x's producer: an element-wise equation (a loop fusion that
    writes the transposed layout instead) or a transpose (two transposes
    compose into one), reached through non-transposing reshapes (bitcasts),
    each value on the way read once (`flat` by the dot only). A value with
    another reader needs its old layout too: XLA recomputes the producer into
    a second, transposed buffer (more flops and bytes than the 2-D dot)."""
    if readers.get(flat, 0) != 1:
        return False
    while True:
        eqn = producer(x)
        if eqn is None or readers.get(x, 0) != 1:
            return False        # an input, or read elsewhere: a real copy
        name = eqn.primitive.name
        if name in _jax.ELEMENTWISE or name == "transpose":
            return True
        if name != "reshape" or _jax.reshape_transposes(eqn) or len(eqn.invars) != 1:
            return False
        x = eqn.invars[0]


def _names(producer, atom):
    eqn = producer(atom)
    if eqn is not None and eqn.primitive.name == "einsum":
        return _jax.einsum_dims(eqn)[2]
    return None


def _emit(ctx, x, y, lhs_c, rhs_c, dot, names):
    # the dot's precision and accumulation dtype carried over: same
    # algorithm class and accumulation dtype as the 2-D dot (module doc)
    if names is not None:
        lhs_dims, rhs_dims, out_dims = names
        opts = _jax.dot_options(dot)
        key = ("fuse.einsum", names, _jax.params_key(opts))
        return ctx.emit(lambda a, b: einsum(a, b, lhs_dims=lhs_dims, rhs_dims=rhs_dims,
                                            out_dims=out_dims, **opts), [x, y], key)
    dn = ((tuple(lhs_c), tuple(rhs_c)), ((), ()))
    return ctx.bind(dot.primitive, [x, y], **_jax.dot_general_params(dot, dn))


def _forward_rule(ctx, eqn):
    m = _match_forward(ctx.producer, eqn)
    if m is None:
        return None
    x, w, c, dot = m
    r = len(x.aval.shape)
    names = None
    xn, wn = _names(ctx.producer, x), _names(ctx.producer, w)
    if xn is not None and wn is not None and xn[-1] == wn[c] and wn[1 - c] not in xn:
        names = (xn, wn, xn[:-1] + (wn[1 - c],))
    out = _rewrite.same_types(eqn, _emit(ctx, x, w, (r - 1,), (c,), dot, names),
                              "fused contraction")
    ctx.count("forward chain fused")
    return out


def _weight_grad_rule(readers, ctx, eqn):
    m = _match_weight_grad(ctx.producer, readers, eqn)
    if m is None:
        return None
    x, g = m
    r = len(x.aval.shape)
    names = None
    xn, gn = _names(ctx.producer, x), _names(ctx.producer, g)
    if (xn is not None and gn is not None and xn[:-1] == gn[:-1] and xn[-1] != gn[-1]):
        names = (xn, gn, (xn[-1], gn[-1]))
    batch = tuple(range(r - 1))
    out = _rewrite.same_types(eqn, _emit(ctx, x, g, batch, batch, eqn, names), "fused contraction")
    ctx.count("weight-grad chain fused")
    return out


def fuse_projections(closed):
    """Replace flatten-dot-unflatten chains by batch-keeping contractions."""
    # reader counts of the input graph: a W rule decides before the later
    # readers of its operands are walked (equations it keeps keep their vars)
    rules = {"reshape": _forward_rule,
             "dot_general": functools.partial(_weight_grad_rule, _rewrite.use_counts(closed))}
    return _rewrite.rewrite(closed, rules)


def remaining(closed) -> int:
    """Number of F and W chains left, sub-jaxprs included (the equations the
    rules' matchers accept)."""
    total, readers = 0, _rewrite.use_counts(closed)
    for jaxpr in _rewrite.iter_jaxprs(closed):
        producer = _rewrite.Producers(jaxpr.eqns)
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "reshape" and _match_forward(producer, eqn) is not None:
                total += 1
            elif _match_weight_grad(producer, readers, eqn) is not None:
                total += 1
    return total
