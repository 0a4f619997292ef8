"""Pass `reroll`: roll runs of identical layer blocks back into `scan`.

Users write layers as a Python `for` loop; tracing unrolls it, and XLA then
compiles every copy (super-linear compile time in depth). This pass finds
runs of structurally identical blocks that feed each other (see
`_reroll_find` for the exact conditions) and replaces each run by one
`jax.lax.scan` whose body is one block:

* values carried from block to block become the scan carry;
* values read from before the run become scan constants when every block
  reads the same one, and scanned inputs (`xs`) when each block reads its own
  (the layer weights);
* block results used after the run become stacked scan outputs (`ys`).

On the joint forward+backward jaxpr of `jax.value_and_grad`, the forward
layers form one run and the backward layers, in reverse order, another; the
backward run reads the forward run's residuals (layers of two kinds
alternating, sliding-window and global attention, roll two per forward
block; the backward, whose layers then differ only in what they read, is
rolled at the same period: `_reroll_find._match_producer_period`). Every
stacked array is recorded (variable -> (stack, index)), so when a later
run's per-block inputs are exactly a contiguous, in-order or reversed,
slice of a stack made earlier (the forward residuals, or the weights the
forward scan already stacked), the later scan reads that stack directly
(`reverse=True` for the backward pass) instead of copying. Only values no
stack holds are stacked with a copy (the
layer weights, once per call); results used outside a scan (the weight
gradients, returned unstacked as before) are indexed out lazily, only where
something reads them.

A per-block result in a 16-bit float type that only later scans read (a
bfloat16 residual) is stacked as its bits (uint16) and bitcast back where
read: XLA:CPU cannot update a bfloat16 stack in place and carried it as
float32 (`_stacks.as_bits`).

How the result is built (linear in the number of equations): by splicing,
not re-tracing. Equations outside runs are kept as they are (the same
equation objects, inputs renamed where needed); each run becomes one
`scan` equation whose body is block 0's own equations re-wired to the body
inputs (nothing traced but the small stacking/indexing helpers, cached by
shape); stacks are one `concatenate` + bitcast reshape and each per-block
read one `dynamic_slice` at an opaque index, so XLA compiles one kernel per
shape, not one per layer. Sub-jaxprs (`jit`, `scan`, `cond`, `while`,
remat, custom-derivative bodies) are rolled the same way, recursively, once
per distinct object.

The element-wise tail after the last run (the optimizer update of every
layer's weights: AdamW is ~18 equations per weight and layer) is applied once
per family to the stacks instead of once per layer (`_reroll_vector` says
which equations and why the values stay the same); only its results that
something reads are indexed out. So are the element-wise equations between
two runs (a global norm's per-layer squares, whose sum a third scan rolls). Per-layer inputs no stack holds (optimizer
moments) are stacked, a copy per call like the weights.

A value every layer reads (an encoder output under cross-attention) has its
gradient summed over the backward layers, and JAX's backward pass starts that
sum without an addition, so the first backward block is one equation short
of the others; a user's sum over layers started at a literal (`aux = 0.0`)
makes layer 0 read a literal where the others read the carry.
`_reroll_seed` starts such a sum at -0.0, or turns the literal into a
variable (both bit-identical), so that block joins the run.

Layers kept stacked by the caller (`jb.stack_layers`) arrive as one input
split into its entries: the scans read that input itself and the gradient
rule's `concatenate` of the per-layer gradients reads the backward scan's
stacked output (`_reroll_walk.Walk.keep`; the rule's reshape of that join
back into layers is the stacked output itself), so nothing is stacked or
split by copying; such runs are rolled from 2 layers (`_Splicer._min_repeats`).

Precondition: a ClosedJaxpr (any; typically the flat jaxpr of a model or of
its `value_and_grad`).
Invariant established: same input and output types, same values up to float
reassociation; afterwards every rolled run of >= `min_repeats` blocks is one
`scan` equation, and no run of the result has >= `min_repeats` blocks of the
same kind left (running the pass twice equals running it once).
Leaves alone: equations outside runs (kept unchanged, in order, except the
vectorised element-wise tail above), blocks
that differ in any parameter, shape, literal or data flow (e.g. a last layer
of another width, a skip connection across two layers, a per-layer literal
(but per-layer dropout keys, folded with the layer index or split once
and indexed per layer, are made before the layers first,
`_reroll_seed.lifted`, and so are the rows of an array the layers index by
their number, `W[i]`, whose gradient's sum of row pads becomes one join,
`_reroll_index`), a per-layer custom_vjp
rule or callback: function-valued parameters are compared by identity, see
`_reroll_find`), effectful equations (never merged, kept in place), a
run inside an open sub-jaxpr (remat) whose rolled form would need an array
constant, and a run that spans a sub-jaxpr boundary.
When nothing is found the input object is returned unchanged.
"""

