"""Finding rollable runs of layer blocks in a flat jaxpr (the analysis half of
`passes.reroll`; the rewrite half lives in `reroll.py`, the tags and records
both use in `_reroll_run.py`).

A *run* is `repeats` consecutive, equally long slices ("blocks") of the
equation list, `period` equations each, such that

1. the blocks are structurally identical: equation r of every block has the
   same primitive, the same parameters, the same operand and result types and
   the same literal operands (checked by comparing interned signatures).
   "Same parameters" is structural (`_rewrite.StructuralKeys`), never printed
   text: sub-jaxprs compared recursively (const values included), a
   custom_jvp rule by its traced JVP jaxpr, any other function-valued
   parameter (a custom_vjp `bwd`, a callback) by identity, so layers that
   differ only there are not merged;
2. they have the same data flow: operand k of equation r reads, in every
   block, either a value made earlier in the same block at the same place
   (`Inner`), a value made by the previous block at the same place (`Prev`,
   a loop carry), a literal (`Lit`), or a value from before the run (`Out`:
   either the same variable in every block, a loop invariant, or a different
   one per block, like the layer's own weights, which gets stacked). A run's
   template numbers carries and outside values instead (`Carry`, `Outside`);
3. each block feeds the next (at least one carry), so unrelated look-alike
   equations (three parallel projections) do not become a loop.

A block whose literal, parameter, width or data flow differs ends the run
there (a run needs `min_repeats` blocks). A value read two or more blocks
after it is made (a skip connection across layers) rejects the whole region,
and any run at another period (say two layers per block) overlapping it:
such a chain is not a simple layer loop. A run whose blocks read an earlier
run's per-block values k blocks to one of its blocks (the backward of
layers rolled two per forward block) is re-split into blocks of k
(`_match_producer_period`).

Blocks must weigh at least MIN_BLOCK_EQNS equations, sub-jaxprs included.

Linear time: equations are hashed once into interned integer signatures
(parameters canonicalised, sub-jaxprs keyed once per distinct object); the
candidate periods are the distances between consecutive occurrences of equal
signatures (a histogram, best few kept); each candidate is checked by one
scan `sig[i] == sig[i + period]`; each found region is verified block by
block against a template. No equation is re-walked per candidate beyond
these O(N) scans.
"""

from __future__ import annotations

import bisect
import collections
import itertools

import numpy as np

from jaxbackend import _jax
from jaxbackend.passes import _rewrite
from jaxbackend.passes._reroll_run import (BAD, LIT, Carry, DepGraph, Inner, Out, Outside, Prev,
                                           Run)

MAX_PERIOD_CANDIDATES = 16
PAIR_PERIOD_CANDIDATES = 4   # second-next distances tried (`candidate_periods`)
# A block lighter than this is not worth a loop (a scan costs more than the
# couple of kernels it would save): e.g. AD's `mul` chains from x ** 2. The
# weight of an equation counts the equations of its sub-jaxprs (a layer
# that is one `jax.checkpoint` equation weighs the whole layer).
MIN_BLOCK_EQNS = 4


# ---------------------------------------------------------------------------
# signatures

def signatures(eqns, keys: _rewrite.StructuralKeys) -> list:
    """One interned int per equation; equal ints <=> same primitive, params
    (sub-jaxprs and custom rules by structure, other functions by identity:
    see `StructuralKeys`), context, operand types, literal values and result
    types. Never printed text: layers that differ only in a custom_vjp `bwd`
    or a callback print alike but must not share one scan body."""
    intern: dict = {}
    sigs: list = []
    for i, e in enumerate(eqns):
        key: tuple
        if e.effects:  # effectful equations never repeat (order matters)
            key = ("effects", i)
        else:
            ins = tuple(keys.literal(v) if isinstance(v, _jax.Literal) else v.aval
                        for v in e.invars)
            key = (e.primitive, keys.params(e), ins, tuple(v.aval for v in e.outvars))
        sigs.append(intern.setdefault(key, len(intern)))
    return sigs


