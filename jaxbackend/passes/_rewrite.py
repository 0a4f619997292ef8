"""The passes' one traversal library: walking jaxprs, an equation builder,
and the rule driver built on it.

Walking (linear in the number of equations):

* `iter_jaxprs(x)`: the top-level jaxpr and every distinct sub-jaxpr (the
  bodies of `jit`, `scan`, `while`, `cond`, remat and custom-derivative
  calls, at any depth), each once however many equations share it;
  `iter_eqns` / `count_eqns` are built on it.
* `Producers(eqns)`: atom -> the equation defining it, indexed lazily as the
  list grows (a builder's output list), so a rule that asks about the graph
  being built pays one dict insert per new output, and one that never asks
  pays nothing. The `remaining()` counters of the passes use it too.
* `map_subjaxprs(eqn, memo, fn)`: an equation with its sub-jaxprs replaced,
  each distinct sub-jaxpr object mapped once (`memo`), never unrolled.

Whether a jaxpr is closed or open is `_jax`'s business (`_jax.jaxpr_parts`).

Building: `EqnBuilder` accumulates the equations of one new (sub-)jaxpr: kept
equations, and new ones made by `emit(fn, args)` / `bind(prim, args, **kw)`,
which trace `fn` through `bind` to a small jaxpr (cached by the caller's key
and the input avals, so the 32 identical layers of a model trace once) and
splice it in with fresh variables. `producer(atom)` reads the graph being
built. `transform(j, walk)` runs a walk over one jaxpr with a fresh builder
and rebuilds a jaxpr of the same kind (closed or open); `reroll` and `dce`
walk that way too.

Driving: `Rewriter` is the rule driver (an `EqnBuilder`). A pass is a
table `{primitive name: rule}` (key `"*"` = any primitive without its own
rule) handed to `rewrite(closed, rules)`. The driver walks the equations
once, in order, keeping an environment old var -> new atom:

* an equation whose rule returns `None` (or has no rule) is kept as it is,
  only its inputs renamed where an earlier rewrite replaced them, so the cost
  of an untouched equation is a dict lookup per input, no re-trace;
* a rule that applies returns the atoms that replace the equation's outputs,
  built with the builder methods of its `ctx` (the driver itself);
* sub-jaxprs in parameters (`jit`/`closed_call`, `scan`, `while`, `cond`,
  `custom_jvp_call`, `custom_vjp_call`, `remat`) are rewritten recursively
  with the same table, once per distinct sub-jaxpr object, never unrolled;
  their input and output types are unchanged, so the enclosing equation
  stays valid.

Rules see the *new* graph: `ctx.producer(atom)` is the equation that defines
an atom after earlier rewrites, so chains of rewrites compose in one walk.
Nothing is re-walked per equation, so a pass is linear in the number of
equations (plus one small trace per distinct rewritten signature).

Equality of equations (`StructuralKeys`, used by `reroll` to match layers
and by `cse`) lives in `_structural`.

Stats: `ctx.count(name)` records a match; `rewrite` returns nothing extra but
adds its counts to the active `collect_stats()` collector (see pipeline), so a
pass keeps the plain signature `ClosedJaxpr -> ClosedJaxpr`.

Leaves alone: every primitive without a rule, every `jvp`/`fwd`/`bwd` callable
of custom-derivative calls (they are functions, not jaxprs), and the jaxpr's
inputs, input types and effects.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import functools
from typing import Any, Callable, Hashable, Iterator, Mapping, Sequence

import jax
import numpy as np

from jaxbackend import _jax
# Structural keys live in their own module; re-exported: one import for passes.
from jaxbackend.passes._structural import StructuralKeys as StructuralKeys

Rule = Callable[["Rewriter", Any], "Sequence[Any] | None"]

_STATS: contextvars.ContextVar = contextvars.ContextVar("jaxbackend_pass_stats", default=None)
_TRACE_CACHE: "collections.OrderedDict[Hashable, Any]" = collections.OrderedDict()
_TRACE_CACHE_SIZE = 4096


class RewriteDeclined(Exception):
    """Raised inside a rule to say "does not apply after all" (the driver
    keeps the original equation; anything already emitted is dead code)."""


@contextlib.contextmanager
def collect_stats():
    """Collect `ctx.count` matches of every `rewrite` run inside the block."""
    counter = collections.Counter()
    token = _STATS.set(counter)
    try:
        yield counter
    finally:
        _STATS.reset(token)


def record_stats(counts: Mapping[str, int]) -> None:
    """Add a pass's match counts to the active `collect_stats()` collector
    (for passes that do not go through `rewrite`, like `dce`)."""
    sink = _STATS.get()
    if sink is not None:
        sink.update(counts)


# ---------------------------------------------------------------------------
# walking

def iter_jaxprs(closed_or_jaxpr, *, seen: set | None = None) -> Iterator:
    """The open jaxpr of `closed_or_jaxpr`, then every distinct sub-jaxpr
    (depth first, each object once)."""
    jaxpr = _jax.open_jaxpr(closed_or_jaxpr)
    seen = set() if seen is None else seen
    yield jaxpr
    for eqn in jaxpr.eqns:
        for sub in _jax.sub_jaxprs(eqn):
            if id(sub) not in seen:
                seen.add(id(sub))
                yield from iter_jaxprs(sub, seen=seen)


def iter_eqns(closed_or_jaxpr) -> Iterator:
    """Every equation, sub-jaxprs included (each distinct sub-jaxpr once)."""
    for jaxpr in iter_jaxprs(closed_or_jaxpr):
        yield from jaxpr.eqns


def count_eqns(closed, primitive: str | None = None) -> int:
    """Number of equations (of `primitive`, if given), sub-jaxprs included."""
    return sum(1 for e in iter_eqns(closed) if primitive is None or e.primitive.name == primitive)


def use_counts(closed_or_jaxpr) -> dict:
    """{var: number of uses} over the jaxpr and its sub-jaxprs: as an
    equation operand (once per operand slot) or a jaxpr output. Passes that
    split or move a value's computation check that all its uses are theirs;
    a var a pass creates later is absent (unknown uses: used elsewhere)."""
    counts: collections.Counter = collections.Counter()
    for jaxpr in iter_jaxprs(closed_or_jaxpr):
        for eqn in jaxpr.eqns:
            counts.update(v for v in eqn.invars if _jax.is_var(v))
        counts.update(v for v in jaxpr.outvars if _jax.is_var(v))
    return dict(counts)


def own_uses(jaxpr) -> collections.Counter:
    """{var: reads within `jaxpr` itself} (operands and outputs; a sub-jaxpr
    reads an outer value only as an operand of its equation, so this does
    not walk sub-jaxprs as `use_counts` does)."""
    uses = collections.Counter(v for e in jaxpr.eqns for v in e.invars if _jax.is_var(v))
    uses.update(v for v in jaxpr.outvars if _jax.is_var(v))
    return uses


class Producers:
    """`producers(atom)`: the equation of `eqns` defining `atom`, or None for
    inputs, consts and literals. `eqns` may grow after construction (a
    builder's output list): new equations are indexed on the next call."""

    def __init__(self, eqns: list):
        self.eqns = eqns
        self._of: dict = {}
        self._indexed = 0            # eqns[:_indexed] are in _of

    def __call__(self, atom):
        if not _jax.is_var(atom):
            return None
        eqns, of = self.eqns, self._of
        for i in range(self._indexed, len(eqns)):
            for v in eqns[i].outvars:
                of[v] = eqns[i]
        self._indexed = len(eqns)
        return of.get(atom)

    def truncate(self, n: int) -> None:
        """Drop `eqns[n:]` (their outputs are then never asked about)."""
        del self.eqns[n:]
        self._indexed = min(self._indexed, n)


def map_subjaxprs(eqn, memo: dict, fn: Callable):
    """`eqn` with every sub-jaxpr parameter replaced by `fn(it)`, which must
    keep its kind and input/output types; memoised per object in `memo`, so
    a sub-jaxpr shared by many equations is mapped once. The same equation
    object when `fn` changed nothing."""
    def once(value):
        hit = memo.get(id(value))
        if hit is None:
            hit = memo[id(value)] = (value, fn(value))  # keep value alive: its id stays unique
        return hit[1]

    return _jax.map_sub_jaxprs(eqn, once)


# ---------------------------------------------------------------------------
# building and driving

def _trace(fn, avals, key):
    """ClosedJaxpr of fn on avals, cached when the rule gives a key."""
    full_key = None
    if key is not None:
        full_key = (key, tuple(avals))
        try:
            hit = _TRACE_CACHE.get(full_key)
        except TypeError:  # unhashable params: trace every time
            full_key, hit = None, None
        if hit is not None:
            _TRACE_CACHE.move_to_end(full_key)
            return hit
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False))
             for a in avals]
    # without its dead equations: make_jaxpr may leave some (a scan's unused
    # zeros, depending on what JAX traced before in the process), and a pass's
    # output should not depend on that
    closed = _jax.dce_keeping_signature(jax.make_jaxpr(lambda *xs: _as_list(fn(*xs)))(*specs))
    if full_key is not None:
        _TRACE_CACHE[full_key] = closed
        if len(_TRACE_CACHE) > _TRACE_CACHE_SIZE:
            _TRACE_CACHE.popitem(last=False)
    return closed


