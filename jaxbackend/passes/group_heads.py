"""`group_heads`: contract against K/V heads once, not once per query head.

Precondition: calls inlined (`inline_calls`), so `jnp.repeat` and friends
are plain equations; best after `hoist_broadcast`, which moves casts and
other elementwise work on a repeated K or V above the repeat. Otherwise any
ClosedJaxpr.

Grouped-query attention written the common JAX way copies every KV head
once per query head before the attention contractions:

    k = jnp.repeat(k, g, axis=2)                      # (b, s, kv*g, d)
    k = jnp.broadcast_to(k[:, :, :, None], (b, s, kv, g, d)).reshape(b, s, kv*g, d)
    k = jnp.tile(k, (1, 1, g, 1))                     # query head = g_i*kv + kv_i
    k = jnp.broadcast_to(k, (b, s, g, d))             # one KV head (kv = 1: MQA)
    s = jnp.einsum("bthd,bshd->bhts", q, k)           # a dot_general in the jaxpr

and AD's transpose of the copy sums `g` per-query-head cotangents back:
`reduce_sum(reshape(transpose?(dot_general(...))), group axis)`. Two rules
remove both, forward and backward:

* repeated operand (`dot_general` rule): an operand that is a repeat
  (`broadcast_in_dim` chain + `reshape` merging a created axis with its
  neighbour, or `tile` along one axis, or, for one KV head, a plain
  broadcast of the size-1 head axis; then any view ops: `transpose`,
  `squeeze`, size-1 `broadcast_in_dim`, as `@` emits for a batch of one)
  along an axis that is a batch dim of the contraction. The other
  operand's paired batch axis (size kv*g) is split by a reshape into
  (kv, g) (`repeat` layout: query head = kv_i*g + g_i) or (g, kv) (`tile`
  layout), the contraction runs against the un-repeated operand with kv as
  the batch dim and g a free dim, and its result is reshaped back;
* folded group sum (`reduce_sum` rule): a sum over the group axis (and
  any size-1 axes) of a reshape splitting a batch dim (kv*g) of a
  contraction into adjacent (kv, g) or (g, kv), with size-1 axes added or
  dropped, or (one KV head) a sum over one batch dim itself, through view
  ops. The reshape may be a chain of single-use reshapes (einops' repeat
  transposes to two: split the heads, then insert size-1 axes; row-major
  reshapes compose into one). The split moves onto both operands and g
  becomes a contracted dim, so the kv*g-headed gradient of K or V is never
  written.

Layout: the new contraction computes the same sums whatever its operand
order, so the rules pick the order that copies least in XLA's dot emitters
(operands in [batch, free, contracted] / [batch, contracted, free] order,
no transpose of the large result where avoidable). On CPU this makes the
MaxText form read fewer bytes than the hand-written grouped form
(`benchmarks/gqa.py`). The matchers live in `_group_match`, shared with
`remaining`; this module emits.

Invariant established: `remaining(closed) == 0`: no contraction anywhere
(sub-jaxprs included) reads a repeated operand along a batch dim, and no
group sum of a contraction's batch dim is left. The copies become dead when
nothing else reads them; `dce` removes them.

Leaves alone: repeats along a contracted or free dim of the contraction,
reshapes that transpose or merge more than the head axis, chains through any
other op (a gather, a slice), contractions and reshapes with an explicit
output sharding, group sums whose contraction, transpose or reshape has
another reader (folding would compute the contraction twice), `einsum`
equations (named code writes the group dim by name), and everything else.

When it preserves `jax.jit`'s results (checked where noted):

* repeated operand: every output element is the same sum of the same
  products (the contracted dims are unchanged; only which array the K/V
  element is read from changes): integers exactly; floats up to the order
  XLA picks for the new dot shape, nan/inf pattern the same. Checked: the
  repeat is exact (kv * g equals the merged size, the group axis is created
  by the broadcast, not data), reshape and broadcast keep the dtype, the
  dot's precision and `preferred_element_type` are reused unchanged.
* folded group sum: the g partial sums are added inside the contraction's
  own sum, accumulated in the dot's result dtype, as the `reduce_sum` was
  (checked: same dtype all along the chain, every value on it read once,
  no reshape on it transposes or carries a sharding). Integers: exact,
  overflow included (wrapping addition is associative). Floats: up to summation
  order (one sum instead of a sum of g sums); nan iff a product is nan or
  products of both infinite signs occur, in either program, except where a
  reordered partial sum reaches the overflow threshold in one order only,
  as for any dot. Low-precision results (bfloat16) are rounded once instead
  of per partial sum: no less accurate.
* both: a replacement whose shape, dtype or weak type differs from the
  equation it replaces is declined (`_rewrite.same_types`).
"""

from __future__ import annotations

import math

from jax import lax

