"""`Plan`: chosen rules, their modelled cost, and the layouts they give.

Precondition: a function and example arguments (arrays, NamedArrays, or
`jax.ShapeDtypeStruct`s; nothing is materialised to plan), or a program
already traced to a ClosedJaxpr with the dim names of its inputs and
outputs. `plan` traces once, builds the graph and cost model, and takes the
given rules or runs the exact search; `plan_jaxpr` does the same from the
ClosedJaxpr (what `jb.jit(fn, mesh=...)` calls at trace time, after its
passes).

A Plan is data: the rules, one mesh-axis mask per dim key, the modelled
cost, the program planned (`closed`, with `in_tree`/`out_tree`) and the
layouts that follow:

* input and output PartitionSpecs (a NamedArray leaf by its dims; every
  leaf by the dim classes the graph inferred for it, so plain arrays of a
  jnp program are laid out the same way);
* `contraction_specs()`: the layout of every contraction (`einsum`,
  `dot_general`), which the compile step pins with a sharding constraint so
  XLA's propagation cannot drift from the plan, and the route the cost model
  costs through a gather or scatter (an embedding lookup and its gradient:
  operands it gathers), pinned too, so that XLA's partitioner cannot reshard
  an operand instead (which it may only manage by replicating it).

Compiling with a plan is `jb.jit(fn, mesh=..., rules=plan)` (jaxbackend/
jit.py). A rule value is a mesh axis, a tuple of axes, or None (see
`_axis_rules`); a tensor that would use one mesh axis for two of its dims
keeps it on the first (listed in `plan.exceptions`).
"""

from __future__ import annotations

import math
import warnings

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxbackend import _html, _jax
from jaxbackend.named import NamedArray
from jaxbackend.sharding import _axis_rules, _search, _walk
from jaxbackend.sharding._cost import KINDS, CostModel
from jaxbackend.sharding._mesh import MeshSpec
from jaxbackend.sharding._tables import size_text

_CONSTRAIN = {"einsum", "dot_general"}
# ops whose route the model chooses as a contraction's (`_op_dims`), pinned
# where the model gathers an operand (an embedding's gradient: the updates)
_ROUTED = {"gather", "scatter-add", "scatter_add", "conv_general_dilated"}
_is_named = lambda x: isinstance(x, NamedArray)  # noqa: E731


def _leaf_test():
    """`is_leaf` for the argument trees this module reads: NamedArrays, and
    parameters whose metadata may name their axes (an NNX variable, a linen
    box: `nn._params.holds_names`)."""
    from jaxbackend.nn import _params   # here: nn imports this package

    return lambda x: _is_named(x) or _params.holds_names(x)


def dims_of(tree) -> list:
    """Per flat leaf of `tree`: its NamedArray's dims; for the value of a Flax
    variable (an `nnx.split` state) or a linen box, the names its metadata
    gives its axes (`nn.param_dims`: our `dims`, or the logical axes of
    `nnx.with_partitioning` or linen's `nn.with_logical_partitioning`, None
    for an unnamed axis), so rules name the dims `nn.partition_specs` does;
    else None."""
    from jaxbackend.nn import _params   # here: nn imports this package

    def one(x):
        if isinstance(x, NamedArray):
            # in a `jb.stack_layers` Stacked, the values carry a leading layer
            # axis the per-layer dims do not name: the names are the trailing axes'
            return [_params.with_leading(x.dims, len(getattr(x.values, "shape", x.dims)))]
        n = len(jax.tree.leaves(x))
        if n != 1:      # not a variable (a plain leaf) holds one; an empty variable none
            return [None] * n
        return [_params.dims_of(x, leading=True)]

    return [d for x in jax.tree.leaves(tree, is_leaf=_leaf_test()) for d in one(x)]