def _as_list(out):
    return list(out) if isinstance(out, (list, tuple)) else [out]


def _renamed(atoms, env):
    return [env.get(v, v) if _jax.is_var(v) else v for v in atoms]


class EqnBuilder:
    """The equations of one new (sub-)jaxpr, in order. `closed`: the jaxpr
    is a ClosedJaxpr's, so array consts may be added; an open one (a remat
    body) declines them (`RewriteDeclined`)."""

    def __init__(self, *, closed: bool):
        self.closed = closed
        self.eqns: list = []
        self.producer = Producers(self.eqns)   # atom -> defining eqn in the new graph
        self.new_constvars: list = []
        self.new_consts: list = []
        self.dropped_constvars: set = set()    # of the old jaxpr, left out by `transform`
        self.changed = False
        # while a rule runs: the source of the equation it replaces, given to
        # what it emits (so `explain` ties new equations to the user's line)
        self.source_info = None

    def append(self, eqn) -> None:
        """Keep `eqn` as it is."""
        self.eqns.append(eqn)

    def emit(self, fn: Callable, args: Sequence, key: Hashable | None = None) -> list:
        """Trace `fn(*arrays)` on the avals of `args`, splice it in, return
        its output atoms. `key` (hashable, unique to what fn computes given
        the avals) enables the trace cache."""
        closed = _trace(fn, [a.aval for a in args], key)
        return self.splice(closed, args)

    def bind(self, prim, args: Sequence, **kw) -> list:
        """One primitive application, as atoms (cached per params/avals)."""
        pk = _jax.params_key(kw)
        key = None if pk is None else ("bind", prim, pk)
        return self.emit(lambda *xs: prim.bind(*xs, **kw), args, key)

    def splice(self, closed, args: Sequence) -> list:
        """Copy the equations of `closed` (a ClosedJaxpr, or a const-free
        Jaxpr) in with fresh variables, its inputs bound to `args`; returns
        the atoms of its outputs."""
        jaxpr, consts = _jax.jaxpr_parts(closed)
        env = dict(zip(jaxpr.invars, args))
        for cv, c in zip(jaxpr.constvars, consts or ()):
            env[cv] = self._const(c, cv.aval)
        for eqn in jaxpr.eqns:
            outvars = []
            for v in eqn.outvars:
                nv = _jax.DropVar(v.aval) if _jax.is_dropvar(v) else _jax.new_var(v.aval)
                env[v] = nv
                outvars.append(nv)
            src: dict = {} if self.source_info is None else {"source_info": self.source_info}
            self.eqns.append(eqn.replace(invars=_renamed(eqn.invars, env), outvars=outvars, **src))
        self.changed = True
        return _renamed(jaxpr.outvars, env)

    def _const(self, value, aval):
        if np.ndim(value) == 0 and not _jax.is_tracer(value):
            return _jax.new_literal(np.asarray(value, dtype=aval.dtype), aval)
        if not self.closed:
            raise RewriteDeclined("cannot add a const inside an open sub-jaxpr")
        v = _jax.new_var(aval)
        self.new_constvars.append(v)
        self.new_consts.append(value)
        return v


