"""The corpus: every program, forward and value_and_grad, gets exactly the
pass behaviour its `Expect` declares (counted on the pipeline's Report and
on the final jaxpr), computes what `jax.jit` computes, and costs no more
than `jax.jit`'s program (XLA's cost analysis), or than its declared
hand-written reference.

The registry is `jaxbackend._corpus.load(this folder)`, the same one
`python -m jaxbackend explain --corpus tests/passes/corpus` reads.
"""

from __future__ import annotations

import pathlib

import jax
import pytest

import jaxbackend as jb
from jaxbackend import _corpus, _explain
from jaxbackend.passes import pipeline
from jaxbackend.testing import abs_scale, assert_close, tolerance

HERE = pathlib.Path(__file__).resolve().parent
PROGRAMS = _corpus.load(HERE)
IDS = [p.name for p in PROGRAMS]


def _cost(compiled) -> dict:
    c = compiled.cost_analysis()
    return c[0] if isinstance(c, (list, tuple)) else c


def test_corpus_covers_the_patterns_and_every_pass():
    """10-15 programs (each forward and grad); every pass of the default
    pipeline is expected to fire on at least one of them."""
    assert 20 <= len(PROGRAMS) <= 30 and len(set(IDS)) == len(IDS)
    assert all(p.name.endswith(".grad") == (i % 2 == 1) for i, p in enumerate(PROGRAMS))
    expected = set().union(*(p.expect.firing() for p in PROGRAMS))
    assert expected == set(pipeline.DEFAULT_PIPELINE)


@pytest.mark.parametrize("prog", PROGRAMS, ids=IDS)
def test_each_pass_does_what_the_program_declares(prog):
    exp = prog.expect
    report = jb.jit(prog.fn).trace_passes(*prog.make_args())
    fired = _explain.fired(report)
    stats = {s.name: s for s in report.stats}
    problems = []
    for name in pipeline.DEFAULT_PIPELINE:
        if fired[name] != (name in exp.firing()):
            problems.append(f"{name} {'fired' if fired[name] else 'did not fire'} "
                            f"({stats[name].eqns_before} -> {stats[name].eqns_after} eqns, "
                            f"{stats[name].matches}); expected it "
                            f"{'to fire' if name in exp.firing() else 'not to fire'}")
    for name, counts in exp.matches.items():
        got = {k: stats[name].matches.get(k, 0) for k in counts}
        if got != counts:
            problems.append(f"{name} matched {got}, expected {counts}")
    for name, least in exp.removes.items():
        removed = stats[name].eqns_before - stats[name].eqns_after
        if removed < least:
            problems.append(f"{name} removed {removed} equations, expected >= {least}")
    for check in exp.checks:
        n = check(report.after)
        if n:
            problems.append(f"final jaxpr: {check.__name__} = {n}, expected 0")
    assert not problems, f"{prog.name}:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("prog", PROGRAMS, ids=IDS)
def test_values_match_jax_jit_and_cost_no_more(prog):
    exp, args = prog.expect, prog.make_args()
    ours = jb.jit(prog.fn).lower(*args).compile()
    ref = jax.jit(prog.fn).lower(*args).compile()
    tol = {} if exp.rounding is None else dict(zip(("rtol", "atol"), tolerance(exp.rounding)))
    assert_close(ours(*args), ref(*args), scale=lambda: abs_scale(prog.fn, *args),
                 what=prog.name, **tol)
    mine, theirs = _cost(ours), _cost(ref)
    if exp.cost_le is not None:
        reference, ratios = exp.cost_le
        base = _cost(jax.jit(reference).lower(*args).compile())
        for key, ratio in ratios.items():
            assert mine[key] <= ratio * base[key], (
                f"{prog.name}: {key} {mine[key]:.4g} is {mine[key] / base[key]:.3f}x "
                f"{reference.__name__}'s {base[key]:.4g}; target <= {ratio}x")
    # The passes rewrite how the program computes; they must never add work.
    extra = {k: mine[k] / theirs[k] for k in ("flops", "bytes accessed") if mine[k] > theirs[k]}
    if exp.known_cost_issue:
        if not extra:
            pytest.fail(f"{prog.name} no longer costs more than jax.jit: remove its "
                        f"known_cost_issue ({exp.known_cost_issue})")
        pytest.xfail(f"{exp.known_cost_issue}: {extra}")
    assert not extra, f"{prog.name} costs more than under jax.jit (ratio): {extra}"


def test_repeated_operand_counter_sees_repeat_broadcast_and_tile():
    """The final-jaxpr counter the GQA programs rely on: it finds K and V
    copied by `jnp.repeat`, by broadcast + reshape and by `jnp.tile`, and
    nothing in the grouped form."""
    from _expect import repeated_operands_of_dots

    from jaxbackend.programs import gqa

    args = gqa.gqa_args()
    for form in (gqa.gqa_repeat, gqa.gqa_broadcast, gqa.gqa_tile, gqa.gqa_repeat_bhtd):
        assert repeated_operands_of_dots(jax.make_jaxpr(form)(*args)) == 2, form.__name__
    assert repeated_operands_of_dots(jax.make_jaxpr(gqa.gqa_grouped)(*args)) == 0
