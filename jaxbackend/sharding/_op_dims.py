"""Per-primitive dim identities: which axes of an equation are the same
dim, and the equation's iteration space for the cost model.

Each function here is the dim rule of its primitives, registered into the
table `_graph` owns (`_graph.register`); `_walk.build` imports this module
once. Precondition: called by `_walk._walk` once per non-call equation as
`rule(g, eqn, ins, outs, mult)`, `g` the `_graph.Builder`, `ins` the graph
ids of the operands (None for literals), `outs` fresh ids for the results.
Each rule unifies positions in the builder's union-find and appends one
`Op`: its iteration dims (one per distinct dim of the computation: the
result's axes, then the summed ones), and for each operand and result an
axis map from its axes to iteration dims. Equations it does not know get
the default rule: elementwise on equal-sized aligned axes (right for `lax`
elementwise, select and convert). Cumulative ops, `sort`, `top_k`, `rev`
and `fft` are elementwise but along their axes, which each result entry
reads whole: the operands must hold them whole (`REPLICATED`), so sharding
one is charged the gather XLA does. An operand axis whose size
differs from the result's (sliced, split, padded, pooled) must be whole
(`REPLICATED`, charged a full gather: XLA may exchange only halos): shard
bounds miss the slices' (an LSTM's gates split from one projection sharded
on the gate dim were modelled free, XLA moved them by all-to-alls and
permutes, and the plan ran 2-3x slower than data parallel). A slice's
result axis of size 1 (one row read, `passes._stacks.corner`) leaves the
operand's axis free: XLA sends that row. Primitive params are read
through `jaxbackend._jax` accessors only.

Kinds: `contract` (dot_general, einsum, gather, scatter-add: a summed or
collapsed dim that is sharded leaves partial results that must be reduced),
`reduce` (the same, one operand), `map` (everything else: no communication
beyond resharding operands).
"""

from __future__ import annotations

import math

from jaxbackend import _jax
from jaxbackend.sharding._graph import REPLICATED, UNMAPPED, Op, register, register_default

# Reads of a part of their operand (a size-1 result axis reads one row of it)
_READS = frozenset({"slice", "dynamic_slice", "split"})
# argmax / argmin reduce `axes` like the reductions, to an index.
_REDUCTIONS = sorted(_jax.REDUCTIONS | {"argmax", "argmin"})


def _numel(g, v) -> int:
    return math.prod(g.shapes[v]) if v is not None else 1


def _map_op(g, ins_maps, out, mult, kind="map", extra=(), reduced=(), flops=None, bitcast=False):
    """Iteration dims = `out`'s axes (+ `extra` (var, axis) positions);
    `bitcast`: the op moves no data (a row-major reshape or squeeze)."""
    n = len(g.shapes[out])
    iclass = tuple((out, a) for a in range(n)) + tuple(extra)
    isizes = tuple(g.shapes[out]) + tuple(g.shapes[v][a] for v, a in extra)
    op = Op(kind=kind, mult=mult, isizes=isizes, iclass=iclass, ins=tuple(ins_maps),
            outs=((out, tuple(range(n))),), reduced=tuple(reduced),
            flops=float(_numel(g, out) if flops is None else flops), bitcast=bitcast)
    g.ops.append(op)
    return op


@register_default
def _default(g, eqn, ins, outs, mult):
    if not outs:
        return
    out = outs[0]
    shape = g.shapes[out]
    read = eqn.primitive.name in _READS
    maps = []
    for v in ins:
        if v is None:
            continue
        if len(g.shapes[v]) != len(shape):
            maps.append((v, (UNMAPPED,) * len(g.shapes[v])))
            continue
        m = []
        for a, (n, k) in enumerate(zip(g.shapes[v], shape)):
            if n == k:
                g.union(v, a, out, a)
                m.append(a)
            else:   # a one-row read moves at most that row: no requirement
                m.append(UNMAPPED if k == 1 and read else REPLICATED)
        maps.append((v, tuple(m)))
    for w in outs[1:]:
        if g.shapes[w] == shape:
            for a in range(len(shape)):
                g.union(w, a, out, a)
    return _map_op(g, maps, out, mult)


