"""`jb.jit`'s `mesh=` half: the passes run under a mesh, the plan per
argument types (`Planner`), and the program evaluated with the plan's
layouts pinned (`run_planned`).

A plan is made once per (static values, argument types, donated leaves, JAX
config) and cached on the `jb.jit` object. JAX's own trace cache also keys
on the inputs' layouts, so a call on arguments placed by the plan (after a
first call or `.lower` on unplaced ones) is a new JAX trace of the same
program: `Planner.lookup` answers it from the cache with the planned
program, without running fn, the passes or the search again.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxbackend import _jax
from jaxbackend.passes import _stacks
from jaxbackend.passes import pipeline as _pipeline

UNSPECIFIED = object()   # in_shardings / out_shardings not given


def spec(x) -> jax.ShapeDtypeStruct:
    """A leaf's type as jax.jit sees it (jax.typeof keeps weak types: Python
    scalars, weak arrays)."""
    t = jax.typeof(x)
    return jax.ShapeDtypeStruct(t.shape, t.dtype, weak_type=t.weak_type)


def mesh_passes(passes) -> tuple:
    """The passes run under a mesh: all but `inline`, so the search plans a
    jaxpr that still has its named einsums (they lower by themselves).
    `reroll` runs first, as without a mesh: the search plans the rolled
    program (a scan body is walked once, its cost counted per trip), and
    the plan's constraints go inside the scan bodies (`run_planned`), so
    compile time stays flat in depth under a mesh too."""
    return tuple(f for n, f in _pipeline.resolve(passes) if n != "inline")


class Planner:
    """Plans per (static values, argument types); checks given in/out
    shardings against each plan."""

    def __init__(self, mesh, rules, memory_budget, profile, in_shardings, out_shardings):
        self.mesh, self.rules, self.budget, self.profile = mesh, rules, memory_budget, profile
        self.in_shardings, self.out_shardings = in_shardings, out_shardings
        self.cache: dict = {}

    @staticmethod
    def _key(static, dynamic, leaves, donated) -> tuple:
        # JAX's own trace cache keys on its config too (x64, matmul precision, ...)
        return (static, jax.tree.structure(dynamic), tuple(map(spec, leaves)), donated,
                _jax.trace_context())

    def lookup(self, static, dynamic, donated):
        """(plan, dynamic leaves) where these arguments (static values, the
        tree of dynamic ones) were planned before, else None."""
        leaves = jax.tree.leaves(dynamic)
        plan = self.cache.get(self._key(static, dynamic, leaves, donated))
        return None if plan is None else (plan, leaves)

    def __call__(self, t, donated: tuple = ()):
        """The plan of `t` (jit's `_Traced`, its jaxpr after the passes)."""
        from jaxbackend.sharding import _plan

        key = self._key(t.static, t.dynamic, t.leaves, donated)
        plan = self.cache.get(key)
        if plan is None:
            plan = _plan.plan_jaxpr(t.closed, _plan.dims_of(t.dynamic), _plan.dims_of(t.out_shape),
                                    jax.tree.structure(t.dynamic), jax.tree.structure(t.out_shape),
                                    mesh=self.mesh, rules=self.rules,
                                    memory_budget=self.budget, profile=self.profile,
                                    in_paths=_plan.paths_of(t.dynamic), donated=donated)
            self.cache[key] = plan
        if self.in_shardings is not UNSPECIFIED:
            _check_agrees("in_shardings", "argument", self.in_shardings, t.dynamic[0],
                          plan.in_specs()[:len(jax.tree.leaves(t.dynamic[0]))], plan)
        if self.out_shardings is not UNSPECIFIED:
            _check_agrees("out_shardings", "output", self.out_shardings, t.out_shape,
                          plan.out_specs(), plan)
        return plan


def on_mesh(shardings, mesh):
    """`shardings` (UNSPECIFIED, or a pytree prefix of shardings,
    PartitionSpecs and Nones) with each PartitionSpec a NamedSharding on
    `mesh`."""
    if shardings is UNSPECIFIED:
        return shardings
    spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)  # noqa: E731
    return jax.tree.map(lambda x: jax.sharding.NamedSharding(mesh, x) if spec(x) else x,
                        shardings, is_leaf=lambda x: x is None or spec(x))


def _check_agrees(arg, what, given, tree, specs, plan) -> None:
    """Each leaf's sharding in `given` (a prefix of `tree`) is the plan's."""
    is_sharding = lambda x: x is None or isinstance(x, (jax.sharding.Sharding,  # noqa: E731
                                                        jax.sharding.PartitionSpec))
    try:
        given = jax.tree.leaves(jax.tree.broadcast(given, tree, is_leaf=is_sharding),
                                is_leaf=is_sharding)
    except ValueError:
        raise ValueError(
            f"jb.jit(mesh=...): {arg} has the structure "
            f"{jax.tree.structure(given, is_leaf=is_sharding)}, which is no prefix of the {what}s' "
            f"{jax.tree.structure(tree)}; give one sharding, or a tree of them shaped like the "
            f"{what}s (or drop {arg}: the plan sets it).") from None
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]
    shapes = [np.shape(x) for x in jax.tree.leaves(tree)]
    for path, shape, g, spec in zip(paths, shapes, given, specs):
        if g is None:
            continue
        want = plan.sharding(spec)
        if isinstance(g, jax.sharding.PartitionSpec):
            g = jax.sharding.NamedSharding(plan.mesh.mesh, g)
        if not g.is_equivalent_to(want, len(shape)):
            raise ValueError(
                f"jb.jit(mesh=...): {arg} lays out {what} {path or '0'} as "
                f"{getattr(g, 'spec', g)}, but the plan lays it out as {spec} (rules "
                f"{plan.rules}); drop {arg} (the plan sets it) or pass rules= that give this "
                f"layout.")


