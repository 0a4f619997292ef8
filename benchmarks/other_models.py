"""Sharding and rolling on architectures the other benchmarks never use.

The AdamW training step of each model of `_other_models` (a ViT, an
adaLN-conditioned DiT, a soft mixture of experts with a load-balancing loss,
an encoder-decoder with cross-attention, a decoder alternating sliding-window
and global attention layers, a GPT in Flax linen, a GPT in plain Flax NNX
trained with gradient clipping on a schedule), written as a user would,
through `jb.jit(step, mesh=)` on a (2, 4) mesh of 8 simulated CPU devices, with
per-layer params (the `nnx.List` as it is) and stacked params
(`jb.stack_layers`; linen: `nn.scan`; plain NNX: the loss merges
`jb.unstack_layers(params)`), at 4 and 16 layers:

* seconds from trace to compiled executable, searched plan (median of
  `--repeat` processes, interleaved), and 16 layers / 4 layers: compile
  time should stay about flat in depth (the sharded_scaling target is 32
  layers <= 1.5 x 4 layers; this table stops at 16 to stay short);
* per-device collective bytes of the compiled HLO for the searched plan and
  two hand rule sets given through `rules=` (data parallel; Megatron-style:
  batch on data, heads / mlp / experts / vocab on model), one process each;
* per-device memory measured by XLA against the plan's prediction, and the
  SPMD partitioner's "involuntary full rematerialization" warnings;
* at 4 layers, the searched step's results (params, AdamW state, loss)
  against `jax.jit`'s on one device (`testing.assert_close` at the error
  model's scale, `testing.abs_scale`);
* where the searched plan moves more bytes than the better hand set, both
  run `STEPS` steps (one process each, after a warm-up step): the search
  minimises modelled step time, and the table says whether the extra bytes
  bought time.

Run: `python benchmarks/other_models.py` (`--models vit dit` for some, in
a section of their own; `--repeat N`; `--quick` for a 2-layer smoke run
that writes nothing). `--depth --models nnx`: the sharded_scaling depth
table's question on another model, compile seconds of the searched step
(per-layer and stacked params; the nnx model's stacked step also with its
blocks called through `jb.layer`, traced once) at 4, 8, 16 and 32 layers
against plain `jax.jit` placed data parallel (its layers unrolled).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WARNING = "Involuntary full rematerialization"
MESH = (2, 4)
STEPS = 5   # steps timed per plan where the searched plan moves more bytes


def run_point(model: str, kind: str, layers: int, rules_name: str, check: bool,
              steps: int = 0) -> dict:
    import jax

    import jaxbackend as jb
    from benchmarks._other_models import FORMS, setup
    from jaxbackend import sharding, testing

    params, tx, step, batch, hand = setup(model, layers, **FORMS[kind])
    opt_state = tx.init(params)
    mesh = sharding.auto_mesh(MESH, ("data", "model"))
    rules = None if rules_name == "search" else hand[rules_name]
    t0 = time.perf_counter()
    f = jb.jit(step, mesh=mesh, rules=rules)
    compiled = f.lower(params, opt_state, *batch).compile()
    out = {"seconds": time.perf_counter() - t0,
           "rules": {k: v for k, v in f.plan.rules.items() if v},
           "predicted": float(f.plan.cost.memory),
           "memory": sharding.hlo_memory(compiled)["total"],
           "bytes": sum(c["bytes"] for c in sharding.hlo_collectives(compiled.as_text()).values())}
    if check:
        args = (params, opt_state, *batch)
        testing.assert_close(f(*args), jax.jit(step)(*args),
                             scale=lambda: testing.abs_scale(step, *args),
                             what=f"{model} {kind} searched step")
        out["equal"] = True
    if steps:
        from benchmarks import _report

        out["step_seconds"] = _report.step_seconds(compiled, (params, opt_state), batch, steps)
    return out


def run_jax_point(model: str, layers: int) -> dict:
    """Seconds from trace to compiled executable of plain `jax.jit` on the
    step (its layers unrolled), inputs placed data parallel: the batch split
    over every device, params and optimizer state replicated."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from benchmarks._other_models import setup
    from jaxbackend import sharding

    params, tx, step, batch, _ = setup(model, layers)
    mesh = sharding.auto_mesh(MESH, ("data", "model"))
    state = jax.device_put((params, tx.init(params)), NamedSharding(mesh, PartitionSpec()))
    batch = jax.device_put(batch, NamedSharding(mesh, PartitionSpec(("data", "model"))))
    t0 = time.perf_counter()   # placement is not compile time
    jax.jit(step).lower(*state, *batch).compile()
    return {"seconds": time.perf_counter() - t0}


