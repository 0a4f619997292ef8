"""Vectorise the per-block element-wise equations between and after the runs of a
rolled program.

After `reroll` has rolled the layers (forward and backward) into `scan`s,
what follows the last scan is typically the optimizer: AdamW applied to each
layer's copy of each weight, i.e. the same few element-wise equations once per
layer and per weight kind (16,000 of a 64-layer GPT step's equations). Their
inputs are per-layer values that a stack already holds (the weight gradients:
a backward scan's stacked output; the weights: the forward scan's stacked
input) or per-layer program inputs (the optimizer moments).

This module plans to apply each such family of equations once, to the stacks:
one `mul` on `f32[L, ...]` instead of L `mul`s on `f32[...]`. It is the
analysis only; `_reroll_walk.Walk` emits the plan (it owns the stacks).

The equations planned are those after a run, up to the next run or the end
(`_reroll_walk.Walk._plan_gap`): after the last run, the optimizer update;
between the backward run and a third one, the squared norm of each layer's
gradients that optax's `clip_by_global_norm` adds up (that sum itself, a
chain of scalar adds, is rolled into the third scan, which then reads the
norms' stacks instead of copies; its order of addition is the program's).

How (linear walks over the planned equations):
1. layer index: an equation whose located inputs (entry i of a stack) all
   have one index i gets index i, and so do its outputs (forward); an
   unlocated equation whose indexed readers all agree gets theirs (backward:
   `b1 * mu_i` is read by `(1 - b1) * g_i + ...`, so it belongs to layer i);
2. families: indexed equations with equal primitive, params (hashable, equal),
   input/output types and input kinds (entry of stack s; output k of family
   f; a literal of one value; a fill of one literal, `zeros_like`; another
   value) form one family, member i (an index seen twice opens another
   family of that key: same-shape weights in two roles, filled in program
   order; a wrong guess only leaves a family incomplete, hence unapplied).
   Steps 1-2 are repeated (at most `_ROUNDS` times) without the first
   equations of families too small to apply: their index was a guess
   (`acc + s_k`, a sum over every layer, gets layer k's) that would make
   whatever reads them conflict;
3. validity, to a fixpoint (`_place`): a family is applied when its members
   are exactly indices 0..n-1 (n >= min_repeats) of stacks/families of
   length n, each "other" input is either one atom shared by all members or
   distinct per member (then stacked, a copy), and it has an emission point:
   no later than its last member and before any equation outside applied
   families reads a member's result, no earlier than its inputs exist (the
   one vector equation is placed there; readers get entry i lazily).

Which equations: element-wise primitives (`_jax.ELEMENTWISE`), `copy`
(`jnp.array(x)`) and reductions (their axes shift by one), without effects,
sub-jaxprs or an explicit output sharding (its spec has the member's rank).

Invariant (what the emitted program keeps): every member result equals the
original one. Element-wise primitives compute each element independently
with the same params, so applying one to stacked inputs and taking entry i is
bit-identical on every backend that evaluates the op the same way in both
shapes; a reduction over a member's axes reduces the same elements (XLA may
order the sum differently: float reassociation, as for `reroll` itself).
Integer, boolean and non-finite values are handled alike (no arithmetic is
added or moved across members; entries are never mixed). Inputs and outputs
of the program are untouched. Where the one equation is placed (its emission
point) changes when it runs, not what it computes: it has no effects, and
its inputs are the members' own; a `copy` is the identity and a fill input is
rebuilt as the same literal broadcast, so both keep every bit.
"""

from __future__ import annotations

import dataclasses

from jax import lax

from jaxbackend import _jax

_CONFLICT = -1
_ROUNDS = 3   # of steps 1-2 (a round drops the wrong guesses the last one made)
_COPIES = ("copy", "copy_p")   # jnp.array(x): the identity, element by element


@dataclasses.dataclass(eq=False)
class Family:
    """Equations that are one primitive applied to entry i of the same
    stacks (member i, at position `members[i]` of the walked equations)."""

    key: tuple
    members: dict = dataclasses.field(default_factory=dict)   # index -> position
    ok: bool = True
    last: int = -1                     # position of the last member
    at: int = -1                       # emitted after this position (-1: before the first)
    base: int = 0                      # position of the planned equations' first in the jaxpr
    fills: dict = dataclasses.field(default_factory=dict)   # input -> literal ("fill" kinds)
    kinds: tuple = ()                  # per input: ("s", sid) | ("f", fam, k) | ("lit",)
                                       # | ("fill",) | ("o",)
    shared: tuple = ()                 # per input: True when one atom serves every member
    read_out: tuple = ()               # per output: read by an equation outside applied
                                       # families, or a program output (then held: `emit`)


