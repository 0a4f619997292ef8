"""The pass pipeline: the passes in order, by name, and the driver.

Order (`DEFAULT_PIPELINE`) and why:

0. `reroll`        first: runs of identical layers -> `scan` (forward and,
                   for AD jaxprs, the reverse backward scan). First because
                   every later pass then works on one layer body instead of
                   L copies (measured 3.8 s -> under 2 s of pass time at 32
                   layers), and because cleanup passes run before it change
                   the edge layers so fewer blocks match (56 of 64 vs 64).
                   Fires from `REROLL_MIN_REPEATS` repeats; `jb.jit(...,
                   reroll=False | k)` turns it off or changes the minimum.
1. `inline_calls`  flatten `jit`/`closed_call` bodies: fusion and
                   hoisting match chains that a call boundary would split
                   (`jnp.linalg.norm` is a nested `jit`). Einsums stay, so
                   names survive for the passes and the sharding search.
2. `fuse_projections`  restore batch-keeping contractions (names where known).
3. `hoist_broadcast`   move work above broadcasts (XSA expand form).
4. `group_heads`   contract against un-repeated K/V heads (GQA written
                   with `jnp.repeat`), forward and AD's group sums. After
                   hoisting, which moves casts on a repeated K/V above the
                   repeat so the repeat feeds the contraction directly.
5. `remat_residuals`  a backward scan recomputes the residuals its forward
                   scan stacks when they are cheap elementwise functions of
                   what it reads anyway (what XLA does across an unrolled
                   program, not across a loop). After the rewrites that
                   change the bodies; before cse, which merges the copies.
6. `canonical_conv`  convolutions in XLA's canonical layout (NHWC / HWIO),
                   operands transposed into it: AD writes others, which
                   XLA:CPU runs 20-40x slower inside a loop body (a rolled
                   backward pass). After the rewrites that make loops;
                   before cse, which merges transposes of one value.
7. `cse`           AD repeats work; earlier rewrites can create duplicates.
8. `dce`           drop what fusion, hoisting, grouping and cse left dead
                   (the residuals `remat_residuals` no longer reads).
   (the sharding search reads the jaxpr at this point: names still there.)
9. `inline`        last: einsum -> dot_general, so XLA sees a flat standard
                   jaxpr with no custom primitive.

Adding a pass is one line: `PASSES["name"] = fn` (fn: ClosedJaxpr ->
ClosedJaxpr) and its name in `DEFAULT_PIPELINE`. A pass reports matches by
`ctx.count` (rule-table passes) or `_rewrite.record_stats`; passes that
report nothing still get equation counts and time.

The driver checks every pass's result, built-in or the user's
(`passes=[callable]`): a ClosedJaxpr whose inputs and outputs keep the
shapes, dtypes and weak types of the pass's input program, or one error
naming the pass (`checked`).

`JAXBACKEND_DUMP=<dir>` writes `<dir>/<label>.<k>.<pass>.txt`, the jaxpr
after each pass (k=0 is the input).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import numbers
import os
import pathlib
import re
import time
from typing import Callable, Sequence

from jaxbackend import _jax
from jaxbackend.passes import _rewrite
from jaxbackend.passes.canonical_conv import canonical_conv
from jaxbackend.passes.cse import cse
from jaxbackend.passes.dce import dce
from jaxbackend.passes.fuse_projections import fuse_projections
from jaxbackend.passes.group_heads import group_heads
from jaxbackend.passes.hoist_broadcast import hoist_broadcast
from jaxbackend.passes.inline import inline, inline_calls
from jaxbackend.passes.remat_residuals import remat_residuals
from jaxbackend.passes.reroll import reroll as _reroll

# Measured crossover (benchmarks/compile_scaling.py, value_and_grad of the
# issue-4 transformer, CPU): at 4 layers the rolled program compiled 10-30%
# slower than the unrolled one in four runs (the stacking and unstacking of
# every weight and gradient outweigh the 4 copies saved) and ran 1-23%
# slower (those copies, per call); at 8 layers it compiled 1.3-1.7x faster.
# The difference crosses zero near 5 repeats.
REROLL_MIN_REPEATS = 5


def _with_min_repeats(k: int) -> Callable:
    def reroll(closed):
        return _reroll(closed, min_repeats=k)
    return reroll


PASSES: dict[str, Callable] = {
    "reroll": _with_min_repeats(REROLL_MIN_REPEATS),
    "inline_calls": inline_calls,
    "fuse_projections": fuse_projections,
    "hoist_broadcast": hoist_broadcast,
    "group_heads": group_heads,
    "remat_residuals": remat_residuals,
    "canonical_conv": canonical_conv,
    "cse": cse,
    "dce": dce,
    "inline": inline,
}

DEFAULT_PIPELINE: tuple[str, ...] = (
    "reroll", "inline_calls", "fuse_projections", "hoist_broadcast", "group_heads",
    "remat_residuals", "canonical_conv", "cse", "dce", "inline")


@dataclasses.dataclass
class PassStat:
    name: str
    eqns_before: int
    eqns_after: int
    seconds: float
    matches: dict


@dataclasses.dataclass
class Report:
    """What each pass did; `str(report)` is the one-screen table. With
    `keep_jaxprs=True` (`jb.jit(f).trace_passes(...)`) it also holds the
    jaxpr before and after every pass."""

    stats: list
    jaxprs: list | None = None  # [(name, ClosedJaxpr)], input first, when kept

    @property
    def seconds(self) -> float:
        return sum(s.seconds for s in self.stats)

    def _kept(self) -> list:
        if self.jaxprs is None:
            raise ValueError("this Report kept no jaxprs; run the pipeline with keep_jaxprs=True "
                             "(or use jb.jit(f).trace_passes(*args)) to keep them.")
        return self.jaxprs

    @property
    def before(self):
        """The input jaxpr."""
        return self._kept()[0][1]

    @property
    def after(self):
        """The jaxpr after the last pass."""
        return self._kept()[-1][1]

    def jaxpr_after(self, name: str):
        """The jaxpr after the pass called `name`."""
        for n, j in self._kept():
            if n == name:
                return j
        raise KeyError(f"no pass named {name!r} ran; passes: {[n for n, _ in self._kept()[1:]]}")

    def __str__(self) -> str:
        rows = [f"{'pass':<18} {'eqns before':>11} {'after':>7} {'ms':>8}  matches"]
        for s in self.stats:
            m = ", ".join(f"{k}: {v}" for k, v in sorted(s.matches.items())) or "-"
            rows.append(f"{s.name:<18} {s.eqns_before:>11} {s.eqns_after:>7} "
                        f"{s.seconds * 1e3:>8.2f}  {m}")
        rows.append(f"{'total':<18} {'':>11} {'':>7} {self.seconds * 1e3:>8.2f}")
        copies = sum(s.matches.get("reroll.stacked_copies", 0) for s in self.stats)
        if copies:
            # the one cost of a rolled program that grows with depth (XLA
            # compiles a kernel per returned per-layer array): say the fix
            rows.append(f"note: reroll copied {copies} per-layer lists into stacks (every call; "
                        f"results come back one array per layer); jb.stack_layers keeps the "
                        f"layers stacked across calls, without the copies (README)")
        return "\n".join(rows)


def configure(passes, *, reroll: bool | int = True):
    """`passes` with `reroll` dropped (False) or firing from `reroll` repeats
    (an integer >= 2, Python's or numpy's); True leaves it as given."""
    if reroll is True:
        return passes
    if reroll is not False and (isinstance(reroll, bool) or not isinstance(reroll, numbers.Integral)
                                or reroll < 2):
        raise ValueError(f"reroll={reroll!r}: pass True, False, or a minimum number of "
                         f"repeated layers >= 2, e.g. reroll=8.")
    out = []
    for name, fn in resolve(passes):
        if name == "reroll":
            if reroll is False:
                continue
            fn = _with_min_repeats(int(reroll))
        out.append(fn)
    return tuple(out)


def resolve(passes) -> list[tuple[str, Callable]]:
    """Names and/or callables -> [(name, fn)]; None means the default."""
    if passes is None:
        passes = DEFAULT_PIPELINE
    if isinstance(passes, str) or callable(passes):
        passes = (passes,)
    out = []
    for p in passes:
        if isinstance(p, str):
            if p not in PASSES:
                raise ValueError(f"unknown pass {p!r}; choose from {', '.join(PASSES)} "
                                 f"or pass a callable ClosedJaxpr -> ClosedJaxpr.")
            out.append((p, PASSES[p]))
        elif callable(p):
            out.append((getattr(p, "__name__", repr(p)), p))
        else:
            raise ValueError(f"pass {p!r} is neither a registered name nor a callable; "
                             f"give a name from {', '.join(PASSES)} or a function.")
    return out


def run_pipeline(closed, passes: Sequence | None = None, *, keep_jaxprs: bool = False,
                 label: str = "jaxpr"):
    """Run `passes` (names or callables; default pipeline) -> (closed, Report)."""
    dump = os.environ.get("JAXBACKEND_DUMP")
    dump_dir = pathlib.Path(dump) if dump else None
    if dump_dir is not None:
        dump_dir.mkdir(parents=True, exist_ok=True)
        label = re.sub(r"[^A-Za-z0-9_.-]+", "_", label)
        (dump_dir / f"{label}.0.input.txt").write_text(str(closed))
    jaxprs = [("input", closed)] if keep_jaxprs else None
    stats: list[PassStat] = []
    with paused_gc():
        closed = _run(closed, passes, jaxprs, stats, dump_dir, label)
    return closed, Report(stats, jaxprs)


@contextlib.contextmanager
def paused_gc():
    """Python's cyclic collector off for the block, back on (if it was) after.

    The passes, the sharding plan and a trace allocate many small objects,
    few of them cyclic garbage; with the collector on, each generation-2
    sweep walks the whole heap (JAX's included): per-equation cost grew with
    program size, and one sweep was 0.1 s of the 0.29 s plan of an 8-layer
    AdamW step. What the block leaves cyclic is collected by the next
    automatic collection after it."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _run(closed, passes, jaxprs, stats, dump_dir, label):
    n = _rewrite.count_eqns(closed)
    for k, (name, fn) in enumerate(resolve(passes), start=1):
        t0 = time.perf_counter()
        with _rewrite.collect_stats() as matches:
            closed = checked(name, fn, closed)
        dt = time.perf_counter() - t0
        m = _rewrite.count_eqns(closed)
        stats.append(PassStat(name, n, m, dt, dict(matches)))
        n = m
        if jaxprs is not None:
            jaxprs.append((name, closed))
        if dump_dir is not None:
            (dump_dir / f"{label}.{k}.{name}.txt").write_text(str(closed))
    return closed


def _type(aval) -> tuple:
    return tuple(aval.shape), aval.dtype, getattr(aval, "weak_type", False)


def checked(name: str, fn: Callable, closed):
    """fn(closed), checked to be a ClosedJaxpr with closed's input and output
    types (shape, dtype, weak type): a pass rewrites how a program computes,
    never what it takes or returns, so jit can evaluate it on the same
    arguments and unflatten its outputs into the same tree."""
    out = fn(closed)
    if not _jax.is_closed_jaxpr(out):
        raise TypeError(f"pass {name!r} returned {type(out).__name__}, not a ClosedJaxpr; a pass "
                        f"must return the rewritten ClosedJaxpr (is a `return` missing?).")
    for side, before, after in (("input", closed.in_avals, out.in_avals),
                                ("output", closed.out_avals, out.out_avals)):
        if len(before) != len(after):
            raise ValueError(f"pass {name!r} changed the number of {side}s from {len(before)} to "
                             f"{len(after)}; a pass must keep the program's {side}s.")
        for i, (a, b) in enumerate(zip(before, after)):
            if _type(a) != _type(b):
                raise ValueError(f"pass {name!r} changed {side} {i} from {a} to {b}; a pass must "
                                 f"keep every {side}'s shape, dtype and weak type.")
    return out
