"""Compile time against depth: named vs plain, rolled vs unrolled.

Two sections of BENCHMARKS.md, both `jax.value_and_grad` of a loss summed
over a stack of layers, weights being the differentiated argument:

* `compile_scaling_named`: the causal attention stack of
  `jaxbackend.programs.attention_stack` (B,T,E,H,HD = 4,32,64,4,16) written
  with `jaxbackend.named` and in plain jnp, 1..32 layers. Columns: trace+lower
  seconds and XLA compile seconds of each, and named/plain ratios.
* `compile_scaling_reroll`: the pre-LayerNorm transformer of
  `jaxbackend.programs.transformer` (and the
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

from jaxbackend.programs import attention_stack as attn  # noqa: E402


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
# section compile_scaling_named

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
        "`jaxbackend/programs/attention_stack.py` (B,T,E,H,HD = 4,32,64,4,16; per layer four\n"
        "contractions, a softmax, a `where` causal mask), written with `jaxbackend.named` and in\n"
        "plain `jnp`. Seconds are medians of "
        f"{repeat} runs; each run traces a fresh closure (no jit cache hit, persistent\n"
        "compilation cache off) and named/plain are interleaved, so ratios come from the same\n"
        "conditions. Target: total ratio named/plain <= 1.10 at every depth: "
        f"**{'met' if met else 'missed'}** (max {max(ratios):.2f}).\n\n"
        + table(headers, rows))
    return body, ratios


# --------------------------------------------------------------------------
# section compile_scaling_reroll

REROLL_INTRO = """\
`jax.value_and_grad` w.r.t. the stack input and every layer weight (as when the
stack sits on a differentiated embedding) of the pre-LayerNorm transformer
(B=2, S=16, D=64, 4 heads, MLP 256 gelu; `jaxbackend/programs/transformer.py`) and of the
named causal attention stack (B,T,E,H,HD = 4,32,64,4,16). Three columns, one run, fresh
closures, interleaved: plain `jax.jit` of the Python for-loop (unrolled), `jb.jit(f)`
(default pipeline: `reroll` first, from `passes.REROLL_MIN_REPEATS` = 5 repeated layers) on the same for-loop function, and a hand-written
`jax.lax.scan` over stacked weights. Seconds: medians of the runs (the unrolled
transformer: one run at 16 and 32 layers, none at 64, see below). The machine is shared
with other jobs: absolute seconds are noisy, ratios come from interleaved runs."""

def _transformer_fns(n):
    """(args_loop, args_scan, loss_loop, loss_scan) for the pre-LN transformer."""
    from jaxbackend.programs import transformer as T

    x, layers = T.init_transformer(jax.random.key(n), n)
    return (x, layers), (x, T.stack_layers(layers)), T.loop_transformer, T.scan_transformer


def _attention_fns(n):
    """The same for the named attention stack; the scan version runs one named
    layer per step on the stacked plain weights."""
    from jaxbackend import named as nx

    x, layers = attn.init_attention_stack(jax.random.key(n), n)
    nx_x, nx_layers = attn.name_params(x, layers)
    stacked = jax.tree.map(lambda *w: jax.numpy.stack(w), *layers)

    def scan_stack(x, stacked):
        def body(h, p):
            p = {k: nx.as_named(v, attn.DIMS[k]) for k, v in p.items()}
            return attn.named_attention_stack(h, [p])[1], None

        h, _ = jax.lax.scan(body, x, stacked)
        return h.sum().values, h

    return (nx_x, nx_layers), (nx_x, stacked), attn.named_attention_stack, scan_stack


def _vg(model):
    """A fresh value_and_grad closure w.r.t. input and weights (see section text)."""
    def loss(x, layers):
        return model(x, layers)

    return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)


def _step_time(compiled, args, number=20, repeat=5):
    import numpy as np

    jax.block_until_ready(compiled(*args))
    runs = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            out = compiled(*args)
        jax.block_until_ready(out)
        runs.append((time.perf_counter() - t0) / number)
    return float(np.median(runs))


def _measure_reroll_model(label, make, depths, repeat, unrolled_max, unrolled_repeat_max, runtime_at):
    import jaxbackend as jb

    rows, data = [], {}
    for n in depths:
        s = {k: [] for k in ("unrolled", "jb", "scan")}
        passes_s, rt = [], {}
        for r in range(repeat):
            args_loop, args_scan, loop_fn, scan_fn = make(n)
            cols = ["jb", "scan"]
            if n <= unrolled_max and (r == 0 or n <= unrolled_repeat_max):
                cols.append("unrolled")
            for col in (cols if r % 2 == 0 else cols[::-1]):
                if col == "jb":
                    f = jb.jit(_vg(loop_fn))  # default pipeline: reroll first
                    t0 = time.perf_counter()
                    lowered = f.lower(*args_loop)
                    t1 = time.perf_counter()
                    c = lowered.compile()
                    tl, tc = t1 - t0, time.perf_counter() - t1
                    passes_s.append(f.last_report.seconds if f.last_report else float("nan"))
                    a = args_loop
                elif col == "scan":
                    tl, tc, c = time_compile(_vg(scan_fn), args_scan)
                    a = args_scan
                else:
                    tl, tc, c = time_compile(_vg(loop_fn), args_loop)
                    a = args_loop
                s[col].append((tl, tc))
                if r == 0 and n in runtime_at:
                    rt[col] = (c, a)
            if r == 0 and rt:  # interleaved step timing of the executables
                # the rolled program itself, whatever the default threshold
                # decides at this depth: reroll forced from 2 repeats
                rt["rolled"] = (jb.jit(_vg(loop_fn), reroll=2).lower(*args_loop).compile(),
                                args_loop)
                times = {k: [] for k in rt}
                for _ in range(3):
                    for k, (c, a) in rt.items():
                        times[k].append(_step_time(c, a))
                rt = {k: _med(v) for k, v in times.items()}
                data.setdefault("runtime", {})[n] = rt
        med = {k: ((_med([t[0] for t in v]), _med([t[1] for t in v])) if v else None)
               for k, v in s.items()}
        data[n] = {k: (None if v is None else v[0] + v[1]) for k, v in med.items()}
        tot = data[n]

        def fmt(k):
            v = med[k]
            return "—" if v is None else f"{v[0]:.2f} + {v[1]:.2f} = **{v[0] + v[1]:.2f}**"

        ratio_scan = tot["jb"] / tot["scan"]
        ratio_unr = "—" if tot["unrolled"] is None else f"{tot['unrolled'] / tot['jb']:.1f}x"
        rows.append([label, n, fmt("unrolled"), fmt("jb"), f"{_med(passes_s):.2f}", fmt("scan"),
                     f"{ratio_scan:.2f}", ratio_unr])
        print(f"reroll {label} L={n}: " + "  ".join(f"{k} {fmt(k)}" for k in s)
              + f"  jb/scan {ratio_scan:.2f}", flush=True)
    return rows, data


def _jb_total(make, n):
    """Seconds of jb.jit trace + passes + lower + compile, one fresh closure."""
    import jaxbackend as jb

    args_loop, _, loop_fn, _ = make(n)
    t0 = time.perf_counter()
    jb.jit(_vg(loop_fn)).lower(*args_loop).compile()
    return time.perf_counter() - t0


def _paired_depth_ratio(make, lo, hi, repeat):
    """Median over pairs of jb.jit total at `hi` layers / at `lo`, the two
    measured back to back (order alternating), so a drift in machine speed
    over the long table run does not enter the ratio."""
    ratios = []
    for r in range(repeat):
        a, b = (lo, hi) if r % 2 == 0 else (hi, lo)
        t = {a: _jb_total(make, a), b: _jb_total(make, b)}
        ratios.append(t[hi] / t[lo])
    return _med(ratios), ratios


def _stack_copy_cost(n):
    """Per-call seconds of stacking n layers' 12 weights (what reroll's forward
    scan copies), vs. one rolled training step: measured on its own."""
    from jaxbackend.passes._stacks import stack  # the pass's own stacking
    from jaxbackend.programs import transformer as T

    _, layers = T.init_transformer(jax.random.key(0), n)
    f = jax.jit(lambda ls: {k: stack([p[k] for p in ls]) for k in ls[0]})
    nbytes = sum(w.size * w.dtype.itemsize for p in layers for w in p.values())
    return _step_time(f, (layers,)), nbytes


def _plot(data_by_model, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(data_by_model), figsize=(5.5 * len(data_by_model), 4))
    for ax, (label, data) in zip(list(axes) if len(data_by_model) > 1 else [axes], data_by_model.items()):
        depths = sorted(k for k in data if isinstance(k, int))
        for col, name, style in (("unrolled", "jax.jit unrolled", "o-"),
                                 ("jb", "jb.jit + reroll", "s-"), ("scan", "hand-written scan", "^--")):
            pts = [(d, data[d][col]) for d in depths if data[d][col] is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("layers")
        ax.set_ylabel("trace + passes + compile, s")
        ax.set_title(f"{label}: value_and_grad")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def run_reroll(*, quick: bool, repeat: int) -> str:
    depths = [2] if quick else [1, 2, 4, 8, 16, 32, 64]
    runtime_at = set() if quick else {4, 16}
    # the 64/4 ratio first, in a fresh process state: after the table's
    # unrolled compiles, the live caches slow Python tracing (GC) of deep
    # programs more than of shallow ones, which is not what a user sees
    pairs = {} if quick else {label: _paired_depth_ratio(make, 4, 64, max(5, repeat))
                              for label, make in (("transformer", _transformer_fns),
                                                  ("named attention", _attention_fns))}
    # transformer unrolled: 16 layers already compile for ~45 s here, 64 took
    # >20 GiB of RAM before we stopped it, so: 3 runs up to 8, one run at 16
    # and 32, none at 64.
    t_rows, t_data = _measure_reroll_model("transformer", _transformer_fns, depths, repeat,
                                           unrolled_max=2 if quick else 32,
                                           unrolled_repeat_max=8, runtime_at=runtime_at)
    a_rows, a_data = _measure_reroll_model("named attention", _attention_fns,
                                           [2] if quick else depths, repeat,
                                           unrolled_max=64, unrolled_repeat_max=16,
                                           runtime_at=set())
    headers = ["model", "layers", "jax.jit unrolled: trace+lower + compile s",
               "jb.jit + reroll: trace+passes+lower + compile s", "of which passes s",
               "hand scan: trace+lower + compile s", "jb / scan", "unrolled / jb"]
    body = [table(headers, t_rows + a_rows)]
    if quick:
        return "\n\n".join(body)
    png = ROOT / "benchmarks" / "compile_scaling_reroll.png"
    _plot({"transformer": t_data, "named attention": a_data}, png)
    # targets
    lines = []
    for label, data in (("transformer", t_data), ("named attention", a_data)):
        r64, each = pairs[label]
        worst = max(data[d]["jb"] / data[d]["scan"] for d in depths)
        lines.append(f"- {label}: jb.jit total at 64 layers / at 4 layers = **{r64:.2f}** "
                     f"(median of {len(each)} back-to-back pairs measured before the table: "
                     f"{', '.join(f'{x:.2f}' for x in each)}; from the table's medians, taken "
                     f"minutes apart: {data[64]['jb'] / data[4]['jb']:.2f}) "
                     f"(target <= 2: {'met' if r64 <= 2 else 'missed'}); worst jb.jit / hand scan "
                     f"over depths = **{worst:.2f}** (target <= 1.25: "
                     f"{'met' if worst <= 1.25 else 'missed'}).")
    rt = t_data.get("runtime", {})
    rt_rows = []
    for n in sorted(rt):
        v = rt[n]
        ratio = v["rolled"] / v["unrolled"]
        rt_rows.append([n, f"{v['unrolled'] * 1e3:.3f}", f"{v['jb'] * 1e3:.3f}",
                        f"{v['rolled'] * 1e3:.3f}", f"{v['scan'] * 1e3:.3f}", f"**{ratio:.2f}**"])
        lines.append(f"- transformer runtime per step at {n} layers: rolled / unrolled = "
                     f"**{ratio:.2f}** (target <= 1.10: {'met' if ratio <= 1.10 else 'missed'}).")
    copy_rows = []
    for n in (16, 64):
        t, nbytes = _stack_copy_cost(n)
        copy_rows.append([n, f"{nbytes / 2**20:.2f}", f"{t * 1e6:.0f}"])
    body += ["Targets:\n" + "\n".join(lines),
             "Runtime per training step on CPU (compiled value_and_grad, median of 5x20 calls, "
             "the executables interleaved; `jb.jit` default rolls from "
             "`REROLL_MIN_REPEATS` layers, the rolled column forces it with `reroll=2`):\n\n"
             + table(["layers", "unrolled ms", "jb.jit default ms", "jb.jit rolled ms",
                      "hand scan ms", "rolled / unrolled"], rt_rows),
             "Weight-stacking copy that remains per call (reroll stacks each weight list once "
             "for the forward scan; the backward scan reuses that stack and the forward "
             "residual stacks, so nothing else is copied): the same stacking jitted alone:\n\n"
             + table(["layers", "weights MiB", "stack copy µs per call"], copy_rows),
             f"![compile seconds vs depth](benchmarks/{png.name})"]
    return "\n\n".join(body)


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
                          "Compile scaling: named vs plain jnp attention", body)
    if args.section in ("reroll", "all"):
        body = REROLL_INTRO + "\n\n" + run_reroll(quick=args.quick, repeat=repeat)
        if args.quick:
            print(body)
        else:
            write_section("compile_scaling_reroll",
                          "Compile scaling: reroll into scan vs unrolled vs hand scan",
                          body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
