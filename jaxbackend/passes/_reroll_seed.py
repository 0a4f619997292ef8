"""Seeds for a run's first block: cross-layer gradient sums and literal
initial values, so the block before a run is one more copy of the others
(part of `passes.reroll`).

A value that every layer reads but none makes (an encoder's output under
cross-attention, a conditioning vector, a shared table) gets its gradient
summed over the layers. JAX's backward pass writes the first contribution it
meets as it is and adds each later one to the sum (`add_any(sum, ct)`), so
the first backward block (the last layer's) has one `add_any` fewer than the
others and is no copy of them: `find_runs` rolls the rest and leaves that
block unrolled, and with it the last layer's weight gradients, which are then
no entry of the backward scan's stack (so the optimizer tail is not
vectorised either, `_reroll_vector`): compile time grows with depth again.
The same happens forward when the user starts a sum over layers at a
literal (`aux = 0.0`, then `aux = aux + layer_aux`): layer 0 adds to the
literal, the others to the carry.

`seeded(jaxpr, runs)` looks at each found run for
- a carry that the run updates as `add_any(carry, .)` whose initial value is
  an `add_any` chain (operand 0 the running sum) whose head, the first
  contribution, is made within one period before the run: the head `h`
  becomes `add_any(z, h)`, `z` a broadcast -0.0 made before everything,
  placed right after `h`'s producer (where the other blocks add their first
  contribution), and every read of `h` reads the new value;
- an equation one period before a carried operand of the run with a literal
  in that operand's place (same primitive, shape and dtype): the literal
  becomes a variable holding the same value (made before everything), which
  the run can then take as the carry's initial value.
`reroll` finds the runs again and keeps the seeded program only when they
cover more equations.

Why the values stay the same: a literal replaced by a variable of the same
value and dtype feeds the same operation (its weak type was resolved when
the equation was traced). IEEE addition of -0.0 returns its other operand
unchanged for every real float (+0.0, -0.0, infinities and NaNs included;
+0.0 would turn a -0.0 into +0.0, which is why the seed is -0.0), so the
seeded sum is bit-identical, except that a subnormal head may be flushed to
zero where the backend flushes subnormal results (XLA:CPU does), as every
later contribution already is when added: a difference below float32's
smallest normal, within the float reassociation `reroll` allows. Only real
floating heads are seeded (a complex -0.0 seed has a +0.0 imaginary part);
the literal keeps its sign through `cse` (literals are keyed by their bytes).

`lifted(jaxpr)` is the third seed, tried before the runs are found, for
per-layer dropout keys. A key folded with the layer index (`fold_in(key, i)`)
makes each layer's block differ in that literal, and keys split once and
read per layer (`keys[i]`, a static slice and a squeeze in each layer; of
a raw `jax.random.PRNGKey`'s split, the slice reads the `random_unwrap`ped
uint32 data) in the slice's index, so no block repeats. The data operand
of every `random_fold_in` that is a literal becomes a variable of the same
value (made before everything), and each key slice (with its squeeze)
moves to right after the keys are made; the blocks then repeat, and each
reads its own index or key as a per-layer input, stacked for the scan as
weights are. Rows of any array that the layers read by their number
(`W[i]` of weights the user keeps stacked, `scale[i]`:
`_reroll_index`) move up the same way.
The values stay the same: the variable holds the literal's value in its
dtype, `random_fold_in` reads only that value, and a slice of keys moved
earlier reads the same keys (pure equations; only their order changes).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax import lax

from jaxbackend import _jax
from jaxbackend.passes import _reroll_index, _rewrite
from jaxbackend.passes._reroll_run import Carry, DepGraph


def _sum_heads(jaxpr, graph, run, heads: dict) -> None:
    """Heads of cross-layer sums carried into `run`: {head var: (producer
    index, the run's add_any to clone)}. `graph()`: the jaxpr's `DepGraph`,
    built on first need (most runs carry no sum)."""
    eqns = jaxpr.eqns
    lo = run.start - run.period
    for r, row in enumerate(run.template):
        link = eqns[run.start + r]
        if link.primitive.name != "add_any" or not row or type(row[0]) is not Carry:
            continue
        g = graph()
        v = run.carry_init[row[0].c]
        d = g.defs.get(v)
        # walk the sum back to its first term, within the block before the run
        while d is not None and d[0] >= lo and eqns[d[0]].primitive.name == "add_any":
            v = eqns[d[0]].invars[0]
            d = g.defs.get(v) if _jax.is_var(v) else None
        if d is None or not lo <= d[0] < run.start or not _jax.is_var(v):
            continue
        if isinstance(v.aval.dtype, np.dtype) and v.aval.dtype.kind == "f":   # a key: no np.dtype
            heads.setdefault(v, (d[0], link))


def _literal_carries(jaxpr, run, sites: dict) -> None:
    """Literals where the block before `run` has one and the run carries:
    {(eqn index, operand): the carry's aval}. E.g. `aux = 0.0` before a loop
    of `aux = aux + layer_aux`: layer 0 adds to the literal 0.0."""
    eqns = jaxpr.eqns
    for r, row in enumerate(run.template):
        i = run.start - run.period + r
        if i < 0:
            continue
        e, t = eqns[i], eqns[run.start + r]
        for k, tag in enumerate(row):
            if type(tag) is not Carry or e.primitive is not t.primitive or k >= len(e.invars):
                continue
            lit, aval = e.invars[k], t.invars[k].aval
            if not isinstance(lit, _jax.Literal):
                continue
            # same shape and dtype, and the equation's results typed as the
            # run's (so a strong-typed variable in the literal's place agrees)
            if (_jax.literal_value(lit).shape == aval.shape
                    and _jax.literal_value(lit).dtype == aval.dtype
                    and all(_jax.same_aval(a.aval, b.aval) for a, b in zip(e.outvars, t.outvars))):
                sites.setdefault((i, k), aval)


def _fill(value, aval):
    """(equations, var): a fresh var of `aval` holding `value` everywhere: a
    weak-typed literal cast to its strong type, then broadcast (`lax.full`
    of a scalar makes no equation; the literal is what the var replaces)."""
    shape, dtype = tuple(aval.shape), aval.dtype

    def fill(x):
        x = _jax.convert_element_type(x, dtype, False)
        return lax.broadcast_in_dim(x, shape, ()) if shape else x

    b = _rewrite.EqnBuilder(closed=False)
    lit = _jax.new_literal(np.asarray(value, dtype), _jax.ShapedArray((), dtype, weak_type=True))
    (z,) = b.emit(fill, [lit])
    if not _jax.is_var(z):
        raise AssertionError(f"_reroll_seed: no equation makes a {aval} fill")
    return b.eqns, z


class _Fills:
    """One fill variable per (shape, dtype, value) (`_fill`); the equations
    that make them, in order, in `eqns` (placed before everything)."""

    def __init__(self):
        self.eqns: list = []
        self._vars: dict = {}

    def __call__(self, value, aval):
        key = (aval.shape, np.dtype(aval.dtype), np.asarray(value, aval.dtype).tobytes())
        if key not in self._vars:
            eqns, self._vars[key] = _fill(value, aval)
            self.eqns.extend(eqns)
        return self._vars[key]

    def __len__(self) -> int:
        return len(self._vars)


def seeded(jaxpr, runs):
    """(seeded jaxpr, number of seeds), or (None, 0) when no run has a
    cross-layer sum started in the block before it or a literal there that
    the run carries."""
    graph = functools.cache(lambda: DepGraph(jaxpr))
    heads: dict = {}
    sites: dict = {}
    for run in runs:
        _sum_heads(jaxpr, graph, run, heads)
        _literal_carries(jaxpr, run, sites)
    if not heads and not sites:
        return None, 0
    after: dict = {}                       # producer index -> [new eqn]
    env: dict = {}
    fill = _Fills()
    for h, (p, link) in heads.items():
        s = _jax.new_var(h.aval)
        after.setdefault(p, []).append(link.replace(invars=[fill(-0.0, h.aval), h], outvars=[s]))
        env[h] = s
    new_lits = {site: fill(_jax.literal_value(jaxpr.eqns[site[0]].invars[site[1]]), aval)
                for site, aval in sites.items()}
    new = list(fill.eqns)
    for i, e in enumerate(jaxpr.eqns):
        if any(_jax.is_var(v) and v in env for v in e.invars) or any(
                (i, k) in new_lits for k in range(len(e.invars))):
            e = e.replace(invars=[new_lits.get((i, k), env.get(v, v) if _jax.is_var(v) else v)
                                  for k, v in enumerate(e.invars)])
        new.append(e)
        new.extend(after.get(i, ()))
    return _jax.jaxpr_with(jaxpr, eqns=new), len(heads) + len(sites)


def covered(runs) -> int:
    return sum(r.period * r.repeats for r in runs)


def _key_slice(e, sliced, raw, indexed) -> bool:
    """A static slice of a key array (typed, or a raw key's data: made by
    `random_unwrap`, in `raw`), a row of an array read by row per layer
    (`_reroll_index.index_reads`, in `indexed`), or the squeeze of either
    (`keys[i]`, `W[i]`)."""
    if e.primitive.name == "slice":
        v = e.invars[0]
        return _jax.is_var(v) and (v in raw or jax.dtypes.issubdtype(v.aval.dtype,
                                                                      jax.dtypes.prng_key)
                                   or _reroll_index.is_index_read(e, indexed))
    return e.primitive.name == "squeeze" and _jax.is_var(e.invars[0]) and e.invars[0] in sliced


def lifted(jaxpr):
    """(jaxpr with per-layer keys made before the layers, number of changes),
    or (None, 0) when there is nothing to change: every literal data operand
    of `random_fold_in` read from a variable of its value, and every
    `keys[i]` of split keys (a static slice and its squeeze) moved to right
    after the keys are made."""
    fill = _Fills()
    after: dict = {}        # var -> the key slices (squeezes) that read it, moved up
    sliced: set = set()
    raw: set = set()        # raw keys' data (jax.random.PRNGKey's uint32 pairs)
    indexed = _reroll_index.index_reads(jaxpr)
    rest: list = []
    n = 0
    for e in jaxpr.eqns:
        if e.primitive.name == "random_unwrap":
            raw.add(e.outvars[0])
        if _key_slice(e, sliced, raw, indexed):
            after.setdefault(e.invars[0], []).append(e)
            sliced.add(e.outvars[0])
            n += e.primitive.name == "slice"
            continue
        if e.primitive.name == "random_fold_in" and isinstance(e.invars[1], _jax.Literal):
            lit = e.invars[1]
            e = e.replace(invars=[e.invars[0], fill(_jax.literal_value(lit), lit.aval)])
        rest.append(e)
    if not len(fill) and not after:
        return None, 0
    new: list = []

    def emit(e):
        new.append(e)
        for v in e.outvars:
            for m in after.pop(v, ()):
                emit(m)

    for e in fill.eqns:
        emit(e)
    for v in [*jaxpr.constvars, *jaxpr.invars]:
        for m in after.pop(v, ()):
            emit(m)
    for e in rest:
        emit(e)
    if after:   # keys made nowhere in this jaxpr (cannot happen): leave it as it was
        return None, 0
    return _jax.jaxpr_with(jaxpr, eqns=new), len(fill) + n
