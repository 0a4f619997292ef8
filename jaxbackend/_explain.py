"""`python -m jaxbackend explain path/to/script.py:function [options]`.

Loads the script as a module (its directory first on sys.path), finds the
function and its example inputs, runs the pass pipeline on the function's
jaxpr and prints the one-screen report: equations before/after each pass,
what each pass matched, and the primitive counts that changed.

Example-input convention (checked in this order):
1. `example_inputs_<function>()` -> tuple of positional arguments;
2. `example_inputs()`            -> tuple of positional arguments;
3. `EXAMPLE_ARGS`                 a module-level tuple.
A non-tuple result is taken as the single argument.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

from jaxbackend._scripts import load_callable


class ExplainError(ValueError):
    """The target could not be loaded or has no example inputs."""


def load_target(spec: str):
    """'path/to/script.py:function' -> (function, args tuple)."""
    module, fn = load_callable(spec, "function", ExplainError)
    path, name = spec.rpartition(":")[::2]
    for attr in (f"example_inputs_{name}", "example_inputs"):
        maker = getattr(module, attr, None)
        if callable(maker):
            args = maker()
            return fn, args if isinstance(args, tuple) else (args,)
    if hasattr(module, "EXAMPLE_ARGS"):
        args = module.EXAMPLE_ARGS
        return fn, args if isinstance(args, tuple) else (args,)
    raise ExplainError(f"{path} provides no example inputs for {name!r}; define "
                       f"example_inputs_{name}() or example_inputs() returning a tuple of args.")


def _primitive_counts(closed):
    from jaxbackend.passes import _rewrite

    return collections.Counter(e.primitive.name for e in _rewrite.iter_eqns(closed))


def explain(fn, args, passes=None, *, show_jaxpr=False) -> str:
    import jaxbackend as jb

    t = jb.jit(fn, passes=passes).trace_passes(*args)
    before, after = _primitive_counts(t.before), _primitive_counts(t.after)
    changed = sorted(k for k in before.keys() | after.keys() if before[k] != after[k])
    lines = [f"explain {getattr(fn, '__name__', fn)}: {len(t.before.jaxpr.invars)} inputs, "
             f"{sum(before.values())} -> {sum(after.values())} equations", "", str(t), "",
             "primitive counts that changed (before -> after):"]
    lines += [f"  {k:<20} {before[k]:>5} -> {after[k]:<5}" for k in changed] or ["  (none)"]
    if show_jaxpr:
        lines += ["", "jaxpr before:", str(t.before), "", "jaxpr after:", str(t.after)]
    return "\n".join(lines)


def _check_passes(passes) -> None:
    """Unknown --passes names: one line, before anything is traced."""
    from jaxbackend.passes import pipeline

    try:
        pipeline.resolve(passes)
    except ValueError as e:
        raise ExplainError(f"--passes: {e}") from None


def main(argv) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxbackend explain",
                                 description="run the pass pipeline on a function and report")
    ap.add_argument("target", help="path/to/script.py:function")
    ap.add_argument("--passes", help="comma-separated pass names (default: the default pipeline)")
    ap.add_argument("--jaxpr", action="store_true", help="also print the jaxpr before and after")
    ap.add_argument("--dump", metavar="DIR", help="write the jaxpr after each pass to DIR")
    a = ap.parse_args(argv)
    if a.dump:
        os.environ["JAXBACKEND_DUMP"] = a.dump
    try:
        fn, args = load_target(a.target)
        passes = tuple(p.strip() for p in a.passes.split(",")) if a.passes else None
        _check_passes(passes)
        print(explain(fn, args, passes, show_jaxpr=a.jaxpr))
    except ExplainError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
