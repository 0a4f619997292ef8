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

Precondition: a ClosedJaxpr (any; typically the flat jaxpr of a model or of
its `value_and_grad`). Runs are searched at the top level only.
Invariant established: same input and output types, same values up to float
reassociation; afterwards every rolled run of >= `min_repeats` blocks is one
`scan` equation, and no run of the result has >= `min_repeats` blocks of the
same kind left (running the pass twice equals running it once).
Leaves alone: equations outside runs (re-emitted unchanged, in order), blocks
that differ in any parameter, shape, literal or data flow (e.g. a last layer
of another width, a skip connection across two layers, a per-layer literal
such as a dropout key folded with the layer index), effectful equations, and
the inside of sub-jaxprs (`jit`, `scan`, `cond`, ... are compared whole).
When nothing is found the input object is returned unchanged.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxbackend import _jax
from jaxbackend.passes._reroll_find import Run, find_runs

__all__ = ["RerollStats", "find_runs", "reroll", "reroll_with_stats"]


@dataclasses.dataclass
class RerollStats:
    """What one `reroll` call did."""

    runs: list = dataclasses.field(default_factory=list)   # (start, period, repeats, reverse)
    eqns_before: int = 0
    eqns_after: int = 0
    stacked_copies: int = 0        # per-block input lists stacked by copying
    stacked_copy_bytes: int = 0    # bytes those copies move per call
    stacks_reused: int = 0         # per-block input lists read from an earlier stack

    @property
    def blocks(self) -> int:
        """Number of runs rolled (one scan each)."""
        return len(self.runs)

    @property
    def repeats(self) -> list:
        return [r[2] for r in self.runs]


def reroll(closed_jaxpr, *, min_repeats: int = 2):
    """ClosedJaxpr -> ClosedJaxpr with runs of >= min_repeats identical,
    chained blocks rolled into `scan` (see the module docstring)."""
    return reroll_with_stats(closed_jaxpr, min_repeats=min_repeats)[0]


def reroll_with_stats(closed_jaxpr, *, min_repeats: int = 2):
    """`reroll` plus a `RerollStats` describing the runs found."""
    if min_repeats < 2:
        raise ValueError(f"reroll: min_repeats={min_repeats} must be >= 2 (a run of one block "
                         "is not a loop); pass min_repeats=2 or more.")
    jaxpr = closed_jaxpr.jaxpr
    stats = RerollStats(eqns_before=len(jaxpr.eqns))
    runs = find_runs(jaxpr, min_repeats)
    if not runs:
        stats.eqns_after = stats.eqns_before
        _record(stats)
        return closed_jaxpr, stats
    stats.runs = []  # filled by the evaluator, with the direction chosen
    fun = _Evaluator(closed_jaxpr, runs, stats)
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False))
             for a in closed_jaxpr.in_avals]
    out = jax.make_jaxpr(fun)(*specs)
    stats.eqns_after = len(out.jaxpr.eqns)
    _record(stats)
    return out, stats


def _record(stats: RerollStats) -> None:
    """Add counts to the pipeline's stats collector when one is active."""
    try:
        from jaxbackend.passes import _rewrite
    except ImportError:  # the shared traversal is optional for this pass
        return
    _rewrite.record_stats({"reroll.runs": stats.blocks,
                           "reroll.blocks_rolled": sum(stats.repeats),
                           "reroll.stacked_copies": stats.stacked_copies})


