"""Grouped-query attention with repeated KV heads, before/after group_heads.

The common JAX way to write GQA copies every KV head once per query head
(`jnp.repeat(k, group, axis=heads)`, MaxText / Gemma style) before the
attention einsums; the hand-written alternative reshapes q to (batch, time,
kv, group, hd) and contracts with an explicit group dim. The forms are in
`jaxbackend.programs.gqa` (causal softmax attention, float32).

Each form is compiled with jax.jit (no passes), with jb.jit running the
default pipeline without `group_heads`, and with jb.jit (default pipeline),
forward and value_and_grad (all of q, k, v), in one run. Reported: XLA
`cost_analysis()` flops and bytes accessed of the compiled program, and the
median wall time of the compiled call. Target: bytes of the repeat form
under jb.jit within 1.10x of the hand-written grouped form under jax.jit,
forward and value_and_grad.

Run: python benchmarks/gqa.py [--quick]   (--quick: tiny sizes, no BENCHMARKS.md)
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax  # noqa: E402

import jaxbackend as jb  # noqa: E402
from benchmarks import _report  # noqa: E402
from jaxbackend.passes import DEFAULT_PIPELINE  # noqa: E402
from jaxbackend.programs import gqa as P  # noqa: E402
from jaxbackend.testing import abs_scale, assert_close  # noqa: E402

FORMS = {"repeat (MaxText/Gemma)": P.gqa_repeat, "broadcast+reshape": P.gqa_broadcast,
         "repeat, heads-first": P.gqa_repeat_bhtd, "tile": P.gqa_tile,
         "grouped (hand-written)": P.gqa_grouped}
WITHOUT = tuple(p for p in DEFAULT_PIPELINE if p != "group_heads")
COMPILERS = {"jax.jit": jax.jit,
             "jb.jit without group_heads": lambda f: jb.jit(f, passes=WITHOUT),
             "jb.jit": jb.jit}
MODES = {"forward": lambda f: f,
         "value_and_grad": lambda f: jax.value_and_grad(P.gqa_loss(f), argnums=(0, 1, 2))}


def run(sizes, repeat):
    args = P.gqa_args(*sizes)
    results = {}
    for mode, wrap in MODES.items():
        for form, fn in FORMS.items():
            compilers = ("jax.jit", "jb.jit") if fn is P.gqa_grouped else COMPILERS
            for compiler in compilers:
                results[(mode, form, compiler)] = _report.compiled_cost(
                    COMPILERS[compiler](wrap(fn)), args, repeat=repeat)
        # the rewritten repeat form computes the hand-written grouped form
        ref = wrap(P.gqa_grouped)
        assert_close(jb.jit(wrap(P.gqa_repeat))(*args), jax.jit(ref)(*args),
                     what=f"{mode}: jb.jit repeat vs grouped", scale=lambda: abs_scale(ref, *args))
    return results


def render(results, sizes):
    rows, verdicts = [], []
    for (mode, form, compiler), r in results.items():
        ref = results[(mode, "grouped (hand-written)", "jax.jit")]
        rows.append([mode, form, compiler, f"{r['flops']:.4g}", f"{r['bytes']:.4g}",
                     f"{r['bytes'] / ref['bytes']:.3f}", f"{r['us']:.0f}"])
    for mode in MODES:
        ref = results[(mode, "grouped (hand-written)", "jax.jit")]["bytes"]
        for form in FORMS:
            if form.startswith("grouped"):
                continue
            before = results[(mode, form, "jb.jit without group_heads")]["bytes"] / ref
            after = results[(mode, form, "jb.jit")]["bytes"] / ref
            target = form in ("repeat (MaxText/Gemma)", "broadcast+reshape")
            verdict = (("MET" if after <= 1.10 else "MISSED") + " (target <= 1.10)" if target
                       else "(other form, no target)")
            verdicts.append(f"- {mode}, {form}: bytes / grouped = {before:.3f} before the pass, "
                            f"{after:.3f} after: {verdict}")
    b, t, kv, g, hd = sizes
    head = (f"Sizes: batch={b} time={t} kv_heads={kv} group={g} (query heads {kv * g}) hd={hd}, "
            "float32, causal softmax attention. flops/bytes: XLA `cost_analysis()` of the "
            "compiled program; bytes ratio: over the hand-written grouped form under jax.jit, "
            "same mode. median us: wall time of the compiled call (3 calls, median of runs) on "
            "a shared 2-core machine, noisy; the target is bytes.\n\n")
    table = _report.table(["mode", "form", "compiler", "flops", "bytes", "bytes / grouped",
                           "median us"], rows)
    note = ("\n\nWhere a repeat form reads fewer bytes than the hand-written grouped form "
            "before the pass, XLA CPU has folded the repeat into the transpose it makes of K "
            "and V for the dot anyway, while the grouped form's einsums make it copy the "
            "score matrix to another layout. The pass removes the copies and picks operand "
            "orders that avoid that layout copy. The tile layout (query head = g_i*kv + kv_i) "
            "has no such order: grouping it costs a transpose of the scores.")
    return head + table + "\n\n" + "\n".join(verdicts) + note


def main(argv=None) -> int:
    return _report.sized_main(argv, doc=__doc__, sizes=(2, 256, 2, 4, 128), quick_sizes=(1, 8, 2, 2, 4),
                              run=run, render=render, section="gqa",
                              title="GQA with repeated KV heads: group_heads")


if __name__ == "__main__":
    sys.exit(main())
