"""The cost model: step time and memory per device of a graph under plans.

Precondition: a finished `_graph.Graph` and a `MeshSpec`. A plan gives each
*key* (a dim name, or a tied group of unnamed dims) a mesh-axis group as a
bit mask. Everything here is vectorised over N candidate plans at once: a
plan is a column of a `(n_keys, N)` mask array, so the search evaluates each
distinct op once over all the plans it can see.

Layout of a tensor: its axes take their keys' masks in order, and an axis
loses mesh axes an earlier axis of the same tensor already uses (the
per-tensor exception: `scores(time, time_k)` with both names on `seq` keeps
`seq` on `time` only).

Per op (evaluated once per distinct op, times its multiplicity):
* compute: flops / (devices sharing the iteration space) / peak, or bytes
  moved / memory bandwidth, whichever is larger; the bytes are those XLA
  moves, fusion, slices and bitcasts considered (`_op_facts.traffic`);
* operand resharding: an operand sharded on a mesh axis that the op's
  iteration layout does not use on that axis is all-gathered (bytes = the
  gathered per-device buffer), once per variable for all its consumers (as
  XLA reuses one gather); less sharding than needed is a free slice; a
  dim that keeps a minor mesh axis of its group without the major one is
  gathered over the whole group (its tiles are no slices: `_reorders`);
* reduction: summed dims sharded on mesh axes leave partial sums: a
  reduce-scatter onto axes the result wants (if the backend emits one) and an
  all-reduce over the rest (this is where data-parallel gradient reductions
  of replicated weights come from). XLA combines independent all-reduces
  (weight gradients) into one per loop trip: such an all-reduce pays its
  bytes and a share of one latency (`_op_facts.latency_shares`);
* contractions try three iteration layouts (either operand's dims first,
  or the result's) and keep the cheapest, as XLA's SPMD partitioner chooses
  between gathering an operand and reducing a partial result; like XLA, an
  alternative to keeping operands in place must be >10% cheaper to win.
  Reductions always reduce in place (XLA never gathers a reduce's operand).
  A gather's or scatter's route (`route`: operands gathered) is pinned in
  the compiled step, so XLA takes it too.

Collectives use the alpha-beta ring formulas (`_ring`, shared with the HLO
reader) on the group's slowest link, S the full (gathered / unreduced)
buffer. On a profile that holds 16-bit floats as float32 (XLA:CPU), their
temporaries count float32 bytes (`held_bytes`), and so do bfloat16
collectives (`wire_bytes`).

Memory per device: arguments + results + the peak over program order of live
intermediates that XLA materialises (`_liveness` says which, and when) +
gathered copies (all gathered weights, which live from forward to backward,
and the largest other one).

`evaluate` gives one plan's `Cost` (a frozen dataclass, a `Collective` per
kind); the search uses the vectorised `step_time` / `memory` and their
terms.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from jaxbackend.sharding._breakdown import Collective, Cost
from jaxbackend.sharding._graph import REPLICATED
from jaxbackend.sharding._liveness import fused_values, liveness, packed_peak
from jaxbackend.sharding._op_facts import latency_shares, traffic
from jaxbackend.sharding._ring import KINDS as KINDS
from jaxbackend.sharding._ring import ring_time

PREFER_IN_PLACE = 0.9


class Operand(NamedTuple):
    """An operand or result of a distinct op: its layout keys, its bytes as a
    collective moves them (`CostModel.wire_bytes`), and its axis map onto
    the op's iteration dims."""
    keys: tuple
    nbytes: int
    amap: tuple


class Sig(NamedTuple):
    """A distinct op: an `_graph.Op` with variables replaced by their keys
    and sizes, so repeated layers share one signature."""
    kind: str
    isizes: tuple
    ikeys: tuple      # key per iteration dim
    ins: tuple        # Operand per operand
    outs: tuple       # Operand per result
    reduced: tuple
    flops: float
    traffic: float    # bytes of the operands and results XLA materialises (unsharded)
    latency_share: float   # of one latency, its all-reduce pays (`_op_facts`)


