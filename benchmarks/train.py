"""Training throughput: `jaxbackend.jit` vs plain Flax `nnx.jit` on the same model.

The same named GPT (`jaxbackend.models.GPT`), the same AdamW and the same
batches, compiled three ways in one run:

* `jaxbackend.jit`: a functional step (params as a pure dict), the pass
  pipeline run on the traced jaxpr, then XLA;
* `nnx.jit`: the idiomatic Flax NNX step (`nnx.Optimizer`, `nnx.value_and_grad`
  on the module), no jaxbackend passes;
* `jax.jit`: the functional step without passes (isolates the passes from
  the NNX graph handling).

Timing: after one warm-up (compile) call, the median over `--repeat` runs of
`--steps` consecutive steps, each run ended by `block_until_ready`; runs of
the three variants are interleaved so machine load hits them alike. Reported:
tokens/s and the ratio to `nnx.jit`. `--dtype bfloat16` keeps parameters and
activations in bfloat16 (meant for GPUs; on CPU bfloat16 matmuls are
emulated and slow). `--quick` is a smoke run at tiny sizes and does not write
BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks import _report  # noqa: E402
from jaxbackend import nn  # noqa: E402
from jaxbackend.jit import jit as jb_jit  # noqa: E402
from jaxbackend.models import GPT, GPTConfig  # noqa: E402


def build(cfg, dtype, batch, seed=0):
    model = GPT(cfg, dtype=dtype, rngs=nnx.Rngs(seed))
    tokens = jax.random.randint(jax.random.key(1), (batch, cfg.seq_len + 1), 0, cfg.vocab_size)
    return model, tokens[:, :-1], tokens[:, 1:]


def functional_step(model, tx, jit):
    params, loss_fn = nn.functional(model, "loss")

    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    f = jit(step, donate_argnums=(0, 1))
    state = [params, tx.init(params)]

    def run(x, y):
        state[0], state[1], loss = f(state[0], state[1], x, y)
        return loss
    return run


def nnx_step(model, tx):
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, x, y):
        loss, grads = nnx.value_and_grad(lambda m: m.loss(x, y))(model)
        opt.update(model, grads)
        return loss

    return lambda x, y: step(model, opt, x, y)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny smoke run; does not write BENCHMARKS.md")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--steps", type=int, default=None, help="steps per timed run")
    ap.add_argument("--repeat", type=int, default=None, help="timed runs per variant")
    ap.add_argument("--section", default=None, help="BENCHMARKS.md section name")
    a = ap.parse_args(argv)
    dtype = jnp.dtype(a.dtype)
    if a.quick:
        cfg, batch, steps, repeat = GPTConfig(vocab_size=128, seq_len=32, n_layers=1, embd=32,
                                              heads=2), 4, a.steps or 3, a.repeat or 2
    else:
        cfg, batch, steps, repeat = GPTConfig(vocab_size=128, seq_len=64, n_layers=2, embd=128,
                                              heads=4), 32, a.steps or 10, a.repeat or 5
    tx = optax.adamw(1e-3)
    variants = {}
    for name, make in [("jaxbackend.jit", lambda m: functional_step(m, tx, jb_jit)),
                       ("nnx.jit (plain Flax)", lambda m: nnx_step(m, tx)),
                       ("jax.jit (functional, no passes)", lambda m: functional_step(m, tx, jax.jit))]:
        model, x, y = build(cfg, dtype, batch)
        fn = make(model)
        t0 = time.perf_counter()
        first = float(fn(x, y))
        variants[name] = dict(fn=fn, x=x, y=y, compile=time.perf_counter() - t0, first=first, runs=[])
    losses = {n: v["first"] for n, v in variants.items()}
    spread = max(losses.values()) - min(losses.values())
    assert spread < 1e-2 * max(1.0, abs(max(losses.values()))), f"first-step losses differ: {losses}"
    for _ in range(repeat):
        for v in variants.values():
            t0 = time.perf_counter()
            for _ in range(steps):
                loss = v["fn"](v["x"], v["y"])
            jax.block_until_ready(loss)
            v["runs"].append((time.perf_counter() - t0) / steps)
    tokens = batch * cfg.seq_len
    base = statistics.median(variants["nnx.jit (plain Flax)"]["runs"])
    rows = []
    for name, v in variants.items():
        med = statistics.median(v["runs"])
        rows.append((name, f"{med * 1e3:.2f}", f"{tokens / med:,.0f}", f"{base / med:.2f}x",
                     f"{v['compile']:.2f}"))
    params = sum(x.size for x in jax.tree.leaves(nnx.state(build(cfg, dtype, 1)[0], nnx.Param)))
    head = (f"GPT: {cfg.n_layers} layers, embd {cfg.embd}, {cfg.heads} heads, seq {cfg.seq_len}, "
            f"batch {batch}, {params:,} params, {a.dtype}; median of {repeat} runs x {steps} steps "
            f"(interleaved), AdamW. Device: {jax.devices()[0].device_kind}.")
    body = head + "\n\n" + _report.table(
        ["compiled with", "ms/step", "tokens/s", "speed vs nnx.jit", "first call (compile) s"], rows)
    print(body)
    if a.quick:
        print("(quick run: BENCHMARKS.md not written)")
        return 0
    plat = jax.devices()[0].platform
    section = a.section or f"train-{plat}-{a.dtype}"
    _report.write_section(section, f"Training throughput ({plat}, {a.dtype}): jaxbackend.jit vs nnx.jit",
                          body + "\n\nShared machine: absolute numbers are noisy; the ratios come "
                          "from interleaved runs in one process.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