from jaxbackend import _jax
from jaxbackend.passes import _group_match, _rewrite


def _unrepeat(r: _group_match.Repeat):
    kept, grouped, bdims, merged, ops = r.small

    def fn(src):
        x = lax.broadcast_in_dim(lax.reshape(src, kept), grouped, bdims)
        return _group_match.apply(lax.reshape(x, merged), ops)
    return fn


def _split_axis(shape, axis, kv, g, minor):
    return tuple(shape[:axis]) + ((kv, g) if minor else (g, kv)) + tuple(shape[axis + 1:])


def _after_split(a, axis):
    """An axis index after `axis` was split in two."""
    return a if a < axis else a + 1


def _dot_rule(ctx, eqn):
    """Repeated operand along a batch dim -> contraction with a group dim."""
    if _jax.has_sharding_annotation(eqn):
        return None
    (lc, rc), (lb, rb) = _jax.dot_dimension_numbers(eqn)
    for side in (0, 1):
        r = _group_match.repeated(ctx.producer, eqn.invars[side], (lb, rb)[side])
        if r is None:
            continue                          # no repeat, or along a contracted or free dim
        out = _grouped_dot(ctx, eqn, side, r)
        ctx.count("repeated operand grouped")
        return _rewrite.same_types(eqn, out, "grouped contraction")
    return None


def _grouped_dot(ctx, eqn, side, r: _group_match.Repeat):
    (lc, rc), (lb, rb) = _jax.dot_dimension_numbers(eqn)
    x, other = eqn.invars[side], eqn.invars[1 - side]
    x_contract, mine = ((lc, lb), (rc, rb))[side]
    o_contract, theirs = ((lc, lb), (rc, rb))[1 - side]
    k = list(mine).index(r.axis)              # batch position of the heads
    p = theirs[k]                             # the other operand's head axis
    kv_ax, g_ax = (p, p + 1) if r.minor else (p + 1, p)
    contract = [_after_split(a, p) for a in o_contract]
    batch = [kv_ax if a == p else _after_split(a, p) for a in theirs]
    # g goes first among the other operand's free axes (a transpose of that
    # operand, the small side of an attention contraction; XLA transposes a
    # dot's operands into [batch, free, contracted] order anyway), so the
    # result holds (kv, g) adjacent when the heads are its last batch dim.
    order = [a for a in range(len(other.aval.shape) + 1) if a != g_ax]
    free_axes = [a for a in order if a not in contract and a not in batch]
    order.insert(order.index(free_axes[0]) if free_axes else len(order), g_ax)
    pos = {a: i for i, a in enumerate(order)}
    o_dims = (tuple(pos[a] for a in contract), tuple(pos[a] for a in batch))
    x_dims = (tuple(x_contract), tuple(mine))
    # result axes by label: ("b", i) batch i (heads: kv), ("g", 0), ("x", a) /
    # ("o", a) free axis a of the repeated / other operand
    x_free = [("x", a) for a in range(len(x.aval.shape)) if a not in x_contract and a not in mine]
    o_free = [("o", a) for a in free_axes]
    heads = [("b", k), ("g", 0)] if r.minor else [("g", 0), ("b", k)]
    want: list = []
    for i in range(len(lb)):
        want += heads if i == k else [("b", i)]
    want += x_free + o_free if side == 0 else o_free + x_free
    # Operand order: the one whose result needs no transpose back (a
    # result-sized copy), else the other operand first (lhs), which keeps
    # its (kv, g) run contiguous for the merge.
    identity = tuple(range(len(want)))
    choices = []
    for o_first in (True, False):
        got = [("b", i) for i in range(len(lb))] + (
            [("g", 0)] + o_free + x_free if o_first else x_free + [("g", 0)] + o_free)
        choices.append((tuple(got.index(w) for w in want), o_first))
    perm, first = next((c for c in choices if c[0] == identity), choices[0])
    (c0, b0), (c1, b1) = (o_dims, x_dims) if first else (x_dims, o_dims)
    split, o_order = _split_axis(other.aval.shape, p, r.kv, r.g, r.minor), tuple(order)
    (small,) = ctx.emit(_unrepeat(r), [r.src], ("group_heads.unrepeat", r.small))
    (o2,) = ctx.emit(lambda o: lax.transpose(lax.reshape(o, split), o_order), [other],
                     ("group_heads.split", split, o_order))
    lhs, rhs = (o2, small) if first else (small, o2)
    (y,) = ctx.bind(eqn.primitive, [lhs, rhs], **_jax.dot_general_params(eqn, ((c0, c1), (b0, b1))))
    shape = tuple(eqn.outvars[0].aval.shape)
    return ctx.emit(lambda y: lax.reshape(lax.transpose(y, perm), shape), [y],
                    ("group_heads.merge", perm, shape))


