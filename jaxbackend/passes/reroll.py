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
backward run reads the forward run's residuals. Every stacked array is
recorded (variable -> (stack, index)), so when a later run's per-block inputs
are exactly a contiguous, in-order or reversed, slice of a stack made earlier
(the forward residuals, or the weights the forward scan already stacked), the
later scan reads that stack directly (`reverse=True` for the backward pass)
instead of copying. Only values no stack holds are stacked with a copy (the
layer weights, once per call); results used outside a scan (the weight
gradients, returned unstacked as before) are indexed out lazily, only where
something reads them.

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
something reads are indexed out. Per-layer inputs no stack holds (optimizer
moments) are stacked, a copy per call like the weights.

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
such as a dropout key folded with the layer index, a per-layer custom_vjp
rule or callback: function-valued parameters are compared by identity, see
`_reroll_find`), effectful equations (never merged, kept in place), a
run inside an open sub-jaxpr (remat) whose rolled form would need an array
constant, and a run that spans a sub-jaxpr boundary.
When nothing is found the input object is returned unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import numpy as np
from jax import lax

from jaxbackend import _jax
from jaxbackend.passes import _reroll_vector, _rewrite, _stacks
from jaxbackend.passes._reroll_find import find_runs
from jaxbackend.passes._reroll_run import Carry, Inner, Lit, Outside, Run

__all__ = ["RerollStats", "RolledRun", "find_runs", "reroll", "reroll_with_stats"]


class RolledRun(NamedTuple):
    """One run rolled into one scan. `start` indexes the jaxpr holding the
    run (the top level, or a sub-jaxpr for runs rolled inside one)."""

    start: int
    period: int          # equations per block
    repeats: int         # blocks
    reverse: bool        # the scan runs backwards (a backward pass)


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
                           "reroll.vectorized": stats.vectorized_eqns})
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
        return _rewrite.map_subjaxprs(eqn, self.memo, self.sub)

    def _walk(self, jaxpr, b):
        """The new outvars (equations into builder `b`), or None when
        neither this jaxpr nor any sub-jaxpr changed."""
        runs = find_runs(jaxpr, self.min_repeats, self.keys)
        walk = _Walk(jaxpr, runs, b, self.stats, self._subs,
                     self.min_repeats if self.vectorize else None)
        for i, eqn in walk.kept():
            if walk.vectorized(i):
                continue
            new = self._subs(eqn)
            b.changed |= new is not eqn
            walk.keep(new)
        if not (runs or b.changed):
            return None
        return [walk.read(v) for v in jaxpr.outvars]