class _Evaluator:
    """Re-traces the jaxpr, binding equations outside runs as they are and
    calling `lax.scan` for each run (so JAX builds the scan equations)."""

    def __init__(self, closed, runs, stats):
        self.closed, self.jaxpr, self.stats = closed, closed.jaxpr, stats
        self.run_at = {r.start: r for r in runs}
        self.max_repeats = max(r.repeats for r in runs)

    def __call__(self, *args):
        self.env = {}
        self.stacked = {}     # var -> (stack id, index)
        self.stacks = []      # stack id -> array
        self.indices = None   # opaque int32 scalars 0..max_repeats-1, made on first use
        self.env.update(zip(self.jaxpr.constvars, self.closed.consts))
        self.env.update(zip(self.jaxpr.invars, args))
        eqns, i = self.jaxpr.eqns, 0
        while i < len(eqns):
            run = self.run_at.get(i)
            if run is None:
                self._bind(eqns[i], [self.read(v) for v in eqns[i].invars])
                i += 1
            else:
                self._scan(run)
                i = run.stop
        return [self.read(v) for v in self.jaxpr.outvars]

    # -- environment ---------------------------------------------------------
    def read(self, v):
        if isinstance(v, _jax.Literal):
            return v.val
        val = self.env.get(v)
        if val is None:  # a per-block result of a scan: index it out, once
            sid, idx = self.stacked[v]
            arr = self.stacks[sid]
            if self.indices is None:
                self.indices = _opaque_indices(self.max_repeats, arr)
            # dynamic_slice (clamped by XLA) + squeeze: two plain equations,
            # where lax.dynamic_index_in_dim would add a nested jit per read
            start = (self.indices[idx],) + (0,) * (arr.ndim - 1)
            val = lax.squeeze(lax.dynamic_slice(arr, start, (1,) + arr.shape[1:],
                                                allow_negative_indices=False), (0,))
            self.env[v] = val
        return val

    def _bind(self, eqn, invals):
        for v, x in zip(eqn.outvars, _jax.bind_eqn(eqn, invals)):
            if not isinstance(v, _jax.DropVar):
                self.env[v] = x

    def _register(self, arr, vars_in_array_order):
        sid = len(self.stacks)
        self.stacks.append(arr)
        for idx, v in enumerate(vars_in_array_order):
            if v is not None and not isinstance(v, _jax.Literal):
                self.stacked.setdefault(v, (sid, idx))

    # -- stacking per-block inputs --------------------------------------------
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

    def _xs(self, vs, reverse: bool):
        """Array whose entry t is block j's input, t = j (or n-1-j if reverse)."""
        n = len(vs)
        hit = self._find_stack(vs)
        if hit is not None and (hit[2] == -1) == reverse:
            sid, i0, step = hit
            lo = i0 if step == 1 else i0 - (n - 1)
            arr = self.stacks[sid]
            self.stats.stacks_reused += 1
            return arr if (lo == 0 and arr.shape[0] == n) else lax.slice_in_dim(arr, lo, lo + n)
        order = list(reversed(vs)) if reverse else list(vs)
        arr = jnp.stack([self.read(v) for v in order])
        self.stats.stacked_copies += 1
        self.stats.stacked_copy_bytes += int(np.prod(arr.shape)) * arr.dtype.itemsize
        self._register(arr, order)
        return arr

    # -- one run ---------------------------------------------------------------
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
        is_xs = set(per_block)
        consts = {s: self.read(vs[0]) for s, vs in enumerate(run.outside) if s not in is_xs}
        xs = [self._xs(run.outside[s], reverse) for s in per_block]
        xs_pos = {s: t for t, s in enumerate(per_block)}
        init = [self.read(v) for v in run.carry_init]
        block = [self.jaxpr.eqns[run.start + r] for r in range(run.period)]

        def body(carry, xs_t):
            local = {}
            for r, eqn in enumerate(block):
                vals = []
                for t, v in zip(run.template[r], eqn.invars):
                    kind = t[0]
                    if kind == "lit":
                        vals.append(v.val)
                    elif kind == "int":
                        vals.append(local[t[1:]])
                    elif kind == "car":
                        vals.append(carry[t[1]])
                    elif t[1] in xs_pos:
                        vals.append(xs_t[xs_pos[t[1]]])
                    else:
                        vals.append(consts[t[1]])
                for o, x in enumerate(_jax.bind_eqn(eqn, vals)):
                    local[(r, o)] = x
            new_carry = [local[slot] for slot in run.carry_slots]
            ys = [local[slot] for slot in run.ys_slots] + [carry[c] for c in run.carry_ys]
            return new_carry, ys

        final, ys = lax.scan(body, init, xs, length=n, reverse=reverse)
        self.stats.runs.append((run.start, run.period, n, reverse))
        pos = (lambda j: n - 1 - j) if reverse else (lambda j: j)
        out_var = lambda j, slot: self.jaxpr.eqns[run.block_eqn_index(j, slot[0])].outvars[slot[1]]  # noqa: E731
        for c, slot in enumerate(run.carry_slots):
            v = out_var(n - 1, slot)
            if not isinstance(v, _jax.DropVar):
                self.env[v] = final[c]
        for arr, slot in zip(ys, run.ys_slots):
            order = [None] * n
            for j in range(n):
                order[pos(j)] = out_var(j, slot)
            self._register(arr, order)
        for arr, c in zip(ys[len(run.ys_slots):], run.carry_ys):
            # entry for block j is its carry-in: the init, or block j-1's result
            order = [None] * n
            for j in range(n):
                order[pos(j)] = run.carry_init[c] if j == 0 else out_var(j - 1, run.carry_slots[c])
            self._register(arr, order)


def _opaque_indices(n: int, like):
    """Scalars 0..n-1 whose values XLA cannot see at compile time.

    Unstacking a scan's output into per-layer results (the weight gradients
    the caller expects) takes one slice per layer. With constant offsets each
    slice is a different XLA:CPU kernel, compiled separately: ~10-40 ms each,
    hundreds per deep model, which alone would cost more than compiling the
    scan (measured: 64 slices of one array, 2.9 s; this way, 0.29 s). With the
    offset a runtime scalar, all slices of one shape are one kernel, which
    XLA compiles once. The scalars come out of a `while` loop that runs zero
    times (its trip count is a value XLA cannot know: whether `like`'s first
    element is NaN) and whose body would leave them unchanged anyway (it adds
    the counter, 0, on its only possible iteration), so the values are always
    0..n-1; the loop costs a few microseconds per call.
    """
    first = lax.index_in_dim(like.reshape(-1), 0, keepdims=False)
    trips = (first != first).astype(jnp.int32)
    init = (jnp.int32(0), tuple(jnp.int32(i) for i in range(n)))
    _, idx = lax.while_loop(lambda c: c[0] < trips,
                            lambda c: (c[0] + 1, tuple(x + c[0] for x in c[1])), init)
    return idx