def paths_of(tree) -> list:
    """Per flat leaf of `tree` (NamedArrays are leaves): where it sits, as
    the user wrote it: `args[0]['blocks'][1]['w1']` for a positional
    argument of `(args, kwargs)`, `x` or `x['w']` for a keyword one. The
    `.value` key a Flax variable (or linen box) adds to its leaf's path is
    left out (`args[0]['bn']['bias']`, as a user indexes an `nnx.split`
    state)."""
    out = []
    for path in _leaf_paths(tree):
        head, rest = path[:2], jax.tree_util.keystr(path[2:])
        if len(head) == 2 and getattr(head[0], "idx", None) == 0:      # (args, kwargs)[0][i]
            out.append(f"args[{head[1].idx}]{rest}")
        elif len(head) == 2 and getattr(head[0], "idx", None) == 1:    # kwargs[name]
            out.append(f"{head[1].key}{rest}")
        else:
            out.append(jax.tree_util.keystr(path) or "arg")
    return out


def _leaf_paths(tree) -> list:
    """The key path of each flat leaf of `tree` (NamedArrays are leaves),
    without a Flax variable's (or linen box's) own leading `.value` key."""
    from jaxbackend.nn import _params   # here: nn imports this package

    out = []
    for path, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_leaf_test())[0]:
        if not _params.holds_names(x):
            out.append(path)
            continue
        for sub, _ in jax.tree_util.tree_flatten_with_path(x, is_leaf=_is_named)[0]:
            value = sub and isinstance(sub[0], jax.tree_util.GetAttrKey) and sub[0].name == "value"
            out.append(path + tuple(sub[1:] if value else sub))
    return out


def trace(fn, *args, transform=None):
    """(ClosedJaxpr, Graph, in_tree, out_tree) for fn(*args); `transform`:
    an optional ClosedJaxpr -> ClosedJaxpr pass run before planning (e.g.
    `passes.fuse_projections`), whose result is what gets planned."""
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    if transform is not None:
        closed = transform(closed)
    graph = _walk.build(closed, dims_of(args), dims_of(out_shape), paths_of((args, {})))
    return closed, graph, jax.tree.structure(args), jax.tree.structure(out_shape)