from __future__ import annotations

import dataclasses

from jaxbackend import _jax, _stacked
from jaxbackend.passes import _reroll_index, _reroll_seed, _rewrite
from jaxbackend.passes._reroll_find import find_runs
from jaxbackend.passes._reroll_walk import RolledRun, Walk

__all__ = ["RerollStats", "RolledRun", "find_runs", "reroll", "reroll_with_stats"]


@dataclasses.dataclass
class RerollStats:
    """What one `reroll` call did; `len(runs)` scans were made."""

    runs: list = dataclasses.field(default_factory=list)   # of RolledRun
    eqns_before: int = 0
    eqns_after: int = 0
    stacked_copies: int = 0        # per-block input lists stacked by copying
    stacked_copy_bytes: int = 0    # bytes those copies move per call
    stacks_reused: int = 0         # per-block input lists read from an earlier stack
    vectorized: int = 0            # element-wise families applied once to stacks
    vectorized_eqns: int = 0       # the per-block equations those replaced
    seeds: int = 0                 # sums, literal carries, per-layer keys seeded (`_reroll_seed`)

    @property
    def repeats(self) -> list:
        return [r.repeats for r in self.runs]


def reroll(closed_jaxpr, *, min_repeats: int = 2):
    """ClosedJaxpr -> ClosedJaxpr with runs of >= min_repeats identical,
    chained blocks rolled into `scan` (see the module docstring)."""
    return reroll_with_stats(closed_jaxpr, min_repeats=min_repeats)[0]


def reroll_with_stats(closed_jaxpr, *, min_repeats: int = 2, vectorize: bool = True):
    """`reroll` plus a `RerollStats` describing the runs found.
    `vectorize=False` keeps the element-wise tail per block (see
    `_reroll_vector`; the reference its tests compare against)."""
    if min_repeats < 2:
        raise ValueError(f"reroll: min_repeats={min_repeats} must be >= 2 (a run of one block "
                         "is not a loop); pass min_repeats=2 or more.")
    stats = RerollStats(eqns_before=len(_jax.open_jaxpr(closed_jaxpr).eqns))
    out = _Splicer(min_repeats, stats, vectorize).sub(closed_jaxpr)
    stats.eqns_after = len(_jax.open_jaxpr(out).eqns)
    _rewrite.record_stats({"reroll.runs": len(stats.runs),
                           "reroll.blocks_rolled": sum(stats.repeats),
                           "reroll.stacked_copies": stats.stacked_copies,
                           "reroll.vectorized": stats.vectorized_eqns,
                           "reroll.seeds": stats.seeds})
    return out, stats


