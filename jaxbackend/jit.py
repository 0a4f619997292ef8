"""`jaxbackend.jit`: trace, run the pass pipeline, compile with XLA.

The one module that knows every stage. Design, chosen for dispatch cost:

    jb.jit(fn)  ==  jax.jit(body)   where body(*args):
        jaxpr  = make_jaxpr(fn) on the abstract args   (names still in it)
        jaxpr  = run_pipeline(jaxpr, passes)           (passes.*)
        jaxpr  = transform(jaxpr)                       (hook, see below)
        return eval_jaxpr(jaxpr, *args)                 (binds into jax.jit's trace)

JAX's own `jax.jit` object does the caching and the dispatch, so a warm call
takes JAX's C++ fast path with no Python cache key of ours: `jb.jit` returns
that very `jax.jit` function object, with our extras (`trace`, `passes`,
`trace_count`, `last_report`) set as instance attributes. (A wrapper class
whose `__call__` is the jit function measured ~3% slower: CPython's
tp_call slot drops vectorcall.) Same
shapes/dtypes/static args never retrace; new ones trace and compile once.
`.lower(*args)` is jax's `Lowered` of the rewritten program (`.compile()`,
`.as_text()`, `.cost_analysis()`); `.trace(*args)` runs the pipeline again
outside jit and returns a `PipelineTrace` (jaxpr before/after every pass and
the one-screen report).

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
from typing import Any, Callable, Sequence

import jax

from jaxbackend import _jax
from jaxbackend.passes import pipeline as _pipeline

_UNSPECIFIED = object()


def _split_static(args, static_argnums):
    static_argnums = {i % len(args) if i < 0 else i for i in static_argnums} if args else ()
    static = {i: a for i, a in enumerate(args) if i in static_argnums}
    dynamic = [a for i, a in enumerate(args) if i not in static_argnums]
    return static, dynamic


def _merge_static(static, dynamic):
    out, it = [], iter(dynamic)
    for i in range(len(static) + len(dynamic)):
        out.append(static[i] if i in static else next(it))
    return out


def _trace_flat(fn, args, kwargs, static_argnums, static_argnames):
    """ClosedJaxpr of fn over the flattened dynamic leaves of (args, kwargs),
    the leaves themselves, and the output tree."""
    static, dynamic = _split_static(args, static_argnums)
    static_kw = {k: v for k, v in kwargs.items() if k in static_argnames}
    dyn_kw = {k: v for k, v in kwargs.items() if k not in static_argnames}
    leaves, in_tree = jax.tree.flatten((dynamic, dyn_kw))

    def flat_fn(*xs):
        dyn, kw = jax.tree.unflatten(in_tree, xs)
        return fn(*_merge_static(static, dyn), **kw, **static_kw)

    specs = [jax.ShapeDtypeStruct(jax.numpy.shape(x), jax.numpy.result_type(x),
                                  weak_type=getattr(getattr(x, "aval", None), "weak_type", False))
             for x in leaves]
    closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*specs)
    return closed, leaves, jax.tree.structure(out_shape)


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


def _make_trace_method(fn, passes, static_argnums, static_argnames, transform):
    def trace(*args, **kwargs) -> PipelineTrace:
        """Run the pipeline on fn's jaxpr for these args, keeping every stage."""
        closed, _, _ = _trace_flat(fn, args, kwargs, static_argnums, static_argnames)
        closed, report = _pipeline.run_pipeline(closed, passes, keep_jaxprs=True,
                                                label=getattr(fn, "__name__", "fn"))
        if transform is not None:
            closed = transform(closed)
            report.jaxprs.append(("transform", closed))
        return PipelineTrace(report.jaxprs, report)

    return trace


def _normalize_argnums(argnums) -> tuple:
    if argnums is None:
        return ()
    if isinstance(argnums, int):
        return (argnums,)
    return tuple(argnums)


def _complete_statics(fn, static_argnums, static_argnames):
    """Both forms of every static argument, as jax.jit infers them from the
    signature, so a static parameter is static whether passed by position
    or by name (our traced body sees fn's signature via functools.wraps)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return static_argnums, static_argnames
    positional = [p.name for p in params
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    nums = {i % len(positional) if i < 0 and positional else i for i in static_argnums}
    names = set(static_argnames)
    for i in list(nums):
        if i < len(positional) and params[i].kind is not params[i].POSITIONAL_ONLY:
            names.add(positional[i])
    for name in list(names):
        if name in positional:
            nums.add(positional.index(name))
    return tuple(sorted(nums)), tuple(sorted(names))


def jit(fn: Callable, *, passes: Sequence | None = None, static_argnums=(),
        static_argnames=(), donate_argnums=(), in_shardings=_UNSPECIFIED,
        out_shardings=_UNSPECIFIED, reroll: bool | int = True, mesh=None, rules=None,
        memory_budget=None, _transform: Callable | None = None, **jax_jit_kwargs):
    """Like `jax.jit(fn)`, with jaxbackend's passes run on the traced jaxpr.

    passes: pass names and/or callables (ClosedJaxpr -> ClosedJaxpr); None
    means `passes.DEFAULT_PIPELINE`, `()` means none. Other arguments mean
    what they mean for `jax.jit` and are passed to it.

    reroll: repeated layers are rolled into `scan` (compile time flat in
    depth) from `passes.REROLL_MIN_REPEATS` repeats; an int changes that
    minimum, False switches the pass off.

    mesh: a `jax.sharding.Mesh` (AxisType.Auto axes). The sharding search
    picks dim-name rules for it (or `rules=` gives them), and the program
    compiles with the plan's input/output shardings and a sharding
    constraint on every named contraction (layers are not rolled into
    `scan` under a mesh); `fn.plan` is the latest plan.
    """
    passes = _pipeline.configure(passes, reroll=reroll)
    if mesh is not None:
        return _sharded(fn, passes, mesh, rules, memory_budget, static_argnums, static_argnames,
                        donate_argnums, in_shardings, out_shardings, _transform, jax_jit_kwargs)
    if rules is not None or memory_budget is not None:
        raise ValueError("jb.jit: rules= and memory_budget= describe a sharding plan and need "
                         "mesh=; pass mesh=jax.sharding.Mesh(...) too.")
    static_argnums = _normalize_argnums(static_argnums)
    static_argnames = (static_argnames,) if isinstance(static_argnames, str) else tuple(static_argnames)
    static_argnums, static_argnames = _complete_statics(fn, static_argnums, static_argnames)
    _pipeline.resolve(passes)  # fail early on unknown pass names
    holder: list = []

    @functools.wraps(fn)  # jax.jit reads fn's name and signature through this
    def body(*args, **kwargs):
        closed, leaves, out_tree = _trace_flat(fn, args, kwargs, static_argnums, static_argnames)
        closed, report = _pipeline.run_pipeline(closed, passes, label=getattr(fn, "__name__", "fn"))
        if _transform is not None:
            closed = _transform(closed)
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
    # are instance attributes; `trace` shadows jax's `Traced`-returning method.
    jitted.trace = _make_trace_method(fn, passes, static_argnums, static_argnames, _transform)
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

    chosen = [(n, f) for n, f in _pipeline.resolve(passes) if n not in ("inline", "reroll")]

    def planned_passes(closed):
        for _, f in chosen:
            closed = f(closed)
        return transform(closed) if transform is not None else closed

    out = sharding.sharded_jit(fn, mesh=mesh, rules=rules, memory_budget=memory_budget,
                               transform=planned_passes)
    out.passes = tuple(n for n, _ in chosen)
    return out
