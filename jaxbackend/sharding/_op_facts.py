"""What XLA does with an op that the cost model (`_cost`) charges for: the
bytes it moves through memory, and the share of an all-reduce latency it
pays. Precondition: a finished `_graph.Graph` (and, for `traffic`, the
values `_liveness.fused_values` says XLA does not materialise). Read only.

Memory traffic: an elementwise chain is one XLA fusion, reading its inputs
and writing its result once, not once per op; a slice reads only what it
keeps; a reshape is a bitcast. Charging every op all its operands and its
result made replicated elementwise work (a data-parallel AdamW update, a
scan body slicing one layer out of stacked weights) look several times
dearer than it is, and the search paid all-gathers to shard it (
the GPT AdamW step on 8 devices sharded hd, mlp and vocab for 3x data
parallel's collective bytes).

All-reduce latency: XLA's combiner merges independent all-reduces into one
(one latency, the bytes summed). A latency per weight gradient made data
parallel look 38x dearer in latency than its compiled all-reduces.
"""

from __future__ import annotations


def latency_shares(g) -> list:
    """Per op of `g`: the share of one all-reduce latency its all-reduce
    pays. XLA's combiner merges independent all-reduces into one, within one
    computation, not across the iterations of a loop (a scan body's are
    all-reduced once per trip). Two kinds of summing ops are independent:
    * those whose results reach the outputs through non-summing ops only (a
      weight gradient on its way to the optimizer, the loss), as no such
      result feeds another sum;
    * the others at the same depth, the number of summing ops on the longest
      chain before them: an op depends on another only at a greater depth
      (BatchNorm's mean and mean of squares of one input are one all-reduce).
    So the k such ops of one multiplicity (one loop, or the step itself) and
    one kind (terminal, or depth d) pay 1/k each (a data-parallel ResNet step
    was modelled with 65 all-reduce latencies where XLA emitted 33)."""
    # An op that sums no dim of size > 1 (a reduction over size-1 axes) can
    # leave no partial sums: it passes values on like an elementwise op.
    sums = [op.kind != "map" and any(op.isizes[i] > 1 for i in op.reduced) for op in g.ops]
    feeds: set = set()   # vars read by a summing op, directly or through other ops
    for op, s in zip(reversed(g.ops), reversed(sums)):   # program order: readers after writers
        if s or any(v in feeds for v, _ in op.outs):
            feeds.update(v for v, _ in op.ins)
    depth: dict = {}     # var -> summing ops on the longest chain making it
    group: list = []   # per op: (multiplicity, depth or None if terminal), None: no sum
    for op, s in zip(g.ops, sums):
        d = max((depth.get(v, 0) for v, _ in op.ins), default=0)
        if s:
            terminal = not any(v in feeds for v, _ in op.outs)
            group.append((op.mult, None if terminal else d))
            d += 1
        else:
            group.append(None)
        for v, _ in op.outs:
            depth[v] = d
    count: dict = {}
    for k in group:
        if k is not None:
            count[k] = count.get(k, 0) + 1
    return [1.0 if k is None else 1.0 / count[k] for k in group]


def traffic(g, op, fused) -> float:
    """Bytes an op moves through memory, unsharded: its materialised
    operands and result (a fused value stays in registers). A data-movement
    op (`map`: slice, dynamic_slice, a scan reading one layer of a stacked
    weight) reads at most one operand element per result element, so an
    operand counts at most the result's bytes. A reshape or squeeze is a
    bitcast in XLA (row-major layouts): it moves nothing itself, but where
    it ends a fused chain the fusion's write lands on it, and where its
    result is fused into its reader the fusion's read of its operand does."""
    ins = sum(g.nbytes(v) for v, _ in op.ins if v not in fused)
    outs = sum(g.nbytes(v) for v, _ in op.outs if v not in fused)
    if op.bitcast:
        fused_in = any(v in fused for v, _ in op.ins)
        return float(outs if outs and fused_in else 0 if outs else ins)
    cap = sum(g.nbytes(v) for v, _ in op.outs) if op.kind == "map" else float("inf")
    return float(sum(min(g.nbytes(v), cap) for v, _ in op.ins if v not in fused) + outs)