@register(*_jax.ALONG_AXES)
def _along(g, eqn, ins, outs, mult):
    """The default rule, with the axes the op works along whole on every
    operand (module docstring)."""
    op = _default(g, eqn, ins, outs, mult)
    if op is None:
        return
    along = set(_jax.along_axes(eqn))
    ins_maps = tuple((v, tuple(REPLICATED if a in along else x for a, x in enumerate(m)))
                     for v, m in op.ins)
    g.ops[-1] = op._replace(ins=ins_maps)   # the op `_default` just appended


@register("transpose")
def _transpose(g, eqn, ins, outs, mult):
    (v,), (out,) = ins, outs
    perm = _jax.transpose_permutation(eqn)
    m = [0] * len(perm)
    for i, p in enumerate(perm):
        g.union(v, p, out, i)
        m[p] = i
    _map_op(g, [(v, tuple(m))], out, mult, flops=0)


@register("broadcast_in_dim")
def _broadcast(g, eqn, ins, outs, mult):
    (v, *_), (out,) = ins, outs
    if v is None:
        return _map_op(g, [], out, mult, flops=0)
    m = []
    for a, d in enumerate(_jax.broadcast_dimensions(eqn)):
        if g.shapes[v][a] == g.shapes[out][d]:
            g.union(v, a, out, d)
            m.append(d)
        else:
            m.append(UNMAPPED)
    _map_op(g, [(v, tuple(m))], out, mult, flops=0)


@register("squeeze")
def _squeeze(g, eqn, ins, outs, mult):
    (v,), (out,) = ins, outs
    drop = {d % len(g.shapes[v]) for d in _jax.squeeze_dimensions(eqn)}
    m, j = [], 0
    for a in range(len(g.shapes[v])):
        if a in drop:
            m.append(UNMAPPED)
        else:
            g.union(v, a, out, j)
            m.append(j)
            j += 1
    _map_op(g, [(v, tuple(m))], out, mult, flops=0, bitcast=True)


@register("reshape")
def _reshape(g, eqn, ins, outs, mult):
    v, out = ins[0], outs[0]
    src, dst = g.shapes[v], g.shapes[out]
    m = [UNMAPPED] * len(src)
    # An empty array (a 0 among the sizes) has no element to place: its axes
    # correspond to nothing, and the products below would never meet.
    a_ax = [a for a, n in enumerate(src) if n != 1] if 0 not in src else []
    b_ax = [b for b, n in enumerate(dst) if n != 1]
    i = j = 0
    while i < len(a_ax) and j < len(b_ax):
        gi, gj = [a_ax[i]], [b_ax[j]]
        pa, pb = src[a_ax[i]], dst[b_ax[j]]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                gi.append(a_ax[i]); pa *= src[a_ax[i]]; i += 1  # noqa: E702
            else:
                gj.append(b_ax[j]); pb *= dst[b_ax[j]]; j += 1  # noqa: E702
        # A 1-1 group is the same dim; a merge/split records the merged axis
        # as a product of the others (sharded as its major factor); minor
        # input factors of a merge must be unsharded.
        if len(gi) == 1 and len(gj) == 1:
            g.union(v, gi[0], out, gj[0])
        elif len(gj) == 1:
            g.set_factors(g.pos(out, gj[0]), [g.pos(v, a) for a in gi])
        elif len(gi) == 1:
            g.set_factors(g.pos(v, gi[0]), [g.pos(out, b) for b in gj])
        else:
            g.union(v, gi[0], out, gj[0])
        m[gi[0]] = gj[0]
        for a in gi[1:]:
            m[a] = REPLICATED
    _unstack_split(g, v, out)
    _map_op(g, [(v, tuple(m))], out, mult, flops=0, bitcast=True)


