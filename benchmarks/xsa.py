"""XSA projection, GQA "expand" vs "unsqueeze" form, before/after hoist_broadcast.

XSA (exclusive self attention) projects the attention output y away from
the normalised value vector of the same position: y - (y . v_hat) v_hat,
v_hat = v / |v| per KV head. With grouped-query attention (kv KV heads,
group query heads each) y has shape (batch, time, kv, group, hd) and v
(batch, time, kv, hd). Two ways to write it in jnp:

* unsqueeze: normalise v once per KV head, then broadcast v_hat over group;
* expand:    broadcast v to every query head first (`v[..., None, :]`
             expanded, PyTorch's `.expand`), then normalise: the norm is
             computed `group` times per KV head.
(`jaxbackend.programs.small.xsa_unsqueeze` and `xsa_expand`.)

We compile each with jax.jit (no passes) and with jaxbackend.jit (default
pipeline, whose `hoist_broadcast` moves the normalisation above the
broadcast), forward and forward+grad, and report XLA's cost_analysis flops,
the number of fusions in the compiled HLO, and the median run time.
Target: after the pass, expand flops within 5% of unsqueeze, and
no more fusions.

Run: python benchmarks/xsa.py [--quick]   (--quick: tiny sizes, no BENCHMARKS.md)
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxbackend as jb  # noqa: E402
from benchmarks import _report  # noqa: E402
from jaxbackend.programs.small import xsa_expand, xsa_unsqueeze  # noqa: E402


def _with_grad(form):
    def loss(v, y):
        return jnp.sum(jnp.tanh(form(v, y)))
    return jax.value_and_grad(loss, argnums=(0, 1))


def fusion_count(hlo_text: str) -> int:
    """Fusion instructions in a compiled HLO module (kLoop/kInput/kOutput...)."""
    return len(re.findall(r"\bfusion\(", hlo_text))


def measure(fn, args, repeat):
    compiled = fn.lower(*args).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    run = lambda: jax.block_until_ready(compiled(*args))  # noqa: E731
    run()
    t = _report.median_time(run, repeat=repeat, number=3)
    return dict(flops=float(cost.get("flops", 0.0)),
                bytes=float(cost.get("bytes accessed", 0.0)),
                fusions=fusion_count(compiled.as_text()), us=t * 1e6)


def run(sizes, repeat):
    key = jax.random.split(jax.random.key(0), 2)
    b, t, kv, g, hd = sizes
    v = jax.random.normal(key[0], (b, t, kv, hd), jnp.float32)
    y = jax.random.normal(key[1], (b, t, kv, g, hd), jnp.float32)
    results = {}
    for mode, wrap in (("forward", lambda f: f), ("forward+grad", _with_grad)):
        for form_name, form in (("unsqueeze", xsa_unsqueeze), ("expand", xsa_expand)):
            for compiler, jit in (("jax.jit", jax.jit), ("jb.jit", jb.jit)):
                results[(mode, form_name, compiler)] = measure(jit(wrap(form)), (v, y), repeat)
        out_a = jb.jit(wrap(xsa_expand))(v, y)
        out_b = jax.jit(wrap(xsa_unsqueeze))(v, y)
        for a, c in zip(jax.tree.leaves(out_a), jax.tree.leaves(out_b)):
            assert jnp.allclose(a, c, rtol=1e-4, atol=1e-4), "expand and unsqueeze disagree"
    return results


def render(results, sizes):
    rows, verdicts = [], []
    for (mode, form, compiler), r in results.items():
        base = results[(mode, "unsqueeze", "jax.jit")]
        rows.append([mode, form, compiler, f"{r['flops']:.3g}", f"{r['flops'] / base['flops']:.3f}",
                     r["fusions"], f"{r['bytes']:.3g}", f"{r['us']:.1f}"])
    for mode in ("forward", "forward+grad"):
        after = results[(mode, "expand", "jb.jit")]
        ref = results[(mode, "unsqueeze", "jax.jit")]
        ratio = after["flops"] / ref["flops"]
        ok = ratio <= 1.05 and after["fusions"] <= ref["fusions"]
        verdicts.append(f"- {mode}: expand after hoist_broadcast / unsqueeze flops = {ratio:.3f}, "
                        f"fusions {after['fusions']} vs {ref['fusions']}: "
                        f"{'MET' if ok else 'MISSED'} (target <= 1.05 and no more fusions)")
    b, t, kv, g, hd = sizes
    head = (f"Sizes: batch={b} time={t} kv_heads={kv} group={g} hd={hd} (float32). "
            "flops/bytes: XLA `cost_analysis()` of the compiled program; fusions: `fusion(` "
            "instructions in `compiled.as_text()`; ratio: flops over jax.jit unsqueeze, same mode. "
            "median us: wall time of the compiled call on a shared 2-core machine, noisy "
            "(identical programs differ by up to 2x between rows); the targets are flops and "
            "fusions.\n\n")
    table = _report.table(["mode", "form", "compiler", "flops", "flops ratio", "fusions",
                           "bytes", "median us"], rows)
    return head + table + "\n\n" + "\n".join(verdicts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes; does not write BENCHMARKS.md")
    args = ap.parse_args(argv)
    sizes = (1, 8, 2, 2, 8) if args.quick else (4, 256, 4, 4, 64)
    results = run(sizes, repeat=3 if args.quick else 7)
    body = render(results, sizes)
    print(body)
    if not args.quick:
        dev = jax.devices()[0]
        _report.write_section(f"xsa_{dev.platform}", f"XSA projection: expand vs unsqueeze "
                              f"({dev.platform}: {dev.device_kind})", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
