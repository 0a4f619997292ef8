"""`python -m jaxbackend explain path/to/script.py:function [options]`
and `python -m jaxbackend explain --corpus DIR`.

Loads the script as a module (its directory first on sys.path), finds the
function and its example inputs, runs the pass pipeline on the function's
jaxpr and prints the one-screen report: equations before/after each pass,
what each pass matched, the primitive counts that changed, and per pass the
user source lines whose equations it removed or added.

Example-input convention (checked in this order):
1. `example_inputs_<function>()` -> tuple of positional arguments;
2. `example_inputs()`            -> tuple of positional arguments;
3. `EXAMPLE_ARGS`                 a module-level tuple.
A non-tuple result is taken as the single argument.

Per source line. Every equation carries the traceback of its tracing; its
line is the innermost frame outside JAX, the stdlib, installed packages
(flax, optax: a layer's equations belong to the user line that called it)
and jaxbackend itself. A pass's change is a multiset difference per line:
equations are compared by (primitive, operand types, result types), not by
identity, since passes rename every variable they touch. So `-12 +3` means
twelve equations of that line's kinds and shapes are gone and three new
ones appeared; an einsum lowered to a dot_general of the same shapes is
`-1 +1`. Equations a pass builds by tracing carry the pass's own traceback,
not a user line; they are counted under "(made by the pass)" unless the
pass stamps them with the source of the equation they replace. One walk
per kept jaxpr: linear in the number of equations.

`--corpus DIR` runs every program of a corpus folder (`jaxbackend._corpus`)
and prints, per pass, the programs it fired on (matched something, or
changed some line's equations); a pass that fired on none is flagged.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import sysconfig

from jaxbackend import _jax
from jaxbackend._scripts import load_callable

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_PASSES = os.path.join(_PACKAGE, "passes") + os.sep
_LIBRARIES = tuple({sysconfig.get_paths()[k] + os.sep for k in ("purelib", "platlib")})
MADE_BY_PASS = "(made by the pass)"
NO_LINE = "(no user source line)"


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


# --- source lines ------------------------------------------------------------

class SourceLines:
    """eqn -> 'file.py:LINE (function)', MADE_BY_PASS or NO_LINE; memoised
    per traceback object, which equations a pass keeps or inlines share.

    An equation of a library's nested `jit` body (jnp.where's) has a
    traceback that stops inside the library: it takes the line of the
    equation that calls the body, and keeps it once inlined."""

    def __init__(self) -> None:
        self._memo: dict = {}

    def __call__(self, eqn, caller: str = NO_LINE) -> str:
        tb = getattr(eqn.source_info, "traceback", None)
        hit = self._memo.get(id(tb))
        if hit is None or hit[0] is not tb:
            line = self._locate(eqn)
            if line == NO_LINE and caller not in (NO_LINE, MADE_BY_PASS):
                line = caller
            hit = self._memo[id(tb)] = (tb, line)
        return hit[1]

    @staticmethod
    def _locate(eqn) -> str:
        for file, line, function in _jax.user_frames(eqn):
            if file.startswith(_PASSES):
                return MADE_BY_PASS    # traced by a pass: the pass's stack, not the user's
            if file.startswith(_PACKAGE) or file.startswith(_LIBRARIES):
                continue
            return f"{os.path.basename(file)}:{line} ({function})"
        return NO_LINE


def _by_line(closed, where: SourceLines) -> dict:
    """line -> Counter of equation kinds (primitive, operand and result
    types), over the jaxpr and each distinct sub-jaxpr once."""
    out: dict = collections.defaultdict(collections.Counter)
    seen: set = set()
    stack = [(_jax.open_jaxpr(closed), NO_LINE)]
    while stack:
        jaxpr, caller = stack.pop()
        for e in jaxpr.eqns:
            line = where(e, caller)
            kind = (e.primitive.name, tuple(str(v.aval) for v in e.invars),
                    tuple(str(v.aval) for v in e.outvars))
            out[line][kind] += 1
            for sub in _jax.sub_jaxprs(e):
                if id(sub) not in seen:
                    seen.add(id(sub))
                    stack.append((sub, line))
    return out


def line_changes(report) -> list[tuple[str, list[tuple[str, int, int]]]]:
    """Per pass of a Report that kept its jaxprs: [(line, removed, added)]
    for the lines whose equations it changed, most changed first."""
    jaxprs = report.jaxprs
    if jaxprs is None:
        raise ValueError("this Report kept no jaxprs; run jb.jit(f).trace_passes(*args) to keep "
                         "the jaxpr after every pass.")
    where = SourceLines()
    empty: collections.Counter = collections.Counter()
    prev_closed, prev = jaxprs[0][1], _by_line(jaxprs[0][1], where)
    out = []
    for name, closed in jaxprs[1:]:
        # A pass that changed nothing returns its input: no second walk.
        cur = prev if closed is prev_closed else _by_line(closed, where)
        rows = []
        for line in prev.keys() | cur.keys():
            b, a = prev.get(line, empty), cur.get(line, empty)
            removed, added = sum((b - a).values()), sum((a - b).values())
            if removed or added:
                rows.append((line, removed, added))
        rows.sort(key=lambda r: (-(r[1] + r[2]), r[0]))
        out.append((name, rows))
        prev_closed, prev = closed, cur
    return out


def format_line_changes(changes) -> list[str]:
    lines = ["source lines each pass changed (equations removed, added):"]
    for name, rows in changes:
        if not rows:
            lines.append(f"  {name:<18} (no line changed)")
            continue
        for k, (line, removed, added) in enumerate(rows):
            lines.append(f"  {name if k == 0 else '':<18} {line:<44} -{removed:<4} eqns  +{added:<4} eqns")
    return lines


# --- one function ------------------------------------------------------------

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
    lines += [""] + format_line_changes(line_changes(t))
    if show_jaxpr:
        lines += ["", "jaxpr before:", str(t.before), "", "jaxpr after:", str(t.after)]
    return "\n".join(lines)


# --- a corpus ----------------------------------------------------------------

def fired(report) -> dict[str, bool]:
    """pass name -> whether it matched something or changed some line's
    equations (a pass may run more than once; any run counts)."""
    out: dict[str, bool] = {}
    for (name, rows), stat in zip(line_changes(report), report.stats):
        out[name] = out.get(name, False) or bool(rows) or any(stat.matches.values())
    return out


def corpus_report(folder, passes=None) -> str:
    import jaxbackend as jb
    from jaxbackend import _corpus
    from jaxbackend.passes import pipeline

    try:
        programs = _corpus.load(folder)
    except ValueError as e:
        raise ExplainError(f"--corpus: {e}") from None
    names = [n for n, _ in pipeline.resolve(passes)]
    on: dict[str, list[str]] = {n: [] for n in names}
    for prog in programs:
        report = jb.jit(prog.fn, passes=passes).trace_passes(*prog.make_args())
        for name, yes in fired(report).items():
            if yes:
                on[name].append(prog.name)
    lines = [f"corpus {folder}: {len(programs)} programs", "",
             f"{'pass':<18} {'fired on':>9}  programs"]
    for name in names:
        hit = on[name]
        shown = ", ".join(hit[:6]) + (f", ... ({len(hit) - 6} more)" if len(hit) > 6 else "")
        lines.append(f"{name:<18} {len(hit):>4} / {len(programs):<3} "
                     f"{shown if hit else 'FIRES ON NOTHING IN THIS CORPUS'}")
    return "\n".join(lines)


# --- command line ------------------------------------------------------------

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
    ap.add_argument("target", nargs="?", help="path/to/script.py:function")
    ap.add_argument("--corpus", metavar="DIR",
                    help="instead of one target: every program of a corpus folder (files defining "
                         "CORPUS); prints per pass the programs it fired on")
    ap.add_argument("--passes", help="comma-separated pass names (default: the default pipeline)")
    ap.add_argument("--jaxpr", action="store_true", help="also print the jaxpr before and after")
    ap.add_argument("--dump", metavar="DIR", help="write the jaxpr after each pass to DIR")
    a = ap.parse_args(argv)
    if a.dump:
        os.environ["JAXBACKEND_DUMP"] = a.dump
    try:
        if (a.target is None) == (a.corpus is None):
            raise ExplainError("give either a target path/to/script.py:function or --corpus DIR, "
                               "not both and not neither.")
        passes = tuple(p.strip() for p in a.passes.split(",")) if a.passes else None
        _check_passes(passes)
        if a.corpus is not None:
            print(corpus_report(a.corpus, passes))
            return 0
        fn, args = load_target(a.target)
        print(explain(fn, args, passes, show_jaxpr=a.jaxpr))
    except ExplainError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
