"""`jaxbackend.jit`: trace, run the pass pipeline, compile with XLA.

The one module that knows every stage. Design, chosen for dispatch cost:

    jb.jit(fn)  ==  jax.jit(body)   where body(*args):
        jaxpr  = make_jaxpr(fn) on the abstract args   (names still in it)
        jaxpr  = run_pipeline(jaxpr, passes)           (passes.*)
        jaxpr  = transform(jaxpr)                       (hook, see below)
        return eval_jaxpr(jaxpr, *args)                 (binds into jax.jit's trace)

JAX's own `jax.jit` object does the caching and the dispatch, so a warm call
takes JAX's C++ fast path with no Python cache key of ours: `jb.jit` returns
that very `jax.jit` function object, with our extras (`trace_passes`,
`passes`, `trace_count`, `last_report`) set as instance attributes whose
names JAX's jit object does not use: JAX calls its own `.trace`, `.lower`
and `.eval_shape` (from `jax.make_jaxpr`, `jax.eval_shape`, an outer
`jax.jit`), so shadowing one breaks those. (A wrapper class whose
`__call__` is the jit function measured ~3% slower: CPython's tp_call slot
drops vectorcall.) Same shapes/dtypes/static args never retrace; new ones
trace and compile once. `.lower(*args)` is jax's `Lowered` of the rewritten
program (`.compile()`, `.as_text()`, `.cost_analysis()`);
`.trace_passes(*args)` runs the pipeline again outside jit and returns a
`PipelineTrace` (jaxpr before/after every pass and the one-screen report).

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

Sharding: `jit(..., in_shardings=, out_shardings=)` pass through to
`jax.jit`; `jit(..., mesh=, rules=)` hands the program to
`sharding.sharded_jit`, which computes both from a searched (or given) plan
and constrains the named contractions. `_transform=fn` (ClosedJaxpr ->
ClosedJaxpr, run after the pipeline) is an internal hook for any other
rewrite.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import operator
import sys
from typing import Any, Callable, Sequence

import jax

from jaxbackend import _jax
from jaxbackend.passes import pipeline as _pipeline

_UNSPECIFIED = object()


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


def _spec(x) -> jax.ShapeDtypeStruct:
    # jax.typeof keeps weak types (Python scalars, weak arrays) as jax.jit does
    t = jax.typeof(x)
    return jax.ShapeDtypeStruct(t.shape, t.dtype, weak_type=t.weak_type)


def _trace_flat(fn, args, kwargs, static_argnums, static_argnames):
    """ClosedJaxpr of fn over the flattened dynamic leaves of (args, kwargs),
    the leaves themselves, and the output tree."""
    static, dynamic = _split_static(args, static_argnums)
    static_kw = {k: v for k, v in kwargs.items() if k in static_argnames}
    dyn_kw = {k: v for k, v in kwargs.items() if k not in static_argnames}
    leaves, in_tree = jax.tree.flatten((dynamic, dyn_kw))

    def flat_fn(*xs):
        dyn, kw = jax.tree.unflatten(in_tree, xs)
        args = _merge_static(static, dyn)
        watched = _nnx_state((args, kw))
        out = fn(*args, **kw, **static_kw)
        _check_nnx_unchanged(fn, watched)
        return out

    closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*map(_spec, leaves))
    return closed, leaves, jax.tree.structure(out_shape)


def _nnx_state(tree) -> list:
    """[(where, object, its leaves with paths, its treedef)] for every Flax
    NNX object (module, optimizer, rngs, variable) in the argument tree.
    Flax NNX objects are pytrees, so jax.jit takes them, but a method that
    updates them (optimizer.update, BatchNorm statistics, Rngs counters)
    updates the traced copy only: the caller's object keeps its old state."""
    nnx = sys.modules.get("flax.nnx")  # no Flax loaded: no NNX objects
    if nnx is None:
        return []
    kinds = (nnx.Pytree, nnx.Variable)
    found = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, kinds))[0]
    return [(("args", "kwargs")[p[0].idx] + jax.tree_util.keystr(p[1:]), x,
             *jax.tree_util.tree_flatten_with_path(x))
            for p, x in found if isinstance(x, kinds)]