class Plan:
    """Rules, masks per dim key, modelled cost and layouts of one program on
    one mesh (`mesh`: MeshSpec; `model`: its CostModel; `closed`: the
    program planned, over `in_tree`'s leaves)."""

    def __init__(self, mesh: MeshSpec, cm: CostModel, masks, closed, in_tree, out_tree, stats=None):
        self.mesh, self.model, self.masks = mesh, cm, list(masks)
        self.closed, self.in_tree, self.out_tree = closed, in_tree, out_tree
        self.stats = stats or {}
        g = cm.g
        planned = _search.planned_keys(cm)
        self.rules = {g.key_names[k]: mesh.axes(self.masks[k]) for k in range(cm.n_keys)
                      if (k in planned or self.masks[k]) and g.key_size[k] > 1}
        # a merged dim is laid out as its major factor: say so under its own name
        self.rules.update({a: self.rules[g.key_names[k]] for a, k in g.key_alias.items()
                           if g.key_names[k] in self.rules})
        self.cost = cm.evaluate(self.masks)
        self.unused_rules: list = []   # given rules naming no dim of the program
        self.exceptions = []
        for i, v in enumerate(g.invars):
            keys = cm.var_keys[v]
            for k, m in zip(keys, cm.layout(keys, self.masks)):
                if m != self.masks[k]:
                    self.exceptions.append((f"argument leaf {i} {g.shapes[v]}", g.key_names[k],
                                            mesh.axes(self.masks[k] & ~m)))

    # -- layouts -------------------------------------------------------------
    def spec(self, var: int) -> PartitionSpec:
        """Layout of graph variable `var` under the plan."""
        keys = self.model.var_keys[var]
        return self._spec(self.model.layout(keys, self.masks))   # an axis shards one dim

    def spec_for_dims(self, dims) -> PartitionSpec:
        """Layout of a tensor with these dim names under the rules."""
        return _axis_rules.spec_for_dims(dims, self.rules)

    def sharding(self, spec: PartitionSpec) -> NamedSharding:
        """`spec` on the plan's (real) mesh."""
        if self.mesh.mesh is None:
            raise ValueError("Plan: this plan was made for an abstract mesh; build it from a "
                             "jax.sharding.Mesh of real devices to get NamedShardings.")
        return NamedSharding(self.mesh.mesh, spec)

    def in_specs(self) -> list:
        return [self.spec(v) for v in self.model.g.invars]

    def out_specs(self) -> list:
        return [self.spec(v) if v is not None else PartitionSpec() for v in self.model.g.outvars]

    def contraction_specs(self) -> dict:
        """{contraction, gather or scatter equation of `closed`, in scan bodies
        too: (its operands' layouts, None for one used as laid out; its
        result's layouts, in order)}. A contraction's result is pinned to its
        layout. A gather or scatter is pinned to the route the cost model
        costs (`CostModel.route`): an operand it gathers is constrained to
        the gathered layout, a result produced on other mesh axes than it is
        laid out on is constrained to those first. A body's equation gets its
        per-iteration layout (the stacked layer dim of a rolled program is
        never sharded: `_walk._scan`).

        Contractions keep XLA's choice of route: pinning theirs too cut
        collective bytes by 10-20% on sharded per-layer plans, but XLA then
        holds the unsliced reductions and gathered weights longer than the
        memory model counts (measured: 2-8 MiB more per device, an
        encoder-decoder's prediction 0.81 -> 0.78 of XLA's)."""
        cm = self.model
        env = cm.g.env
        out: dict = {}
        producer = {op.outs[0][0]: i for i, op in enumerate(cm.g.ops) if op.outs}
        routes: dict = {}    # per distinct op (layers repeat)

        def route(v):
            i = producer.get(v)
            if i is None or cm.g.ops[i].kind != "contract":
                return None
            k = cm.op_sig[i]
            if k not in routes:
                routes[k] = cm.route(i, self.masks)
            return routes[k]

        stack = [self.closed.jaxpr]
        while stack:
            for e in stack.pop().eqns:
                name = e.primitive.name
                if name in _CONSTRAIN and e.outvars[0] in env:
                    out[e] = ([None] * len(e.invars), [self.spec(env[e.outvars[0]])])
                elif name in _ROUTED and e.outvars[0] in env:
                    v = env[e.outvars[0]]
                    r = route(v)
                    if r is not None and len(r[0]) == len(e.invars):
                        res = [self.spec(v)] if r[1] is None else [self._spec(r[1]), self.spec(v)]
                        out[e] = ([None if m is None else self._spec(m) for m in r[0]], res)
                if name == "conv_general_dilated" and _jax.conv_dims(e)[1][1] > 1:
                    self._whole_operands_if_partly_sharded(e, out)
                stack.extend(_jax.sub_jaxprs(e))
        return out

    def _whole_operands_if_partly_sharded(self, e, out) -> None:
        """XLA's SPMD partitioner (JAX 0.10.2 / XLA:CPU, measured) multiplies
        a `batch_group_count` convolution (a grouped conv's weight gradient:
        a depthwise conv1d's kernel gradient) by the size of the mesh axes its
        operands leave replicated, when they shard it over the others (the
        batch on `data` of a (2, 4) mesh: 4x the true gradient; the batch on
        both axes, or the groups on `model` and the batch on `data`: exact).
        The operands are always pinned, so XLA's propagation cannot pick a
        partial layout of its own: to their planned layouts where those use
        every mesh axis or none, else whole, so each device computes the
        full conv and takes its share of the result: exact, at a gather the
        model does not charge."""
        env = self.model.g.env
        if e.outvars[0] not in env:
            return
        ins = out.get(e, ([None] * len(e.invars), None))[0]
        layouts = [spec if spec is not None else self.spec(env[x]) if x in env else PartitionSpec()
                   for spec, x in zip(ins, e.invars)]
        used = {a for spec in layouts for d in spec for a in _axis_rules.axes_tuple(d)}
        if used and used != set(self.mesh.axis_names):
            out[e] = ([PartitionSpec()] * len(e.invars), [self.spec(env[e.outvars[0]])])
        else:
            out[e] = (layouts, out[e][1] if e in out else [self.spec(env[e.outvars[0]])])

    def _spec(self, masks) -> PartitionSpec:
        """A layout given as a mesh-axis mask per axis."""
        return PartitionSpec(*[self.mesh.axes(int(m)) for m in masks])

    def stack_eqns(self) -> set:
        """The `concatenate` equations of `closed` (in scan bodies too) that
        stack per-layer values (`_op_dims._unstack_split`) whose leading dim
        the plan shards, and whose one reader is the reshape into the stack.
        `run_planned` builds these on a new leading axis: each part keeps its
        layout (as one concatenate of the merged rows, every part would be
        resharded), and the reshape that follows changes nothing. The others
        stay one concatenate of the parts, the cheaper program to compile."""
        g, env, found = self.model.g, self.model.g.env, set()
        todo = [self.closed.jaxpr]
        while todo:
            j = todo.pop()
            readers: dict = {}
            for e in j.eqns:
                for v in e.invars:
                    if _jax.is_var(v):
                        readers.setdefault(v, []).append(e)
                todo.extend(_jax.sub_jaxprs(e))
            results = {v for v in j.outvars if _jax.is_var(v)}
            for e in j.eqns:
                v = e.outvars[0] if e.primitive.name == "concatenate" else None
                if v is None or env.get(v) not in g.stacks or v in results:
                    continue
                r = readers.get(v, [])
                if (len(r) == 1 and r[0].primitive.name == "reshape"
                        and self.spec(env[e.invars[0]])[0] is not None):
                    found.add(e)
        return found

    def shardings(self, args):
        """A pytree like `args` with a NamedSharding per array leaf."""
        leaves, tree = jax.tree.flatten(args)
        g = self.model.g
        if len(leaves) == len(g.invars) and all(
                tuple(np.shape(x)) == g.shapes[v] for x, v in zip(leaves, g.invars)):
            specs = self.in_specs()
        else:
            specs = [self.spec_for_dims(d) if d is not None else PartitionSpec()
                     for d in dims_of(args)]
        return jax.tree.unflatten(tree, [self.sharding(s) for s in specs])

    # -- for people -------------------------------------------------------------
    def table(self) -> str:
        c = self.cost
        lines = [f"Plan on {self.mesh!r}", "", "| dim | mesh axes |", "|---|---|"]
        lines += [f"| {d} | {a} |" for d, a in self.rules.items()]
        lines += ["", "| cost | time (ms) | bytes/device | count |", "|---|---|---|---|",
                  f"| compute | {c.compute * 1e3:.4g} | | |"]
        for k in KINDS:
            lines.append(f"| {k} | {c.collective(k).time * 1e3:.4g} | {c.collective(k).bytes:.4g} | {c.collective(k).count:g} |")
        lines += [f"| step (modelled) | {c.time * 1e3:.4g} | | |",
                  f"| memory/device | | {c.memory:.4g} | |"]
        st = self.stats or {}
        if st.get("optimal") is False:
            lines.append(f"search: {st['method']}, NOT proven optimal ({st['why']})")
        elif st.get("time", 0.0) > st.get("least_time", np.inf):
            lines.append(f"search: the fewest collective bytes within {_search.TOLERANCE:.0%} "
                         f"of the least modelled time ({st['least_time'] * 1e3:.4g} ms)")
        for where, dim, axes in self.exceptions:
            lines.append(f"exception: {where}: {dim} not on {axes} (axis used by an earlier dim)")
        if self.unused_rules:
            lines.append(f"unused rules (no such dim in this program): "
                         f"{', '.join(self.unused_rules)}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        """`table()`'s facts as HTML tables, for Jupyter: the rules (with how
        many pieces each dim is cut into), the modelled cost per step and
        device, the search's verdict and the exceptions."""
        c, sizes = self.cost, dict(zip(self.mesh.axis_names, self.mesh.axis_sizes))
        rules = [(d, _axis_rules.axes_text(a),
                  math.prod(sizes[x] for x in _axis_rules.axes_tuple(a)))
                 for d, a in self.rules.items()]
        cost = [("compute", f"{c.compute * 1e3:.4g}", "", "")]
        cost += [(k, f"{c.collective(k).time * 1e3:.4g}", f"{c.collective(k).bytes:,.0f}",
                  f"{c.collective(k).count:g}") for k in KINDS]
        cost += [("step (modelled)", f"{c.time * 1e3:.4g}", "", ""),
                 ("memory/device", "", f"{c.memory:,.0f}", "")]
        parts = [_html.table(("dim", "mesh axes", "pieces"), rules,
                             "rules: dim name → mesh axes"),
                 _html.table(("cost", "time (ms)", "bytes/device", "count"), cost,
                             "modelled cost per step, per device")]
        st = self.stats
        if not st:
            unused = (f"; unused (no such dim in this program): {', '.join(self.unused_rules)}"
                      if self.unused_rules else "")
            parts.append(_html.note("rules given, not searched" + unused))
        else:
            proven = ("proven optimal" if st.get("optimal")
                      else f"NOT proven optimal ({st.get('why')})")
            if st.get("optimal") and st.get("time", 0.0) > st.get("least_time", np.inf):
                proven += (f" (the fewest collective bytes within {_search.TOLERANCE:.0%} of "
                           f"the least modelled time, {st['least_time'] * 1e3:.4g} ms)")
            parts.append(_html.note(f"search: {st.get('method')}, {proven}, over "
                                    f"{st.get('candidates', 0):,} rule sets "
                                    f"in {st.get('seconds', 0.0):.3g} s"))
        if self.exceptions:
            rows = [(where, d, _axis_rules.axes_text(a)) for where, d, a in self.exceptions]
            parts.append(_html.table(("tensor", "dim", "not on"), rows,
                                     "exceptions: mesh axis already used by an earlier dim"))
        return _html.box(f"Plan on {self.mesh!r}", *parts)

    def __repr__(self):
        return f"Plan(rules={self.rules}, time={self.cost.time:.4g}s, memory={self.cost.memory:.4g}B)"


