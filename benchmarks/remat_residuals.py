"""Residuals a rolled backward pass recomputes (`remat_residuals`): memory and runtime.

A rolled training step's forward scan stacks, per layer, every value its
backward scan reads. `remat_residuals` makes the backward scan recompute the
ones that are cheap elementwise functions of what it reads anyway (as XLA
does in an unrolled program), so the forward scan stops storing them.

Per point (model, layers), one process compiles the AdamW training step
with `jb.jit` (one device, no mesh) twice, with the default pipeline and
with the same pipeline less `remat_residuals`, and reports XLA's memory
(`memory_analysis()`: arguments + outputs + temporaries), the bytes of the
forward scans' stacked outputs in the final jaxpr, and the runtime per step
(their calls alternating: `--rounds` rounds of 5 steps, median), in one
process per point by default (`--repeat`: the median over more; memory
is the same in every process). Models (embd 128, seq 128, batch 8):

* `GPT stacked`: the library GPT, params from `nn.functional(...,
  stacked=True)` (what `python -m jaxbackend train` uses);
* `GPT per-layer`: the same with one array per layer and weight;
* `plain NNX stacked`: `programs.nnx_plain.PlainLM`, a transformer written
  with Flax's own layers (`nnx.MultiHeadAttention`, `nnx.Linear`, ...).

Run: `python benchmarks/remat_residuals.py` (`--quick`: tiny sizes, writes
nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODELS = ("GPT stacked", "GPT per-layer", "plain NNX stacked")


def _step(model_name: str, layers: int, embd: int, seq: int, batch: int):
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from jaxbackend import nn

    if model_name.startswith("GPT"):
        from jaxbackend.models import GPT, GPTConfig
        model = GPT(GPTConfig(seq_len=seq, n_layers=layers, embd=embd, heads=4, vocab_size=128),
                    rngs=nnx.Rngs(0))
        params, loss_fn = nn.functional(model, "loss", stacked="stacked" in model_name)
    else:
        from jaxbackend.programs import nnx_plain
        model = nnx_plain.PlainLM(layers, embd, rngs=nnx.Rngs(0))
        params, loss_fn = nn.functional(model, nnx_plain.lm_loss, stacked=True)
    tx = optax.adamw(1e-3)

    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    x = jax.random.randint(jax.random.key(1), (batch, seq), 0, 128, jnp.int32)
    return step, (params, tx.init(params), x, jnp.roll(x, -1, axis=1))


def _stacked_residual_bytes(report) -> int:
    jaxpr = report.jaxprs[-1][1].jaxpr
    return sum(v.aval.size * v.aval.dtype.itemsize for e in jaxpr.eqns
               if e.primitive.name == "scan" and not e.params["reverse"]
               for v in e.outvars[e.params["num_carry"]:])


def run_point(model_name: str, layers: int, dims: dict, rounds: int) -> dict:
    import jax

    import jaxbackend as jb
    from jaxbackend import sharding
    from jaxbackend.passes import DEFAULT_PIPELINE

    step, args = _step(model_name, layers, **dims)
    without = tuple(p for p in DEFAULT_PIPELINE if p != "remat_residuals")
    out, fns = {}, {}
    for label, passes in (("on", None), ("off", without)):
        f = jb.jit(step, passes=passes)
        compiled = f.lower(*args).compile()
        out[label] = {"memory": sharding.hlo_memory(compiled)["total"],
                      "residuals": _stacked_residual_bytes(f.trace_passes(*args))}
        fns[label] = compiled
        jax.block_until_ready(compiled(*args))           # warm-up
    times = {"on": [], "off": []}
    for _ in range(rounds):
        for label in ("on", "off"):
            t0 = time.perf_counter()
            for _ in range(5):
                jax.block_until_ready(fns[label](*args))
            times[label].append((time.perf_counter() - t0) / 5)
    for label in times:
        out[label]["step"] = statistics.median(times[label])
    return out


def _child(a) -> None:
    print("RESULT " + json.dumps(run_point(a.model, a.layers, json.loads(a.dims), a.rounds)))


def spawn(model_name: str, layers: int, dims: dict, rounds: int) -> dict:
    cmd = [sys.executable, __file__, "--child", "--model", model_name, "--layers", str(layers),
           "--dims", json.dumps(dims), "--rounds", str(rounds)]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode or not line:
        raise RuntimeError(f"{model_name} {layers} layers failed:\n{p.stderr[-3000:]}")
    return json.loads(line[-1][len("RESULT "):])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, no BENCHMARKS.md")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--dims", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        _child(a)
        return 0
    dims, depths = dict(embd=128, seq=128, batch=8), [8, 32]
    if a.quick:
        dims, depths, a.repeat, a.rounds = dict(embd=32, seq=16, batch=2), [5], 1, 1
    # the quick smoke run stays in this process (a fresh one per point is
    # for timing, which it does not judge)
    measure = ((lambda m, d: run_point(m, d, dims, a.rounds)) if a.quick
               else (lambda m, d: spawn(m, d, dims, a.rounds)))
    runs: dict = {}
    for _ in range(a.repeat):
        for d in depths:
            for m in MODELS:
                runs.setdefault((m, d), []).append(measure(m, d))

    def med(m, d, label, key):
        return statistics.median(r[label][key] for r in runs[(m, d)])

    mib = 2 ** 20
    rows = ["| model | layers | stacked residuals off / on (MiB) | memory off / on (MiB) | "
            "memory on / off | step off / on (ms) | step on / off |",
            "|---|---|---|---|---|---|---|"]
    worst_mem, worst_step = 0.0, 0.0
    for d in depths:
        for m in MODELS:
            mem = med(m, d, "on", "memory") / med(m, d, "off", "memory")
            stp = med(m, d, "on", "step") / med(m, d, "off", "step")
            worst_mem, worst_step = max(worst_mem, mem), max(worst_step, stp)
            rows.append(f"| {m} | {d} | {med(m, d, 'off', 'residuals') / mib:.1f} / "
                        f"{med(m, d, 'on', 'residuals') / mib:.1f} | "
                        f"{med(m, d, 'off', 'memory') / mib:.1f} / {med(m, d, 'on', 'memory') / mib:.1f}"
                        f" | {mem:.2f} | {1e3 * med(m, d, 'off', 'step'):.1f} / "
                        f"{1e3 * med(m, d, 'on', 'step'):.1f} | {stp:.2f} |")
    body = [f"AdamW training step under `jb.jit` (one CPU device), embd {dims['embd']}, seq "
            f"{dims['seq']}, batch {dims['batch']}; `off`: the default pipeline less "
            f"`remat_residuals`; {a.repeat} process(es) per point (runtime: the median of {a.rounds} "
            f"alternating rounds of 5 steps):", "", *rows, "",
            f"- memory with / without the pass, worst point: {worst_mem:.2f} (never more: "
            f"{'met' if worst_mem <= 1.0 else 'MISSED'})",
            f"- runtime per step with / without, worst point: {worst_step:.2f} (target <= 1.05: "
            f"{'met' if worst_step <= 1.05 else 'MISSED'})"]
    print("\n".join(body))
    if not a.quick:
        from benchmarks import _report
        _report.write_section("remat-residuals", "Residuals recomputed by the backward scan "
                              "(`remat_residuals`)", "\n".join(body))
    return 0


if __name__ == "__main__":
    sys.exit(main())
