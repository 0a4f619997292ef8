"""Compile time against depth: named vs plain (issue 2), rolled vs unrolled (issue 4).

Two sections of BENCHMARKS.md, both `jax.value_and_grad` of a loss summed
over a stack of layers, weights being the differentiated argument:

* `compile_scaling_named`: the causal attention stack of
  `jaxbackend.models._attention_stack` (B,T,E,H,HD = 4,32,64,4,16) written
  with `jaxbackend.named` and in plain jnp, 1..32 layers. Columns: trace+lower
  seconds and XLA compile seconds of each, and named/plain ratios.
* `compile_scaling_reroll`: the issue-4 pre-LayerNorm transformer (and the
  named attention stack), 1..64 layers, three columns: plain `jax.jit` of the
  Python for-loop (unrolled), `jb.jit` / the `reroll` pass (rolled into
  scans), and a hand-written `jax.lax.scan` over stacked weights.

How caches are kept out of the numbers: every measurement builds a new
closure (so jit's tracing cache, keyed on function identity, misses), the
persistent compilation cache is switched off, and variants are interleaved
within each repeat so machine load drifts hit all columns alike. Medians of
`--repeat` runs (>= 3). `--quick` is a smoke run at tiny depths that prints
but does not write BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import jax  # noqa: E402

jax.config.update("jax_enable_compilation_cache", False)

from _report import table, write_section  # noqa: E402

from jaxbackend.models import _attention_stack as attn  # noqa: E402


# --------------------------------------------------------------------------
# timing one (fresh) function: trace+lower and compile, separately

def time_compile(fn, args):
    """(trace+lower s, compile s, compiled) of jax.jit(fn) at args.

    `fn` must be a function object never jitted before (a fresh closure)."""
    t0 = time.perf_counter()
    lowered = jax.jit(fn).trace(*args).lower()
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, compiled


def _med(xs):
    return statistics.median(xs)


# --------------------------------------------------------------------------
# section compile_scaling_named (issue 2)

def _named_fresh(n_layers):
    """Fresh value_and_grad closures of the named and plain stacks + args."""
    x, layers = attn.init_attention_stack(jax.random.key(n_layers), n_layers)
    nx_x, nx_layers = attn.name_params(x, layers)

    def named_loss(x, layers):  # a new function object on every call
        return attn.named_attention_stack(x, layers)

    def plain_loss(x, layers):
        return attn.jnp_attention_stack(x, layers)

    return ((jax.value_and_grad(named_loss, argnums=1, has_aux=True), (nx_x, nx_layers)),
            (jax.value_and_grad(plain_loss, argnums=1, has_aux=True), (x, layers)))


def run_named(depths, repeat):
    rows, ratios = [], []
    for n in depths:
        samples = {"named": ([], []), "plain": ([], [])}
        for r in range(repeat):
            (nf, nargs), (pf, pargs) = _named_fresh(n)
            # alternate which variant goes first so warm-up order cancels out
            order = [("named", nf, nargs), ("plain", pf, pargs)]
            if r % 2:
                order.reverse()
            for name, f, a in order:
                tl, tc, _ = time_compile(f, a)
                samples[name][0].append(tl)
                samples[name][1].append(tc)
        nl, nc = _med(samples["named"][0]), _med(samples["named"][1])
        pl, pc = _med(samples["plain"][0]), _med(samples["plain"][1])
        ratio = (nl + nc) / (pl + pc)
        ratios.append(ratio)
        rows.append([n, f"{nl:.3f}", f"{nc:.3f}", f"{pl:.3f}", f"{pc:.3f}",
                     f"{nl / pl:.2f}", f"{nc / pc:.2f}", f"**{ratio:.2f}**"])
        print(f"named  L={n:3d}  named {nl:.3f}+{nc:.3f}s  plain {pl:.3f}+{pc:.3f}s  "
              f"ratio {ratio:.2f}", flush=True)
    headers = ["layers", "named trace+lower s", "named compile s", "plain trace+lower s",
               "plain compile s", "ratio trace+lower", "ratio compile", "ratio total"]
    met = all(r <= 1.10 for r in ratios)
    body = (
        "`jax.value_and_grad` (w.r.t. the layer weights) of the causal attention stack of\n"
        "`jaxbackend/models/_attention_stack.py` (B,T,E,H,HD = 4,32,64,4,16; per layer four\n"
        "contractions, a softmax, a `where` causal mask), written with `jaxbackend.named` and in\n"
        "plain `jnp`. Seconds are medians of "
        f"{repeat} runs; each run traces a fresh closure (no jit cache hit, persistent\n"
        "compilation cache off) and named/plain are interleaved, so ratios come from the same\n"
        "conditions. Target: total ratio named/plain <= 1.10 at every depth: "
        f"**{'met' if met else 'missed'}** (max {max(ratios):.2f}).\n\n"
        + table(headers, rows))
    return body, ratios


# --------------------------------------------------------------------------

def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--section", choices=["named", "reroll", "all"], default="all")
    p.add_argument("--quick", action="store_true", help="tiny smoke run; writes nothing")
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)
    repeat = 1 if args.quick else max(3, args.repeat)
    if args.section in ("named", "all"):
        depths = [1, 2] if args.quick else [1, 2, 4, 8, 16, 32]
        body, _ = run_named(depths, repeat)
        if args.quick:
            print(body)
        else:
            write_section("compile_scaling_named",
                          "Compile scaling: named vs plain jnp attention (issue 2)", body)
    if args.section in ("reroll", "all"):
        from _compile_scaling_reroll import run_reroll  # noqa: E402

        body = run_reroll(quick=args.quick, repeat=repeat)
        if args.quick:
            print(body)
        else:
            write_section("compile_scaling_reroll",
                          "Compile scaling: reroll into scan vs unrolled vs hand scan (issue 4)",
                          body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