class _Walk:
    """One pass over one jaxpr's equations: runs replaced, the rest kept."""

    def __init__(self, jaxpr, runs, b, stats, subs, min_repeats):
        self.jaxpr, self.b, self.stats, self.min_repeats = jaxpr, b, stats, min_repeats
        self.subs = subs      # eqn -> eqn with its sub-jaxprs rolled
        self.run_at = {r.start: r for r in runs}
        self.max_repeats = max((r.repeats for r in runs), default=0)
        self.env = {}         # old var -> new atom, where they differ
        self.stacked = {}     # old var -> (stack id, index): a per-block result
        self.stacks = []      # stack id -> atom of the stacked array
        self.indices = None   # atoms of opaque int32 scalars 0..max_repeats-1
        self.tail = max((r.stop for r in runs), default=len(jaxpr.eqns))
        self.vector = {}      # position after the last run -> its Family (`_reroll_vector`)
        self.family_out = {}  # (id(family), output k) -> atom of the stacked result
        self.concatenated = set()   # atoms of the stacks this walk concatenated
        self.held_stacks = {}       # such a stack -> its `held` atom

    def kept(self):
        """Yield (position, equation) for each equation outside runs, in
        order, after emitting the scan of every run before it."""
        eqns, i = self.jaxpr.eqns, 0
        while i < len(eqns):
            run = self.run_at.get(i)
            if run is None:
                yield i, eqns[i]
                i += 1
            else:
                self._scan(run)
                i = run.stop
                if i == self.tail and self.min_repeats:   # every stack exists: plan the tail
                    self.vector = _reroll_vector.plan(
                        eqns[i:], self.stacked, {s: a.aval.shape[0] for s, a in enumerate(self.stacks)},
                        self.min_repeats, self.jaxpr.outvars)

    def vectorized(self, pos: int) -> bool:
        """Whether equation `pos` is a member of an applied family (its
        family's one equation is emitted at the last member)."""
        fam = self.vector.get(pos - self.tail) if pos >= self.tail else None
        if fam is None:
            return False
        if pos - self.tail == fam.last:
            _reroll_vector.emit(self, fam)
        return True

    def keep(self, eqn):
        invars = [self.read(v) for v in eqn.invars]
        if any(a is not b for a, b in zip(invars, eqn.invars)):
            eqn = eqn.replace(invars=invars)
        self.b.append(eqn)

    # -- environment ---------------------------------------------------------
    def read(self, v):
        if not _jax.is_var(v):
            return v
        new = self.env.get(v)
        if new is not None:
            return new
        loc = self.stacked.get(v)
        if loc is None:
            return v               # defined by a kept equation, an input or a const
        new = self.env[v] = self._index_out(*loc)  # a per-block result read outside its scan
        return new

    def _index_out(self, sid, idx):
        """Entry idx of stack sid as an atom: one dynamic_slice at an opaque
        offset (see `_stacks.opaque_indices`) and a reshape (a bitcast), so every
        read of one shape is the same XLA kernel."""
        arr = self.stacks[sid]
        if not arr.aval.size:   # nothing to read, nor to compile: a static slice
            return self.b.emit(lambda a: lax.index_in_dim(a, idx, keepdims=False), [arr],
                                key=("reroll.index", idx))[0]
        out, = self.b.emit(_stacks.unstack_one, [arr, self.opaque_index(idx, arr)],
                           key="reroll.unstack")
        return out

    def held(self, arr):
        """`arr` for a vectorised family to read: a stack this walk
        concatenated from at most `_stacks.CONCAT_FUSES_UP_TO` entries goes
        through `_stacks.hold` (once), else XLA fuses the concatenate into
        each element-wise reader, one large kernel per reader (measured: the
        8-layer GPT AdamW step compiled in 11.8 s that way, 7.6 s held; the
        16-layer one, whose stacks XLA does not fuse, in 5.2 s)."""
        if (arr not in self.concatenated or not arr.aval.size
                or arr.aval.shape[0] > _stacks.CONCAT_FUSES_UP_TO):
            return arr
        if arr not in self.held_stacks:
            self.held_stacks[arr] = self.hold(arr)
        return self.held_stacks[arr]

    def hold(self, arr):
        """`_stacks.hold(arr)`: arr materialised once, as one new atom."""
        return self.b.emit(_stacks.hold, [arr, self.opaque_index(0, arr)], key="reroll.hold")[0]

    def opaque_index(self, idx, like):
        """The opaque int32 scalar idx (`_stacks.opaque_indices`), made on
        first use. Its loop's trip count reads one element of the jaxpr's
        smallest input (a replicated scalar, under a mesh, where there is
        one: an optimizer's step count), else of `like`, a non-empty stack.
        An input, because XLA folds constants: read from a stack of
        per-layer constants (a mask made from iota), the trip count was
        known, and XLA removed every `hold` loop and made every read of an
        entry a kernel of its own."""
        if self.indices is None:
            n = self.max_repeats
            inputs = [v for v in self.jaxpr.invars if getattr(v.aval, "size", 0)
                      and not jax.dtypes.issubdtype(v.aval.dtype, jax.dtypes.extended)]
            src = min(inputs, key=lambda v: v.aval.size) if inputs else like
            self.indices = self.b.emit(lambda a: _stacks.opaque_indices(n, a), [src],
                                        key=("reroll.opaque", n))
        return self.indices[idx]

    def register(self, arr, vars_in_array_order):
        sid = len(self.stacks)
        self.stacks.append(arr)
        for idx, v in enumerate(vars_in_array_order):
            if _jax.is_var(v):
                self.stacked.setdefault(v, (sid, idx))

    def _find_stack(self, vs):
        """(stack id, first index, step) if vs are stack[i0 + step*j]."""
        try:
            locs = [self.stacked[v] for v in vs]
        except (KeyError, TypeError):
            return None
        sid, i0 = locs[0]
        step = locs[1][1] - i0
        if step not in (1, -1) or any(s != sid or i != i0 + step * j
                                      for j, (s, i) in enumerate(locs)):
            return None
        return sid, i0, step

    # -- one run ---------------------------------------------------------------
    def stack_inputs(self, vs, reverse: bool):
        """Atom of the array whose entry t is block j's input, t = j (or
        n-1-j if reverse): an earlier stack (or a slice of it) when one holds
        exactly these values in this order, else a new stack (a copy)."""
        n = len(vs)
        hit = self._find_stack(vs)
        if hit is not None and (hit[2] == -1) == reverse:
            sid, i0, step = hit
            lo = i0 if step == 1 else i0 - (n - 1)
            arr = self.stacks[sid]
            self.stats.stacks_reused += 1
            if lo == 0 and arr.aval.shape[0] == n:
                return arr
            return self.b.emit(lambda a: lax.slice_in_dim(a, lo, lo + n), [arr],
                                key=("reroll.slice", lo, n))[0]
        order = list(reversed(vs)) if reverse else list(vs)
        arr, = self.b.emit(lambda *xs: _stacks.stack(xs), [self.read(v) for v in order],
                            key="reroll.stack")
        self.concatenated.add(arr)
        self.stats.stacked_copies += 1
        self.stats.stacked_copy_bytes += int(np.prod(arr.aval.shape)) * arr.aval.dtype.itemsize
        self.register(arr, order)
        return arr

    def _body(self, run: Run, const_slots, xs_slots):
        """The scan body: block 0's own equations, re-wired (no re-trace) to
        read body inputs consts + carry + xs, returning carry + ys."""
        block = self.jaxpr.eqns[run.start:run.start + run.period]
        new = _jax.new_var
        consts = {s: new(run.outside[s][0].aval) for s in const_slots}
        xs = {s: new(run.outside[s][0].aval) for s in xs_slots}
        carry = [new(block[r].outvars[o].aval) for r, o in run.carry_slots]
        local: dict = {}
        eqns: list = []
        for r, eqn in enumerate(block):
            invars = []
            for t, v in zip(run.template[r], eqn.invars):
                if isinstance(t, Lit):
                    invars.append(v)
                elif type(t) is Inner:
                    invars.append(local[t.slot])
                elif isinstance(t, Carry):
                    invars.append(carry[t.c])
                else:
                    assert isinstance(t, Outside)
                    invars.append(xs[t.s] if t.s in xs else consts[t.s])
            outvars = [new(v.aval) for v in eqn.outvars]
            local.update(((r, o), v) for o, v in enumerate(outvars))
            # the body's own sub-jaxprs are rolled too (a layer that is one
            # remat equation may hold a loop of sub-layers): one pass suffices
            eqns.append(self.subs(eqn).replace(invars=invars, outvars=outvars))
        outvars = ([local[slot] for slot in run.carry_slots]
                   + [local[slot] for slot in run.ys_slots] + [carry[c] for c in run.carry_ys])
        invars = [consts[s] for s in const_slots] + carry + [xs[s] for s in xs_slots]
        return _jax.as_closed(_jax.new_jaxpr(invars, outvars, eqns))

    def _scan(self, run: Run):
        n = run.repeats
        per_block = [s for s, vs in enumerate(run.outside) if any(v is not vs[0] for v in vs)]
        # direction: follow the first per-block input an earlier stack holds reversed
        reverse = False
        for s in per_block:
            hit = self._find_stack(run.outside[s])
            if hit is not None:
                reverse = hit[2] == -1
                break
        const_slots = [s for s in range(len(run.outside)) if s not in set(per_block)]
        args = ([self.read(run.outside[s][0]) for s in const_slots]
                + [self.read(v) for v in run.carry_init]
                + [self.stack_inputs(run.outside[s], reverse) for s in per_block])
        body = self._body(run, const_slots, per_block)
        n_consts, n_carry = len(const_slots), len(run.carry_slots)
        outs = self.b.emit(lambda *a: _jax.scan_bind(body, a, length=n, reverse=reverse,
                                                     n_consts=n_consts, n_carry=n_carry), args)
        final, ys = outs[:len(run.carry_slots)], outs[len(run.carry_slots):]
        self.stats.runs.append(RolledRun(run.start, run.period, n, reverse))
        pos = (lambda j: n - 1 - j) if reverse else (lambda j: j)
        eqns = self.jaxpr.eqns

        def out_var(j, slot):
            return eqns[run.block_eqn_index(j, slot[0])].outvars[slot[1]]

        for c, slot in enumerate(run.carry_slots):
            v = out_var(n - 1, slot)
            if not _jax.is_dropvar(v):
                self.env[v] = final[c]
        for arr, slot in zip(ys, run.ys_slots):
            order = [None] * n
            for j in range(n):
                order[pos(j)] = out_var(j, slot)
            self.register(arr, order)
        for arr, c in zip(ys[len(run.ys_slots):], run.carry_ys):
            # entry for block j is its carry-in: the init, or block j-1's result
            order = [None] * n
            for j in range(n):
                order[pos(j)] = run.carry_init[c] if j == 0 else out_var(j - 1, run.carry_slots[c])
            self.register(arr, order)
