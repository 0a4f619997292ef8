"""`reroll`'s walk over one jaxpr: runs replaced by scans, the rest kept.

`reroll._Splicer` finds the runs of a jaxpr (`_reroll_find`) and hands them
to a `Walk`, which emits the new equations in order: each run as one `scan`
(`Walk._scan`; its body is block 0's own equations re-wired), stacking the
per-block inputs no earlier stack holds and recording every stack it makes
or reads (variable -> (stack, index)), so later runs, the vectorised families
after each run (`_reroll_vector`, `Walk._plan_gap`) and reads outside the
scans find their values there.
A stacked input split into layers (`jb.stack_layers`: `_stacked.splits_entries`)
is recorded the same way, and a `concatenate` of consecutive entries of one
stack (its gradient rule) reads a slice of that stack (`Walk.keep`). A
16-bit float result only later runs read is stacked as its bits
(`_stacks.as_bits`, `Walk.bits`): the scans reading the stack and
`_index_out` bitcast each entry back.
The invariant is `reroll`'s: every value read equals the original one.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np
from jax import lax

from jaxbackend import _jax, _stacked
from jaxbackend.passes import _reroll_vector, _stacks
from jaxbackend.passes._reroll_run import Carry, Inner, Lit, Outside, Run


class RolledRun(NamedTuple):
    """One run rolled into one scan. `start` indexes the jaxpr holding the
    run (the top level, or a sub-jaxpr for runs rolled inside one)."""

    start: int
    period: int          # equations per block
    repeats: int         # blocks
    reverse: bool        # the scan runs backwards (a backward pass)



class Walk:
    """One pass over one jaxpr's equations: runs replaced, the rest kept."""

    def __init__(self, jaxpr, runs, b, stats, subs, min_repeats):
        self.jaxpr, self.b, self.stats, self.min_repeats = jaxpr, b, stats, min_repeats
        self.subs = subs      # eqn -> eqn with its sub-jaxprs rolled
        self.run_at = {r.start: r for r in runs}
        self.max_repeats = max((r.repeats for r in runs), default=0)
        self.env = {}         # old var -> new atom, where they differ
        self.joined = {}      # a join's merged rows (`_joins_a_stack`) -> its stack of layers
        self.stacked = {}     # old var -> (stack id, index): a per-block result
        self.stacks = []      # stack id -> atom of the stacked array
        self.indices = None   # atoms of opaque int32 scalars 0..max_repeats-1
        self.vector = {}      # position after a run -> its Family (`_reroll_vector`)
        self.last_read = None  # var -> position of its last reader (`_plan_gap`)
        self.family_out = {}  # (id(family), output k) -> id of its stack (`stacks`)
        self.emit_at = {}     # position -> the families emitted after it
        self.concatenated = set()   # atoms of the stacks this walk concatenated
        self.held_stacks = {}       # such a stack -> its `held` atom
        self.pending_holds = {}     # stack ids to hold before their entries are read (ordered)
        self.bits = {}              # stack id -> the 16-bit float type its uint16 entries hold
        self.read_outside = None    # vars some equation outside the runs reads (`_only_runs_read`)

    def kept(self):
        """Yield (position, equation) for each equation outside runs, in
        order, after emitting the scan of every run before it."""
        eqns, i = self.jaxpr.eqns, 0
        while i < len(eqns):
            run = self.run_at.get(i)
            if run is None:
                yield i, eqns[i]
                # resumed once the caller has handled equation i: the
                # families whose emission point it is follow it
                self._emit_after(i)
                i += 1
            else:
                self._scan(run)
                i = run.stop
                if self.min_repeats:
                    self._plan_gap(i)

    def _plan_gap(self, start: int):
        """Plan the families of the equations from `start` (a run's end) to
        the next run or the end: the optimizer update after the last run;
        between the backward run and a later one, the squared norms of the
        layers' gradients that a rolled sum of them reads
        (`optax.clip_by_global_norm`). Every stack made so far exists."""
        eqns = self.jaxpr.eqns
        stop = min((r.start for r in self.run_at.values() if r.start >= start), default=len(eqns))
        if self.last_read is None:   # var -> its last reader's position (outputs: the end)
            self.last_read = {v: k for k, e in enumerate(eqns) for v in e.invars
                              if _jax.is_var(v)}
            self.last_read.update((v, len(eqns)) for v in self.jaxpr.outvars if _jax.is_var(v))
        gap = eqns[start:stop]
        later = [o for e in gap for o in e.outvars if self.last_read.get(o, -1) >= stop]
        vector = _reroll_vector.plan(gap, self.stacked, self.stacks, self.min_repeats, later)
        for fam in {id(f): f for f in vector.values()}.values():   # in creation order
            fam.base = start
            self.emit_at.setdefault(start + fam.at, []).append(fam)
        self.vector.update((start + k, fam) for k, fam in vector.items())
        _reroll_vector.hold_inputs(self, gap, vector)
        self._emit_after(start - 1)

    def _emit_after(self, pos: int):
        for fam in self.emit_at.pop(pos, ()):
            _reroll_vector.emit(self, fam)

    def vectorized(self, pos: int) -> bool:
        """Whether equation `pos` is a member of an applied family (its
        family's one equation is emitted after position `base + at`)."""
        return pos in self.vector

    def keep(self, eqn):
        if self._joins_a_stack(eqn) or self._splits_a_join(eqn):
            return
        invars = [self.read(v) for v in eqn.invars]
        if any(a is not b for a, b in zip(invars, eqn.invars)):
            eqn = eqn.replace(invars=invars)
        self.b.append(eqn)
        if _stacked.splits_entries(eqn):
            # a stacked input split into its layers (`jb.stack_layers`): the
            # scans read the input itself, not a copy stacked from the pieces
            self.register(invars[0], eqn.outvars, defined=True)

    def _splits_a_join(self, eqn) -> bool:
        """A row-major `reshape` of a join of layers (`_joins_a_stack`) back
        into layers (`jb.stack_layers`' gradient is such a join, split
        again) is the join's stack of layers itself: an exact round trip,
        and the sharding model would otherwise see a merge of the layer axis
        with the layers' leading dim, which must then be unsharded."""
        if eqn.primitive.name != "reshape" or _jax.reshape_transposes(eqn):
            return False
        layers = self.joined.get(self.read(eqn.invars[0]))
        if (layers is None or _jax.has_sharding_annotation(eqn)
                or not _jax.same_aval(layers.aval, eqn.outvars[0].aval)):
            return False
        self.env[eqn.outvars[0]] = layers
        return True

    def _joins_a_stack(self, eqn) -> bool:
        """A `concatenate` along axis 0 of per-layer values, L of which are
        entries i..i+L-1, in order, of one stack (the backward rule of
        `jb.stack_layers` joining the per-layer gradients a backward scan
        returned stacked) reads those L as one slice of the stack: not L
        entries indexed out and copied back in. When every operand is one
        layer's value (same type), the join is built as a stack of layers
        (the other operands on a new leading axis, the slices as they are;
        the stack itself when one stack gives every operand) then reshaped to
        the merged rows (a bitcast), and `_splits_a_join` reads the stack;
        otherwise each slice is reshaped to rows and concatenated. Same
        values exactly: the concatenate only moves them."""
        if (eqn.primitive.name != "concatenate" or len(eqn.invars) < 2
                or _jax.concatenate_dimension(eqn) != 0 or not eqn.invars[0].aval.shape):
            return False
        items, k, vs = [], 0, eqn.invars   # (atom, whether a slice of a stack)
        while k < len(vs):
            run = self._stack_run(vs, k)
            if run is None:
                items.append((self.read(vs[k]), False))
                k += 1
                continue
            sid, i0, n, step = run
            got = self.entries(sid, i0 if step > 0 else i0 - n + 1, n)
            if step < 0:    # the layers in reverse (a backward scan's stack)
                got = self.b.emit(lambda a: lax.rev(a, (0,)), [got], key="reroll.rev")[0]
            items.append((got, True))
            k += n
        if len(items) == len(vs):
            return False                  # no run of stack entries: kept as it is
        merged = eqn.outvars[0].aval.shape
        if all(_jax.same_aval(v.aval, vs[0].aval) for v in vs):
            flags = tuple(f for _, f in items)
            layers = items[0][0] if len(items) == 1 else self.b.emit(
                lambda *xs: lax.concatenate(
                    [x if f else lax.expand_dims(x, (0,)) for x, f in zip(xs, flags)], 0),
                [a for a, _ in items], key=("reroll.join_layers", flags))[0]
            out = self.b.emit(lambda a: a.reshape(merged), [layers],
                              key=("reroll.join", merged))[0]
            self.joined[out] = layers
            self.env[eqn.outvars[0]] = out
            return True
        pieces = [a if not f else self.b.emit(
            lambda a: a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:]), [a],
            key=("reroll.rows",))[0] for a, f in items]
        out = _jax.new_var(eqn.outvars[0].aval)
        self.b.append(eqn.replace(invars=pieces, outvars=[out]))
        self.env[eqn.outvars[0]] = out
        return True

    def _stack_run(self, vs, k):
        """(stack id, first index, length >= 2, step) of the longest run of
        vs from k on that are consecutive entries of one stack of their own
        shape, in order (step 1) or in reverse (step -1: the entries of a
        scan over the layers backward, joined in layer order)."""
        loc = self.stacked.get(vs[k]) if _jax.is_var(vs[k]) else None
        if loc is None:
            return None
        have, want = self.stacks[loc[0]].aval, vs[k].aval
        if (have.shape[1:] != want.shape or have.dtype != want.dtype
                or have.weak_type != want.weak_type):
            return None
        sid, i0 = loc
        for step in (1, -1):
            n = 1
            while (k + n < len(vs) and _jax.is_var(vs[k + n])
                   and self.stacked.get(vs[k + n]) == (sid, i0 + step * n)):
                n += 1
            if n >= 2:
                return sid, i0, n, step
        return None

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
        if sid in self.pending_holds:
            self._hold_pending()
        arr = self.stacks[sid]
        if not arr.aval.size:   # nothing to read, nor to compile: a static slice
            return self.b.emit(lambda a: lax.index_in_dim(a, idx, keepdims=False), [arr],
                                key=("reroll.index", idx))[0]
        out, = self.b.emit(_stacks.unstack_one, [arr, self.opaque_index(idx, arr)],
                           key="reroll.unstack")
        if sid in self.bits:
            out, = self.b.emit(lambda a: lax.bitcast_convert_type(a, self.bits[sid]), [out],
                               key=("reroll.from_bits", self.bits[sid]))
        return out

    def held(self, arr):
        """`arr` for a vectorised family to read: a stack this walk
        concatenated from at most `_stacks.CONCAT_FUSES_UP_TO` entries goes
        through `_stacks.hold` (once), else XLA fuses the concatenate into
        each element-wise reader, one large kernel per reader (measured: the
        8-layer GPT AdamW step compiled in 11.8 s that way, 7.6 s held; the
        16-layer one, whose stacks XLA does not fuse, in 5.2 s)."""
        if self.to_hold(arr):
            self.hold_all([arr])
        return self.held_stacks.get(arr, arr)

    def to_hold(self, arr) -> bool:
        """Whether `held(arr)` would hold arr now (a short stack of this
        walk's, not held yet)."""
        return (arr in self.concatenated and arr not in self.held_stacks and bool(arr.aval.size)
                and arr.aval.shape[0] <= _stacks.CONCAT_FUSES_UP_TO)

    def hold_all(self, arrs):
        """Hold each of `arrs` (`held` then returns the held atom), by one
        loop (`_stacks.hold`)."""
        if arrs:
            held = self.b.emit(lambda *a: _stacks.hold(a[:-1], a[-1]),
                               list(arrs) + [self.opaque_index(0, arrs[0])],
                               key="reroll.hold")
            self.held_stacks.update(zip(arrs, held))

    def hold_later(self, sid):
        """Stack sid is to be read out held (`_stacks.hold`): by one loop
        with every stack pending when the first of them is read out."""
        self.pending_holds[sid] = None

    def _hold_pending(self):
        sids = list(self.pending_holds)
        self.pending_holds.clear()
        arrs = [self.stacks[s] for s in sids]
        self.hold_all(arrs)
        for s, a in zip(sids, arrs):
            self.stacks[s] = self.held_stacks[a]

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

    def register(self, arr, vars_in_array_order, defined: bool = False):
        """Record that entry idx of `arr` is var idx's value. `defined`: the
        vars are results of kept equations, read as they are (not indexed
        out of `arr`)."""
        sid = len(self.stacks)
        self.stacks.append(arr)
        for idx, v in enumerate(vars_in_array_order):
            if _jax.is_var(v):
                self.stacked.setdefault(v, (sid, idx))
                if defined:
                    self.env.setdefault(v, v)
        return sid

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

    def entries(self, sid, lo: int, n: int):
        """Entries lo..lo+n-1 of stack sid as one atom: the stack itself, or
        one static slice of it (no copy XLA must keep)."""
        arr = self.stacks[sid]
        self.stats.stacks_reused += 1
        if lo == 0 and arr.aval.shape[0] == n:
            return arr
        return self.b.emit(lambda a: lax.slice_in_dim(a, lo, lo + n), [arr],
                           key=("reroll.slice", lo, n))[0]

    # -- one run ---------------------------------------------------------------
    def stack_inputs(self, vs, reverse: bool):
        """Atom of the array whose entry t is block j's input, t = j (or
        n-1-j if reverse): an earlier stack (or a slice of it) when one holds
        exactly these values in this order, else a new stack (a copy)."""
        n = len(vs)
        hit = self._find_stack(vs)
        if hit is not None and (hit[2] == -1) == reverse:
            sid, i0, step = hit
            return self.entries(sid, i0 if step == 1 else i0 - (n - 1), n)
        order = list(reversed(vs)) if reverse else list(vs)
        arr, = self.b.emit(lambda *xs: _stacks.stack(xs), [self.read(v) for v in order],
                            key="reroll.stack")
        self.concatenated.add(arr)
        self.stats.stacked_copies += 1
        self.stats.stacked_copy_bytes += int(np.prod(arr.aval.shape)) * arr.aval.dtype.itemsize
        self.register(arr, order)
        return arr

    def _body(self, run: Run, const_slots, xs_slots, xs_bits, ys_bits):
        """The scan body: block 0's own equations, re-wired (no re-trace) to
        read body inputs consts + carry + xs, returning carry + ys. Slots in
        `xs_bits` are read from a stack of their bits and bitcast back first;
        those in `ys_bits` are stacked as their bits (`_stacks.as_bits`)."""
        block = self.jaxpr.eqns[run.start:run.start + run.period]
        new = _jax.new_var
        consts = {s: new(run.outside[s][0].aval) for s in const_slots}
        xs = {s: new(run.outside[s][0].aval) for s in xs_slots}
        carry = [new(block[r].outvars[o].aval) for r, o in run.carry_slots]
        local: dict = {}
        eqns: list = []
        xs_in = dict(xs)
        for s in xs_bits:   # the body reads the bits and bitcasts them back
            xs_in[s] = new(_stacks.bits_aval(xs[s].aval))
            eqns.append(_stacks.bitcast_eqn(xs_in[s], xs[s]))
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
        ys = [local[slot] for slot in run.ys_slots]
        for k in ys_bits:
            bits = new(_stacks.bits_aval(ys[k].aval))
            eqns.append(_stacks.bitcast_eqn(ys[k], bits))
            ys[k] = bits
        outvars = [local[slot] for slot in run.carry_slots] + ys + [carry[c] for c in run.carry_ys]
        invars = [consts[s] for s in const_slots] + carry + [xs_in[s] for s in xs_slots]
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
        xs_bits = [s for s, a in zip(per_block, args[len(args) - len(per_block):])
                   if a.aval.dtype != run.outside[s][0].aval.dtype]   # a stack of bits
        eqns = self.jaxpr.eqns

        def out_var(j, slot):
            return eqns[run.block_eqn_index(j, slot[0])].outvars[slot[1]]

        ys_bits = [k for k, slot in enumerate(run.ys_slots)
                   if _stacks.as_bits(out_var(0, slot).aval) is not None
                   and all(self._only_runs_read(out_var(j, slot)) for j in range(n))]
        body = self._body(run, const_slots, per_block, xs_bits, ys_bits)
        n_consts, n_carry = len(const_slots), len(run.carry_slots)
        outs = self.b.emit(lambda *a: _jax.scan_bind(body, a, length=n, reverse=reverse,
                                                     n_consts=n_consts, n_carry=n_carry), args)
        final, ys = outs[:len(run.carry_slots)], outs[len(run.carry_slots):]
        self.stats.runs.append(RolledRun(run.start, run.period, n, reverse))
        pos = (lambda j: n - 1 - j) if reverse else (lambda j: j)
        for c, slot in enumerate(run.carry_slots):
            v = out_var(n - 1, slot)
            if not _jax.is_dropvar(v):
                self.env[v] = final[c]
        for k, (arr, slot) in enumerate(zip(ys, run.ys_slots)):
            order = [None] * n
            for j in range(n):
                order[pos(j)] = out_var(j, slot)
            sid = self.register(arr, order)
            if k in ys_bits:
                self.bits[sid] = out_var(0, slot).aval.dtype
        for arr, c in zip(ys[len(run.ys_slots):], run.carry_ys):
            # entry for block j is its carry-in: the init, or block j-1's result
            order = [None] * n
            for j in range(n):
                order[pos(j)] = run.carry_init[c] if j == 0 else out_var(j - 1, run.carry_slots[c])
            self.register(arr, order)

    def _only_runs_read(self, v) -> bool:
        """Is `v` read by equations of runs only (not by one kept, nor an
        output)? Then its stack is read only by later scans and `_index_out`,
        which both take a stack of bits (`_stacks.as_bits`)."""
        if self.read_outside is None:
            inside = np.zeros(len(self.jaxpr.eqns) + 1, bool)
            for r in self.run_at.values():
                inside[r.start:r.stop] = True
            self.read_outside = {x for i, e in enumerate(self.jaxpr.eqns) if not inside[i]
                                 for x in e.invars if _jax.is_var(x)}
            self.read_outside.update(x for x in self.jaxpr.outvars if _jax.is_var(x))
        return v not in self.read_outside