def _unstack_split(g, v, out) -> None:
    """`v` = concatenate(parts, 0) of n parts of one shape s, reshaped to
    (n,) + s: that is jnp.stack(parts) (`reroll` stacks per-layer weights
    this way, `passes._stacks.stack`), so out[i, j, ...] = parts[i][j, ...]:
    each part's axis a is out's axis a + 1. The concatenate rule unified the
    other axes already; axis 0 it could not (a part's s[0] rows are not the
    result's n * s[0]), and without this the per-layer weights' first dim
    was a key of its own, unknown to the scan body's names (a 32-layer step
    searched 6 such keys more: 4096x the grid).

    Such a stack is emitted on a new leading axis (`Plan.stack_eqns`) when
    the plan shards the parts' axis 0, so the concatenate keeps each part's
    layout: its parts' axis 0 asks for no gather here (measured: as one
    concatenate of the merged rows, XLA all-to-alls every sharded part, 36
    MiB per device on a 16-layer MLP; on a new axis, nothing).

    The concatenate's iteration space becomes `out`'s, (n,) + s, so each part's
    axis a is iteration dim a + 1 (no gather, the parts keep their layout) and
    its copy is charged per device as the parts are sharded. Over `v`'s own
    axes it was charged whole on every device wherever the parts' axis 0 is
    sharded, since `v`'s merged axis 0 follows its major factor, the layers
    (measured: a step whose forward is not rolled, so reroll stacks each
    layer's batch-major activations for the rolled backward, was modelled
    52 ms slower under data parallelism than it is, and the search sharded
    the sequence instead, for 6x data parallelism's bytes in the HLO)."""
    hit = g.stack_parts.get(v)
    if hit and g.shapes[out] == (len(hit[0]),) + g.shapes[hit[0][0]]:
        parts, i = hit
        for w in parts:
            g.union(w, 0, out, 1)
        n = len(g.shapes[out])
        g.ops[i] = g.ops[i]._replace(
            isizes=tuple(g.shapes[out]), iclass=tuple((out, a) for a in range(n)),
            ins=tuple((w, tuple(range(1, n))) for w in parts),
            # v's axis 0 merges out's axes 0 and 1; it follows the major one
            outs=((v, (0,) + tuple(range(2, n))),))
        g.stacks.add(v)


@register(*_REDUCTIONS)
def _reduce(g, eqn, ins, outs, mult):
    v, out = ins[0], outs[0]
    axes = tuple(a % len(g.shapes[v]) for a in _jax.reduce_axes(eqn))
    kept = [a for a in range(len(g.shapes[v])) if a not in axes]
    for j, a in enumerate(kept):
        g.union(v, a, out, j)
    m = [0] * len(g.shapes[v])
    for j, a in enumerate(kept):
        m[a] = j
    for k, a in enumerate(axes):
        m[a] = len(kept) + k
    n_out = len(kept)
    _map_op(g, [(v, tuple(m))], out, mult, kind="reduce", extra=[(v, a) for a in axes],
            reduced=tuple(range(n_out, n_out + len(axes))), flops=_numel(g, v))


@register("dot_general")
def _dot_general(g, eqn, ins, outs, mult):
    lhs, rhs = ins
    out = outs[0]
    (lc, rc), (lb, rb) = _jax.dot_dimension_numbers(eqn)
    nl, nr = len(g.shapes[lhs]), len(g.shapes[rhs])
    lfree = [a for a in range(nl) if a not in lc and a not in lb]
    rfree = [a for a in range(nr) if a not in rc and a not in rb]
    ml, mr = [0] * nl, [0] * nr
    o = 0
    for a, b in zip(lb, rb):
        g.union(lhs, a, out, o); g.union(rhs, b, out, o)  # noqa: E702
        ml[a] = mr[b] = o
        o += 1
    for a in lfree:
        g.union(lhs, a, out, o)
        ml[a] = o
        o += 1
    for b in rfree:
        g.union(rhs, b, out, o)
        mr[b] = o
        o += 1
    for k, (a, b) in enumerate(zip(lc, rc)):
        g.union(lhs, a, rhs, b)
        ml[a] = mr[b] = o + k
    flops = 2 * _numel(g, out) * math.prod(g.shapes[lhs][a] for a in lc)
    _map_op(g, [(lhs, tuple(ml)), (rhs, tuple(mr))], out, mult, kind="contract",
            extra=[(lhs, a) for a in lc], reduced=tuple(range(o, o + len(lc))), flops=flops)


