"""`Plan`: the chosen rules, their modelled cost, and compiling with them.

Precondition: a function and example arguments (arrays, NamedArrays, or
`jax.ShapeDtypeStruct`s; nothing is materialised to plan). `search` traces
once, builds the graph and cost model, and runs the exact search;
`sharded_jit` does the same on first call (per argument structure) and
compiles with the plan:

* input and output shardings come from the rules (a NamedArray leaf by its
  dims; every leaf by the dim classes the graph inferred for it, so plain
  arrays of a jnp program are sharded the same way);
* every top-level contraction (`einsum`, `dot_general`) gets a
  `with_sharding_constraint` with its result's layout, by re-evaluating the
  traced jaxpr with a hook, so XLA's propagation cannot drift from the plan.

A rule value is a mesh axis, a tuple of axes, or None; a tensor that would
use one mesh axis for two of its dims keeps it on the first (listed in
`plan.exceptions`). It leaves the function alone: the jaxpr it compiles is
the traced one, evaluated equation by equation.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxbackend import _jax
from jaxbackend.named import NamedArray
from jaxbackend.sharding import _graph, _mesh, _search
from jaxbackend.sharding._cost import KINDS, CostModel
from jaxbackend.sharding._mesh import MeshSpec

_CONSTRAIN = {"einsum", "dot_general"}
_is_named = lambda x: isinstance(x, NamedArray)  # noqa: E731


def _dims_of(tree):
    return [x.dims if isinstance(x, NamedArray) else None
            for x in jax.tree.leaves(tree, is_leaf=_is_named)]


def trace(fn, *args, transform=None):
    """(ClosedJaxpr, Graph, in_tree, out_tree) for fn(*args); `transform`:
    an optional ClosedJaxpr -> ClosedJaxpr pass run before planning (e.g.
    `passes.fuse_projections`), whose result is what gets compiled."""
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    if transform is not None:
        closed = transform(closed)
    graph = _graph.build(closed, _dims_of(args), _dims_of(out_shape))
    return closed, graph, jax.tree.structure(args), jax.tree.structure(out_shape)


class Plan:
    def __init__(self, mesh: MeshSpec, cm: CostModel, masks, closed, in_tree, out_tree, stats=None):
        self.mesh, self.model, self.masks = mesh, cm, list(masks)
        self.closed, self.in_tree, self.out_tree = closed, in_tree, out_tree
        self.stats = stats or {}
        g = cm.g
        held = {k for v in g.invars for k in cm.var_keys[v]}
        self.rules = {g.key_names[k]: mesh.axes(self.masks[k]) for k in range(cm.n_keys)
                      if k in held and g.key_size[k] > 1}
        # a merged dim is laid out as its major factor: say so under its own name
        self.rules.update({a: self.rules[g.key_names[k]] for a, k in g.key_alias.items()
                           if g.key_names[k] in self.rules})
        self.cost = cm.evaluate(self.masks)
        self.exceptions = []
        for i, v in enumerate(g.invars):
            keys = cm.var_keys[v]
            for k, m in zip(keys, cm._layout(keys, self.masks)):
                if m != self.masks[k]:
                    self.exceptions.append((f"argument leaf {i} {g.shapes[v]}", g.key_names[k],
                                            mesh.axes(self.masks[k] & ~m)))

    # -- layouts -------------------------------------------------------------
    def spec(self, var: int) -> PartitionSpec:
        keys = self.model.var_keys[var]
        return PartitionSpec(*[self.mesh.axes(int(m)) for m in self.model._layout(keys, self.masks)])

    def spec_for_dims(self, dims) -> PartitionSpec:
        """Layout of a tensor with these dim names under the rules."""
        return _mesh.spec_for_dims(dims, self.rules)

    def _sharding(self, spec):
        if self.mesh.mesh is None:
            raise ValueError("Plan: this plan was made for an abstract mesh; build it from a "
                             "jax.sharding.Mesh of real devices to get NamedShardings.")
        return NamedSharding(self.mesh.mesh, spec)

    def in_specs(self):
        return [self.spec(v) for v in self.model.g.invars]

    def out_specs(self):
        return [self.spec(v) if v is not None else PartitionSpec() for v in self.model.g.outvars]

    def shardings(self, args):
        """A pytree like `args` with a NamedSharding per array leaf."""
        leaves, tree = jax.tree.flatten(args)
        g = self.model.g
        if len(leaves) == len(g.invars) and all(
                tuple(np.shape(x)) == g.shapes[v] for x, v in zip(leaves, g.invars)):
            specs = self.in_specs()
        else:
            dims = _dims_of(args)
            specs = [self.spec_for_dims(d) if d is not None else PartitionSpec() for d in dims]
        return jax.tree.unflatten(tree, [self._sharding(s) for s in specs])

    # -- compiling ------------------------------------------------------------
    def constrained_fun(self):
        """Flat-args function evaluating the traced jaxpr with constraints."""
        g, closed = self.model.g, self.closed
        specs = {}
        for eqn in closed.jaxpr.eqns:
            if eqn.primitive.name in _CONSTRAIN:
                specs[eqn] = self._sharding(self.spec(g.top_env[eqn.outvars[0]]))

        def hook(eqn, outs):
            s = specs.get(eqn)
            return outs if s is None else [jax.lax.with_sharding_constraint(outs[0], s)]

        def run(*flat):
            return tuple(_jax.eval_jaxpr_hooked(closed.jaxpr, closed.consts, flat, hook))
        return run

    def jit(self):
        """`jax.jit` of the traced function with this plan: call with the
        same argument structure; returns the same output structure."""
        if self.mesh.mesh is not None:
            check_auto_axes(self.mesh.mesh)
        ins = tuple(self._sharding(s) for s in self.in_specs())
        outs = tuple(self._sharding(s) for s in self.out_specs())
        compiled = jax.jit(self.constrained_fun(), in_shardings=ins, out_shardings=outs)
        in_tree, out_tree = self.in_tree, self.out_tree

        def call(*args):
            leaves, tree = jax.tree.flatten(args)
            if tree != in_tree:
                raise ValueError(f"sharded function: arguments have structure {tree}, but the plan "
                                 f"was made for {in_tree}; call search/sharded_jit again.")
            return jax.tree.unflatten(out_tree, compiled(*leaves))

        call.lower = lambda *args: compiled.lower(*jax.tree.leaves(args))
        return call

    # -- for people -------------------------------------------------------------
    def table(self) -> str:
        c = self.cost
        lines = [f"Plan on {self.mesh!r}", "", "| dim | mesh axes |", "|---|---|"]
        lines += [f"| {d} | {a} |" for d, a in self.rules.items()]
        lines += ["", "| cost | time (ms) | bytes/device | count |", "|---|---|---|---|",
                  f"| compute | {c['compute'] * 1e3:.4g} | | |"]
        for k in KINDS:
            lines.append(f"| {k} | {c[k]['time'] * 1e3:.4g} | {c[k]['bytes']:.4g} | {c[k]['count']:g} |")
        lines += [f"| step (modelled) | {c['time'] * 1e3:.4g} | | |",
                  f"| memory/device | | {c['memory']:.4g} | |"]
        if (self.stats or {}).get("optimal") is False:
            lines.append(f"search: {self.stats['method']}, NOT proven optimal ({self.stats['why']})")
        for where, dim, axes in self.exceptions:
            lines.append(f"exception: {where}: {dim} not on {axes} (axis used by an earlier dim)")
        return "\n".join(lines)

    def __repr__(self):
        return f"Plan(rules={self.rules}, time={self.cost['time']:.4g}s, memory={self.cost['memory']:.4g}B)"


def _rules_to_masks(cm, mesh, rules):
    g = cm.g
    unknown = sorted(set(rules) - set(g.key_names) - set(g.key_alias))
    if unknown:
        raise ValueError(f"rules: {unknown} name no dim of this program, whose dims are "
                         f"{sorted(set(g.key_names) | set(g.key_alias))}; fix the spelling or drop "
                         f"those rules.")
    rules = dict(rules)
    for alias, k in g.key_alias.items():   # a merged dim is sharded as its major factor
        if alias in rules:
            major = g.key_names[k]
            if major in rules and rules[major] != rules[alias]:
                raise ValueError(f"rules: dim {alias!r} is a reshape of dims whose major factor is "
                                 f"{major!r}, so it is sharded as {major!r}, but the rules give "
                                 f"{alias!r} -> {rules[alias]!r} and {major!r} -> {rules[major]!r}; "
                                 f"give one of them, or both the same axes.")
            rules[major] = rules.pop(alias)
    masks = [0] * cm.n_keys
    for k, name in enumerate(g.key_names):
        if name in rules:
            m = mesh.mask(rules[name])
            n = int(mesh.group_size[m])
            if g.key_size[k] % n:
                raise ValueError(f"rules: dim {name!r} has size {g.key_size[k]}, not divisible by mesh "
                                 f"axes {rules[name]!r} of size {n}; map it to a divisor or None.")
            masks[k] = m
    return masks


def plan_for(fn, *args, mesh, rules=None, memory_budget=None, profile=None, transform=None) -> Plan:
    """A Plan with the given `rules`, or searched when rules is None."""
    spec = MeshSpec.from_mesh(mesh, profile or "cpu")
    closed, graph, in_tree, out_tree = trace(fn, *args, transform=transform)
    cm = CostModel(graph, spec)
    if rules is not None:
        return Plan(spec, cm, _rules_to_masks(cm, spec, rules), closed, in_tree, out_tree)
    masks, stats = _search.search(cm, memory_budget)
    return Plan(spec, cm, masks, closed, in_tree, out_tree, stats)


def search(fn, *args, mesh, memory_budget=None, profile=None, transform=None) -> Plan:
    """The least-modelled-time plan for `fn(*args)` on `mesh` under the budget
    (bytes per device; default the profile's device memory)."""
    return plan_for(fn, *args, mesh=mesh, memory_budget=memory_budget, profile=profile,
                    transform=transform)


def check_auto_axes(mesh) -> None:
    """A plan compiles with sharding constraints on its contractions, which
    JAX takes only on Auto mesh axes; `jax.make_mesh` makes Explicit ones by
    default (JAX 0.10), which fail deep inside JAX, so say so up front."""
    types = tuple(getattr(mesh, "axis_types", ()))
    bad = [n for n, t in zip(mesh.axis_names, types) if t != jax.sharding.AxisType.Auto]
    if bad:
        n = len(mesh.axis_names)
        raise ValueError(
            f"mesh axes ({', '.join(map(repr, bad))}) are not Auto (axis types "
            f"{tuple(t.name for t in types)}), and a sharding plan needs Auto axes to constrain "
            f"contractions; build it with jax.make_mesh(shape, names, "
            f"axis_types=(jax.sharding.AxisType.Auto,) * {n}) or jaxbackend.sharding.auto_mesh("
            f"shape, names).")


def sharded_jit(fn, *, mesh, rules=None, memory_budget=None, profile=None, transform=None):
    """Like `jax.jit(fn)`, sharded over `mesh` (Auto axes) with searched (or
    given) rules. The plan of the latest call is at `.plan`."""
    check_auto_axes(mesh)
    cache = {}

    def planned(args):
        key = jax.tree.structure(args), tuple((np.shape(x), str(getattr(x, "dtype", type(x))))
                                              for x in jax.tree.leaves(args))
        if key not in cache:
            p = plan_for(fn, *args, mesh=mesh, rules=rules, memory_budget=memory_budget,
                         profile=profile, transform=transform)
            cache[key] = (p, p.jit())
        call.plan, f = cache[key]
        return f

    def call(*args):
        return planned(args)(*args)

    call.lower = lambda *args: planned(args).lower(*args)
    call.plan = None
    return call
