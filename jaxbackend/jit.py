"""`jaxbackend.jit`: trace, run the pass pipeline, plan shardings, compile.

The one module that knows every stage. Design, chosen for dispatch cost:

    jb.jit(fn)  ==  jax.jit(body)   where body(*args):
        jaxpr  = make_jaxpr(fn) on the abstract args   (names still in it)
        jaxpr  = run_pipeline(jaxpr, passes)           (passes.*)
        jaxpr  = transform(jaxpr)                       (hook, see below)
        plan   = plan_jaxpr(jaxpr, mesh, rules)         (only with mesh=)
        return eval_jaxpr(jaxpr, *args)                 (binds into jax.jit's trace;
                                                         with a plan, constrained)

JAX's own `jax.jit` object does the caching and the dispatch, so a warm call
takes JAX's C++ fast path with no Python cache key of ours: `jb.jit` returns
that very `jax.jit` function object, with or without a mesh, with our
extras set as instance attributes whose names JAX's jit object does not
use: JAX calls its own `.trace`, `.lower` and `.eval_shape` (from
`jax.make_jaxpr`, `jax.eval_shape`, an outer `jax.jit`), so shadowing one
breaks those. (A wrapper class whose `__call__` is the jit function
measured ~3% slower: CPython's tp_call slot drops vectorcall.) The extras:
`trace_passes(*args)` (the pipeline run again outside jit, every jaxpr
kept: a `passes.Report`), `passes` (the pass names run), `trace_count`
(times fn was traced for XLA), `last_report` (the Report of the latest
trace), `plan` (the sharding Plan of the latest trace; None without a
mesh). Same shapes/dtypes/static args never retrace; new ones trace and
compile once. `.lower(*args)` is jax's `Lowered` of the rewritten program.

Like `jax.jit`: static arguments are completed from fn's signature as
jax.jit completes them (a negative `static_argnums` resolves per call,
against the positional arguments passed); Python scalars and weak-typed
arrays trace weakly typed. Unlike `jax.jit`, a trace that updates the state
of a Flax NNX argument (module, optimizer, variable) raises: the update
would be lost, since the compiled function is pure; this check runs at
trace time only, so warm calls pay nothing for it.

AD: `jax.grad(jb.jit(f))` differentiates the rewritten jaxpr (custom-
derivative calls are kept by `inline`, so their rules still apply);
`jb.jit(jax.grad(f))` runs the passes on the AD jaxpr, named backward
einsums included.

Sharding: without a mesh, `in_shardings=`/`out_shardings=` pass through to
`jax.jit`. With `mesh=` (Auto axes), the trace also plans: the sharding
search (or `rules=`, a dict or a Plan) runs on the jaxpr after the passes,
once per static values and argument types (`_planned.Planner`: a call on
inputs placed by the plan is a new JAX trace, answered from that cache
without tracing fn again), and the program is evaluated with a
sharding constraint on every input, every output and every top-level
contraction (outputs that are rows of one stack, a rolled step's per-layer
weights, by one on the stack), so XLA lays out arguments, results and
contractions as the plan says. `static_argnums`, `static_argnames`, `donate_argnums` mean what
they mean for jax.jit (a training step donates its params and optimizer
state; donation frees arrays already placed with the plan's shardings,
`f.plan.shardings(args)`). `in_shardings=`/`out_shardings=` under a mesh
must agree with the plan, checked at trace time: one line names the first
leaf that differs. `_transform=fn` (ClosedJaxpr -> ClosedJaxpr, run after
the pipeline) is an internal hook for any other rewrite.
"""

from __future__ import annotations

import functools
import inspect
import operator
import sys
from typing import Any, Callable, NamedTuple, Sequence

import jax

from jaxbackend import _jax, _planned
from jaxbackend.passes import _stacks
from jaxbackend.passes import pipeline as _pipeline

def _split_static(args, static_argnums):
    """({position: static arg}, [dynamic args]). A negative argnum counts from
    the last positional argument passed, and one beyond them is an error, as
    in jax.jit; a positive one beyond them is ignored (a default was used)."""
    n = len(args)
    for i in static_argnums:
        if i < -n:
            raise ValueError(f"static_argnums={i} needs at least {-i} positional arguments, "
                             f"but the call passed {n}; pass more or use a smaller index.")
    nums = {i % n for i in static_argnums if i < n}
    static = {i: a for i, a in enumerate(args) if i in nums}
    dynamic = [a for i, a in enumerate(args) if i not in nums]
    return static, dynamic


def _merge_static(static, dynamic):
    out, it = [], iter(dynamic)
    for i in range(len(static) + len(dynamic)):
        out.append(static[i] if i in static else next(it))
    return out