def plan_jaxpr(closed, in_dims, out_dims, in_tree, out_tree, *, mesh, rules=None,
               memory_budget=None, profile=None, in_paths=None, donated=()) -> Plan:
    """The Plan of a traced program: `rules` as given, or searched when None.
    `in_dims`/`out_dims`: per flat input/output, its dim names or None;
    `in_paths`: per flat input, its `paths_of` (names unnamed dims);
    `donated`: per flat input, True where its buffer is donated (results
    may reuse it: the memory model and budget count that)."""
    return _planned(closed, _walk.build(closed, in_dims, out_dims, in_paths), in_tree, out_tree,
                    mesh, rules, memory_budget, profile, donated)


def plan(fn, *args, mesh, rules=None, memory_budget=None, profile=None, transform=None) -> Plan:
    """The plan for `fn(*args)` on `mesh`: the given `rules`, or when None the
    least-modelled-time rules under `memory_budget` (bytes per device;
    default the profile's device memory). `profile`: a HardwareProfile or
    "cpu", "h100", "h200"; None: the mesh's devices' (`device_profile`);
    `transform`: see `trace`."""
    closed, graph, in_tree, out_tree = trace(fn, *args, transform=transform)
    return _planned(closed, graph, in_tree, out_tree, mesh, rules, memory_budget, profile)