def spawn(model, kind, layers, rules_name, check=False, steps=0) -> dict:
    from benchmarks import _report

    return _report.spawn_on_8_devices(__file__, ["--child", json.dumps(
        [model, kind, layers, rules_name, check, steps])], f"{model} {kind} {layers} {rules_name}",
        WARNING)


def better_hand(runs, point) -> str:
    """The hand rule set of `point` (model, kind, layers) with fewer bytes."""
    return min(("dp", "megatron"), key=lambda r: runs[point + (r,)][0]["bytes"])


def more_bytes(runs, point) -> bool:
    """Whether the searched plan of `point` moves more bytes than the better
    hand set (0.1% slack: the byte counts of equal plans are equal)."""
    return (runs[point + ("search",)][0]["bytes"]
            > runs[point + (better_hand(runs, point),)][0]["bytes"] * 1.001)


def measure(models, depths, repeat: int) -> dict:
    """{(model, kind, layers, rules): [results]} (searched: `repeat` runs)."""
    from benchmarks import _other_models

    runs: dict = {}
    for r in range(repeat):            # interleaved: load hits every point alike
        for m in models:
            for kind in _other_models.KINDS:
                for d in depths:
                    check = r == 0 and d == depths[0]
                    runs.setdefault((m, kind, d, "search"), []).append(
                        spawn(m, kind, d, "search", check))
    for m in models:
        for kind in _other_models.KINDS:
            for d in depths:
                for rules in ("dp", "megatron"):
                    runs[(m, kind, d, rules)] = [spawn(m, kind, d, rules)]
    for point in [p[:3] for p in runs if p[3] == "search"]:
        if more_bytes(runs, point):   # did the extra bytes buy time? one process each
            for rules in ("search", better_hand(runs, point)):
                runs[point + (rules, "steps")] = spawn(*point, rules, steps=STEPS)
    return runs


# the searched columns of the depth table: (column, params form, what the
# verdicts call it); "once" is the nnx model's only (`depth_columns`)
DEPTH_COLUMNS = (("searched", "per-layer", "per-layer params"),
                 ("stacked", "stacked", "stacked params"),
                 ("once", "stacked, jb.layer", "stacked params, blocks through jb.layer"))


def depth_columns(model: str) -> tuple:
    """`DEPTH_COLUMNS` measured for `model`: (column, params form)."""
    return tuple((c, form) for c, form, _ in DEPTH_COLUMNS if c != "once" or model == "nnx")


def measure_depth(models, depths, repeat: int) -> dict:
    """{(model, column, layers): [seconds]}: `jb.jit(mesh=)` searched on
    per-layer params ("searched"), on `jb.stack_layers` params ("stacked")
    and, for the nnx model, on stacked params with its blocks called
    through `jb.layer` ("once"); and `jax.jit` placed data parallel;
    `repeat` processes each, interleaved."""
    from benchmarks import _report

    runs: dict = {}
    for _ in range(repeat):
        for m in models:
            for d in depths:
                for column, kind in depth_columns(m):
                    runs.setdefault((m, column, d), []).append(
                        spawn(m, kind, d, "search")["seconds"])
                runs.setdefault((m, "jax.jit", d), []).append(_report.spawn_on_8_devices(
                    __file__, ["--child-jax", json.dumps([m, d])], f"{m} jax.jit {d}",
                    WARNING)["seconds"])
    return runs


