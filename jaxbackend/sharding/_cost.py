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
* compute: flops / (devices sharing the iteration space) / peak, or bytes /
  memory bandwidth for data movement, whichever is larger;
* operand resharding: an operand sharded on a mesh axis that the op's
  iteration layout does not use on that axis is all-gathered (bytes = the
  gathered per-device buffer), once per variable for all its consumers (as
  XLA reuses one gather); less sharding than needed is a free slice;
* reduction: summed dims sharded on mesh axes leave partial sums: a
  reduce-scatter onto axes the result wants (if the backend emits one) and an
  all-reduce over the rest (this is where data-parallel gradient reductions
  of replicated weights come from);
* contractions try three iteration layouts (either operand's dims first,
  or the result's) and keep the cheapest, as XLA's SPMD partitioner chooses
  between gathering an operand and reducing a partial result; like XLA, an
  alternative to keeping operands in place must be >10% cheaper to win.
  Reductions always reduce in place (XLA never gathers a reduce's operand).

Collectives use the alpha-beta ring formulas on the group's slowest link:
all-reduce 2(n-1)/n S/B + 2(n-1)a, all-gather / reduce-scatter / all-to-all
(n-1)/n S/B + (n-1)a, S the full (gathered / unreduced) buffer.

Memory per device: arguments + results + the peak over program order of live
intermediates that XLA materialises (outputs of contractions, reductions,
and of elementwise ops read by a non-elementwise op or by more than one op;
an elementwise result read by one elementwise op is assumed fused into it) + gathered copies (all gathered
weights, which live from forward to backward, and the largest other one).
"""

from __future__ import annotations

import numpy as np

from jaxbackend.sharding._graph import REPLICATED

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")
PREFER_IN_PLACE = 0.9
FUSE_MAX_USES = 1   # an elementwise result read by one elementwise op is fused into it


class CostModel:
    def __init__(self, graph, mesh):
        self.g, self.mesh = graph, mesh
        g = graph
        self.n_keys = len(g.key_names)
        self.var_keys = [tuple(g.class_key[c] for c in cs) for cs in g.var_classes]
        # Distinct ops (layers repeat): signature -> [op, total multiplicity].
        sigs: dict = {}
        consumers: dict = {}   # var -> [(distinct op, operand position)], and its mult
        for op in g.ops:
            if op.mult == 0:
                continue
            sig = (op.kind, op.isizes, tuple(g.class_key[c] for c in op.iclass),
                   tuple((self.var_keys[v], g.nbytes(v), m) for v, m in op.ins),
                   tuple((self.var_keys[v], g.nbytes(v), m) for v, m in op.outs),
                   op.reduced, op.flops)
            if sig in sigs:
                sigs[sig][1] += op.mult
            else:
                sigs[sig] = [sig, op.mult, len(sigs)]
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
            gk = (self.var_keys[v], self.g.nbytes(v), tuple(sorted(set(uses))), v in inputs)
            c = groups.setdefault(gk, [0.0, 0])
            c[0] += mult
            c[1] += 1
        self.gather_groups = [(gk, m) for gk, (m, _) in groups.items()]
        self.gather_counts = [n for _, n in groups.values()]
        self._memory_setup()

    # -- layouts ---------------------------------------------------------------
    def _layout(self, keys, masks):
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

    def _coll(self, kind, mask, full_bytes):
        """Time of one collective over the mesh group `mask` on a buffer of
        `full_bytes` per device (gathered / unreduced size)."""
        ms = self.mesh
        n = ms.group_size[mask]
        frac = (n - 1) / n
        steps = n - 1
        if kind == "all-reduce":
            frac, steps = 2 * frac, 2 * steps
        return frac * full_bytes / ms.group_bandwidth[mask] + steps * ms.group_latency[mask]

    # -- one distinct op under N plans -------------------------------------------
    def op_cost(self, sig, masks, detail=False):
        """(time without operand gathers, details, per-operand gather masks).
        The iteration layout is chosen with the gathers counted."""
        kind, isizes, ikeys, ins, outs, reduced, flops = sig
        natural = list(range(len(isizes)))
        orders = []
        if kind in ("contract", "reduce"):
            for _, _, amap in ins[:1] if kind == "reduce" else ins:
                first = [i for i in amap if i >= 0]
                orders.append(first + [i for i in natural if i not in first])
        if kind != "reduce":
            orders.append(natural)
        best = None
        for order in orders:
            t, tg, d, ex = self._strategy(sig, masks, order, detail)
            if best is None:
                best = (t, tg, d, ex)
                continue
            # Like XLA's partitioner, keep operands in place (partial sums,
            # then a reduction) unless moving them is clearly cheaper.
            better = t + tg < PREFER_IN_PLACE * (best[0] + best[1])
            best = (np.where(better, t, best[0]), np.where(better, tg, best[1]),
                    {k: np.where(better, d[k], best[2][k]) for k in best[2]},
                    [np.where(better, a, b) for a, b in zip(ex, best[3])])
        return best[0], best[2], best[3]

    def gather_cost(self, keys, nb, gmask, masks):
        """One all-gather of a tensor over the mesh axes `gmask`: (time, bytes)."""
        shard_after = 1.0
        for m in self._layout(keys, masks):
            shard_after = shard_after * self.mesh.group_size[m & ~gmask]
        full = nb / shard_after
        return self._coll("all-gather", gmask, full), np.where(gmask > 0, full, 0.0)

    def _gathers(self, extras, masks, detail):
        t, b, n = 0.0, 0.0, 0.0
        for (keys, nb, uses, _), mult in self.gather_groups:
            gm = 0
            for i, j in uses:
                gm = gm | extras[i][j]
            if np.any(gm):
                tt, bb = self.gather_cost(keys, nb, gm, masks)
                t = t + mult * tt
                if detail:
                    b, n = b + mult * bb, n + mult * (bb > 0)
        return t, b, n

    def _strategy(self, sig, masks, order, detail):
        kind, isizes, ikeys, ins, outs, reduced, flops = sig
        p = self.mesh.profile
        imask = [0] * len(isizes)
        used = 0
        for i in order:
            m = masks[ikeys[i]] & ~used
            used = used | m
            imask[i] = m
        # A scalar: each term then spans only the keys this op touches (the
        # search bounds partial plans by that).
        zero = np.zeros(())
        comm = {k: zero for k in KINDS} if detail else None
        nbytes = {k: zero for k in KINDS} if detail else None
        t = t_in = zero
        io_bytes = 0.0
        extras = []
        for keys, nb, amap in ins:   # operand resharding (charged per variable)
            gather = 0
            for a, m in enumerate(self._layout(keys, masks)):
                need = imask[amap[a]] if amap[a] >= 0 else (0 if amap[a] == REPLICATED else m)
                gather = gather | (m & ~need)
            t_in = t_in + self.gather_cost(keys, nb, gather, masks)[0]
            extras.append(gather)
            io_bytes += nb
        ishard = self._shard(imask)
        out_keys, out_nb, omap = outs[0]
        io_bytes += out_nb
        want = self._layout(out_keys, masks)
        produced = [imask[i] for i in omap]
        partial = out_nb / self._shard(produced)
        red = 0
        for i in reduced:
            red = red | imask[i]
        if kind in ("contract", "reduce"):
            scatter = 0
            if p.reduce_scatter:
                w_all = 0
                for w, pr in zip(want, produced):
                    w_all = w_all | (w & ~pr)
                scatter = red & w_all
            ar = red & ~scatter
            n_sc = self.mesh.group_size[scatter]
            t_rs = self._coll("reduce-scatter", scatter, partial)
            t_ar = self._coll("all-reduce", ar, partial / n_sc)
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
        compute = np.maximum(flops / p.peak_flops, io_bytes / p.mem_bandwidth) / ishard
        if detail:
            comm["all-gather"] = comm["all-gather"] + tg
            nbytes["all-gather"] = nbytes["all-gather"] + np.where(gather > 0, full, 0.0)
            return t + compute, t_in, dict(compute=compute + zero, **{f"t:{k}": comm[k] for k in KINDS},
                                           **{f"b:{k}": nbytes[k] for k in KINDS},
                                           **{f"n:{k}": (nbytes[k] > 0) * 1.0 for k in KINDS}), extras
        return t + compute, t_in, {}, extras

    # -- memory --------------------------------------------------------------
    def _memory_setup(self):
        g = self.g
        born = [-1] * len(g.shapes)
        for i, op in enumerate(g.ops):
            for v, _ in op.outs:
                born[v] = i
        fused = set()
        consumers: dict = {}
        for op in g.ops:
            for v, _ in op.ins:
                consumers.setdefault(v, []).append(op.kind)
        outs = set(g.outvars)
        for i, op in enumerate(g.ops):
            for v, _ in op.outs:
                # Dead values are removed by XLA; constants (broadcasts of
                # literals, iota) are fused into their consumers.
                if v not in outs and (v not in consumers or not op.ins):
                    fused.add(v)
            if op.kind == "map":
                for v, _ in op.outs:
                    if v not in g.pinned and (all(k == "map" for k in consumers.get(v, ["out"])) and v not in g.outvars
                            and len(consumers.get(v, ())) <= FUSE_MAX_USES):
                        fused.add(v)
        groups: dict = {}
        self.fixed_groups = []   # (keys, nbytes) of arguments and results
        for v in set(g.invars) | {v for v in g.outvars if v is not None}:
            self.fixed_groups.append((self.var_keys[v], g.nbytes(v)))
        events = []
        for v in range(len(g.shapes)):
            if v in g.invars or v in g.outvars or born[v] < 0 or v in fused or not g.shapes[v]:
                continue
            end = max(g.uses[v], born[v])
            gk = (self.var_keys[v], g.nbytes(v))
            j = groups.setdefault(gk, len(groups))
            events.append((born[v], 1, j))
            events.append((end + 1, -1, j))
        self.mem_groups = list(groups)
        events.sort()
        count = np.zeros(len(groups))
        i = 0
        pts = []
        while i < len(events):   # live counts after each program point
            t0 = events[i][0]
            while i < len(events) and events[i][0] == t0:
                count[events[i][2]] += events[i][1]
                i += 1
            pts.append(count.copy())
        rows = np.array(pts) if pts else np.zeros((1, len(groups)))
        # Keep only points not dominated by another (a peak is at one of
        # them); checking against the kept rows only, largest first, keeps
        # this near-linear (few rows survive).
        rows = np.unique(rows, axis=0)
        rows = rows[np.argsort(-rows.sum(axis=1), kind="stable")]
        keep = np.zeros((0, len(groups)))
        for r in rows:
            if not (keep >= r).all(axis=1).any():
                keep = np.vstack([keep, r])
        self.mem_points = keep if len(keep) else np.zeros((1, len(groups)))

    def extras(self, masks):
        """Per distinct op, per operand: the mesh axes it is gathered over."""
        return [self.op_cost(sig, masks)[2] for sig, _ in self.sigs]

    def memory_terms(self, masks, extras):
        """`memory` in parts, each over the few keys it depends on: (fixed:
        per argument/result, weights: per gathered input group, live: per
        temporary group, transient: per other gather group), where memory =
        sum(fixed) + sum(weights) + max over rows p of `mem_points[p] @ live`
        + max(transient, 0)."""
        fixed = [nb / self._shard(self._layout(keys, masks)) for keys, nb in self.fixed_groups]
        weights, transient = [], []
        for ((keys, nb, uses, is_input), _), count in zip(self.gather_groups, self.gather_counts):
            gm = 0
            for i, j in uses:
                gm = gm | extras[i][j]
            if np.any(gm):
                full = self.gather_cost(keys, nb, gm, masks)[1]
                # gathered weights stay live from forward to backward (one
                # gather serves both); other gathers are short-lived
                (weights.append(count * full) if is_input else transient.append(full))
        live = [nb / self._shard(self._layout(keys, masks)) for keys, nb in self.mem_groups]
        return fixed, weights, live, transient

    def memory(self, masks, extras=None):
        """Bytes per device under each plan: (args+results, peak temporaries
        + gathered copies)."""
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
        shape = np.broadcast(*[np.asarray(x) for x in live]).shape
        mat = np.stack([np.broadcast_to(x, shape) for x in live])       # groups x N
        temp = (self.mem_points @ mat.reshape(len(live), -1)).max(axis=0).reshape(shape)
        return fixed, temp + gathered

    # -- whole plans -------------------------------------------------------------
    def time_terms(self, masks):
        """`step_time` as a list of terms (per distinct op, times its
        multiplicity; then per operand all-gather group), and the extras.
        Under masks broadcast over a grid (one axis per searched key) a term
        spans only the axes of the keys it depends on: what lets the search
        bound partial plans."""
        terms, extras = [], []
        for sig, mult in self.sigs:
            t, _, ex = self.op_cost(sig, masks)
            extras.append(ex)
            terms.append(mult * t)
        for (keys, nb, uses, _), mult in self.gather_groups:
            gm = 0
            for i, j in uses:
                gm = gm | extras[i][j]
            if np.any(gm):
                terms.append(mult * self.gather_cost(keys, nb, gm, masks)[0])
        return terms, extras

    def step_time(self, masks):
        """Modelled step time only (fast path; same model as `evaluate`)."""
        total, extras = 0.0, []
        for sig, mult in self.sigs:
            t, _, ex = self.op_cost(sig, masks)
            extras.append(ex)
            total = total + mult * t
        return total + self._gathers(extras, masks, False)[0], extras

    def evaluate(self, masks):
        """A full breakdown for one plan (`masks[k]` an int per key)."""
        masks = [np.asarray(m) for m in masks]
        total = 0.0
        acc: dict = {}
        extras = []
        for sig, mult in self.sigs:
            t, d, ex = self.op_cost(sig, masks, detail=True)
            extras.append(ex)
            total = total + mult * t
            for k, v in d.items():
                acc[k] = acc.get(k, 0.0) + (mult * v)
        tg, bg, ng = self._gathers(extras, masks, True)
        total = total + tg
        for k, v in (("t:all-gather", tg), ("b:all-gather", bg), ("n:all-gather", ng)):
            acc[k] = acc.get(k, 0.0) + v
        fixed, temp = self.memory(masks, extras)
        out = {"time": float(total), "compute": float(acc.get("compute", 0.0)),
               "memory": float(fixed + temp), "memory_fixed": float(fixed), "memory_temp": float(temp)}
        for k in KINDS:
            out[k] = {"time": float(acc.get(f"t:{k}", 0.0)), "bytes": float(acc.get(f"b:{k}", 0.0)),
                      "count": float(acc.get(f"n:{k}", 0.0))}
        out["communication"] = sum(out[k]["time"] for k in KINDS)
        return out