def _eligible(eqn) -> bool:
    name = eqn.primitive.name
    return ((name in _jax.ELEMENTWISE or name in _jax.REDUCTIONS or name in _COPIES)
            and not eqn.effects and not _jax.has_sub_jaxprs(eqn)
            and not _jax.has_sharding_annotation(eqn)   # a spec of the member's rank
            and _jax.params_key(eqn.params) is not None
            and not any(_jax.is_dropvar(v) for v in eqn.outvars))


def _fills(eqn) -> bool:
    """A `broadcast_in_dim` of a scalar literal (`jnp.zeros_like`)."""
    return (eqn.primitive.name == "broadcast_in_dim" and not _jax.is_var(eqn.invars[0])
            and not eqn.invars[0].aval.shape and not _jax.has_sharding_annotation(eqn))


def _type(aval) -> tuple:
    # the dtype object itself: hashable and compared by value (str() of a
    # dtype costs ~10 us, a third of the plan's time at 64 layers)
    return (aval.shape, aval.dtype, bool(getattr(aval, "weak_type", False)))


def plan(eqns, located: dict, stacks: list, min_repeats: int, read_later=()) -> dict:
    """{position: Family} for the members of every family to apply, given
    `located` (var -> (stack id, index)), `stacks` (stack id -> its array) and
    `read_later`, the results of `eqns` that something after them reads
    (the program's outputs, a later run)."""
    elig = [_eligible(e) for e in eqns]
    readers: dict = {}
    for k, e in enumerate(eqns):
        for v in e.invars:
            if _jax.is_var(v):
                readers.setdefault(v, []).append(k)
    for _ in range(_ROUNDS):
        index = _indices(eqns, elig, located, readers)
        families, made_by, fam_at = _families(eqns, index, located)
        # a family of too few members is never applied, and the index it
        # passes on may be a wrong guess: the sum over all layers plus layer
        # k's term gets index k, and so would the global norm computed from
        # it and everything the norm scales. Such an equation is left out of
        # the next round when no other lone one feeds it (the first wrong
        # guess: its readers then get their index from their other inputs)
        lone = {k for f in families if len(f.members) < min_repeats for k in f.members.values()}
        roots = [k for k in lone if not any(
            _jax.is_var(a) and a in made_by and len(made_by[a][0].members) < min_repeats
            for a in eqns[k].invars)]
        if not roots:
            break
        for k in roots:
            elig[k] = False

    by_id = {id(f): f for f in families}
    for fam in families:                                # 3a. shape of each family
        n = len(fam.members)
        fam.ok = n >= min_repeats and set(fam.members) == set(range(n))
        if not fam.ok:
            continue
        shared = []
        for p, kind in enumerate(fam.kinds):
            atoms = [eqns[fam.members[i]].invars[p] for i in range(n)]
            if kind[0] == "s":
                fam.ok &= stacks[kind[1]].aval.shape[0] == n
            if kind[0] in ("lit", "fill"):
                shared.append(True)
            elif kind[0] == "o":
                distinct = len(set(map(id, atoms)))
                fam.ok &= distinct in (1, n)
                shared.append(distinct == 1)
            else:
                shared.append(False)
        fam.shared = tuple(shared)

    defined = {o: k for k, e in enumerate(eqns) for o in e.outvars}
    changed = True                                       # 3b. validity fixpoint
    while changed:
        changed = _place(families, by_id, eqns, readers, fam_at, defined)
    outs = set(read_later)
    for fam in families:
        if fam.ok:
            fam.read_out = tuple(
                any(o in outs or any(not (fam_at[r] is not None and fam_at[r].ok)
                                     for r in readers.get(o, ()))
                    for o in (eqns[k].outvars[j] for k in fam.members.values()))
                for j in range(len(eqns[fam.last].outvars)))
    return {k: fam for fam in families if fam.ok for k in fam.members.values()}