@register("einsum")
def _einsum(g, eqn, ins, outs, mult):
    lhs, rhs = ins
    out = outs[0]
    ld, rd, od = _jax.einsum_dims(eqn)
    for v, dims in ((lhs, ld), (rhs, rd), (out, od)):
        for a, d in enumerate(dims):
            g.label(v, a, d)
    contracted = [d for d in ld if d in rd and d not in od]
    order = list(od) + contracted
    idx = {d: i for i, d in enumerate(order)}
    flops = 2 * _numel(g, out) * math.prod(g.shapes[lhs][ld.index(d)] for d in contracted)
    _map_op(g, [(lhs, tuple(idx[d] for d in ld)), (rhs, tuple(idx[d] for d in rd))], out, mult,
            kind="contract", extra=[(lhs, ld.index(d)) for d in contracted],
            reduced=tuple(range(len(od), len(order))), flops=flops)


@register("conv_general_dilated")
def _conv(g, eqn, ins, outs, mult):
    """A convolution is a contraction over the input features: batch with
    batch, out feature with the kernel's, in features summed (partial sums
    where they are sharded, as for a dot; a weight gradient's conv sums the
    batch this way). Spatial and window axes must be whole (REPLICATED), so a
    sharded one is charged a full gather (XLA exchanges halos, which cost
    less: an overcharge, never a plan that looks cheaper than it runs), and
    so must a grouped convolution's grouped axes; a kernel's window is
    never sharded (`WINDOW`). Left to the default
    rule, a conv looked element-wise and one flop per output, and a ResNet
    step was planned channel-parallel (its inputs' and outputs' channels of
    equal size unified) for 80x data parallel's collective bytes."""
    lhs, rhs = ins
    out = outs[0]
    if lhs is None or rhs is None:
        return _default(g, eqn, ins, outs, mult)
    ((lb, lf, *_), (ro, ri, *window), (ob, of, *_)), (groups, batch_groups) = _jax.conv_dims(eqn)
    # A kernel's window axis (a window axis a parameter holds: `finish`)
    # is never sharded: the kernel's gradient is a conv whose result
    # spatial axes are that window, which XLA's partitioner cannot split
    # (sharded, the search saw that conv's work halved; XLA replicated and
    # re-sharded it, an involuntary rematerialisation)
    g.windows.update(g.pos(rhs, w) for w in window)
    ml, mr = [REPLICATED] * len(g.shapes[lhs]), [REPLICATED] * len(g.shapes[rhs])
    if batch_groups == 1:
        g.union(lhs, lb, out, ob)
        ml[lb] = ob
    g.union(rhs, ro, out, of)
    mr[ro] = of
    n = len(g.shapes[out])
    extra, reduced = [], ()
    if groups == 1:
        g.union(lhs, lf, rhs, ri)
        ml[lf] = mr[ri] = n
        extra, reduced = [(lhs, lf)], (n,)
    flops = 2 * _numel(g, out) * g.shapes[rhs][ri] * math.prod(g.shapes[rhs][a] for a in window)
    _map_op(g, [(lhs, tuple(ml)), (rhs, tuple(mr))], out, mult,
            kind="contract" if groups == 1 else "map", extra=extra, reduced=reduced, flops=flops)