def run_planned(plan, leaves) -> list:
    """Evaluate the plan's program on `leaves` with its layouts pinned: a
    sharding constraint on every input, every output and every contraction,
    and on the operands and results of the route the cost model took through
    a gather or scatter (`Plan.contraction_specs`; XLA's propagation fills
    in the rest); stacks of sharded per-layer values built on a new axis
    (`Plan.stack_eqns`); short stacks of inputs through one loop
    (`_stacks.HeldInputStacks`: no XLA:CPU kernel each). Outputs that are
    rows of a stack laid out as its rows are pinned by one constraint on the
    stack (`_rows_of_stacks`)."""
    closed, wsc = plan.closed, jax.lax.with_sharding_constraint
    cons = {e: ([None if s is None else plan.sharding(s) for s in ins],
                [plan.sharding(s) for s in res])
            for e, (ins, res) in plan.contraction_specs().items()}
    stacks = plan.stack_eqns()
    entered = _scans_holding(closed.jaxpr, set(cons) | stacks)
    env = plan.model.g.env

    def instead(eqn, invals):
        # a stack of sharded parts: on a new axis (`Plan.stack_eqns`)
        if eqn in stacks:
            return [_stacks.stack_new_axis(invals)]
        if (got := held.get(eqn)) is not None:   # a short stack of inputs, held
            return got
        ins = cons[eqn][0] if eqn in cons else ()
        if any(s is not None for s in ins):     # operands gathered as costed
            # from the operand's own layout, pinned first: left to XLA's
            # propagation, the gathered layout flowed back through a slice
            # into the contraction before it (a recommender's embedding
            # gradient), whose pinned layout it could not reach but by
            # rematerialising the contraction whole
            own = [env.get(v) if _jax.is_var(v) else None for v in eqn.invars]
            return _jax.bind_eqn(eqn, [
                x if s is None else wsc(x if o is None else wsc(x, plan.sharding(plan.spec(o))), s)
                for x, s, o in zip(invals, ins, own)])
        return None

    out_specs = plan.out_specs()
    rows, stacked = _rows_of_stacks(plan, out_specs)

    def hook(eqn, outs):
        if eqn in cons:
            y = outs[0]
            for s in cons[eqn][1]:
                y = wsc(y, s)
            outs = [y]
        if stacked and any(v in stacked for v in eqn.outvars):
            outs = [wsc(y, stacked[v]) if v in stacked else y for v, y in zip(eqn.outvars, outs)]
        return outs

    ins = [wsc(x, plan.sharding(s)) for x, s in zip(leaves, plan.in_specs())]
    held = _stacks.HeldInputStacks(closed.jaxpr, ins, skip=stacks)
    outs = _jax.eval_jaxpr_hooked(closed.jaxpr, closed.consts, ins, hook,
                                  enter=entered.__contains__, instead=instead)
    return [y if k in rows else wsc(y, plan.sharding(s))
            for k, (y, s) in enumerate(zip(outs, out_specs))]


def _rows_of_stacks(plan, out_specs) -> tuple:
    """({k: output k is one whole row of a stack, `_stacks.unstack_one`'s
    reshape of a `dynamic_slice`, laid out as the stack's rows by
    `out_specs` (the plan's)}, {each such stack: its NamedSharding}). A
    rolled step returns its per-layer weights and optimizer state as rows of
    stacks: 1536 of the 1553 outputs of a 32-layer GPT AdamW step, whose
    constraints cost 0.35 s of its 5.24 s from trace to executable
    (measured, median of 5). One constraint on the stack pins its rows as
    well: a row of an array whose leading axis is unsharded is laid out as
    the array's other axes are, which is XLA's propagation through a slice
    (the compiled step's output layouts stay the plan's, `test_jit_mesh`)."""
    j, env = plan.closed.jaxpr, plan.model.g.env
    made = {v: e for e in j.eqns for v in e.outvars}
    rows: set = set()
    stacked: dict = {}
    for k, (v, want) in enumerate(zip(j.outvars, out_specs)):
        r = made.get(v) if _jax.is_var(v) else None
        d = made.get(r.invars[0]) if r is not None and r.primitive.name == "reshape" else None
        if d is None or d.primitive.name != "dynamic_slice" or not _jax.is_var(d.invars[0]):
            continue
        s = d.invars[0]
        shape = s.aval.shape
        if d.outvars[0].aval.shape != (1,) + shape[1:] or v.aval.shape != shape[1:] \
                or env.get(s) is None:
            continue
        spec = plan.spec(env[s])
        axes = tuple(spec) + (None,) * (len(shape) - len(spec))
        if axes[0] is None and axes[1:] == tuple(want) + (None,) * (len(shape) - 1 - len(want)):
            rows.add(k)
            stacked[s] = plan.sharding(spec)
    return rows, stacked


def _scans_holding(jaxpr, eqns) -> set:
    """The scan equations of `jaxpr` (at any depth) whose bodies hold one of
    `eqns`: the ones the constrained evaluation must enter."""
    found: set = set()

    def visit(j) -> bool:
        hit = False
        for e in j.eqns:
            inner = [visit(s) for s in _jax.sub_jaxprs(e)]   # every body, not just the first hit
            if any(inner) and e.primitive.name == "scan":
                found.add(e)
            hit = hit or any(inner) or e in eqns
        return hit

    visit(jaxpr)
    return found