def _check_nnx_unchanged(fn, watched) -> None:
    for where, obj, leaves, tree in watched:
        now, now_tree = jax.tree_util.tree_flatten_with_path(obj)
        changed = [jax.tree_util.keystr(p) for (p, a), (_, b) in zip(leaves, now) if a is not b]
        if changed or now_tree != tree:
            raise TypeError(
                f"jb.jit: {getattr(fn, '__name__', 'fn')} updated Flax NNX state at "
                f"{where}{changed[0] if changed else ''} ({type(obj).__name__}), an update the "
                f"compiled function, being pure, would lose; use nnx.jit for NNX-aware jit, or "
                f"nnx.split the module, pass its state in and return the new state (nnx.merge "
                f"inside; jaxbackend.nn.functional does this for parameters).")


@dataclasses.dataclass
class PipelineTrace:
    """The jaxpr before and after each pass, and the report."""

    jaxprs: list          # [(pass name, ClosedJaxpr)], ("input", ...) first
    report: Any           # passes.pipeline.Report

    @property
    def before(self):
        return self.jaxprs[0][1]

    @property
    def after(self):
        return self.jaxprs[-1][1]

    def jaxpr_after(self, name: str):
        for n, j in self.jaxprs:
            if n == name:
                return j
        raise KeyError(f"no pass named {name!r} ran; passes: {[n for n, _ in self.jaxprs[1:]]}")

    def __str__(self) -> str:
        return str(self.report)


def _make_trace_passes(fn, passes, static_argnums, static_argnames, transform):
    def trace_passes(*args, **kwargs) -> PipelineTrace:
        """Run the pipeline on fn's jaxpr for these args, keeping every stage."""
        closed, _, _ = _trace_flat(fn, args, kwargs, static_argnums, static_argnames)
        closed, report = _pipeline.run_pipeline(closed, passes, keep_jaxprs=True,
                                                label=getattr(fn, "__name__", "fn"))
        if transform is not None:
            closed = _pipeline.checked("_transform", transform, closed)
            report.jaxprs.append(("transform", closed))
        return PipelineTrace(report.jaxprs, report)

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
        static_argnames=None, donate_argnums=None, in_shardings=_UNSPECIFIED,
        out_shardings=_UNSPECIFIED, reroll: bool | int = True, mesh=None, rules=None,
        memory_budget=None, _transform: Callable | None = None, **jax_jit_kwargs):
    """Like `jax.jit(fn)`, with jaxbackend's passes run on the traced jaxpr.

    passes: pass names and/or callables (ClosedJaxpr -> ClosedJaxpr); None
    means `passes.DEFAULT_PIPELINE`, `()` means none. Other arguments mean
    what they mean for `jax.jit` and are passed to it.

    reroll: repeated layers are rolled into `scan` (compile time flat in
    depth) from `passes.REROLL_MIN_REPEATS` repeats; an integer >= 2
    changes that minimum, False switches the pass off.

    mesh: a `jax.sharding.Mesh` (AxisType.Auto axes). The sharding search
    picks dim-name rules for it (or `rules=` gives them), and the program
    compiles with the plan's input/output shardings and a sharding
    constraint on every named contraction (layers are not rolled into
    `scan` under a mesh); `fn.plan` is the latest plan.

    The result is JAX's jit object; `.trace_passes(*args)` adds the jaxpr
    before and after each pass (`PipelineTrace`).
    """
    _check_callable(fn)
    passes = _pipeline.configure(passes, reroll=reroll)
    if mesh is not None:
        return _sharded(fn, passes, mesh, rules, memory_budget, static_argnums, static_argnames,
                        donate_argnums, in_shardings, out_shardings, _transform, jax_jit_kwargs)
    if rules is not None or memory_budget is not None:
        raise ValueError("jb.jit: rules= and memory_budget= describe a sharding plan and need "
                         "mesh=; pass mesh=jax.sharding.Mesh(...) too.")
    static_argnums, static_argnames = _complete_statics(fn, static_argnums, static_argnames)
    _pipeline.resolve(passes)  # fail early on unknown pass names
    holder: list = []

    @functools.wraps(fn)  # jax.jit reads fn's name and signature through this
    def body(*args, **kwargs):
        closed, leaves, out_tree = _trace_flat(fn, args, kwargs, static_argnums, static_argnames)
        closed, report = _pipeline.run_pipeline(closed, passes, label=getattr(fn, "__name__", "fn"))
        if _transform is not None:
            closed = _pipeline.checked("_transform", _transform, closed)
        if holder:
            holder[0].trace_count += 1
            holder[0].last_report = report
        return jax.tree.unflatten(out_tree, _jax.eval_jaxpr(closed, *leaves))

    kw = dict(jax_jit_kwargs, static_argnums=static_argnums, static_argnames=static_argnames,
              donate_argnums=donate_argnums)
    if in_shardings is not _UNSPECIFIED:
        kw["in_shardings"] = in_shardings
    if out_shardings is not _UNSPECIFIED:
        kw["out_shardings"] = out_shardings
    jitted = jax.jit(body, **kw)
    # Return jax's own jit function object, so a call *is* a jax.jit call
    # (C++ fast path, measured equal in benchmarks/dispatch.py). Our extras
    # are instance attributes with names of our own: JAX calls its `trace`,
    # `lower` and `eval_shape` itself (make_jaxpr, eval_shape, nested jit).
    jitted.trace_passes = _make_trace_passes(fn, passes, static_argnums, static_argnames,
                                             _transform)
    jitted.passes = passes
    jitted.trace_count = 0      # times fn was traced for XLA (cache misses)
    jitted.last_report = None   # passes.Report of the most recent trace
    holder.append(jitted)
    return jitted