class _Traced(NamedTuple):
    closed: Any       # ClosedJaxpr of fn over the flat dynamic leaves
    leaves: list      # the flat dynamic leaves of (args, kwargs)
    dynamic: tuple    # (dynamic positional args, dynamic kwargs): the tree of `leaves`
    out_shape: Any    # fn's output tree, ShapeDtypeStruct leaves
    static: tuple     # the static values, hashable: with the leaf types, the plan's key


def _split_args(args, kwargs, static_argnums, static_argnames) -> tuple:
    """(static positional, static kwargs, dynamic positional, dynamic kwargs)."""
    static, dynamic = _split_static(args, static_argnums)
    static_kw = {k: v for k, v in kwargs.items() if k in static_argnames}
    dyn_kw = {k: v for k, v in kwargs.items() if k not in static_argnames}
    return static, static_kw, dynamic, dyn_kw


def _static_key(static, static_kw) -> tuple:
    # with each value's type, as JAX's own cache keys static arguments: 1,
    # 1.0 and True are equal (and hash alike) but trace different programs
    return (tuple(sorted((k, type(v), v) for k, v in static.items())),
            tuple(sorted((k, type(v), v) for k, v in static_kw.items())))


def _trace_flat(fn, args, kwargs, static_argnums, static_argnames) -> _Traced:
    static, static_kw, dynamic, dyn_kw = _split_args(args, kwargs, static_argnums, static_argnames)
    leaves, in_tree = jax.tree.flatten((dynamic, dyn_kw))

    def flat_fn(*xs):
        dyn, kw = jax.tree.unflatten(in_tree, xs)
        args = _merge_static(static, dyn)
        watched = _nnx_state((args, kw))
        out = fn(*args, **kw, **static_kw)
        _check_nnx_unchanged(fn, watched, out)
        return out

    closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*map(_planned.spec, leaves))
    return _Traced(closed, leaves, (tuple(dynamic), dyn_kw), out_shape,
                   _static_key(static, static_kw))


def _nnx_kinds():
    """(nnx.Pytree, nnx.Variable), or None when Flax NNX is not loaded (then
    no argument can hold an NNX object)."""
    nnx = sys.modules.get("flax.nnx")
    return None if nnx is None else (nnx.Pytree, nnx.Variable)


def _nnx_state(tree) -> list:
    """[(where, object, its leaves with paths, its treedef)] for every Flax
    NNX object (module, optimizer, rngs, variable) in the argument tree.
    Flax NNX objects are pytrees, so jax.jit takes them, but a method that
    updates them (optimizer.update, BatchNorm statistics, Rngs counters)
    updates the traced copy only: the caller's object keeps its old state."""
    kinds = _nnx_kinds()
    if kinds is None:
        return []
    found = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, kinds))[0]
    return [(("args", "kwargs")[p[0].idx] + jax.tree_util.keystr(p[1:]), x,
             *jax.tree_util.tree_flatten_with_path(x))
            for p, x in found if isinstance(x, kinds)]


def _check_nnx_unchanged(fn, watched, out) -> None:
    """Refuse an update of NNX state passed in unless fn returns it as NNX
    state: the updated Variable, or a State or module holding it (a functional
    step with dropout returns `nnx.state(model, nnx.RngState)`), which gives
    the caller the new value, as jax.jit would. A bare array returned is not
    taken for the update (the caller's Variable would keep its old value)."""
    kinds = _nnx_kinds()
    if not watched or kinds is None:
        return
    returned = {id(x) for obj in jax.tree.leaves(out, is_leaf=lambda x: isinstance(x, kinds))
                if isinstance(obj, kinds) for x in jax.tree.leaves(obj)}
    for where, obj, leaves, tree in watched:
        now, now_tree = jax.tree_util.tree_flatten_with_path(obj)
        # `forwards`: a value written back unchanged (nnx.remat writes every
        # Variable of its module back) loses nothing
        changed = [jax.tree_util.keystr(p) for (p, a), (_, b) in zip(leaves, now)
                   if a is not b and id(b) not in returned and not _jax.forwards(b, a)]
        if changed or now_tree != tree:
            raise TypeError(
                f"jb.jit: {getattr(fn, '__name__', 'fn')} updated Flax NNX state at "
                f"{where}{changed[0] if changed else ''} ({type(obj).__name__}), an update the "
                f"compiled function, being pure, would lose; use nnx.jit for NNX-aware jit, or "
                f"nnx.split the module, pass its state in and return the new state (nnx.merge "
                f"inside; jaxbackend.nn.functional does this for parameters).")