def _indices(eqns, elig, located, readers) -> list:
    """Step 1: each eligible equation's layer index (None: none; _CONFLICT)."""
    index: list = [None] * len(eqns)
    var_index = {v: i for v, (_, i) in located.items()}
    for k, e in enumerate(eqns):                       # 1a. forward
        if not elig[k]:
            continue
        got = {var_index[v] for v in e.invars if _jax.is_var(v) and v in var_index}
        if len(got) == 1:
            index[k] = got.pop()
            for o in e.outvars:
                var_index[o] = index[k]
        elif got:
            index[k] = _CONFLICT
    for k in range(len(eqns) - 1, -1, -1):             # 1b. backward
        if not elig[k] or index[k] is not None:
            continue
        got = {index[r] for o in eqns[k].outvars for r in readers.get(o, ())}
        got.discard(None)
        if len(got) == 1 and _CONFLICT not in got:
            index[k] = got.pop()
    return index


def _families(eqns, index, located) -> tuple:
    """Step 2: (families in creation order, var -> (family, output k),
    position -> its family or None)."""
    families: list = []
    by_key: dict = {}
    made_by: dict = {}
    fam_at: list = [None] * len(eqns)
    filled = {}                                         # var -> the literal it is filled with
    for k, e in enumerate(eqns):
        if _fills(e):
            filled[e.outvars[0]] = e.invars[0]
        i = index[k]
        if i is None or i == _CONFLICT:
            continue
        kinds: list = []
        for a in e.invars:
            if not _jax.is_var(a):
                kinds.append(("lit", _jax.literal_value(a).tobytes()))
            elif a in filled:   # zeros_like(g) per layer (optax's abs_sq: g.imag)
                kinds.append(("fill", _jax.literal_value(filled[a]).tobytes()))
            elif a in made_by:
                f, j = made_by[a]
                kinds.append(("f", id(f), j))
            elif a in located:
                kinds.append(("s", located[a][0]))
            else:
                kinds.append(("o",))
        key = (e.primitive, _jax.params_key(e.params), tuple(_type(a.aval) for a in e.invars),
               tuple(_type(v.aval) for v in e.outvars), tuple(kinds))
        # equal keys, one index twice (weights of one shape in two roles: two
        # layer norms' scales): a lane per role, filled in program order
        lanes = by_key.setdefault(key, [])
        fam = next((f for f in lanes if i not in f.members), None)
        if fam is None:
            fills = {p: filled[a] for p, a in enumerate(e.invars) if kinds[p][0] == "fill"}
            fam = Family(key, kinds=tuple(kinds), fills=fills)
            lanes.append(fam)
            families.append(fam)
        fam.members[i] = k
        fam.last = max(fam.last, k)
        fam_at[k] = fam
        for j, o in enumerate(e.outvars):
            made_by[o] = (fam, j)
    return families, made_by, fam_at


def _place(families, by_id, eqns, readers, fam_at, defined) -> bool:
    """One round of 3b: set each applied family's emission point `at` and
    drop (ok = False) those that cannot have one; True when any was dropped.

    `at` is the family's last member (where its readers all are, for the
    optimizer update), or earlier when an equation outside the applied
    families reads a member's result before that: squared norms added up as
    they are made (`total += jnp.sum(g * g)` per layer) get `at` before the
    first add. Consumer families are visited first (a consumer is created
    after its producers), so a producer's `at` is <= its consumers'. A
    family is dropped when its inputs are not all defined by `at` (a member
    input made later, or a producer family dropped) or when it reads a
    family of another length."""
    for fam in reversed(families):
        if not fam.ok:
            continue
        at = fam.last
        for k in fam.members.values():
            for o in eqns[k].outvars:
                for r in readers.get(o, ()):
                    by = fam_at[r]
                    at = min(at, by.at if by is not None and by.ok else r - 1)
        fam.at = at
    dropped = False
    for fam in families:
        if not fam.ok:
            continue
        bad = any(k[0] == "f" and (not by_id[k[1]].ok or len(by_id[k[1]].members)
                                   != len(fam.members)) for k in fam.kinds)
        avail = max((defined.get(eqns[k].invars[p], -1) for p, kind in enumerate(fam.kinds)
                     if kind[0] == "o" for k in fam.members.values()), default=-1)
        if bad or avail > fam.at:
            fam.ok, dropped = False, True
    return dropped