def _sharded(fn, passes, mesh, rules, memory_budget, static_argnums, static_argnames,
             donate_argnums, in_shardings, out_shardings, transform, jax_jit_kwargs):
    """`jb.jit(fn, mesh=...)`: the search plans the jaxpr after every pass but
    `inline` (so it reads dim names; the named einsums lower by themselves)
    and `reroll`: the plan's sharding constraints go on top-level
    contractions, which a `scan` body would hide. Under a mesh, layers stay
    unrolled for now: rolling after planning, with the constraints moved into
    the scan bodies, compiled slower under SPMD (measured on a (2, 4) CPU
    mesh: 10.2 s vs 7.7 s for the issue-4 transformer at 8 layers, 5.7 s vs
    1.5 s for the named attention stack at 16), and rolling after the
    planning passes finds fewer runs (`cse` and `hoist_broadcast` change the
    layers' periodicity), so it waits for planning on the rolled program."""
    given = [name for name, v in [("static_argnums", static_argnums),
                                  ("static_argnames", static_argnames),
                                  ("donate_argnums", donate_argnums),
                                  ("in_shardings", in_shardings is not _UNSPECIFIED),
                                  ("out_shardings", out_shardings is not _UNSPECIFIED),
                                  *jax_jit_kwargs.items()] if v]
    if given:
        raise ValueError(
            f"jb.jit(mesh=...) does not take {', '.join(given)}: the plan sets the shardings; "
            f"close over static values with functools.partial, or drop mesh= to use them.")
    from jaxbackend import sharding  # the sharding stage is only loaded when used

    chosen = [f for n, f in _pipeline.resolve(passes) if n not in ("inline", "reroll")]

    def planned_passes(closed):
        closed, _ = _pipeline.run_pipeline(closed, chosen, label=getattr(fn, "__name__", "fn"))
        return _pipeline.checked("_transform", transform, closed) if transform else closed

    out = sharding.sharded_jit(fn, mesh=mesh, rules=rules, memory_budget=memory_budget,
                               transform=planned_passes)
    out.passes = tuple(n for n, _ in _pipeline.resolve(chosen))
    return out