def _make_trace_passes(fn, passes, static_argnums, static_argnames, transform):
    def trace_passes(*args, **kwargs) -> _pipeline.Report:
        """Run the pipeline on fn's jaxpr for these args, keeping every stage."""
        closed = _trace_flat(fn, args, kwargs, static_argnums, static_argnames).closed
        closed, report = _pipeline.run_pipeline(closed, passes, keep_jaxprs=True,
                                                label=getattr(fn, "__name__", "fn"))
        if transform is not None:
            closed = _pipeline.checked("_transform", transform, closed)
            report.jaxprs.append(("transform", closed))
        return report

    return trace_passes


def _index_tuple(argnums) -> tuple | None:
    if argnums is None:
        return None
    try:
        return (operator.index(argnums),)
    except TypeError:
        return tuple(map(operator.index, argnums))


def _complete_statics(fn, static_argnums, static_argnames):
    """(static_argnums, static_argnames) completed as jax.jit completes them
    (jax._src.api_util.infer_argnums_and_argnames, JAX 0.10.2): given one of
    the two, the other follows from fn's positional-or-keyword parameters;
    given both or neither, they stand as given. We hand jax.jit both, so it
    holds static exactly the arguments our body splits off. A negative
    argnum gets no name: it resolves per call (`_split_static`)."""
    nums = _index_tuple(static_argnums)
    names = (static_argnames,) if isinstance(static_argnames, str) else static_argnames
    names = None if names is None else tuple(names)
    if (nums is None) == (names is None):
        return nums or (), names or ()
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return nums or (), names or ()
    pk = [(i, p.name) for i, p in enumerate(params) if p.kind is p.POSITIONAL_OR_KEYWORD]
    if nums is None:
        return tuple(i for i, k in pk if k in names), names
    return nums, tuple(k for i, k in pk if i in nums)


def _check_callable(fn) -> None:
    # what jax.jit refuses at once (jax._src.api_util.check_callable), refused
    # here too: our body would otherwise hide it until the first call
    if isinstance(fn, staticmethod) or not callable(fn):
        raise TypeError(f"jb.jit: fn={fn!r} is not callable; pass the function to compile, "
                        f"e.g. jb.jit(loss_fn).")
    if inspect.isgeneratorfunction(fn):
        raise TypeError(f"jb.jit: fn={getattr(fn, '__name__', fn)!r} is a generator function; "
                        f"jit needs a function that returns arrays, not one that yields them.")