def render_depth(runs, models, depths, repeat: int) -> str:
    rows = [f"| model | layers | `jb.jit(mesh=)` searched (s) | searched, stacked params (s) | "
            f"searched, stacked params, blocks through `jb.layer` (s) | `jax.jit` data "
            f"parallel, unrolled (s) | searched / jax.jit | stacked / jax.jit | stacked, "
            f"`jb.layer` / jax.jit |", "|---|---|---|---|---|---|---|---|---|"]
    lines = []
    for m in models:
        cols = [c for c, _ in depth_columns(m)]
        med = {(c, d): statistics.median(runs[(m, c, d)]) for c in cols + ["jax.jit"]
               for d in depths}
        for d in depths:
            b = med[("jax.jit", d)]
            secs = [med.get((c, d)) for c, _, _ in DEPTH_COLUMNS]
            rows.append(f"| {m} | {d} | " + " | ".join("-" if x is None else f"{x:.2f}"
                                                      for x in secs)
                        + f" | {b:.2f} | " + " | ".join("-" if x is None else f"{x / b:.2f}"
                                                       for x in secs) + " |")
        for c, _, params in DEPTH_COLUMNS:
            if c not in cols:
                continue
            flat = med[(c, depths[-1])] / med[(c, depths[0])]
            worst = max((med[(c, d)] / med[("jax.jit", d)] for d in depths if d >= 8),
                        default=float("nan"))   # (--quick: no depth >= 8)
            lines += [f"- {m}, {params}: searched {depths[-1]} / {depths[0]} layers = "
                      f"{flat:.2f} (the sharded_scaling target: <= 1.5): "
                      f"{'MET' if flat <= 1.5 else 'MISSED'}",
                      f"- {m}, {params}: searched / jax.jit, worst depth >= 8 = "
                      f"{worst:.2f} (target <= 1): {'MET' if worst <= 1 else 'MISSED'}"]
    return "\n".join([f"Trace + passes + search + lower + compile seconds, median of {repeat} "
                      f"processes, (2, 4) mesh of 8 simulated CPU devices:", "", *rows, "",
                      "Targets:", *lines])