def _after_transpose(perm, ops) -> tuple:
    """("transpose", perm) then `ops`, two leading transposes composed."""
    if ops and ops[0][0] == "transpose":
        return (("transpose", tuple(perm[i] for i in ops[0][1])),) + tuple(ops[1:])
    return (("transpose", tuple(perm)),) + tuple(ops)


def _copied(shape, batch, contract, lhs: bool) -> int:
    """Elements a dot operand is copied by when its axes are not in the order
    a matrix multiply reads without a transpose: [batch, free, contracted]
    for the lhs, [batch, contracted, free] for the rhs (XLA's CPU and GPU dot
    emitters; size-1 axes do not count)."""
    free = [a for a in range(len(shape)) if a not in batch and a not in contract]
    want = [a for a in list(batch) + (free + list(contract) if lhs else list(contract) + free)
            if shape[a] != 1]
    return 0 if want == sorted(want) else math.prod(shape)


def _sum_rule(ctx, eqn, uses):
    """Group sum of a contraction's batch dim -> g contracted in the dot."""
    m = _group_match.group_sum(ctx.producer, uses, eqn)
    if m is None:
        return None
    dot, ops, kv, g, minor, q = m
    (lc, rc), (lb, rb) = _jax.dot_dimension_numbers(dot)
    shapes, dims = [], []
    for x, c, b in ((dot.invars[0], lc, lb), (dot.invars[1], rc, rb)):
        p = b[q]
        kv_ax, g_ax = (p, p + 1) if minor else (p + 1, p)
        shapes.append(_split_axis(x.aval.shape, p, kv, g, minor))
        dims.append(([_after_split(a, p) for a in c] + [g_ax],
                     tuple(kv_ax if a == p else _after_split(a, p) for a in b)))
    # contracted pairs in the larger operand's axis order, and the operand
    # order that copies fewer elements (operand transposes, and a transpose
    # of the result when the operands swap): the cheaper dot, same sums
    big = int(math.prod(shapes[1]) > math.prod(shapes[0]))
    pairs = sorted(zip(dims[0][0], dims[1][0]), key=lambda ab: ab[big])
    dims = [(tuple(ab[i] for ab in pairs), dims[i][1]) for i in (0, 1)]
    free = [len(s) - len(c) - len(b) for s, (c, b) in zip(shapes, dims)]
    nb = len(lb)
    swap_back = (tuple(range(nb)) + tuple(range(nb + free[1], nb + free[1] + free[0]))
                 + tuple(range(nb, nb + free[1])))
    best = None
    for first in (0, 1):
        a, b = first, 1 - first
        cost = (_copied(shapes[a], dims[a][1], dims[a][0], True)
                + _copied(shapes[b], dims[b][1], dims[b][0], False))
        chain = ops if first == 0 else _after_transpose(swap_back, ops)
        if _group_match.transposes_result(chain):
            cost += math.prod(eqn.invars[0].aval.shape) // g
        if best is None or cost < best[0]:
            best = (cost, first, chain)
    _, first, chain = best
    a, b = first, 1 - first
    ops = [ctx.emit(lambda o: lax.reshape(o, shapes[i]), [dot.invars[i]],
                    ("group_heads.split", shapes[i], None))[0] for i in (a, b)]
    dn = ((dims[a][0], dims[b][0]), (dims[a][1], dims[b][1]))
    (y,) = ctx.bind(dot.primitive, ops, **_jax.dot_general_params(dot, dn))
    shape = tuple(eqn.outvars[0].aval.shape)
    out = ctx.emit(lambda y: lax.reshape(_group_match.apply(y, chain), shape), [y],
                   ("group_heads.merge", chain, shape))
    ctx.count("group sum folded into contraction")
    return _rewrite.same_types(eqn, out, "folded contraction")


def group_heads(closed):
    """Contract against un-repeated K/V heads, forward and backward (module doc)."""
    uses = _rewrite.use_counts(closed)
    return _rewrite.rewrite(closed, {"dot_general": _dot_rule,
                                     "reduce_sum": lambda ctx, eqn: _sum_rule(ctx, eqn, uses)})


def remaining(closed) -> int:
    """Contractions reading a repeated operand along a batch dim, plus group
    sums the `reduce_sum` rule folds, sub-jaxprs included."""
    uses, total = _rewrite.use_counts(closed), 0
    for jaxpr in _rewrite.iter_jaxprs(closed):
        producer = _rewrite.Producers(jaxpr.eqns)
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "reduce_sum":
                total += _group_match.group_sum(producer, uses, eqn) is not None
            elif eqn.primitive.name == "dot_general" and not _jax.has_sharding_annotation(eqn):
                (_, _), (lb, rb) = _jax.dot_dimension_numbers(eqn)
                for x, batch in zip(eqn.invars, (lb, rb)):
                    total += _group_match.repeated(producer, x, batch) is not None
    return total
