"""Compile time vs depth under a mesh for Flax's own scan-over-layers model.

A plain Flax NNX transformer LM (no dim names, no jaxbackend layers) written
the way Flax recommends for depth: the blocks are made by `nnx.vmap` (their
weights stacked on a leading layer axis by the author) and run by
`nnx.scan`; the AdamW step goes through `nnx.split` / `nnx.merge`. So the
program reaches jaxbackend already rolled: this measures what `jb.jit(mesh=)`
adds to a model that needs no rerolling, against the plain-JAX user's hand
rules. The same step goes through

* `jb.jit(step, mesh=)`: the searched plan;
* `jax.jit(step)` on inputs placed for data parallelism (the batch on both
  mesh axes, weights replicated).

Each point: trace + passes + search + lower + compile seconds in a fresh
process on a (2, 4) mesh of 8 simulated CPU devices (median of `--repeat`),
the compiled step's per-device collective bytes, and, for the plan, its
predicted memory against XLA's.

Run: `python benchmarks/nnx_scan_depth.py` (`--repeat N`, `--quick`: 2 and
4 layers, nothing written).
"""

from __future__ import annotations

import json
import pathlib
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

D, H, F, T, B, V = 128, 4, 512, 64, 16, 256
WARNING = "Involuntary full rematerialization"


def model(layers: int, embd: int = D, heads: int = H, mlp: int = F, vocab: int = V, seed: int = 0):
    """(graphdef, params, loss) of the LM: `loss(params, x, y)` is the mean
    next-token cross-entropy of tokens x (batch, seq) against y."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.n1 = nnx.LayerNorm(embd, rngs=rngs)
            self.att = nnx.MultiHeadAttention(heads, embd, decode=False, rngs=rngs)
            self.n2 = nnx.LayerNorm(embd, rngs=rngs)
            self.w1 = nnx.Linear(embd, mlp, rngs=rngs)
            self.w2 = nnx.Linear(mlp, embd, rngs=rngs)

        def __call__(self, x):
            x = x + self.att(self.n1(x), mask=nnx.make_causal_mask(jnp.ones(x.shape[:2])))
            return x + self.w2(jax.nn.gelu(self.w1(self.n2(x))))

    class LM(nnx.Module):
        def __init__(self, rngs):
            self.emb = nnx.Embed(vocab, embd, rngs=rngs)

            @nnx.split_rngs(splits=layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def blocks(rngs):
                return Block(rngs)

            self.blocks, self.norm = blocks(rngs), nnx.LayerNorm(embd, rngs=rngs)

        def loss(self, x, y):
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def run(h, block):
                return block(h)

            logits = self.emb.attend(self.norm(run(self.emb(x), self.blocks)))
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    graphdef, params = nnx.split(LM(nnx.Rngs(seed)), nnx.Param)

    def loss(params, x, y):
        return nnx.merge(graphdef, params).loss(x, y)

    return graphdef, params, loss


def run_point(kind: str, layers: int) -> dict:
    import jax
    import optax

    from benchmarks import _report
    from jaxbackend import sharding

    _, params, loss = model(layers)
    tx = optax.adamw(1e-3)

    def step(params, opt_state, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    x = jax.random.randint(jax.random.key(1), (B, T), 0, V)
    compiled, f, _, _, out = _report.compile_dp_or_planned(
        step, params, tx, (x, jax.numpy.roll(x, -1, axis=1)), kind == "hand")
    out["memory"] = sharding.hlo_memory(compiled)["total"]
    if kind != "hand":
        out["rules"] = {k: v for k, v in f.plan.rules.items() if v}
        out["predicted"] = float(f.plan.cost.memory)
    return out


def spawn(kind: str, layers: int) -> dict:
    from benchmarks import _report

    return _report.spawn_on_8_devices(__file__, ["--child", kind, str(layers)],
                                      f"{kind} {layers} layers", WARNING)


def render(runs: dict, depths) -> str:
    from benchmarks import _report

    med = {p: statistics.median(r["seconds"] for r in rs) for p, rs in runs.items()}
    rows = []
    for d in depths:
        s, h = runs[("searched", d)][0], runs[("hand", d)][0]
        rows.append([d, f"{med[('searched', d)]:.2f}", f"{med[('hand', d)]:.2f}",
                     f"{med[('searched', d)] / med[('hand', d)]:.2f}", f"{s['mib']:.2f}",
                     f"{h['mib']:.2f}", f"{s['predicted'] / 2**20:.1f} / {s['memory'] / 2**20:.1f}",
                     sum(r["warnings"] for k in ("searched", "hand") for r in runs[(k, d)])])
    table = _report.table(
        ["layers", "`jb.jit(mesh=)` searched (s)", "`jax.jit` data parallel (s)",
         "searched / jax.jit", "searched collective MiB", "data parallel collective MiB",
         "memory MiB: predicted / measured", "remat warnings"], rows)
    lo, hi = depths[0], depths[-1]
    ratio = med[("searched", hi)] / med[("searched", lo)]
    vs = [med[("searched", d)] / med[("hand", d)] for d in depths if d >= 8]
    mem = max(abs(r["predicted"] / r["memory"] - 1) for (k, _), rs in runs.items()
              if k == "searched" for r in rs)
    more = [d for d in depths
            if runs[("searched", d)][0]["mib"] > runs[("hand", d)][0]["mib"] * 1.001]
    lines = [f"- searched: {hi} / {lo} layers = {ratio:.2f} (target <= 1.5): "
             f"{'MET' if ratio <= 1.5 else 'MISSED'}; / jax.jit, worst depth >= 8 = "
             + (f"{max(vs):.2f} (target <= 1): {'MET' if max(vs) <= 1 else 'MISSED'}"
                if vs else "no such depth run"),
             f"- searched bytes <= data parallel's: {len(depths) - len(more)} of {len(depths)} "
             f"depths" + (f" (more at {more})" if more else ""),
             f"- predicted vs measured memory, worst {mem:.0%} (target <= 20%): "
             f"{'MET' if mem <= 0.2 else 'MISSED'}"]
    plans = sorted({json.dumps(r["rules"], sort_keys=True)
                    for (k, _), rs in runs.items() if k == "searched" for r in rs})
    head = (f"Plain Flax NNX transformer LM, blocks made by `nnx.vmap` and run by `nnx.scan` "
            f"(Flax's scan-over-layers), AdamW; embd {D}, {H} heads, mlp {F}, seq {T}, batch {B}, "
            f"vocab {V}; seconds from trace to compiled executable, median of the processes:\n\n")
    return head + table + "\n\n" + "\n".join(lines) + "\n\nSearched rules: " + "; ".join(plans)


def main() -> int:
    from benchmarks import _report

    a = _report.depth_cli(__doc__, run_point, "2 and 4 layers, 1 run, writes nothing")
    depths = (2, 4) if a.quick else (4, 8, 16, 32)
    runs: dict = {}
    for _ in range(1 if a.quick else a.repeat):   # interleaved: load hits both columns alike
        for d in depths:
            for k in ("searched", "hand"):
                runs.setdefault((k, d), []).append(spawn(k, d))
    body = render(runs, depths)
    print(body)
    if not a.quick:
        _report.write_section("nnx-scan-depth", "Compile time vs depth under a mesh: Flax's "
                              "scan-over-layers model", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