class GatherGroup(NamedTuple):
    """Variables gathered together: same layout keys, size and consumers
    (`uses`: (distinct op, operand position) pairs)."""
    keys: tuple
    nbytes: int       # as a collective moves them (`CostModel.wire_bytes`; so is the gathered copy)
    uses: tuple
    is_input: bool
    mult: float       # times gathered per step (the least multiplicity of a consumer, summed)
    n_vars: int       # variables in the group


class _Detail(NamedTuple):
    """One distinct op's terms under N plans (arrays), per collective kind."""
    compute: object
    time: dict        # kind -> seconds
    nbytes: dict      # kind -> bytes moved per device


class CostModel:
    """The model of one `Graph` on one `MeshSpec` (see the module docstring):
    its distinct ops (`sigs`: (Sig, multiplicity) pairs), gather groups and
    memory events, set up once; plans are then evaluated in batches."""

    def __init__(self, graph, mesh, donated=()):
        """`donated`: flags per graph input, True where its buffer is donated
        (results may reuse it; `_liveness`)."""
        self.g, self.mesh = graph, mesh
        g = graph
        self.n_keys = len(g.key_names)
        self._reorders = _reorders(len(mesh.group_size))
        self.var_keys = [tuple(g.class_key[c] for c in cs) for cs in g.var_classes]
        # Distinct ops (layers repeat): signature -> [op, total multiplicity].
        sigs: dict = {}
        consumers: dict = {}   # var -> [(distinct op, operand position)], and its mult
        fused = fused_values(g)
        held, wire = self.held_bytes, self.wire_bytes
        self.op_sig: list = []   # per op of the graph: its distinct op's index (None: never run)
        for op, share in zip(g.ops, latency_shares(g)):
            if op.mult == 0:
                self.op_sig.append(None)
                continue
            sig = Sig(op.kind, op.isizes, tuple(g.class_key[c] for c in op.iclass),
                      tuple(Operand(self.var_keys[v], wire(v), m) for v, m in op.ins),
                      tuple(Operand(self.var_keys[v], wire(v), m) for v, m in op.outs),
                      op.reduced, op.flops, traffic(g, op, fused), share)
            if sig in sigs:
                sigs[sig][1] += op.mult
            else:
                sigs[sig] = [sig, op.mult, len(sigs)]
            self.op_sig.append(sigs[sig][2])
            for j, (v, _) in enumerate(op.ins):
                c = consumers.setdefault(v, [[], op.mult])
                c[0].append((sigs[sig][2], j))
                c[1] = min(c[1], op.mult)
        self.sigs = [(sig, mult) for sig, mult, _ in sigs.values()]
        # Operand all-gathers are charged per variable, not per use: XLA
        # gathers a tensor once for all ops needing the same (or a subset)
        # layout (e.g. FSDP: one gather of a weight serves forward and
        # backward). Variables with the same layout keys, size and consumers
        # are one group.
        groups: dict = {}
        inputs = set(g.invars)
        for v, (uses, mult) in consumers.items():
            gk = (self.var_keys[v], wire(v), tuple(sorted(set(uses))), v in inputs)
            c = groups.setdefault(gk, [0.0, 0])
            c[0] += mult
            c[1] += 1
        self.gather_groups = [GatherGroup(*gk, m, n) for gk, (m, n) in groups.items()]
        given = [v for v, d in zip(g.invars, donated) if d]
        self.liveness = liveness(g, self.var_keys, given, held)
        self.fixed_groups, self.mem_groups, self.mem_points = self.liveness[:3]

    def held_bytes(self, v) -> int:
        """Bytes of var `v` as a temporary: its own, or float32's for a
        16-bit float on a profile that holds those so
        (`HardwareProfile.half_held_as_f32`, XLA:CPU). A loop's state and
        stacked results keep their own (a `while` carries its declared
        types), as do arguments and results (`_liveness`)."""
        g = self.g
        held = v not in g.loop_state and v not in g.pinned
        return self._widened(v, ("bfloat16", "float16") if held else ())

    def wire_bytes(self, v) -> int:
        """Bytes of var `v` in a collective: its own, or float32's for
        bfloat16 on such a profile (XLA:CPU: not for float16)."""
        return self._widened(v, ("bfloat16",))

    def _widened(self, v, dtypes) -> int:
        """v's bytes, as float32's if its dtype is one of `dtypes` on a
        profile that widens them."""
        widen = self.mesh.profile.half_held_as_f32 and self.g.half.get(v) in dtypes
        return self.g.nbytes(v) * (2 if widen else 1)

    # -- layouts ---------------------------------------------------------------
    def layout(self, keys, masks) -> list:
        """Mesh-axis mask per axis of a tensor whose axes have layout `keys`
        under `masks` (per key): an axis loses the mesh axes an earlier axis
        of the same tensor already uses."""
        used = 0
        out = []
        for k in keys:
            m = masks[k] & ~used
            used = used | m
            out.append(m)
        return out


    def _shard(self, mask_list):
        gs = self.mesh.group_size
        s = 1.0
        for m in mask_list:
            s = s * gs[m]
        return s

    def _coll(self, kind, mask, full_bytes, latency_share=1.0):
        """Time of one collective over the mesh group `mask` on a buffer of
        `full_bytes` per device (gathered / unreduced size), paying
        `latency_share` of the latency (a combined all-reduce's share)."""
        ms = self.mesh
        return ring_time(kind, ms.group_size[mask], full_bytes, ms.group_bandwidth[mask],
                         ms.group_latency[mask] * latency_share, ms.profile.rendezvous)

    # -- one distinct op under N plans -------------------------------------------
    def op_cost(self, sig, masks, detail=False):
        """(time without operand gathers, details, per-operand gather masks,
        the compute part of that time). The iteration layout is chosen with
        the gathers counted."""
        best = None
        for order in _orders(sig):
            t, tg, d, ex, c = self._strategy(sig, masks, order, detail)
            if best is None:
                best = (t, tg, d, ex, c)
                continue
            # Like XLA's partitioner, keep operands in place (partial sums,
            # then a reduction) unless moving them is clearly cheaper.
            better = t + tg < PREFER_IN_PLACE * (best[0] + best[1])
            best = (np.where(better, t, best[0]), np.where(better, tg, best[1]),
                    _pick(better, d, best[2]), [np.where(better, a, b) for a, b in zip(ex, best[3])],
                    np.where(better, c, best[4]))
        return best[0], best[2], best[3], best[4]

    def route(self, op_index, masks):
        """How op `op_index` of the graph runs under one plan (`masks[k]` an
        int per key), as the model costs it: (per operand, the mesh-axis mask
        per axis it is gathered to, None where it is used in place; per
        result axis, the mask its iteration layout produces after its
        reduction, None where that is the result's layout). None: as laid
        out. `Plan.contraction_specs` pins these for gathers and scatters,
        so that XLA's partitioner runs them the way they were costed (left to
        itself, it may reshard an operand instead, even one it cannot reshard
        but by replicating it)."""
        i = self.op_sig[op_index]
        if i is None:
            return None
        sig = self.sigs[i][0]
        masks = [np.asarray(m) for m in masks]
        best, chosen = None, None
        for order in _orders(sig):
            t, tg = self._strategy(sig, masks, order, False)[:2]
            if best is None or t + tg < PREFER_IN_PLACE * best:
                best, chosen = t + tg, order
        imask = self._iteration_masks(sig, masks, chosen)
        ins = []
        for keys, _, amap in sig.ins:
            axes = self._operand_gathers(keys, amap, imask, masks)
            ins.append([int(m & ~g) for m, g in axes] if any(int(g) for _, g in axes) else None)
        produced = [imask[i] for i in sig.outs[0].amap]
        want = self.layout(sig.outs[0].keys, masks)
        if sig.kind in ("contract", "reduce") and self.mesh.profile.reduce_scatter:
            red = 0       # reduce-scattered onto the axes the result wants (`_strategy`)
            for i in sig.reduced:
                red = red | imask[i]
            produced = [pr | (w & ~pr & red) for w, pr in zip(want, produced)]
        out = [int(pr) for pr in produced]
        if out == [int(w) for w in want]:
            out = None
        if all(x is None for x in ins) and out is None:
            return None
        return ins, out

    def _operand_gathers(self, keys, amap, imask, masks) -> list:
        """Per axis of an operand laid out by `keys`, used in iteration
        layout `imask`: (its mesh axes, those it is gathered over)."""
        out = []
        for a, m in enumerate(self.layout(keys, masks)):
            need = imask[amap[a]] if amap[a] >= 0 else (0 if amap[a] == REPLICATED else m)
            # keeping a minor axis of the dim's group without its major one
            # reorders the tiles: a gather of the whole group
            out.append((m, np.where(self._reorders[m, m & need], m, m & ~need)))
        return out

    def _iteration_masks(self, sig, masks, order):
        """Mesh-axis mask per iteration dim: its key's, less the mesh axes
        a dim earlier in `order` took (`layout` of the dims in that order)."""
        imask = [0] * len(sig.isizes)
        for i, m in zip(order, self.layout([sig.ikeys[i] for i in order], masks)):
            imask[i] = m
        return imask

    def gather_cost(self, keys, nb, gmask, masks):
        """One all-gather of a tensor over the mesh axes `gmask`: (time, bytes)."""
        shard_after = 1.0
        for m in self.layout(keys, masks):
            shard_after = shard_after * self.mesh.group_size[m & ~gmask]
        full = nb / shard_after
        return self._coll("all-gather", gmask, full), np.where(gmask > 0, full, 0.0)

    def _group_mask(self, group, extras):
        """The mesh axes a gather group is gathered over (any consumer's)."""
        gm = 0
        for i, j in group.uses:
            gm = gm | extras[i][j]
        return gm

    def _gathers(self, extras, masks, detail):
        """The operand all-gathers: (time, bytes, count; the last two only
        with `detail`)."""
        t, b, n = 0.0, 0.0, 0.0
        for grp in self.gather_groups:
            gm = self._group_mask(grp, extras)
            if np.any(gm):
                tt, bb = self.gather_cost(grp.keys, grp.nbytes, gm, masks)
                t = t + grp.mult * tt
                if detail:
                    b, n = b + grp.mult * bb, n + grp.mult * (bb > 0)
        return t, b, n

    def _strategy(self, sig, masks, order, detail):
        p = self.mesh.profile
        imask = self._iteration_masks(sig, masks, order)
        # A scalar: each term then spans only the keys this op touches (the
        # search bounds partial plans by that).
        zero = np.zeros(())
        comm = {k: zero for k in KINDS} if detail else None
        nbytes = {k: zero for k in KINDS} if detail else None
        t = t_in = zero
        extras = []
        for keys, nb, amap in sig.ins:   # operand resharding (charged per variable)
            gather = 0
            for _, g in self._operand_gathers(keys, amap, imask, masks):
                gather = gather | g
            t_in = t_in + self.gather_cost(keys, nb, gather, masks)[0]
            extras.append(gather)
        ishard = self._shard(imask)
        out_keys, out_nb, omap = sig.outs[0]
        want = self.layout(out_keys, masks)
        produced = [imask[i] for i in omap]
        partial = out_nb / self._shard(produced)
        red = 0
        for i in sig.reduced:
            red = red | imask[i]
        if sig.kind in ("contract", "reduce"):
            scatter = 0
            if p.reduce_scatter:
                w_all = 0
                for w, pr in zip(want, produced):
                    w_all = w_all | (w & ~pr)
                scatter = red & w_all
            ar = red & ~scatter
            n_sc = self.mesh.group_size[scatter]
            t_rs = self._coll("reduce-scatter", scatter, partial)
            t_ar = self._coll("all-reduce", ar, partial / n_sc, sig.latency_share)
            t = t + t_rs + t_ar
            if detail:
                comm["reduce-scatter"] = comm["reduce-scatter"] + t_rs
                comm["all-reduce"] = comm["all-reduce"] + t_ar
                nbytes["reduce-scatter"] = nbytes["reduce-scatter"] + np.where(scatter > 0, partial / n_sc, 0.0)
                nbytes["all-reduce"] = nbytes["all-reduce"] + np.where(ar > 0, partial / n_sc, 0.0)
            produced = [pr | (w & scatter) for w, pr in zip(want, produced)]
        # Result resharding: produced on mesh axes the result does not want.
        gather, shard_after = 0, 1.0
        for w, pr in zip(want, produced):
            extra = pr & ~w
            gather = gather | extra
            shard_after = shard_after * self.mesh.group_size[pr & ~extra]
        full = out_nb / shard_after
        tg = self._coll("all-gather", gather, full)
        t = t + tg
        compute = np.maximum(sig.flops / p.peak_flops, sig.traffic / p.mem_bandwidth) / ishard
        if detail:
            comm["all-gather"] = comm["all-gather"] + tg
            nbytes["all-gather"] = nbytes["all-gather"] + np.where(gather > 0, full, 0.0)
            return t + compute, t_in, _Detail(compute + zero, comm, nbytes), extras, compute
        return t + compute, t_in, None, extras, compute

    # -- memory --------------------------------------------------------------
    def extras(self, masks):
        """Per distinct op, per operand: the mesh axes it is gathered over."""
        return [self.op_cost(sig, masks)[2] for sig, _ in self.sigs]

    def memory_terms(self, masks, extras):
        """`memory` in parts, each over the few keys it depends on: (fixed:
        per argument/result, weights: per gathered input group, live: per
        temporary group, transient: per other gather group), where memory =
        sum(fixed) + sum(weights) + max over rows p of `mem_points[p] @ live`
        + max(transient, 0)."""
        fixed = [nb / self._shard(self.layout(keys, masks)) for keys, nb in self.fixed_groups]
        weights, transient = [], []
        for grp in self.gather_groups:
            gm = self._group_mask(grp, extras)
            if np.any(gm):
                full = self.gather_cost(grp.keys, grp.nbytes, gm, masks)[1]
                # gathered weights stay live from forward to backward (one
                # gather serves both); other gathers are short-lived
                (weights.append(grp.n_vars * full) if grp.is_input else transient.append(full))
        live = [nb / self._shard(self.layout(keys, masks)) for keys, nb in self.mem_groups]
        return fixed, weights, live, transient

    def memory(self, masks, extras=None, packed: bool = False):
        """Bytes per device under each plan: (args+results, peak temporaries
        + gathered copies). `packed` (one plan, scalar masks): temporaries
        placed in result buffers not yet written (`packed_peak`), never more
        than the search's matrix-product peak."""
        if extras is None:
            extras = self.extras(masks)
        fixed_t, weights, live, transient = self.memory_terms(masks, extras)
        fixed, gathered, other = 0.0, 0.0, 0.0
        for x in fixed_t:
            fixed = fixed + x
        for x in weights:
            gathered = gathered + x
        for x in transient:
            other = np.maximum(other, x)
        gathered = gathered + other
        if not live:
            return fixed, gathered + fixed * 0.0
        if packed:
            return fixed, packed_peak(self.liveness, live, fixed_t) + gathered
        shape = np.broadcast(*[np.asarray(x) for x in live]).shape
        mat = np.stack([np.broadcast_to(x, shape) for x in live])       # groups x N
        temp = (self.mem_points @ mat.reshape(len(live), -1)).max(axis=0).reshape(shape)
        return fixed, temp + gathered

    # -- whole plans -------------------------------------------------------------
    def time_terms(self, masks, comm: bool = True):
        """`step_time` as a list of terms (per distinct op, times its
        multiplicity; then per operand all-gather group), the extras, and the
        terms' collective bytes per device (the search's tie-break; empty
        without `comm`). Under masks broadcast over a grid (one axis per
        searched key) a term spans only the axes of the keys it depends on:
        what lets the search bound partial plans."""
        terms, extras, comms = [], [], []
        for sig, mult in self.sigs:
            t, d, ex, _ = self.op_cost(sig, masks, detail=comm)
            extras.append(ex)
            terms.append(mult * t)
            if comm:
                comms.append(mult * sum(d.nbytes.values()))
        for grp in self.gather_groups:
            gm = self._group_mask(grp, extras)
            if np.any(gm):
                t, nbytes = self.gather_cost(grp.keys, grp.nbytes, gm, masks)
                terms.append(grp.mult * t)
                if comm:
                    comms.append(grp.mult * nbytes)
        return terms, extras, comms

    def step_time(self, masks):
        """Modelled step time only (fast path; same model as `evaluate`)."""
        total, extras = 0.0, []
        for sig, mult in self.sigs:
            t, _, ex, _ = self.op_cost(sig, masks)
            extras.append(ex)
            total = total + mult * t
        return total + self._gathers(extras, masks, False)[0], extras

    def evaluate(self, masks) -> Cost:
        """The full breakdown of one plan (`masks[k]` an int per key)."""
        masks = [np.asarray(m) for m in masks]
        total = compute = 0.0
        times, nbytes, counts = ({k: 0.0 for k in KINDS} for _ in range(3))
        extras = []
        for sig, mult in self.sigs:
            t, d, ex, _ = self.op_cost(sig, masks, detail=True)
            extras.append(ex)
            total = total + mult * t
            compute = compute + mult * d.compute
            for k in KINDS:
                times[k] = times[k] + mult * d.time[k]
                nbytes[k] = nbytes[k] + mult * d.nbytes[k]
                # combined all-reduces count as their share of one
                n = mult * sig.latency_share if k == "all-reduce" else mult
                counts[k] = counts[k] + n * ((d.nbytes[k] > 0) * 1.0)
        tg, bg, ng = self._gathers(extras, masks, True)
        total = total + tg
        k = "all-gather"
        times[k], nbytes[k], counts[k] = times[k] + tg, nbytes[k] + bg, counts[k] + ng
        fixed, temp = self.memory(masks, extras, packed=True)
        # counts: shares of combined all-reduces summed (1/3 * 6 is 2, not 1.9999999999999998)
        colls = {k: Collective(float(times[k]), float(nbytes[k]), round(float(counts[k]), 9))
                 for k in KINDS}
        return Cost(time=float(total), compute=float(compute),
                    communication=sum(c.time for c in colls.values()),
                    memory=float(fixed + temp), memory_fixed=float(fixed), memory_temp=float(temp),
                    **{k.replace("-", "_"): c for k, c in colls.items()})