def _planned(closed, graph, in_tree, out_tree, mesh, rules, memory_budget, profile,
             donated=()) -> Plan:
    spec = MeshSpec.from_mesh(mesh, profile)
    cm = CostModel(graph, spec, donated)
    if rules is not None:   # (the search checks its budget itself)
        if memory_budget is not None:
            memory_budget = _search.check_budget(memory_budget)
        masks, unused = _axis_rules.to_masks(_axis_rules.normalize(rules), graph, spec)
        if unused:
            warnings.warn(f"sharding rules for {unused}: this program has no such dims, so "
                          f"those rules are unused (its dims: {_axis_rules.dim_names(graph)}).",
                          stacklevel=2)
        plan = Plan(spec, cm, masks, closed, in_tree, out_tree)
        plan.unused_rules = unused
        if memory_budget is not None and plan.cost.memory > memory_budget:
            raise _search.NoPlanFits(
                f"sharding.plan: the given rules need {size_text(plan.cost.memory)} per device, "
                f"over memory_budget {size_text(memory_budget)}; shard more dims in rules, "
                f"raise memory_budget, or leave rules=None to search for a plan that fits.")
        return plan
    masks, stats = _search.search(cm, memory_budget)
    return Plan(spec, cm, masks, closed, in_tree, out_tree, stats)
