"""The one traversal every pass uses: a rule table walked over a jaxpr.

A pass is a table `{primitive name: rule}` (key `"*"` = any primitive without
its own rule) handed to `rewrite(closed, rules)`. The driver walks the
equations once, in order, keeping an environment old var -> new atom:

* an equation whose rule returns `None` (or has no rule) is kept as it is,
  only its inputs renamed where an earlier rewrite replaced them, so the cost
  of an untouched equation is a dict lookup per input, no re-trace;
* a rule that applies returns the atoms that replace the equation's outputs.
  It builds them with `ctx.emit(fn, args)` / `ctx.bind(prim, args, **params)`,
  which trace `fn` through `bind` to a small jaxpr (cached by the rule's key
  and the input avals, so the 32 identical layers of a model trace once) and
  splice it in with fresh variables;
* sub-jaxprs in parameters (`jit`/`closed_call`, `scan`, `while`, `cond`,
  `custom_jvp_call`, `custom_vjp_call`, `remat`: any `ClosedJaxpr`/`Jaxpr`
  parameter, or tuple of them) are rewritten recursively with the same table,
  once per distinct sub-jaxpr object, never unrolled; their input and output
  types are unchanged, so the enclosing equation stays valid.

Rules see the *new* graph: `ctx.producer(atom)` is the equation that defines
an atom after earlier rewrites, so chains of rewrites compose in one walk.
Nothing is re-walked per equation, so a pass is linear in the number of
equations (plus one small trace per distinct rewritten signature).

Equality of equations (`StructuralKeys`, used by `reroll` to match layers
and by `cse`): by structure, sub-jaxprs recursively and once per object,
custom_jvp rules by their traced jaxprs, other function-valued parameters by
identity; never by printed text.

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
from typing import Any, Callable, Hashable, Mapping, Sequence

import jax
import numpy as np

from jaxbackend import _jax
# Structural equation keys (and has_jaxpr) live in their own module; re-exported.
from jaxbackend.passes._structural import StructuralKeys as StructuralKeys, has_jaxpr as has_jaxpr

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
    closed = jax.make_jaxpr(lambda *xs: _as_list(fn(*xs)))(*specs)
    if full_key is not None:
        _TRACE_CACHE[full_key] = closed
        if len(_TRACE_CACHE) > _TRACE_CACHE_SIZE:
            _TRACE_CACHE.popitem(last=False)
    return closed


def _as_list(out):
    return list(out) if isinstance(out, (list, tuple)) else [out]


class Rewriter:
    """State of one walk over one (sub-)jaxpr; the `ctx` rules receive."""

    def __init__(self, rules: Mapping[str, Rule], *, closed: bool, shared: dict):
        self.rules = rules
        self._closed = closed        # may new consts be added (ClosedJaxpr level)?
        self._shared = shared        # per-pass: memo of rewritten sub-jaxprs, stats
        self.eqns: list = []
        self._producer: dict = {}
        self._indexed = 0            # eqns[:_indexed] are in _producer
        self.new_constvars: list = []
        self.new_consts: list = []
        self.changed = False
        self.local: dict = {}        # per-walk scratch space for rules (one scope)

    # -- for rules ---------------------------------------------------------
    def producer(self, atom):
        """The equation (in the new graph) defining `atom`, or None for
        inputs, consts and literals."""
        if not _jax.is_var(atom):
            return None
        # Indexed lazily: passes that never ask (inline, cse) pay nothing.
        eqns, producer = self.eqns, self._producer
        for i in range(self._indexed, len(eqns)):
            for v in eqns[i].outvars:
                producer[v] = eqns[i]
        self._indexed = len(eqns)
        return producer.get(atom)

    def count(self, name: str, n: int = 1) -> None:
        self._shared["stats"][name] += n

    def emit(self, fn: Callable, args: Sequence, key: Hashable | None = None) -> list:
        """Trace `fn(*arrays)` on the avals of `args`, splice it in, return
        its output atoms. `key` (hashable, unique to what fn computes given
        the avals) enables the trace cache."""
        closed = _trace(fn, [a.aval for a in args], key)
        return self.splice(closed, args)

    def bind(self, prim, args: Sequence, **params) -> list:
        """One primitive application, as atoms (cached per params/avals)."""
        try:
            key = ("bind", prim, tuple(sorted(params.items())))
            hash(key)
        except TypeError:
            key = None
        return self.emit(lambda *xs: prim.bind(*xs, **params), args, key)

    def splice(self, closed, args: Sequence) -> list:
        """Copy `closed`'s equations in with fresh variables, its inputs
        bound to `args`; returns the atoms of its outputs."""
        env = dict(zip(closed.jaxpr.invars, args))
        for cv, c in zip(closed.jaxpr.constvars, closed.consts):
            env[cv] = self._const(c, cv.aval)
        for eqn in closed.jaxpr.eqns:
            invars = [env.get(v, v) if _jax.is_var(v) else v for v in eqn.invars]
            outvars = []
            for v in eqn.outvars:
                nv = _jax.DropVar(v.aval) if _jax.is_dropvar(v) else _jax.new_var(v.aval)
                env[v] = nv
                outvars.append(nv)
            self.eqns.append(eqn.replace(invars=invars, outvars=outvars))
        self.changed = True
        return [env.get(v, v) if _jax.is_var(v) else v for v in closed.jaxpr.outvars]

    # -- driver ------------------------------------------------------------
    def _const(self, value, aval):
        if np.ndim(value) == 0 and not isinstance(value, jax.core.Tracer):
            return _jax.new_literal(np.asarray(value, dtype=aval.dtype), aval)
        if not self._closed:
            raise RewriteDeclined("cannot add a const inside an open sub-jaxpr")
        v = _jax.new_var(aval)
        self.new_constvars.append(v)
        self.new_consts.append(value)
        return v

    def _rewrite_sub(self, value):
        if _jax.is_closed_jaxpr(value):
            return _rewrite_closed(value, self.rules, self._shared)
        return _rewrite_open(value, self.rules, self._shared)

    def finish(self, jaxpr, outvars):
        """`jaxpr` with the walked equations, these outvars and any consts
        the rules added (same inputs and effects)."""
        return _jax.jaxpr_with(jaxpr, eqns=self.eqns, outvars=outvars,
                               constvars=list(jaxpr.constvars) + self.new_constvars)

    def run(self, jaxpr) -> tuple[list, list]:
        env: dict = {}
        rules = self.rules
        default = rules.get("*")
        for eqn in jaxpr.eqns:
            if env:
                invars = [env.get(v, v) if _jax.is_var(v) else v for v in eqn.invars]
                if any(a is not b for a, b in zip(invars, eqn.invars)):
                    eqn = eqn.replace(invars=invars)
            new = map_subjaxprs(eqn, self._shared["memo"], self._rewrite_sub)
            if new is not eqn:
                eqn = new
                self.changed = True
            rule = rules.get(eqn.primitive.name, default)
            out = None
            if rule is not None:
                n_before = len(self.eqns)
                try:
                    out = rule(self, eqn)
                except RewriteDeclined:
                    del self.eqns[n_before:]   # now dead; drop them
                    self._indexed = min(self._indexed, n_before)
                    out = None
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
        outvars = [env.get(v, v) if _jax.is_var(v) else v for v in jaxpr.outvars]
        return self.eqns, outvars


def _same_type(a, b) -> bool:
    return tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype


def same_types(eqn, outs, what: str = "replacement"):
    """`outs`, if each has the shape, dtype and weak type of the output of
    `eqn` it replaces; otherwise the rule does not apply (RewriteDeclined:
    when in doubt, keep). Rules call it where they build their result."""
    if not all(_jax.same_aval(old.aval, new.aval) for old, new in zip(eqn.outvars, outs)):
        raise RewriteDeclined(f"{eqn.primitive.name}: {what} changes the type")
    return outs


def _rewrite_closed(closed, rules, shared):
    rw = Rewriter(rules, closed=True, shared=shared)
    _, outvars = rw.run(closed.jaxpr)
    if not rw.changed:
        return closed
    return _jax.ClosedJaxpr(rw.finish(closed.jaxpr, outvars), list(closed.consts) + rw.new_consts)


def _rewrite_open(jaxpr, rules, shared):
    rw = Rewriter(rules, closed=False, shared=shared)
    _, outvars = rw.run(jaxpr)
    return rw.finish(jaxpr, outvars) if rw.changed else jaxpr


def map_subjaxprs(eqn, memo: dict, fn: Callable):
    """`eqn` with every sub-jaxpr parameter (a `ClosedJaxpr`/`Jaxpr`, directly
    or in a tuple) replaced by `fn(it)`, which must keep its type and input/
    output types; memoised per object in `memo`, so a sub-jaxpr shared by
    many equations is rewritten once. The same equation object when `fn`
    changed nothing."""
    params = eqn.params
    if not any(has_jaxpr(p) for p in params.values()):
        return eqn

    def sub(value):
        if isinstance(value, tuple):
            new = tuple(sub(v) for v in value)
            return value if all(a is b for a, b in zip(new, value)) else new
        if not (_jax.is_closed_jaxpr(value) or _jax.is_open_jaxpr(value)):
            return value
        hit = memo.get(id(value))
        if hit is None:
            hit = memo[id(value)] = (value, fn(value))  # keep value alive: its id stays unique
        return hit[1]

    new = {k: sub(p) for k, p in params.items()}
    return eqn if all(new[k] is params[k] for k in params) else eqn.replace(params=new)


def rewrite(closed, rules: Mapping[str, Rule]):
    """Apply the rule table to `closed` and every sub-jaxpr; returns a new
    ClosedJaxpr (the same object when no rule fired)."""
    shared = {"memo": {}, "stats": collections.Counter()}
    out = _rewrite_closed(closed, rules, shared)
    record_stats(shared["stats"])
    return out


def record_stats(counts: Mapping[str, int]) -> None:
    """Add a pass's match counts to the active `collect_stats()` collector
    (for passes that do not go through `rewrite`, like `dce`)."""
    sink = _STATS.get()
    if sink is not None:
        sink.update(counts)


def iter_eqns(closed_or_jaxpr, *, seen=None):
    """Every equation, sub-jaxprs included (each distinct sub-jaxpr once)."""
    jaxpr = closed_or_jaxpr.jaxpr if _jax.is_closed_jaxpr(closed_or_jaxpr) else closed_or_jaxpr
    seen = set() if seen is None else seen
    for eqn in jaxpr.eqns:
        yield eqn
        if not any(has_jaxpr(p) for p in eqn.params.values()):
            continue
        for sub in _jax.jaxprs_in_params(eqn.params):
            if id(sub) not in seen:
                seen.add(id(sub))
                yield from iter_eqns(sub, seen=seen)


def count_eqns(closed, primitive: str | None = None) -> int:
    """Number of equations (of `primitive`, if given), sub-jaxprs included."""
    return sum(1 for e in iter_eqns(closed) if primitive is None or e.primitive.name == primitive)


def uses(jaxpr) -> collections.Counter:
    """How many times each var is read (equation inputs and outputs)."""
    c: collections.Counter = collections.Counter()
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if _jax.is_var(v):
                c[v] += 1
    for v in jaxpr.outvars:
        if _jax.is_var(v):
            c[v] += 1
    return c