def transform(j, walk: Callable, make: Callable = EqnBuilder):
    """Run `walk(jaxpr, builder) -> new outvars | None` over the equations
    of `j` (a ClosedJaxpr or an open Jaxpr) with a fresh `make(closed=...)`
    builder; returns `j` itself when walk returns None, else a jaxpr of
    j's kind: the builder's equations, constvars (less the dropped ones,
    plus the added ones), same inputs and effects."""
    jaxpr, consts = _jax.jaxpr_parts(j)
    b = make(closed=consts is not None)
    outvars = walk(jaxpr, b)
    if outvars is None:
        return j
    dropped = b.dropped_constvars
    constvars = [v for v in jaxpr.constvars if v not in dropped] + b.new_constvars
    new = _jax.jaxpr_with(jaxpr, eqns=b.eqns, outvars=outvars, constvars=constvars)
    if consts is None:
        return _jax.jaxpr_rebuilt(j, new)
    kept = [c for v, c in zip(jaxpr.constvars, consts) if v not in dropped]
    return _jax.jaxpr_rebuilt(j, new, kept + b.new_consts)


class Rewriter(EqnBuilder):
    """The rule driver: one walk of one (sub-)jaxpr through a rule table; the
    `ctx` rules receive (the builder methods, plus `count` and `local`)."""

    def __init__(self, rules: Mapping[str, Rule], *, closed: bool, subs: Callable,
                 stats: collections.Counter):
        super().__init__(closed=closed)
        self.rules = rules
        self._subs = subs            # eqn -> eqn with its sub-jaxprs rewritten
        self._stats = stats
        self.local: dict = {}        # per-walk scratch space for rules (one scope)

    def count(self, name: str, n: int = 1) -> None:
        self._stats[name] += n

    def run(self, jaxpr):
        """The new outvars, or None when nothing changed."""
        env: dict = {}
        rules = self.rules
        default = rules.get("*")
        for eqn in jaxpr.eqns:
            if env:
                invars = _renamed(eqn.invars, env)
                if any(a is not b for a, b in zip(invars, eqn.invars)):
                    eqn = eqn.replace(invars=invars)
            new = self._subs(eqn)
            if new is not eqn:
                eqn = new
                self.changed = True
            rule = rules.get(eqn.primitive.name, default)
            out = None
            if rule is not None:
                n_before = len(self.eqns)
                self.source_info = eqn.source_info
                try:
                    out = rule(self, eqn)
                except RewriteDeclined:
                    self.producer.truncate(n_before)   # what it emitted is dead: drop it
                    out = None
                finally:
                    self.source_info = None
            if out is None:
                self.eqns.append(eqn)
                continue
            out = list(out)
            assert len(out) == len(eqn.outvars), (eqn.primitive, len(out), len(eqn.outvars))
            for old, new in zip(eqn.outvars, out):
                assert _same_type(old.aval, new.aval), (eqn.primitive, old.aval, new.aval)
                if not _jax.is_dropvar(old):
                    env[old] = new
            self.changed = True
        return _renamed(jaxpr.outvars, env) if self.changed else None


def _same_type(a, b) -> bool:
    return tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype


def same_types(eqn, outs, what: str = "replacement"):
    """`outs`, if each has the shape, dtype and weak type of the output of
    `eqn` it replaces; otherwise the rule does not apply (RewriteDeclined:
    when in doubt, keep). Rules call it where they build their result."""
    if not all(_jax.same_aval(old.aval, new.aval) for old, new in zip(eqn.outvars, outs)):
        raise RewriteDeclined(f"{eqn.primitive.name}: {what} changes the type")
    return outs


def rewrite(closed, rules: Mapping[str, Rule]):
    """Apply the rule table to `closed` and every sub-jaxpr; returns a new
    ClosedJaxpr (the same object when no rule fired)."""
    memo: dict = {}
    stats: collections.Counter = collections.Counter()

    def sub(j):
        make = functools.partial(Rewriter, rules, subs=subs, stats=stats)
        return transform(j, lambda jaxpr, rw: rw.run(jaxpr), make)

    def subs(eqn):
        return map_subjaxprs(eqn, memo, sub)

    out = sub(closed)
    record_stats(stats)
    return out