def render(runs, models, depths, repeat: int) -> str:
    from benchmarks import _other_models

    mib = 2 ** 20
    rows = ["| model | params | layers | compile s (median of %d) | deepest / shallowest | "
            "collectives MiB: searched / data parallel / Megatron | memory MiB: predicted / "
            "measured | warnings | values = jax.jit | searched rules | where searched bytes "
            "exceed: s/step searched / better hand set |" % repeat,
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    verdict: dict = {"flat": [], "bytes": [0, 0], "memory": [], "warnings": 0, "steps": []}
    for m in models:
        for kind in _other_models.KINDS:
            secs = {d: statistics.median(x["seconds"] for x in runs[(m, kind, d, "search")])
                    for d in depths}
            ratio = secs[depths[-1]] / secs[depths[0]]
            verdict["flat"].append((m, kind, ratio))
            for d in depths:
                s = runs[(m, kind, d, "search")][0]
                dp, mg = runs[(m, kind, d, "dp")][0], runs[(m, kind, d, "megatron")][0]
                verdict["bytes"][0] += not more_bytes(runs, (m, kind, d))
                verdict["bytes"][1] += 1
                verdict["memory"].append(s["predicted"] / s["memory"])
                verdict["warnings"] += s["warnings"] + dp["warnings"] + mg["warnings"]
                rules = ", ".join(f"{k}: {v if isinstance(v, str) else '(' + ', '.join(v) + ')'}"
                                  for k, v in s["rules"].items()) or "-"
                timed = ""
                if more_bytes(runs, (m, kind, d)):
                    hand = better_hand(runs, (m, kind, d))
                    a, b = (runs[(m, kind, d, r, "steps")]["step_seconds"] for r in ("search", hand))
                    verdict["steps"].append(a / b)
                    timed = f"{a:.3f} / {b:.3f} ({hand}): {a / b:.2f}"
                rows.append(
                    f"| {m} | {kind} | {d} | {secs[d]:.2f} | "
                    f"{f'{ratio:.2f}' if d == depths[-1] else ''} | "
                    f"{s['bytes'] / mib:.1f} / {dp['bytes'] / mib:.1f} / {mg['bytes'] / mib:.1f} | "
                    f"{s['predicted'] / mib:.0f} / {s['memory'] / mib:.0f} | "
                    f"{s['warnings']} | {'yes' if s.get('equal') else ''} | {rules} | {timed} |")
    worst = max(verdict["flat"], key=lambda t: t[2])
    mem = verdict["memory"]
    lines = [
        f"- {depths[-1]} / {depths[0]} layers, compile seconds: worst {worst[2]:.2f} "
        f"({worst[0]}, {worst[1]}); per model and params: "
        + ", ".join(f"{m} {k} {r:.2f}" for m, k, r in verdict["flat"]) + ".",
        f"- searched bytes <= the better hand set: {verdict['bytes'][0]} of {verdict['bytes'][1]}.",
        f"- where searched bytes exceed it, measured seconds per step searched / that hand set's "
        f"({STEPS} steps, median, one process each): "
        + (", ".join(f"{r:.2f}" for r in verdict["steps"]) + f" (searched faster in "
           f"{sum(r < 1 for r in verdict['steps'])} of {len(verdict['steps'])})"
           if verdict["steps"] else "none") + ".",
        f"- memory predicted / measured: {min(mem):.2f} .. {max(mem):.2f} (target within 20%: "
        f"{'met' if all(0.8 <= x <= 1.2 for x in mem) else 'missed'}).",
        f"- involuntary rematerialization warnings, all plans: {verdict['warnings']}.",
    ]
    return "\n".join(rows + ["", "Verdicts:", *lines])


def main(argv=None) -> int:
    from benchmarks import _other_models

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", choices=_other_models.MODELS,
                    default=list(_other_models.MODELS))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="2 and 4 layers, 1 run, no BENCHMARKS.md")
    ap.add_argument("--depth", action="store_true",
                    help="compile seconds at 4, 8, 16 and 32 layers against plain jax.jit")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-jax", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print("RESULT " + json.dumps(run_point(*json.loads(a.child))))
        return 0
    if a.child_jax:
        print("RESULT " + json.dumps(run_jax_point(*json.loads(a.child_jax))))
        return 0
    if a.depth:
        from benchmarks import _report

        depths = [2, 4] if a.quick else [4, 8, 16, 32]
        repeat = 1 if a.quick else a.repeat
        body = render_depth(measure_depth(a.models, depths, repeat), a.models, depths, repeat)
        print(body)
        if not a.quick:
            _report.write_section("other-models-depth-" + "-".join(a.models),
                                  "Compile seconds against depth on architectures the benchmarks "
                                  f"never use ({', '.join(a.models)})", body)
        return 0
    depths = [2, 4] if a.quick else [4, 16]
    repeat = 1 if a.quick else a.repeat
    body = ("AdamW training steps, (2, 4) mesh of 8 simulated CPU devices; one process per "
            "point:\n\n" + render(measure(a.models, depths, repeat), a.models, depths, repeat))
    print(body)
    if not a.quick:
        from benchmarks import _report

        # a subset of the models gets a section of its own: the full table stays
        subset = "" if a.models == list(_other_models.MODELS) else "-".join(a.models)
        _report.write_section("other-models" + (f"-{subset}" if subset else ""),
                              "Sharding and rolling on architectures the benchmarks never use"
                              + (f" ({', '.join(a.models)})" if subset else ""), body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