def hold_inputs(walk, eqns, vector: dict) -> None:
    """Before the planned equations `eqns`: stack now the per-member inputs
    of the applied families that are defined before them (the optimizer
    moments: program inputs), and hold every short stack the families read
    (`Walk.held`) by one loop, not one loop each (`_stacks.hold`)."""
    made_in_tail = {o for e in eqns for o in e.outvars}
    wanted: dict = {}
    for fam in sorted({id(f): f for f in vector.values()}.values(), key=lambda f: f.at):
        members = [eqns[fam.members[i]] for i in range(len(fam.members))]
        for p, kind in enumerate(fam.kinds):
            if fam.shared[p] or kind[0] == "f":
                continue
            atoms = [m.invars[p] for m in members]
            if kind[0] == "o" and any(v in made_in_tail for v in atoms):
                continue
            wanted[_input_stack(walk, kind, atoms)] = None
    walk.hold_all([a for a in wanted if walk.to_hold(a)])


def _input_stack(walk, kind, atoms):
    """The stack a family reads at an input of kind "s" (an existing stack)
    or "o" (the members' own inputs, stacked: a copy, or an earlier stack)."""
    return walk.stacks[kind[1]] if kind[0] == "s" else walk.stack_inputs(atoms, reverse=False)


def emit(walk, fam):
    """Emit `fam` into `walk` (a `_reroll_walk.Walk`) as one equation on stacks;
    entry i of its result is member i's result, which later readers index
    out lazily (`walk.read`)."""
    members = [walk.jaxpr.eqns[fam.base + fam.members[i]] for i in range(len(fam.members))]
    e0, n = members[0], len(members)
    out_shape = tuple(e0.outvars[0].aval.shape)
    args = []
    for p, kind in enumerate(fam.kinds):
        aval = e0.invars[p].aval
        if kind[0] == "fill":  # made here: the members' own fills may come later
            arr = _broadcast(walk.b, fam.fills[p], (n,) + tuple(aval.shape), ())
        elif fam.shared[p]:
            arr = walk.read(e0.invars[p])
            if aval.ndim:      # one array for every member: the same entry for each
                arr = _broadcast(walk.b, arr, (n,) + tuple(aval.shape),
                                 tuple(range(1, aval.ndim + 1)))
        else:
            if kind[0] == "f":
                arr = walk.stacks[walk.family_out[kind[1:]]]
            else:
                arr = walk.held(_input_stack(walk, kind, [m.invars[p] for m in members]))
            if not aval.ndim and out_shape:   # a per-member scalar next to arrays
                arr = _broadcast(walk.b, arr, (n,) + out_shape, (0,))
        args.append(arr)
    params = _jax.eqn_params(e0)
    if e0.primitive.name in _jax.REDUCTIONS:
        params = _jax.reduce_params(e0, [a + 1 for a in _jax.reduce_axes(e0)])
    outs = walk.b.bind(e0.primitive, args, **params)
    if all(a.aval.ndim == v.aval.ndim for a, v in zip(args, e0.invars)):
        # every input one scalar all members share (a step size from one
        # learning rate, traced once per layer): one value, made a stack of
        # n equal entries, as the family's readers expect
        outs = [_broadcast(walk.b, o, (n,) + tuple(o.aval.shape),
                           tuple(range(1, o.aval.ndim + 1))) for o in outs]
    for k, out in enumerate(outs):
        sid = walk.register(out, [m.outvars[k] for m in members])
        walk.family_out[(id(fam), k)] = sid
        if fam.read_out[k] and out.aval.size:
            # entries read out (program outputs: the new weights and moments)
            # come from a materialised stack: held, with every stack pending
            # then, by one loop before the first entry is read
            # (`Walk.hold_later`); families emitted after that read the held
            # stack, so the loop's input has no reader after it and XLA
            # needs no copy of it
            walk.hold_later(sid)
    walk.stats.vectorized += 1
    walk.stats.vectorized_eqns += n


def _broadcast(b, arr, shape, dims):
    return b.emit(lambda a: lax.broadcast_in_dim(a, shape, dims), [arr],
                  key=("reroll.broadcast", shape, dims))[0]
