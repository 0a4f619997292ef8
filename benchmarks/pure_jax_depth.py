"""Compile time vs depth under a mesh for a model written in plain JAX.

No Flax, no dim names, no jaxbackend layers: an encoder-decoder transformer
(self-attention encoder, causal decoder with cross-attention, tied
embeddings) whose per-layer weights are Python lists of dicts, trained by
an optax AdamW step. The same step goes through

* `jb.jit(step, mesh=)`: searched plan, the lists as they are (reroll rolls
  both loops, the plan is made on the rolled program);
* the same over `jb.stack_layers(params)`;
* `jb.jit(step, mesh=)` on weights the user keeps stacked: each list one
  dict of (layers, ...) arrays, the loss taking `jax.tree.map(lambda a:
  a[i], stacked)` per layer before its loops (no jaxbackend helper);
* `jax.jit(step)` on inputs placed for data parallelism (the batch on both
  mesh axes, weights replicated): the plain-JAX user's hand rules.

Each point: trace + passes + search + lower + compile seconds in a fresh
process on a (2, 4) mesh of 8 simulated CPU devices (median of `--repeat`),
and the compiled step's per-device collective bytes. `jax.jit` is run up to
`--hand-max` layers: unrolled, it took 226 s to compile at 32 layers
(measured once). At 8 layers both plans also run `STEPS` steps (one process
each): the search minimises step time, not bytes; and the plan searched with
the H100 profile (what a mesh of H100s gets by default) is compiled for its
collective bytes.

Run: `python benchmarks/pure_jax_depth.py` (`--repeat N`, `--quick`: 2 and
5 layers, nothing written).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

D, H, F, T, B, V = 128, 4, 512, 64, 16, 256
STEPS = 5
WARNING = "Involuntary full rematerialization"


def _model(layers: int, user_stacked: bool = False):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    keys = iter(jax.random.split(jax.random.key(0), 64 * layers + 8))

    def dense(i, o):
        return jax.random.normal(next(keys), (i, o)) / np.sqrt(i)

    def attn():
        return {n: dense(D, D) for n in ("q", "k", "v", "o")}

    def mlp():
        return {"w1": dense(D, F), "b1": jnp.zeros(F), "w2": dense(F, D), "b2": jnp.zeros(D)}

    def norm():
        return {"g": jnp.ones(D), "b": jnp.zeros(D)}

    params = {"emb": jax.random.normal(next(keys), (V, D)) * 0.02,
              "pos": jax.random.normal(next(keys), (T, D)) * 0.02,
              "enc": [{"ln1": norm(), "att": attn(), "ln2": norm(), "mlp": mlp()}
                      for _ in range(layers)],
              "dec": [{"ln1": norm(), "self": attn(), "ln2": norm(), "cross": attn(),
                       "ln3": norm(), "mlp": mlp()} for _ in range(layers)],
              "lnf": norm()}

    def layernorm(p, x):
        m = x.mean(-1, keepdims=True)
        v = ((x - m) ** 2).mean(-1, keepdims=True)
        return (x - m) * jax.lax.rsqrt(v + 1e-5) * p["g"] + p["b"]

    def attention(p, x, ctx, causal):
        def heads(a):
            return a.reshape(a.shape[0], a.shape[1], H, D // H)
        q, k, v = heads(x @ p["q"]), heads(ctx @ p["k"]), heads(ctx @ p["v"])
        s = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(D // H)
        if causal:
            s = jnp.where(jnp.tril(jnp.ones((x.shape[1], ctx.shape[1]), bool)), s, -1e9)
        return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, -1), v).reshape(x.shape) @ p["o"]

    def ffn(p, x):
        return jax.nn.gelu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]

    def loss_fn(params, src, tgt_in, tgt_out):
        if user_stacked:     # rows of the user's stacks, one per layer
            params = dict(params, **{k: [jax.tree.map(lambda a, i=i: a[i], params[k])
                                         for i in range(layers)] for k in ("enc", "dec")})
        e = params["emb"][src] + params["pos"]
        for p in params["enc"]:
            h = layernorm(p["ln1"], e)
            e = e + attention(p["att"], h, h, False)
            e = e + ffn(p["mlp"], layernorm(p["ln2"], e))
        d = params["emb"][tgt_in] + params["pos"]
        for p in params["dec"]:
            h = layernorm(p["ln1"], d)
            d = d + attention(p["self"], h, h, True)
            d = d + attention(p["cross"], layernorm(p["ln2"], d), e, False)
            d = d + ffn(p["mlp"], layernorm(p["ln3"], d))
        logits = layernorm(params["lnf"], d) @ params["emb"].T
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tgt_out[..., None], -1))

    tx = optax.adamw(1e-3)

    def step(params, opt_state, src, tgt_in, tgt_out):
        loss, grads = jax.value_and_grad(loss_fn)(params, src, tgt_in, tgt_out)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    if user_stacked:
        params = dict(params, **{k: jax.tree.map(lambda *a: jnp.stack(a), *params[k])
                                 for k in ("enc", "dec")})
    k1, k2 = jax.random.split(jax.random.key(1))
    src = jax.random.randint(k1, (B, T), 0, V)
    tgt = jax.random.randint(k2, (B, T + 1), 0, V)
    return params, tx, step, (src, tgt[:, :-1], tgt[:, 1:])


def run_point(kind: str, layers: int, steps: int) -> dict:
    from benchmarks import _report

    params, tx, step, batch = _model(layers, user_stacked=kind == "user")
    if kind == "stacked":
        import jaxbackend as jb

        params = jb.stack_layers(params)
    # "h100": the plan a mesh of H100s gets (its bytes, compiled here)
    compiled, f, state, batch, out = _report.compile_dp_or_planned(
        step, params, tx, batch, kind == "hand", **({"profile": "h100"} if kind == "h100" else {}))
    if kind != "hand":
        out["rules"] = {k: v for k, v in f.plan.rules.items() if v}
    if steps:
        out["step_seconds"] = _report.step_seconds(compiled, state, batch, steps)
    return out


def spawn(kind: str, layers: int, steps: int = 0) -> dict:
    from benchmarks import _report

    return _report.spawn_on_8_devices(
        __file__, ["--child", kind, str(layers), str(steps)], f"{kind} {layers} layers", WARNING)


def measure(depths, hand_max: int, repeat: int, timed_at: int) -> tuple[dict, dict]:
    kinds = ("searched", "stacked", "user", "hand")
    runs: dict = {}
    for _ in range(repeat):             # interleaved: load hits every column alike
        for d in depths:
            for k in kinds:
                if k != "hand" or d <= hand_max:
                    runs.setdefault((k, d), []).append(spawn(k, d))
    steps = {k: spawn(k, timed_at, STEPS) for k in ("searched", "hand")} if timed_at else {}
    if timed_at:
        steps["h100"] = spawn("h100", timed_at)
    return runs, steps


def render(runs, steps, depths, timed_at: int) -> str:
    med = {p: statistics.median(r["seconds"] for r in rs) for p, rs in runs.items()}

    def cell(k, d):
        return f"{med[(k, d)]:.2f}" if (k, d) in med else "not run"

    rows = []
    for d in depths:
        hand = med.get(("hand", d))
        rows.append([d, cell("searched", d), cell("stacked", d), cell("user", d), cell("hand", d),
                     f"{med[('searched', d)] / hand:.2f}" if hand else "",
                     f"{med[('stacked', d)] / hand:.2f}" if hand else "",
                     f"{med[('user', d)] / hand:.2f}" if hand else "",
                     f"{runs[('searched', d)][0]['mib']:.1f}",
                     f"{runs[('hand', d)][0]['mib']:.1f}" if hand else "",
                     sum(r["warnings"] for k in ("searched", "stacked", "user")
                         for r in runs[(k, d)])])
    from benchmarks import _report

    table = _report.table(
        ["layers", "`jb.jit(mesh=)` searched (s)", "searched, stacked params (s)",
         "searched, user-stacked weights (s)", "`jax.jit` data parallel (s)",
         "searched / jax.jit", "stacked / jax.jit", "user-stacked / jax.jit",
         "searched collective MiB", "data parallel collective MiB", "remat warnings"], rows)
    lo, hi = depths[0], depths[-1]
    lines = []
    for k in ("searched", "stacked", "user"):
        ratio = med[(k, hi)] / med[(k, lo)]
        vs = [med[(k, d)] / med[("hand", d)] for d in depths if d >= 8 and ("hand", d) in med]
        lines.append(f"- {k}: {hi} / {lo} layers = {ratio:.2f} (target <= 1.5): "
                     f"{'MET' if ratio <= 1.5 else 'MISSED'}; / jax.jit, worst depth >= 8 = "
                     + (f"{max(vs):.2f} (target <= 1): {'MET' if max(vs) <= 1 else 'MISSED'}"
                        if vs else "no such depth run"))
    if steps:
        s, h = steps["searched"], steps["hand"]
        lines.append(f"- at {timed_at} layers, seconds per step (median of {STEPS}): searched "
                     f"{s['step_seconds']:.3f} ({s['mib']:.1f} MiB), data parallel "
                     f"{h['step_seconds']:.3f} ({h['mib']:.1f} MiB): ratio "
                     f"{s['step_seconds'] / h['step_seconds']:.2f}")
        g = steps["h100"]
        lines.append(f"- at {timed_at} layers, the plan a mesh of H100s gets (`profile=\"h100\"`, "
                     f"the default there): {g['mib']:.1f} MiB against data parallel's "
                     f"{h['mib']:.1f} ({'MET' if g['mib'] <= h['mib'] * 1.001 else 'MISSED'}), "
                     f"rules {json.dumps(g['rules'], sort_keys=True)}")
    plans = sorted({f"{k}: " + json.dumps(r["rules"], sort_keys=True)
                    for (k, _), rs in runs.items() if k != "hand" for r in rs})
    head = (f"Encoder-decoder transformer in plain JAX (lists of per-layer dicts, AdamW), "
            f"embd {D}, {H} heads, mlp {F}, seq {T}, batch {B}, vocab {V}; `layers` encoder and "
            f"`layers` decoder layers; seconds from trace to compiled executable, median of "
            f"the processes. `user` (user-stacked weights): the same lists kept as dicts of "
            f"(layers, ...) arrays by the user, the loss taking row i of each per layer:\n\n")
    return head + table + "\n\n" + "\n".join(lines) + "\n\nSearched rules: " + "; ".join(plans)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--hand-max", type=int, default=16, help="deepest jax.jit point")
    ap.add_argument("--quick", action="store_true", help="2 and 5 layers, writes nothing")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print("RESULT " + json.dumps(run_point(a.child[0], int(a.child[1]), int(a.child[2]))))
        return 0
    depths = (2, 5) if a.quick else (4, 8, 16, 32)
    timed_at = 0 if a.quick else 8
    runs, steps = measure(depths, a.hand_max, 1 if a.quick else a.repeat, timed_at)
    body = render(runs, steps, depths, timed_at)
    print(body)
    if not a.quick:
        from benchmarks import _report

        _report.write_section("pure-jax-depth", "Compile time vs depth under a mesh: a plain "
                              "JAX encoder-decoder", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