def candidate_periods(sigs, weights, min_repeats: int) -> list:
    """Distances between consecutive equal signatures, best-covering first
    (coverage counted in weight, so one remat equation per layer counts as
    the layer); then distances to the second-next equal signature, for a
    block made of two halves alike (a residual block of two conv-BatchNorm
    pairs: its backward repeats every equation twice per block, 32 and 33
    equations apart, and no equation once per block, so the block's 65 is no
    distance between neighbours); then the periods at which sub-jaxpr
    equations repeat. A distance under MIN_BLOCK_EQNS stays a candidate only
    when equations with sub-jaxprs repeat at it; `find_runs` checks each
    run's block weight."""
    last: dict = {}
    last2: dict = {}     # the occurrence before last
    hist: collections.Counter = collections.Counter()
    heavy: collections.Counter = collections.Counter()
    hist2: collections.Counter = collections.Counter()
    heavy2: collections.Counter = collections.Counter()
    for i, s in enumerate(sigs):
        if s in last:
            d = i - last[s]
            hist[d] += 1
            heavy[d] += weights[i] - 1
            if s in last2:
                d = i - last2[s]
                hist2[d] += 1
                heavy2[d] += weights[i] - 1
            last2[s] = last[s]
        last[s] = i

    def ranked(hist, heavy):
        ok = [((c + heavy[d]) * d, d) for d, c in hist.items()
              if c >= max(1, min_repeats - 1) and (d >= MIN_BLOCK_EQNS or heavy[d])]
        ok.sort(key=lambda t: (-t[0], t[1]))
        return ok

    ok = ranked(hist, heavy)
    best = [d for _, d in ok[:MAX_PERIOD_CANDIDATES]]
    pairs = [d for _, d in ranked(hist2, heavy2) if d not in best][:PAIR_PERIOD_CANDIDATES]
    # Periods at which layer calls (equations with sub-jaxprs) repeat, by the
    # weight they repeat: a run of short-period calls (an encoder of jitted
    # blocks, one equation each) next to a long unrolled region (a decoder
    # whose blocks are inlined) scores far below that region's many partial
    # periods above, and would be left out of the first list.
    calls = sorted(((-heavy[d], d) for _, d in ok[MAX_PERIOD_CANDIDATES:] if heavy[d]))
    return best + pairs + [d for _, d in calls[:MAX_PERIOD_CANDIDATES]]


def periodic_regions(sigs, period: int, min_repeats: int):
    """Maximal [a, b) with sig[i] == sig[i + period] for a <= i < b - period."""
    n, i, need = len(sigs), 0, (min_repeats - 1) * period
    while i + period < n:
        if sigs[i] != sigs[i + period]:
            i += 1
            continue
        j = i
        while j + period < n and sigs[j] == sigs[j + period]:
            j += 1
        if j - i >= need:
            yield i, j + period
        i = j + 1


# ---------------------------------------------------------------------------
# data flow

