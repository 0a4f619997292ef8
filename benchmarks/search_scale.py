"""The sharding search at the scale of real models, on paper.

LLaMA-3-8B (32 layers, d_model 4096, 32 heads over 8 KV heads, head dim
128, MLP 14336, vocab 128256) and LLaMA-3-70B (80 layers, 8192, 64 over 8,
128, 28672, 128256) at sequence 8192: one training step (value_and_grad of
the next-token loss, then an AdamW update with float32 moments), bfloat16
parameters, every layer rematerialised (`jax.checkpoint`, as such models
are trained: only layer inputs are kept for the backward pass), written with
`jaxbackend.named` ops so every contraction carries its dim names. No RoPE
(it adds no contraction and no dim). Inputs are `jax.ShapeDtypeStruct`s:
nothing is materialised. Meshes are abstract (`abstract_mesh`), 64, 256 and
1024 devices with 2 or 3 axes, on the H100 profile (80 GB per device, 8 per
node on NVLink, minor axes inside a node); global batch = one 8192-token
sequence per device. One 4-axis mesh shows a grid far over the exhaustive
limit (`_search.GRID_LIMIT`, which used to be an error).

Timed per case (median of runs): tracing (`jax.make_jaxpr` of the step on
abstract inputs: reported apart, not counted in the target), building the
dim-class graph and the cost model, the search, and the `Plan` (rules and a
full cost breakdown). Target: graph + model + search + plan under 2 s on the
2- and 3-axis meshes. In the
same run, where the grid fits, the exhaustive search is timed on the same
cost model as the reference and must return the same plan. Layers are
stacked and run by `lax.scan`; the unrolled Python loop is traced too, to
show the graph's distinct ops (`cm.sigs`) do not grow with depth.

    python benchmarks/search_scale.py            # full table -> BENCHMARKS.md
    python benchmarks/search_scale.py --quick    # smoke run, writes nothing
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent))

from benchmarks import _report  # noqa: E402
from jaxbackend import named as nx  # noqa: E402
from jaxbackend import sharding  # noqa: E402
from jaxbackend.sharding import _cost, _plan, _search, _walk  # noqa: E402

SEQ = 8192
GB = 1e9


@dataclasses.dataclass(frozen=True)
class Llama:
    name: str
    layers: int
    embd: int
    heads: int
    kv: int
    hd: int
    mlp: int
    vocab: int = 128256

    def size(self, dim: str) -> int:
        return dict(embd=self.embd, kv=self.kv, grp=self.heads // self.kv, hd=self.hd, mlp=self.mlp,
                    vocab=self.vocab, layer=self.layers)[dim]


LLAMA3_8B = Llama("LLaMA-3-8B", 32, 4096, 32, 8, 128, 14336)
LLAMA3_70B = Llama("LLaMA-3-70B", 80, 8192, 64, 8, 128, 28672)
TINY = Llama("tiny", 2, 64, 8, 2, 8, 128, vocab=256)   # --quick

LAYER_DIMS = dict(
    norm1=("embd",), wq=("embd", "kv", "grp", "hd"), wk=("embd", "kv", "hd"), wv=("embd", "kv", "hd"),
    wo=("kv", "grp", "hd", "embd"), norm2=("embd",), wg=("embd", "mlp"), wu=("embd", "mlp"),
    wd=("mlp", "embd"))
TOP_DIMS = dict(embed=("vocab", "embd"), norm_f=("embd",), unembed=("embd", "vocab"))


# -- the model ---------------------------------------------------------------------

def abstract_params(cfg: Llama, *, stacked: bool, dtype=jnp.bfloat16) -> dict:
    """NamedArrays of ShapeDtypeStructs; `stacked`: layers on a leading "layer" dim."""
    def leaf(dims):
        return nx.NamedArray(jax.ShapeDtypeStruct(tuple(cfg.size(d) for d in dims), dtype), dims)

    params = {k: leaf(d) for k, d in TOP_DIMS.items()}
    if stacked:
        params["layers"] = {k: leaf(("layer",) + d) for k, d in LAYER_DIMS.items()}
    else:
        params["layers"] = [{k: leaf(d) for k, d in LAYER_DIMS.items()} for _ in range(cfg.layers)]
    return params


def _rms_norm(x, scale):
    return x * nx.rsqrt((x * x).mean(dim="embd") + 1e-5) * scale


def _layer(x, p, causal):
    h = _rms_norm(x, p["norm1"])
    q = nx.dot(h, p["wq"], dim="embd")                                  # batch time kv grp hd
    k = nx.dot(h, p["wk"], dim="embd").rename(time="time_k")
    v = nx.dot(h, p["wv"], dim="embd").rename(time="time_k")
    s = nx.dot(q, k, dim="hd") / math.sqrt(q.sizes["hd"])
    a = nx.softmax(nx.where(causal, s, -1e9), dim="time_k")
    x = x + nx.dot(nx.dot(a, v, dim="time_k"), p["wo"], dim=("kv", "grp", "hd"))
    h = _rms_norm(x, p["norm2"])
    m = nx.silu(nx.dot(h, p["wg"], dim="embd")) * nx.dot(h, p["wu"], dim="embd")
    return x + nx.dot(m, p["wd"], dim="mlp")


def loss_fn(params, tokens, targets):
    """Mean next-token cross entropy; each layer rematerialised."""
    x = params["embed"].isel(vocab=tokens)                              # batch time embd
    t = x.sizes["time"]
    causal = nx.arange(t, dim="time") >= nx.arange(t, dim="time_k")
    layer = jax.checkpoint(lambda x, p: _layer(x, p, causal))
    layers = params["layers"]
    if isinstance(layers, dict):
        dims = {k: v.dims[1:] for k, v in layers.items()}
        def body(x, w):
            return layer(x, {k: nx.NamedArray(v, dims[k]) for k, v in w.items()}), None
        x, _ = jax.lax.scan(body, x, {k: v.values for k, v in layers.items()})
    else:
        for p in layers:
            x = layer(x, p)
    logits = nx.dot(_rms_norm(x, params["norm_f"]), params["unembed"], dim="embd")
    return nx.cross_entropy(logits, targets, dim="vocab").mean().values


def train_step(params, opt, tokens, targets, lr=3e-4, b1=0.9, b2=0.95, eps=1e-8, wd=0.1):
    """value_and_grad of the loss, then AdamW; opt = (m, v, count)."""
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens, targets)
    m, v, count = opt
    count = count + 1
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g.astype(m.dtype), m, grads)
    v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * jnp.square(g.astype(v.dtype)), v, grads)
    c1, c2 = 1 - b1 ** count, 1 - b2 ** count

    def update(w, m, v):
        step = (m / c1) / (jnp.sqrt(v / c2) + eps) + wd * w.astype(m.dtype)
        return (w - lr * step).astype(w.dtype)
    return loss, jax.tree.map(update, params, m, v), (m, v, count)


def abstract_args(cfg: Llama, batch: int, seq: int, *, stacked: bool):
    params = abstract_params(cfg, stacked=stacked)
    f32 = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), params)
    tokens = nx.NamedArray(jax.ShapeDtypeStruct((batch, seq), jnp.int32), ("batch", "time"))
    return params, (f32, f32, jax.ShapeDtypeStruct((), jnp.int32)), tokens, tokens


# -- one case ----------------------------------------------------------------------

def case(cfg: Llama, shape, names, *, seq=SEQ, stacked=True, reference=True):
    """Timings, plan and checks of one search."""
    args = abstract_args(cfg, math.prod(shape), seq, stacked=stacked)
    t0 = time.perf_counter()
    # a fresh function each run: make_jaxpr caches traces by function
    closed, out_shape = jax.make_jaxpr(lambda *a: train_step(*a), return_shape=True)(*args)
    t1 = time.perf_counter()
    graph = _walk.build(closed, _plan.dims_of(args), _plan.dims_of(out_shape))
    spec = sharding.MeshSpec.from_mesh(sharding.abstract_mesh(shape, names), "h100")
    cm = _cost.CostModel(graph, spec)
    t2 = time.perf_counter()
    out = dict(trace_s=t1 - t0, graph_s=t2 - t1, ops=len(graph.ops), sigs=len(cm.sigs),
               max_mult=max(m for _, m in cm.sigs))
    try:
        masks, stats = _search.search(cm)
    except sharding.NoPlanFits as e:
        error = str(e).split("budget: ", 1)[-1].split(";")[0]
        return dict(out, search_s=time.perf_counter() - t2, error=error)
    plan = _plan.Plan(spec, cm, masks, closed, jax.tree.structure(args), jax.tree.structure(out_shape),
                      stats)
    t3 = time.perf_counter()
    out.update(search_s=t3 - t2, plan=plan, stats=stats)
    if reference:
        out.update(zip(("dead_s", "dead_same"), without_dead_code(graph, spec, masks, plan.cost.time)))
    keys, options = _search.search_space(cm)
    fits = math.prod(len(o) for o in options) <= _search.GRID_LIMIT
    if reference and fits and stats["method"] != "exhaustive":
        r0 = time.perf_counter()
        ex_masks, _ = _search.search(cm, method="exhaustive")
        out.update(exhaustive_s=time.perf_counter() - r0, same=ex_masks == masks)
    return out


def without_dead_code(graph, spec, masks, total: float):
    """(Modelled seconds the cost model charges for ops XLA does not run:
    results never read, broadcasts of constants, which XLA fuses into their
    readers; whether the search picks the same plan without them)."""
    read = {v for op in graph.ops for v, _ in op.ins} | {v for v in graph.outvars if v is not None}
    g = dataclasses.replace(graph, ops=tuple(
        op._replace(mult=0) if all(v not in read for v, _ in op.outs)
        or (op.kind == "map" and not op.ins) else op for op in graph.ops))
    cm = _cost.CostModel(g, spec)
    return total - cm.evaluate(masks).time, _search.search(cm)[0] == masks


def _rules(rules: dict) -> str:
    return ", ".join(f"{k}->{v}" for k, v in rules.items() if v is not None) or "all replicated"


def row(cfg, shape, names, runs, stacked):
    r = runs[-1]
    med = lambda k: statistics.median(x[k] for x in runs)  # noqa: E731
    total = med("graph_s") + med("search_s")
    mesh = f"{math.prod(shape)} {dict(zip(names, shape))}".replace("'", "")
    head = [cfg.name, "scan" if stacked else "unrolled", mesh,
            f"{r['ops']} / {r['sigs']} (x{r['max_mult']:g})", f"{med('trace_s'):.2f}",
            f"{med('graph_s'):.3f}", f"{med('search_s'):.3f}", f"**{total:.3f}**"]
    if "plan" not in r:
        return head + ["-", "-", "-", "-", "-", f"no plan fits: {r['error']}"], total
    s, p = r["stats"], r["plan"]
    ref = (f"{r['exhaustive_s']:.2f}, {'same' if r['same'] else 'DIFFERENT'}" if "exhaustive_s" in r
           else "(is exhaustive)" if s["method"] == "exhaustive" else "over the limit")
    dead = (f"; {r['dead_s']:.2f}, {'same' if r['dead_same'] else 'OTHER'} plan without"
            if "dead_s" in r else "")
    return head + [
        f"{s['candidates']:.3g}",
        f"{s['method'].replace('_', ' ')}, {'proven' if s['optimal'] else 'NOT proven'}", ref, f"{p.cost.time:.2f} ({p.cost.communication:.2f}{dead})",
        f"{p.cost.memory / GB:.1f}", _rules(p.rules)], total


DM, DFM = ("data", "model"), ("data", "fsdp", "model")
MESHES = [((8, 8), DM), ((16, 16), DM), ((4, 8, 8), DFM), ((4, 16, 16), DFM)]
CASES = ([(LLAMA3_8B, s, n) for s, n in MESHES] + [(LLAMA3_70B, s, n) for s, n in MESHES]
         + [(LLAMA3_70B, (4, 4, 8, 8), ("pod",) + DFM)])
UNROLLED = [(LLAMA3_8B, (8, 8), DM), (LLAMA3_70B, (8, 8), DM)]
QUICK = [(TINY, (2, 4), DM), (TINY, (2, 2, 2), DFM)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a tiny model on 8 devices; write nothing")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args(argv)
    repeat, seq = (1, 64) if a.quick else (a.repeat, SEQ)
    rows, totals = [], []
    plans = {}
    for stacked, cases in ((True, QUICK if a.quick else CASES), (False, QUICK[:1] if a.quick else UNROLLED)):
        for cfg, shape, names in cases:
            runs = [case(cfg, shape, names, seq=seq, stacked=stacked, reference=i == 0 and stacked)
                    for i in range(repeat if stacked else 1)]
            runs[-1].update({k: v for k, v in runs[0].items() if k in ("exhaustive_s", "same", "dead_s",
                                                                        "dead_same")})
            cells, total = row(cfg, shape, names, runs, stacked)
            rule = runs[-1]["plan"].rules if "plan" in runs[-1] else None
            if stacked:
                plans[(cfg.name, shape)] = rule
            elif (cfg.name, shape) in plans:   # unrolled: the same dims bar "layer", the same plan?
                same = {k: v for k, v in plans[(cfg.name, shape)].items() if k != "layer"} == rule
                cells[-1] += "" if same else " (differs from scan)"
            rows.append(cells)
            totals.append((stacked and len(shape) <= 3, total))
            print(" | ".join(str(c) for c in cells), flush=True)
    headers = ["model", "layers as", "devices {mesh}", "graph ops / distinct (max mult.)", "trace (s)",
               "graph + model (s)", "search + plan (s)", "total, trace excluded (s)", "plans",
               "method", "exhaustive reference (s), plan", "modelled step s (comm.; dead code)",
               "memory/device (GB of 80)", "rules (unlisted: None)"]
    body = _report.table(headers, rows)
    worst = max(t for s, t in totals if s)
    body += (
        f"\n\nTarget (< 2 s per case on meshes of 2-3 axes, graph + cost model + search + plan; tracing "
        f"reported apart): worst such case {worst:.3f} s, {'met' if worst < 2 else 'MISSED'}. The 4-axis "
        f"mesh (up to 16 options per dim, beyond the target) shows a grid far over the old limit: the "
        f"branch and bound stops before proving its plan there, and the method column says so; its "
        f"time grows with the options per dim. "
        f"Median of {repeat} runs; "
        f"H100 profile (80 GB), sequence {seq}, one sequence per device, bf16 parameters, float32 "
        f"AdamW moments, remat per layer. `plans` is the grid of candidate plans the search ranges "
        f"over; `branch and bound, proven` returns the exhaustive search's plan (checked in the same "
        f"run where the grid fits, `exhaustive reference`); over the old {_search.GRID_LIMIT:.3g}-plan "
        f"limit it is the only exact method. `dead code`: seconds of the modelled step that the cost "
        f"model charges for ops XLA does not run (results never read, such as a zeros broadcast of the "
        f"attention scores' shape in every layer, and broadcasts of constants), and whether searching "
        f"without them picks the same plan. Unrolled rows: the graph holds every layer's ops, the cost "
        f"model's distinct ops do not grow with depth (each layer's ops share a signature, counted "
        f"with its multiplicity); building that graph does grow with depth, and the cost model's memory "
        f"for the unrolled loop is higher than for the scan (it keeps every layer's gathered weights "
        f"live from forward to backward, where the scan gathers one layer's slice at a time).")
    print(body)
    if not a.quick:
        _report.write_section("search_scale", "Sharding search at LLaMA-3 scale (8B, 70B; 64-1024 devices)",
                              body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
