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


_JAXPR_TYPES = (_jax.ClosedJaxpr, _jax.Jaxpr)


def has_jaxpr(p) -> bool:
    """Does a parameter value hold a (Closed)Jaxpr, directly or in a tuple?"""
    # Fast path: most parameters are ints, dtypes or tuples of ints.
    if isinstance(p, _JAXPR_TYPES):
        return True
    return type(p) is tuple and any(isinstance(q, _JAXPR_TYPES) for q in p)


def _same_type(a, b) -> bool:
    return tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype


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


# ---------------------------------------------------------------------------
# structural keys: what an equation computes, never its printed text

_PLAIN = frozenset({int, str, type(None)})   # keyed as themselves


class StructuralKeys:
    """Hashable keys of equation parameters and (sub-)jaxprs, by structure.

    Two equations with equal keys (and equal inputs) compute the same thing,
    so `reroll` may run block 0's equation for every layer and `cse` may keep
    the first of two. Printed text does not decide that: a function-valued
    parameter prints as a bare name (`bwd=<lambda>`), so layers differing
    only in a custom rule or callback would print alike. Hence:

    * a sub-jaxpr is keyed by its structure: per equation the primitive, the
      keys of its parameters, its operands (variables numbered by position of
      definition, literals by aval + bytes), its result types, effects and
      context; ClosedJaxpr consts by value (bytes; identity above
      `VALUE_BYTES`). Built once per distinct jaxpr object (memoised, linear
      in its size) and interned to a small int, so a parent's key holds the
      int, not a copy, and hashing never re-walks a sub-jaxpr;
    * a custom_jvp rule by the structure of its traced JVP jaxpr
      (`_jax.custom_jvp_rule`): layers calling `jax.nn.relu` share a key,
      rules that differ (say in a closed-over scale) do not;
    * any other function-valued or opaque parameter (custom_vjp `bwd`,
      callbacks, thunks, unhashable values) by identity;
    * plain values by value and type: floats by bits (0.0 != -0.0), bools
      apart from ints (True == 1 in Python), arrays by dtype, shape, bytes.
    """

    VALUE_BYTES = 1 << 16
    MAX_RULE_DEPTH = 8

    def __init__(self, *, expand_rules: bool = True):
        # keys of traced rules with their nested rules left out: to spot a
        # rule that repeats an enclosing one (see `_expand_rule`)
        self._shallow = StructuralKeys(expand_rules=False) if expand_rules else None
        self._stack: list = []     # shallow keys of the rules being expanded
        # memos keyed by id(obj) hold (result, obj): obj kept alive, so its id stays unique
        self._jaxprs: dict = {}    # id(jaxpr) -> interned key
        self._rules: dict = {}     # id(jvp_jaxpr_fun) -> key of the traced rule
        self._weights: dict = {}   # id(open jaxpr) -> number of equations, sub-jaxprs included
        self._alive: dict = {}     # id(obj) -> obj, for objects keyed by identity
        self._intern: dict = {}    # structural key -> small int

    # -- public ----------------------------------------------------------------
    def jaxpr(self, j) -> int:
        """Interned structural key of a Jaxpr or ClosedJaxpr."""
        hit = self._jaxprs.get(id(j))
        if hit is None:
            if _jax.is_closed_jaxpr(j):
                key = ("closed", self.jaxpr(j.jaxpr), tuple(self.value(c) for c in j.consts))
            else:
                key = self._open(j)
            hit = self._jaxprs[id(j)] = (self._intern.setdefault(key, len(self._intern)), j)
        return hit[0]

    def params(self, eqn) -> tuple:
        """Key of an equation's parameters (plus its context)."""
        custom_jvp = eqn.primitive.name == "custom_jvp_call"
        return (_jax.eqn_context(eqn),) + tuple(
            (k, self._jvp_rule(eqn, v) if custom_jvp and k == "jvp_jaxpr_fun" else self(v))
            for k, v in sorted(eqn.params.items()))

    def literal(self, lit) -> tuple:
        return ("lit", lit.aval) + self.value(lit.val)[1:]

    def atom(self, a):
        """An operand of an equation in the enclosing scope: the var itself."""
        return self.literal(a) if isinstance(a, _jax.Literal) else a

    def weight(self, eqn) -> int:
        """1 + the equations inside its sub-jaxprs (a remat of a whole layer
        weighs the layer, not 1)."""
        if not any(has_jaxpr(p) for p in eqn.params.values()):
            return 1
        return 1 + sum(self._jaxpr_weight(s) for s in _jax.jaxprs_in_params(eqn.params))

    def value(self, x) -> tuple:
        """Key of an array or scalar value: dtype, shape, bytes; identity for
        tracers, unconvertible or large values."""
        size = getattr(x, "size", 1)
        if (isinstance(x, jax.core.Tracer) or not isinstance(size, int)
                or size * 16 > self.VALUE_BYTES):    # (16: the widest element, complex128)
            return self._identity(x)
        try:
            a = np.asarray(x)
        except Exception:  # noqa: BLE001 -- e.g. PRNG key arrays: compare by identity
            return self._identity(x)
        if a.dtype == object:
            return self._identity(x)
        return ("val", a.dtype, a.shape, a.tobytes())   # (dtype.str is '<V2' for bfloat16)

    def __call__(self, x):
        """Key of one parameter value."""
        t = type(x)
        if t in _PLAIN:
            return x
        if t is bool:
            return ("bool", x)
        if t is tuple:
            if set(map(type, x)) <= _PLAIN:         # fast path: axes, shapes, dim names
                return x
            return tuple(self(y) for y in x)
        if _jax.is_closed_jaxpr(x) or _jax.is_open_jaxpr(x):
            return ("jaxpr", self.jaxpr(x))
        if _jax.is_function_param(x):
            return self._identity(x)
        if isinstance(x, np.integer):
            return int(x)
        if isinstance(x, (float, complex, np.generic, np.ndarray, jax.Array)):
            return self.value(x)
        if isinstance(x, tuple):                    # NamedTuples (dimension numbers)
            return (t, tuple(self(y) for y in x))
        if isinstance(x, list):
            return ("list", tuple(self(y) for y in x))
        if isinstance(x, dict):
            return ("dict", tuple(sorted((k, self(v)) for k, v in x.items())))
        try:                                        # dtypes, enums, shardings, avals
            hash(x)
        except TypeError:
            return self._identity(x)
        return (t, x)

    # -- internals -------------------------------------------------------------
    def _identity(self, x):
        self._alive[id(x)] = x
        return ("id", id(x))

    def _open(self, jaxpr) -> tuple:
        num = {v: k for k, v in enumerate(list(jaxpr.constvars) + list(jaxpr.invars))}

        def ref(a):
            if isinstance(a, _jax.Literal):
                return self.literal(a)
            k = num.get(a)
            return ("free", self._identity(a)) if k is None else k

        eqns = []
        for e in jaxpr.eqns:
            ins = tuple(ref(a) for a in e.invars)
            for v in e.outvars:
                num[v] = len(num)
            eqns.append((e.primitive, self.params(e), ins, tuple(v.aval for v in e.outvars),
                         frozenset(e.effects) if e.effects else ()))
        return ("open", tuple(v.aval for v in jaxpr.constvars), tuple(v.aval for v in jaxpr.invars),
                tuple(eqns), tuple(ref(a) for a in jaxpr.outvars),
                frozenset(jaxpr.effects) if jaxpr.effects else ())

    def _jvp_rule(self, eqn, fun):
        if self._shallow is None:
            return ("rule",)
        hit = self._rules.get(id(fun))
        if hit is None:
            hit = self._rules[id(fun)] = (self._expand_rule(eqn, fun), fun)
        return hit[0]

    def _expand_rule(self, eqn, fun):
        """Key of a custom_jvp rule: its traced JVP jaxpr, nested custom_jvp
        calls' rules expanded too (they drive higher derivatives). A rule
        usually calls its own function for the primal output (`defjvps`
        does), so expanding never ends: a nested rule whose trace has the
        shape of an enclosing one (nested rules left out) is taken to be
        that rule again and keyed by its distance up the stack. Anything
        else deeper than MAX_RULE_DEPTH: identity."""
        rule = None if len(self._stack) >= self.MAX_RULE_DEPTH else _jax.custom_jvp_rule(eqn)
        if rule is None:
            return self._identity(fun)
        jaxpr, consts, out_zeros = rule
        head = (self._shallow.jaxpr(jaxpr), tuple(self.value(c) for c in consts), out_zeros)
        if head in self._stack:
            return ("rule again", len(self._stack) - self._stack.index(head))
        self._stack.append(head)
        try:
            return ("rule",) + head[1:] + (self.jaxpr(jaxpr),)
        finally:
            self._stack.pop()

    def _jaxpr_weight(self, j) -> int:
        j = j.jaxpr if _jax.is_closed_jaxpr(j) else j
        hit = self._weights.get(id(j))
        if hit is None:
            hit = self._weights[id(j)] = (sum(self.weight(e) for e in j.eqns), j)
        return hit[0]