class _Splicer:
    """Builds the rolled jaxpr by splicing: equations outside runs are kept
    as they are (only their inputs renamed, no re-trace), each run becomes
    one `scan` equation (plus the stacking it needs), and per-block results
    are indexed out of their stack where read.
    Sub-jaxprs (`jit`, `scan`, `cond`, remat, custom-derivative bodies) are
    rolled recursively, once per distinct object."""

    def __init__(self, min_repeats, stats, vectorize=True):
        self.min_repeats, self.stats, self.memo = min_repeats, stats, {}
        self.vectorize = vectorize
        self.keys = _rewrite.StructuralKeys()   # one for every jaxpr: each keyed once

    def sub(self, j):
        """The rolled version of a (sub-)jaxpr (same object if unchanged).
        An open one (a remat body) whose rolled form would need an array
        const is left as it is, and nothing of it is counted."""
        before = dataclasses.replace(self.stats, runs=list(self.stats.runs))
        try:
            return _rewrite.transform(j, self._walk)
        except _rewrite.RewriteDeclined:
            self.stats.__dict__.update(before.__dict__)
            return j

    def _subs(self, eqn):
        if _stacked.splits_entries(eqn):
            return eqn   # L unit pieces, nothing to roll, and its body is the proof it is one
        return _rewrite.map_subjaxprs(eqn, self.memo, self.sub)

    def _min_repeats(self, jaxpr) -> int:
        """`min_repeats`, or fewer where the layers are a stacked input split
        in L < min_repeats (`jb.stack_layers`): then a run reads the stack
        with no copy in or out, and rolling pays from 2 layers (measured,
        XLA compile of the 4-layer stacked GPT AdamW step: 3.4-3.9 s
        unrolled, 3.1 s rolled, as the 64-layer one; per-layer params,
        unrolled: 2.6-3.0 s)."""
        if self.min_repeats <= 2:
            return self.min_repeats
        split = [len(e.outvars) for e in jaxpr.eqns if _stacked.splits_entries(e)]
        return max(2, min([self.min_repeats, *split]))

    def _if_more(self, jaxpr, runs, seeded, n, min_repeats) -> tuple:
        """(seeded, its runs) where its runs cover more equations than
        `runs` (`n` seeds counted), else (jaxpr, runs)."""
        if seeded is not None:
            more = find_runs(seeded, min_repeats, self.keys)
            if _reroll_seed.covered(more) > _reroll_seed.covered(runs):
                self.stats.seeds += n
                return seeded, more
        return jaxpr, runs

    def _rows(self, jaxpr, runs, min_repeats) -> tuple:
        """An input's rows read one by one, and the gradient's sum of their
        pads, as one split and one join (`_reroll_index`: same values, fewer
        equations, and the scans then read and write the input's stack
        itself), where the program then has runs covering at least as many
        equations; else (jaxpr, runs) as they were."""
        split, n = _reroll_index.split_rows(jaxpr)
        joined, m = _reroll_index.joined_pads(split)
        if not n + m:
            return jaxpr, runs
        new = split if joined is None else joined
        more = find_runs(new, min_repeats, self.keys)
        if not more or _reroll_seed.covered(more) < _reroll_seed.covered(runs):
            return jaxpr, runs
        self.stats.seeds += n + m
        return new, more

    def _walk(self, jaxpr, b):
        """The new outvars (equations into builder `b`), or None when
        neither this jaxpr nor any sub-jaxpr changed."""
        min_repeats = self._min_repeats(jaxpr)
        runs = find_runs(jaxpr, min_repeats, self.keys)
        jaxpr, runs = self._rows(jaxpr, runs, min_repeats)
        # per-layer dropout keys and rows W[i], then cross-layer sums and
        # literal carries
        jaxpr, runs = self._if_more(jaxpr, runs, *_reroll_seed.lifted(jaxpr), min_repeats)
        jaxpr, runs = self._if_more(jaxpr, runs, *_reroll_seed.seeded(jaxpr, runs), min_repeats)
        walk = Walk(jaxpr, runs, b, self.stats, self._subs,
                     min_repeats if self.vectorize else None)
        for i, eqn in walk.kept():
            if walk.vectorized(i):
                continue
            new = self._subs(eqn)
            b.changed |= new is not eqn
            walk.keep(new)
        if not (runs or b.changed):
            return None
        return [walk.read(v) for v in jaxpr.outvars]