def jit(fn: Callable, *, passes: Sequence | None = None, static_argnums=None,
        static_argnames=None, donate_argnums=None, in_shardings=_planned.UNSPECIFIED,
        out_shardings=_planned.UNSPECIFIED, reroll: bool | int = True, mesh=None, rules=None,
        memory_budget=None, profile=None, _transform: Callable | None = None, **jax_jit_kwargs):
    """Like `jax.jit(fn)`, with jaxbackend's passes run on the traced jaxpr.

    passes: pass names and/or callables (ClosedJaxpr -> ClosedJaxpr); None
    means `passes.DEFAULT_PIPELINE`, `()` means none. Other arguments mean
    what they mean for `jax.jit` and are passed to it.

    reroll: repeated layers are rolled into `scan` (compile time flat in
    depth) from `passes.REROLL_MIN_REPEATS` repeats; an integer >= 2
    changes that minimum, False switches the pass off.

    mesh: a `jax.sharding.Mesh` (AxisType.Auto axes). Each trace plans the
    program: the sharding search under `memory_budget` (bytes per device)
    and `profile` ("cpu", "h100", "h200" or a HardwareProfile; default: the
    mesh's devices', `sharding.device_profile`) picks dim-name rules, or
    `rules=` (a dict or a Plan) gives them; the program runs with the
    plan's layouts pinned on inputs, outputs and every named contraction,
    in scan bodies too. `inline` does not run under a mesh
    (`_planned.mesh_passes`).

    The result is JAX's jit object, with `.trace_passes(*args)`, `.passes`,
    `.trace_count`, `.last_report` and `.plan` added (module docstring).
    """
    _check_callable(fn)
    passes = _pipeline.configure(passes, reroll=reroll)
    if mesh is None:
        extra = [n for n, v in [("rules", rules), ("memory_budget", memory_budget),
                                ("profile", profile)] if v is not None]
        if extra:
            raise ValueError(f"jb.jit: the sharding arguments {', '.join(n + '=' for n in extra)} "
                             f"need mesh=; pass mesh=jax.sharding.Mesh(...) too.")
    else:
        from jaxbackend.sharding._mesh import check_auto_axes  # loaded only when used

        check_auto_axes(mesh)
        passes = _planned.mesh_passes(passes)
        # a bare PartitionSpec means one on this mesh (jax.jit would want a
        # mesh context for it)
        in_shardings, out_shardings = (_planned.on_mesh(s, mesh)
                                       for s in (in_shardings, out_shardings))
    names = tuple(n for n, _ in _pipeline.resolve(passes))  # fail early on unknown pass names
    static_argnums, static_argnames = _complete_statics(fn, static_argnums, static_argnames)
    label = getattr(fn, "__name__", "fn")
    planner = None if mesh is None else _planned.Planner(mesh, rules, memory_budget, profile,
                                                 in_shardings, out_shardings)
    donate_names = jax_jit_kwargs.get("donate_argnames") or ()
    donate = (_index_tuple(donate_argnums) or (),
              (donate_names,) if isinstance(donate_names, str) else tuple(donate_names))
    holder: list = []

    @functools.wraps(fn)  # jax.jit reads fn's name and signature through this
    def body(*args, **kwargs):
        with _pipeline.paused_gc():   # trace, passes, plan: see paused_gc
            return traced_body(*args, **kwargs)

    def traced_body(*args, **kwargs):
        if planner is not None:
            donated = _donated_leaves(args, kwargs, static_argnums, static_argnames, *donate)
            static, static_kw, dynamic, dyn_kw = _split_args(args, kwargs, static_argnums,
                                                             static_argnames)
            hit = planner.lookup(_static_key(static, static_kw), (tuple(dynamic), dyn_kw), donated)
            if hit is not None:   # planned before: JAX traces again for new input layouts
                plan, leaves = hit
                if holder:
                    holder[0].plan = plan
                return jax.tree.unflatten(plan.out_tree, _planned.run_planned(plan, leaves))
        t = _trace_flat(fn, args, kwargs, static_argnums, static_argnames)
        closed, report = _pipeline.run_pipeline(t.closed, passes, label=label)
        if _transform is not None:
            closed = _pipeline.checked("_transform", _transform, closed)
        plan = None if planner is None else planner(t._replace(closed=closed), donated)
        if holder:
            holder[0].trace_count += 1
            holder[0].last_report = report
            holder[0].plan = plan
        if plan is None:
            # short stacks of inputs made held: no XLA:CPU kernel each
            held = _stacks.HeldInputStacks(closed.jaxpr, t.leaves)
            outs = (_jax.eval_jaxpr_hooked(closed.jaxpr, closed.consts, t.leaves,
                                           lambda e, o: o, instead=lambda e, _: held.get(e))
                    if held else _jax.eval_jaxpr(closed, *t.leaves))
        else:
            outs = _planned.run_planned(plan, t.leaves)
        return jax.tree.unflatten(jax.tree.structure(t.out_shape), outs)

    kw = dict(jax_jit_kwargs, static_argnums=static_argnums, static_argnames=static_argnames,
              donate_argnums=donate_argnums)
    if in_shardings is not _planned.UNSPECIFIED:
        kw["in_shardings"] = in_shardings
    if out_shardings is not _planned.UNSPECIFIED:
        kw["out_shardings"] = out_shardings
    jitted: Any = jax.jit(body, **kw)
    # Return jax's own jit function object, so a call *is* a jax.jit call
    # (C++ fast path, measured equal in benchmarks/dispatch.py). Our extras
    # are instance attributes with names of our own: JAX calls its `trace`,
    # `lower` and `eval_shape` itself (make_jaxpr, eval_shape, nested jit).
    jitted.trace_passes = _make_trace_passes(fn, passes, static_argnums, static_argnames,
                                             _transform)
    jitted.passes = names
    jitted.trace_count = 0      # times fn was traced for XLA (cache misses)
    jitted.last_report = None   # passes.Report of the most recent trace
    jitted.plan = None          # sharding.Plan of the most recent trace (mesh= only)
    holder.append(jitted)
    return jitted


def _donated_leaves(args, kwargs, static_argnums, static_argnames, nums, names) -> tuple:
    """Per leaf of the traced (dynamic args, dynamic kwargs): is its buffer
    donated (`donate_argnums` / `donate_argnames`, as jax.jit reads them)?"""
    n = len(args)
    nums = {i % n for i in nums if -n <= i < n}
    per_arg = [jax.tree.map(lambda _, d=i in nums: d, a) for i, a in enumerate(args)]
    flags = (_split_static(per_arg, static_argnums)[1],   # the traced args, as _trace_flat
             {k: jax.tree.map(lambda _, d=k in names: d, v)
              for k, v in kwargs.items() if k not in static_argnames})
    return tuple(jax.tree.leaves(flags))
