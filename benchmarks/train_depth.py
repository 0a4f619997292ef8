"""The training loop on 8 devices against depth: as shipped, per-layer, stacked.

`jaxbackend.train.train` (what `python -m jaxbackend train` runs) with
`devices=8` (a 1-d `data` mesh of simulated CPU devices; the step is
`jb.jit(mesh=, donate_argnums=(0, 1))`, its searched plan placing the
parameters, data and optimizer state), embd 64, 4 heads, seq 64, batch 16,
2 steps, no evaluation, sample or checkpoint. Seconds to the end of the
first step (trace, passes, sharding search, lower, XLA compile and one
step: `compile_s`), at 4, 8 and 32 layers, three ways: `default`
(`stack_layers=None`, what the command does: the blocks stacked from
`passes.REROLL_MIN_REPEATS` layers), `per-layer` (`--no-stack-layers`) and
`stacked` (`--stack-layers`); one fresh process per point, the variants
interleaved, medians of `--repeat`. Target (issue 12): the 32-layer step
within 1.5x the 4-layer one.

Run: `python benchmarks/train_depth.py` (`--quick`: 2 and 4 layers, one
repeat, writes nothing).
"""

from __future__ import annotations

import os
import pathlib
import statistics
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
VARIANTS = ("default", "per-layer", "stacked")
STACK = {"default": None, "per-layer": False, "stacked": True}


def run_point(variant: str, layers: int) -> dict:
    import jax

    from jaxbackend.train import TrainConfig, train

    jax.config.update("jax_enable_compilation_cache", False)
    with tempfile.TemporaryDirectory() as out:
        cfg = TrainConfig(steps=2, batch=16, seq=64, layers=layers, embd=64, heads=4,
                          devices=8, stack_layers=STACK[variant], sample_chars=0,
                          eval_every=0, ckpt_every=0, eval_batches=1, quiet=True, out=out)
        r = train(cfg, log=lambda s: None)
    return {"compile": r["compile_s"], "loss": r["history"][0]}


def main() -> None:
    from _report import depth_cli, spawn_point

    from jaxbackend._devices import cpu_device_flags

    a = depth_cli(__doc__, run_point, "2 and 4 layers, one repeat, no file")
    env = dict(os.environ, XLA_FLAGS=cpu_device_flags(8))
    depths, repeat = ((2, 4), 1) if a.quick else ((4, 8, 32), a.repeat)
    got: dict = {}
    for _ in range(repeat):
        for n in depths:
            for v in VARIANTS:
                r = spawn_point(__file__, v, n, env)
                got.setdefault((v, n), []).append(r)
                print(f"{v:10s} {n:3d} layers: first step {r['compile']:.2f} s", flush=True)
    med = {k: statistics.median(r["compile"] for r in rs) for k, rs in got.items()}
    from _report import table, write_section

    lo, hi = depths[0], depths[-1]
    rows = [[n, *(f"{med[v, n]:.2f}" for v in VARIANTS)] for n in depths]
    ratio = {v: med[v, hi] / med[v, lo] for v in VARIANTS}
    body = ("`python -m jaxbackend train --devices 8` (its `train` function), embd 64, 4 heads, "
            f"seq 64, batch 16, the step compiled with `jb.jit(mesh=, donate_argnums=(0, 1))`; "
            f"seconds to the end of the first step (trace, passes, sharding search of the whole "
            f"step, lower, XLA compile, one step), median of {repeat} fresh "
            f"processes per point:\n\n"
            + table(["layers", "default", "`--no-stack-layers`", "`--stack-layers`"], rows) + "\n\n"
            + "\n".join(f"- {v}: {hi} / {lo} layers = **{ratio[v]:.2f}** (target <= 1.5): "
                        f"{'met' if ratio[v] <= 1.5 else 'MISSED'}" for v in VARIANTS) + "\n")
    print(body)
    if not a.quick:
        write_section("train-depth", "Training on 8 devices against depth", body)


if __name__ == "__main__":
    main()