@register("gather")
def _gather(g, eqn, ins, outs, mult):
    operand, indices = ins
    out = outs[0]
    dn, sizes = _jax.gather_parts(eqn)
    shape = g.shapes[operand]
    skip = set(dn.collapsed_slice_dims) | set(dn.operand_batching_dims)
    window = [a for a in range(len(shape)) if a not in skip]
    mo = [UNMAPPED] * len(shape)
    for a, d in zip(window, dn.offset_dims):
        if sizes[a] == shape[a]:
            g.union(operand, a, out, d)
            mo[a] = d
    batch_out = [d for d in range(len(g.shapes[out])) if d not in dn.offset_dims]
    mi = [UNMAPPED] * len(g.shapes[indices])
    # a batching dim pairs an operand dim with an index dim (take_along_axis):
    # each batch element reads its own slice, so the three are one dim
    paired = dict(zip(dn.start_indices_batching_dims, dn.operand_batching_dims))
    for a, d in zip(range(len(g.shapes[indices]) - 1), batch_out):
        g.union(indices, a, out, d)
        mi[a] = d
        if a in paired and shape[paired[a]] == g.shapes[out][d]:
            g.union(operand, paired[a], out, d)
            mo[paired[a]] = d
    n = len(g.shapes[out])
    collapsed = list(dn.collapsed_slice_dims)
    for k, a in enumerate(collapsed):
        mo[a] = n + k
    _map_op(g, [(operand, tuple(mo)), (indices, tuple(mi))], out, mult, kind="contract",
            extra=[(operand, a) for a in collapsed], reduced=tuple(range(n, n + len(collapsed))),
            flops=_numel(g, out))


@register("scatter-add", "scatter_add")
def _scatter_add(g, eqn, ins, outs, mult):
    operand, indices, updates = ins[:3]
    out = outs[0]
    dn = _jax.scatter_dimension_numbers(eqn)
    n = len(g.shapes[out])
    for a in range(n):
        g.union(operand, a, out, a)
    skip = set(dn.inserted_window_dims) | set(dn.operand_batching_dims)
    window = [a for a in range(n) if a not in skip]
    mu = [UNMAPPED] * len(g.shapes[updates])
    for d, a in zip(dn.update_window_dims, window):
        if g.shapes[updates][d] == g.shapes[out][a]:
            g.union(updates, d, out, a)
            mu[d] = a
    scatter = [d for d in range(len(g.shapes[updates])) if d not in dn.update_window_dims]
    mi = [UNMAPPED] * len(g.shapes[indices])
    # a batching dim pairs an index dim with an operand dim (the gradient of
    # take_along_axis): each batch element adds into its own slice, no sum
    paired = dict(zip(dn.scatter_indices_batching_dims, dn.operand_batching_dims))
    summed = []
    for k, d in enumerate(scatter):
        a = paired.get(k)
        if a is not None and g.shapes[updates][d] == g.shapes[out][a]:
            g.union(updates, d, out, a)
            mu[d] = a
        else:
            mu[d] = n + len(summed)
            summed.append(d)
        if k < len(g.shapes[indices]) - 1:
            g.union(indices, k, updates, d)
            mi[k] = mu[d]
    maps = [(operand, tuple(range(n))), (indices, tuple(mi)), (updates, tuple(mu))]
    _map_op(g, maps, out, mult, kind="contract", extra=[(updates, d) for d in summed],
            reduced=tuple(range(n, n + len(summed))), flops=_numel(g, updates))


@register("concatenate")
def _concatenate(g, eqn, ins, outs, mult):
    out, dim = outs[0], _jax.concatenate_dimension(eqn)
    if dim == 0 and None not in ins and len({g.shapes[v] for v in ins}) == 1 and g.shapes[out]:
        # a stack, if a reshape splits it (`_unstack_split`): parts, this op's index
        g.stack_parts[out] = (list(ins), len(g.ops))
    maps = []
    for v in ins:
        if v is None:
            continue
        m = []
        for a in range(len(g.shapes[v])):
            if a == dim:
                m.append(REPLICATED)
            else:
                g.union(v, a, out, a)
                m.append(a)
        maps.append((v, tuple(m)))
    _map_op(g, maps, out, mult, flops=0)


@register("iota")
def _free(g, eqn, ins, outs, mult):
    for out in outs:
        _map_op(g, [], out, mult, flops=0)