def _reorders(n_masks: int) -> np.ndarray:
    """[group, kept]: whether keeping mesh axes `kept` of a dim sharded on
    `group` (bit i: mesh axis i, major first) drops an axis more major than
    one it keeps. Such a tile is no slice of the group's tile: measured,
    XLA permutes devices and gathers more than the dropped axes (the wide
    GPT step on (4, 2) with mlp on (data, model) and batch on data: 59 MiB
    of all-gathers and 4 MiB of permutes, where gathers over the dropped
    axes alone come to 24)."""
    out = np.zeros((n_masks, n_masks), bool)
    for group in range(n_masks):
        for kept in range(n_masks):
            dropped = group & ~kept
            if kept & group == kept and kept and dropped:
                out[group, kept] = (dropped & -dropped) < (1 << (kept.bit_length() - 1))
    return out


def _orders(sig) -> list:
    """The iteration orders an op may take: either operand's dims first (a
    contraction; the operand's, for a reduction), or the result's."""
    natural = list(range(len(sig.isizes)))
    orders = []
    if sig.kind in ("contract", "reduce"):
        for operand in sig.ins[:1] if sig.kind == "reduce" else sig.ins:
            first = [i for i in operand.amap if i >= 0]
            orders.append(first + [i for i in natural if i not in first])
    if sig.kind != "reduce":
        orders.append(natural)
    return orders


def _pick(better, new, old):
    """Per plan, `new`'s detail where `better`, else `old`'s (None: no detail)."""
    if old is None:
        return None
    where = lambda a, b: {k: np.where(better, a[k], b[k]) for k in KINDS}  # noqa: E731
    return _Detail(np.where(better, new.compute, old.compute), where(new.time, old.time),
                   where(new.nbytes, old.nbytes))
