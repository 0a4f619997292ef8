"""Structural keys: what an equation computes, never its printed text.

`StructuralKeys` gives equation parameters (read through `_jax.param_items`)
and (sub-)jaxprs hashable keys by structure, shared by `reroll` (matching
layers) and `cse` (merging equal equations); see the class docstring for
what is compared how.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxbackend import _jax

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
            jaxpr, consts = _jax.jaxpr_parts(j)
            if consts is not None:
                key = ("closed", self.jaxpr(jaxpr), tuple(self.value(c) for c in consts))
            else:
                key = self._open(jaxpr)
            hit = self._jaxprs[id(j)] = (self._intern.setdefault(key, len(self._intern)), j)
        return hit[0]

    def params(self, eqn) -> tuple:
        """Key of an equation's parameters (plus its context)."""
        rule = _jax.custom_jvp_rule_fun(eqn)
        return (_jax.eqn_context(eqn),) + tuple(
            (k, self._jvp_rule(eqn, v) if rule is not None and v is rule else self(v))
            for k, v in _jax.param_items(eqn))

    def literal(self, lit) -> tuple:
        return ("lit", lit.aval) + self.value(lit.val)[1:]

    def atom(self, a):
        """An operand of an equation in the enclosing scope: the var itself."""
        return self.literal(a) if isinstance(a, _jax.Literal) else a

    def weight(self, eqn) -> int:
        """1 + the equations inside its sub-jaxprs (a remat of a whole layer
        weighs the layer, not 1)."""
        return 1 + sum(self._jaxpr_weight(s) for s in _jax.sub_jaxprs(eqn))

    def value(self, x) -> tuple:
        """Key of an array or scalar value: dtype, shape, bytes; identity for
        tracers, unconvertible or large values."""
        size = getattr(x, "size", 1)
        if (_jax.is_tracer(x) or not isinstance(size, int)
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
        if _jax.is_jaxpr(x):
            return ("sub", self.jaxpr(x))
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
        j = _jax.open_jaxpr(j)
        hit = self._weights.get(id(j))
        if hit is None:
            hit = self._weights[id(j)] = (sum(self.weight(e) for e in j.eqns), j)
        return hit[0]