def phase_ranking(g: DepGraph, a: int, b: int, period: int, min_repeats: int) -> list:
    """Block starts in [a, a + period), best first: fewest values live across
    the block boundary (carries), then most blocks, then earliest. Items are
    (live, -blocks, start)."""
    nb_max = (b - a) // period
    p = a + period * max(0, (nb_max - 2) // 2)        # a window with a next block
    diff = [0] * (period + 1)
    for i in range(p, p + period):
        for v in g.eqns[i].outvars:
            uses = g.uses.get(v)
            if not uses:
                continue
            k = bisect.bisect_right(uses, i + period) - 1
            if k < 0 or uses[k] <= i:
                continue
            lo, hi = (i + 1 - a) % period, (uses[k] - a) % period   # live over cuts (i, u]
            if uses[k] - i >= period:
                diff[0] += 1
                diff[period] -= 1
            elif lo <= hi:
                diff[lo] += 1
                diff[hi + 1] -= 1
            else:
                diff[lo] += 1
                diff[period] -= 1
                diff[0] += 1
                diff[hi + 1] -= 1
    ranked, live = [], 0
    for c in range(period):
        live += diff[c]
        nb = (b - a - c) // period
        if nb >= min_repeats:
            ranked.append((live, -nb, a + c))
    ranked.sort()
    return ranked


def _desc(g: DepGraph, v, j: int, s: int, start: int, period: int):
    """How block j (of a run whose first block is s) reads operand v."""
    if isinstance(v, _jax.Literal):
        return LIT
    d = g.defs.get(v)
    if d is None or d[0] < start + s * period:
        return Out(v)
    bj, r = divmod(d[0] - start, period)
    if bj == j:
        return Inner(r, d[1])
    if bj == j - 1:
        return Prev(r, d[1])
    return BAD


def _matches(t, d):
    """Does operand tag d agree with template tag t (an outside value may
    differ per block)?"""
    return type(t) is type(d) and (isinstance(t, Out) or t == d)


def split_runs(g: DepGraph, start: int, period: int, nblocks: int, min_repeats: int):
    """Verified runs among blocks start + j*period, j < nblocks; None when a
    value skips a block (the region is then not a chain at this period)."""
    runs, s = [], 0
    while nblocks - s >= min_repeats:
        eq = lambda j, r: g.eqns[start + j * period + r]  # noqa: E731
        # template: block s+1 relative to block s
        tmpl = [[_desc(g, v, s + 1, s, start, period) for v in eq(s + 1, r).invars]
                for r in range(period)]
        if any(d is BAD for row in tmpl for d in row):
            return None   # a value skips a block (a skip connection): not a simple chain
        if not any(type(d) is Prev for row in tmpl for d in row):
            s += 1
            continue
        # block s: carried operands must come from outside, one var per carry
        init: dict = {}
        ok = True
        for r in range(period):
            for t, v in zip(tmpl[r], eq(s, r).invars):
                d = _desc(g, v, s, s, start, period)
                if type(t) is Prev:
                    ok = ok and type(d) is Out and init.setdefault(t.slot, v) is v
                else:
                    ok = ok and _matches(t, d)
        if not ok:
            s += 1
            continue
        j = s + 2
        while j < nblocks:
            descs = [(t, _desc(g, v, j, s, start, period))
                     for r in range(period) for t, v in zip(tmpl[r], eq(j, r).invars)]
            if any(d is BAD for _, d in descs):
                return None
            if not all(_matches(t, d) for t, d in descs):
                break
            j += 1
        if j - s >= min_repeats:
            runs.append(_make_run(g, start + s * period, period, j - s, tmpl, init))
            s = j
        else:
            s += 1
    return runs


def _make_run(g: DepGraph, start: int, period: int, n: int, tmpl, init) -> Run:
    eqns, stop = g.eqns, start + period * n
    carry_slots = list(init)                       # (r, o) in first-use order
    carry_index = {slot: c for c, slot in enumerate(carry_slots)}
    outside: list = []
    outside_index: dict = {}
    template: list = []
    for r in range(period):
        row: list = []
        for k, t in enumerate(tmpl[r]):
            if type(t) is Prev:
                row.append(Carry(carry_index[t.slot]))
            elif type(t) is Out:
                vs = tuple(eqns[start + j * period + r].invars[k] for j in range(n))
                if vs not in outside_index:
                    outside_index[vs] = len(outside)
                    outside.append(vs)
                row.append(Outside(outside_index[vs]))
            else:
                row.append(t)   # Lit or Inner
        template.append(row)
    ys_slots, carry_ys = [], []
    for r in range(period):
        for o in range(len(eqns[start + r].outvars)):
            # (a DropVar in one block need not be dropped in another)
            outs = [eqns[start + j * period + r].outvars[o] for j in range(n)]
            c = carry_index.get((r, o))
            if c is None:
                if any(g.last_use(v) >= stop for v in outs):
                    ys_slots.append((r, o))
            elif any(g.last_use(v) >= stop for v in outs[:-1]):
                carry_ys.append(c)
    return Run(start, period, n, template, carry_slots, [init[s] for s in carry_slots],
               outside, ys_slots, carry_ys)


def find_runs(jaxpr, min_repeats: int = 2, keys: _rewrite.StructuralKeys | None = None) -> list:
    """Non-overlapping verified runs of `jaxpr` (top level), in program order.
    `keys`: share one across the jaxprs of one program, so each sub-jaxpr is
    keyed once however deep it is nested."""
    if len(jaxpr.eqns) < min_repeats:
        return []
    keys = _rewrite.StructuralKeys() if keys is None else keys
    g = DepGraph(jaxpr)
    sigs = signatures(jaxpr.eqns, keys)
    weights = [keys.weight(e) for e in jaxpr.eqns]
    prefix = np.concatenate([[0], np.cumsum(weights)])
    found: list = []                                 # (run, region)
    skips: list = []                                 # (a, b) rejected
    for period in candidate_periods(sigs, weights, min_repeats):
        for a, b in periodic_regions(sigs, period, min_repeats):
            ranked = phase_ranking(g, a, b, period, min_repeats)
            if not ranked:
                continue
            runs = split_runs(g, ranked[0][2], period, -ranked[0][1], min_repeats)
            if runs is None:
                skips.append((a, b))
            else:   # (every block of a run weighs the same: it is a window of one period)
                found.extend((r, (a, b, period, ranked)) for r in runs
                             if prefix[r.start + period] - prefix[r.start] >= MIN_BLOCK_EQNS)
    # a skip connection seen at one period also vetoes the same equations at a
    # multiple of it (two layers per block would hide the skip inside a block)
    found = [(r, reg) for r, reg in found
             if all(r.stop <= a or b <= r.start for a, b in skips)]
    chosen = _align_producers(g, _select(found), min_repeats)
    return _match_producer_period(g, [r for r, _ in chosen], min_repeats)


def _select(found):
    """Greedy non-overlapping choice, most equations covered first."""
    found = sorted(found, key=lambda t: (-(t[0].period * t[0].repeats), t[0].period, t[0].start))
    chosen = []
    for r, reg in found:
        if all(r.stop <= c.start or c.stop <= r.start for c, _ in chosen):
            chosen.append((r, reg))
    return sorted(chosen, key=lambda t: t[0].start)


def _align_producers(g: DepGraph, chosen, min_repeats: int):
    """Re-phase a run whose per-block results a later run reads (forward
    residuals read by the backward run): among the block starts that tie on
    the ranking, take one whose blocks each hold all the values one consumer
    block reads, so the consumer scans the producer's stacked outputs
    instead of a copy. (Forward and backward layers then line up.)"""
    out = list(chosen)
    for fi, (f, reg) in enumerate(out):
        a, b, period, ranked = reg
        spans = []                                     # (lo, hi) eqn positions per consumer block
        for c, _ in out[fi + 1:]:
            per_block = [vs for vs in c.outside if any(v is not vs[0] for v in vs)]
            for j in range(c.repeats):
                pos = [g.defs[vs[j]][0] for vs in per_block
                       if vs[j] in g.defs and a <= g.defs[vs[j]][0] < b]
                if pos:
                    spans.append((min(pos), max(pos)))
        if not spans:
            continue
        best = ranked[0][:2]
        for live, neg_nb, start in ranked:
            if (live, neg_nb) != best:
                break
            if not all((lo - start) // period == (hi - start) // period for lo, hi in spans):
                continue
            if start != f.start:
                runs = split_runs(g, start, period, -neg_nb, min_repeats) or []
                others = [c for k, (c, _) in enumerate(out) if k != fi]
                if len(runs) == 1 and all(runs[0].stop <= c.start or c.stop <= runs[0].start
                                          for c in others):
                    out[fi] = (runs[0], reg)
            break
    return out


def _match_producer_period(g: DepGraph, runs, min_repeats: int):
    """Roll a consumer run at its producer's period: where a run's blocks
    (the backward layers) read per-block values that an earlier run makes
    (the forward residuals), and every such read advances one producer
    block per k > 1 consumer blocks (the forward rolled two alternating
    layers per block, the backward, whose layers differ only in what they
    read, one), re-split the consumer into blocks of k. Each of its
    per-block reads is then one stack of the producer's outputs, scanned as
    made (reversed), not an interleaving of k stacks copied into a new one
    (every residual held twice). Only for k < min_repeats: the merged body's
    k blocks are no run themselves (the pass stays idempotent). The phase
    is the one most reads follow; blocks outside whole groups (< k at each
    end) stay unrolled; blocks of k that do not verify as one run of
    min_repeats leave the run as it was."""
    out = list(runs)
    for ci, c in enumerate(out):
        for f in out[:ci]:
            ks: set = set()
            heads: collections.Counter = collections.Counter()
            for vs in c.outside:
                seq = [(g.defs[v][0] - f.start) // f.period
                       if v in g.defs and f.start <= g.defs[v][0] < f.stop else None for v in vs]
                while seq and seq[-1] is None:
                    seq.pop()
                lead = 0
                while lead < len(seq) and seq[lead] is None:
                    lead += 1
                if lead == len(seq):
                    continue                         # not made by f (a weight, an invariant)
                sizes = [len(list(grp)) for _, grp in itertools.groupby(seq[lead:])]
                k = max(sizes)
                # each producer block read by one group of k consecutive
                # blocks (fewer at the ends only), no gap
                if (None in seq[lead:] or len(set(seq[lead:])) != len(sizes) or len(sizes) < 3
                        or any(n != k for n in sizes[1:-1])):
                    ks.add(0)
                    break
                ks.add(k)
                heads[(lead + sizes[0]) % k] += 1
            if len(ks) != 1 or not 2 <= next(iter(ks)) < min_repeats:
                continue
            k = ks.pop()
            head = heads.most_common(1)[0][0]
            whole = (c.repeats - head) // k
            if whole < min_repeats:
                continue
            new = split_runs(g, c.start + head * c.period, k * c.period, whole, min_repeats)
            if new and len(new) == 1 and new[0].repeats == whole:
                out[ci] = new[0]
            break
    return out
