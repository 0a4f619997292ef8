"""Latency of one collective between simulated CPU devices, by kind and group size.

The cost model's CPU profile (`sharding.cpu_profile`) charges a collective
over n devices (n - 1) latencies whatever its kind: on XLA:CPU a collective
is a rendezvous of the device threads, not a ring over links. This measures
it: chains of 200 dependent collectives on 64-byte shards (`shard_map`;
psum, all_gather, psum_scatter) over groups of 2, 4 and 8 of 8 simulated
devices (meshes (2, 4), (4, 2) and (8,)), median of 5 calls, against the
ring formulas' (n - 1) or 2 (n - 1) steps at the profile's latency.

Run: `python benchmarks/cpu_collectives.py` (spawns one process with 8
simulated devices; `--child` runs the measurement there).
"""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CHAIN = 200
KINDS = ("all-reduce", "all-gather", "reduce-scatter")


def measure() -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, PartitionSpec as P

    try:
        from jax import shard_map
    except ImportError:                                 # JAX < 0.7
        from jax.experimental.shard_map import shard_map

    from benchmarks._report import median_time

    out = {}
    for shape in ((2, 4), (4, 2), (8,)):
        names = ("a", "b")[:len(shape)]
        mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))
        ax, n = names[0], shape[0]
        chains = {
            "all-reduce": lambda x: jax.lax.psum(x, ax) * (1.0 / n),
            "all-gather": lambda x: jax.lax.all_gather(x, ax, tiled=True)[:x.shape[0]],
            "reduce-scatter": lambda x: jnp.tile(jax.lax.psum_scatter(x, ax, tiled=True), n),
        }
        for kind, one in chains.items():
            def chain(x, one=one):
                for _ in range(CHAIN):
                    x = one(x)
                return x
            f = jax.jit(shard_map(chain, mesh=mesh, in_specs=P(names), out_specs=P(names)))
            x = jnp.ones((16 * 8,), jnp.float32)       # 64 bytes per device
            c = f.lower(x).compile()
            call = lambda c=c, x=x: jax.block_until_ready(c(x))  # noqa: E731
            call()
            out[f"{kind} {n}"] = median_time(call, repeat=5) / CHAIN
    return out


def main() -> None:
    import json

    if "--child" in sys.argv:
        print("RESULT " + json.dumps(measure()))
        return
    from benchmarks._report import spawn_on_8_devices, table, write_section
    from jaxbackend.sharding import cpu_profile

    got = spawn_on_8_devices("benchmarks/cpu_collectives.py", ["--child"], "collectives", "-")
    lat = cpu_profile().intra_latency
    rows, per_step = [], []
    for n in (2, 4, 8):
        for kind in KINDS:
            t = got[f"{kind} {n}"]
            ring = (2 if kind == "all-reduce" else 1) * (n - 1) * lat
            rows.append((kind, n, f"{t * 1e6:.0f}", f"{t / (n - 1) * 1e6:.1f}",
                         f"{(n - 1) * lat * 1e6:.0f}", f"{ring * 1e6:.0f}"))
            per_step.append(t / (n - 1))
    body = (f"Chains of {CHAIN} dependent collectives on 64-byte shards (`shard_map`) over groups "
            "of n of 8 simulated CPU devices, median of 5 calls, per collective:\n\n"
            + table(("kind", "n", "measured (us)", "per other device (us)",
                     "model: (n-1) x latency (us)", "ring formula (us)"), rows)
            + f"\n\n- per other device: {min(per_step) * 1e6:.0f}-{max(per_step) * 1e6:.0f} us, "
            f"kind for kind alike; the CPU profile's latency is {lat * 1e6:.0f} us per other "
            "device for every kind (the ring formula charges an all-reduce twice that)")
    write_section("cpu-collectives", "Collective latency between simulated CPU devices", body)


if __name__ == "__main__":
    main()
