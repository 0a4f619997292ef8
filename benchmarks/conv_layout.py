"""Convolutions in loops: AD's layouts vs the canonical one (`canonical_conv`).

Part 1 (one device): 8 layers of 3x3 convolutions over 32x16x16x32 (NHWC,
HWIO), per kind (the forward, and the input and kernel gradients that AD
writes in other layouts): seconds per call unrolled and in a `lax.scan`,
each as written and after the `canonical_conv` pass (operands transposed
into NHWC / HWIO), median of 5 calls.

Part 2: the training step (SGD with momentum) of a residual ConvNet written
with Flax NNX (`nnx.Conv`, `nnx.BatchNorm` in training mode: its batch
statistics returned as new state), 8 blocks of two conv-BN pairs, 32
channels, batch 32 of 16x16x3: seconds per step (median of 5 after a
warm-up) of `jax.jit` and of `jb.jit` (layers rolled) with and without
`canonical_conv`, on one device; and, on a (2, 4) mesh of 8 simulated
devices, `jb.jit(mesh=)` with its searched plan against `jax.jit` with the
batch on both axes (data parallel): seconds per step, collective bytes per
device in the compiled HLO, the searched rules.

Run: `python benchmarks/conv_layout.py` (`--child` runs the mesh part in a
process with 8 simulated devices).
"""

from __future__ import annotations

import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LAYERS, BATCH, SIDE, CHANNELS = 8, 32, 16, 32


def _median_call(fn, args) -> float:
    """Median seconds of 5 calls, after a warm-up call."""
    import jax

    from benchmarks._report import median_time

    call = lambda: jax.block_until_ready(fn(*args))  # noqa: E731
    call()
    return median_time(call, repeat=5)


def kernels() -> list:
    """Part 1 rows: (kind, unrolled, scan, unrolled canonical, scan canonical)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from jaxbackend import _jax
    from jaxbackend.passes.canonical_conv import canonical_conv

    def grads_dn():   # the dimension numbers AD writes for an NHWC/HWIO conv's gradients
        f = lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "SAME",  # noqa: E731
                                                  dimension_numbers=("NHWC", "HWIO", "NHWC"))
        j = jax.make_jaxpr(jax.grad(lambda x, w: f(x, w).sum(), argnums=(0, 1)))(
            jnp.ones((2, 4, 4, 3)), jnp.ones((3, 3, 3, 3)))
        fwd = lax.conv_dimension_numbers((1, 1, 1, 1), (1, 1, 1, 1), ("NHWC", "HWIO", "NHWC"))
        return [e.params["dimension_numbers"] for e in j.jaxpr.eqns
                if e.primitive.name == "conv_general_dilated"
                and e.params["dimension_numbers"] != fwd]   # kernel gradient, input gradient

    dn_kernel, dn_input = grads_dn()
    act = jnp.ones((LAYERS, BATCH, SIDE, SIDE, CHANNELS)) * 0.01
    ker = jnp.ones((LAYERS, 3, 3, CHANNELS, CHANNELS)) * 0.01
    cases = {   # kind: (one layer's convolution, its two stacked operands)
        "forward (NHWC, HWIO)": (lambda a, b: lax.conv_general_dilated(
            a, b, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")), act, ker),
        "input gradient": (lambda a, b: lax.conv_general_dilated(
            a, b, (1, 1), ((1, 1), (1, 1)), dimension_numbers=dn_input), act, ker),
        "kernel gradient": (lambda a, b: lax.conv_general_dilated(
            a, b, (1, 1), ((1, 1), (1, 1)), dimension_numbers=dn_kernel), act, act),
    }
    rows = []
    for kind, (one, a, b) in cases.items():
        progs = {"unrolled": lambda a, b, one=one: jnp.stack([one(a[i], b[i])
                                                              for i in range(LAYERS)]),
                 "scan": lambda a, b, one=one: lax.scan(lambda c, ab: (c, one(*ab)), 0, (a, b))[1]}
        times = {}
        for name, prog in progs.items():
            closed = jax.make_jaxpr(prog)(a, b)
            for canon in (False, True):
                c = canonical_conv(closed) if canon else closed
                times[name, canon] = _median_call(jax.jit(_jax.jaxpr_as_fun(c)), (a, b))
        rows.append((kind, times["unrolled", False], times["scan", False],
                     times["unrolled", True], times["scan", True]))
    return rows


def _convnet():
    import jax
    import optax
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.c1 = nnx.Conv(CHANNELS, CHANNELS, (3, 3), rngs=rngs)
            self.b1 = nnx.BatchNorm(CHANNELS, rngs=rngs)
            self.c2 = nnx.Conv(CHANNELS, CHANNELS, (3, 3), rngs=rngs)
            self.b2 = nnx.BatchNorm(CHANNELS, rngs=rngs)

        def __call__(self, x):
            return nnx.relu(x + self.b2(self.c2(nnx.relu(self.b1(self.c1(x))))))

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.stem = nnx.Conv(3, CHANNELS, (3, 3), rngs=rngs)
            self.blocks = nnx.List([Block(rngs) for _ in range(LAYERS)])
            self.head = nnx.Linear(CHANNELS, 10, rngs=rngs)

        def __call__(self, x):
            x = self.stem(x)
            for b in self.blocks:
                x = b(x)
            return self.head(x.mean((1, 2)))

    model = Net(nnx.Rngs(0))
    model.train()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = optax.sgd(0.1, momentum=0.9)

    def step(params, rest, opt, x, y):
        m = nnx.merge(graphdef, params, rest)
        loss, g = nnx.value_and_grad(
            lambda m: optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean())(m)
        updates, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, updates), nnx.state(m, nnx.BatchStat), opt, loss

    x = jax.random.normal(jax.random.key(1), (BATCH, SIDE, SIDE, 3))
    y = jax.random.randint(jax.random.key(2), (BATCH,), 0, 10)
    return step, (params, rest, tx.init(params), x, y)


def _steps(fn, args) -> float:
    """Median seconds per step over 5 steps after a warm-up, state fed back."""
    import jax

    args = list(args)
    runs = []
    for i in range(6):
        t = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        runs.append(time.perf_counter() - t)
        args[0], args[1], args[2] = out[0], out[1], out[2]
    return statistics.median(runs[1:])


def one_device() -> dict:
    import jax

    import jaxbackend as jb

    step, args = _convnet()
    without = [p for p in jb.passes.DEFAULT_PIPELINE if p != "canonical_conv"]
    return {"jax.jit": _steps(jax.jit(step), args), "jb.jit": _steps(jb.jit(step), args),
            "jb.jit without canonical_conv": _steps(jb.jit(step, passes=without), args)}


def on_mesh() -> dict:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jaxbackend as jb
    from jaxbackend import sharding

    step, args = _convnet()
    mesh = sharding.auto_mesh((2, 4), ("data", "model"))
    f = jb.jit(step, mesh=mesh)
    searched = f.lower(*args).compile()
    rep, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P(("data", "model")))
    placed = jax.device_put(args[:3], rep) + jax.device_put(args[3:], batch)
    hand = jax.jit(step).lower(*placed).compile()

    def moved(c):
        return sum(v["bytes"] for v in sharding.hlo_collectives(c.as_text()).values())

    return {"searched": _steps(f, args), "data parallel": _steps(hand, placed),
            "searched bytes": moved(searched), "data parallel bytes": moved(hand),
            "rules": {k: v for k, v in f.plan.rules.items() if v}}


def main() -> None:
    import json

    if "--child" in sys.argv:
        print("RESULT " + json.dumps(on_mesh()))
        return
    from benchmarks._report import spawn_on_8_devices, table, write_section

    k = kernels()
    one = one_device()
    mesh = spawn_on_8_devices("benchmarks/conv_layout.py", ["--child"], "mesh part",
                              "Involuntary full rematerialization")
    ms = lambda t: f"{t * 1e3:.1f}"  # noqa: E731
    body = (f"Part 1, one device: {LAYERS} layers of 3x3 convolutions over {BATCH}x{SIDE}x{SIDE}x"
            f"{CHANNELS}, ms per call (median of 5):\n\n"
            + table(("convolution", "unrolled", "scan", "unrolled, canonical", "scan, canonical",
                     "scan / unrolled, as written", "scan / unrolled, canonical"),
                    [(r[0], ms(r[1]), ms(r[2]), ms(r[3]), ms(r[4]), f"{r[2] / r[1]:.1f}",
                      f"{r[4] / r[3]:.1f}") for r in k])
            + f"\n\nPart 2, the training step of a residual ConvNet (Flax NNX: {LAYERS} blocks "
            f"of two conv-BatchNorm pairs, {CHANNELS} channels, batch {BATCH} of {SIDE}x{SIDE}x3, "
            "SGD with momentum), ms per step (median of 5 after a warm-up):\n\n"
            + table(("program", "ms per step", "/ jax.jit"),
                    [(name, ms(t), f"{t / one['jax.jit']:.2f}") for name, t in one.items()])
            + "\n\nOn a (2, 4) mesh of 8 simulated CPU devices:\n\n"
            + table(("plan", "ms per step", "collective bytes / device"),
                    [("`jb.jit(mesh=)` searched", ms(mesh["searched"]),
                      f"{mesh['searched bytes']:.0f}"),
                     ("`jax.jit`, data parallel", ms(mesh["data parallel"]),
                      f"{mesh['data parallel bytes']:.0f}")])
            + f"\n\n- searched rules: `{mesh['rules']}`; XLA rematerialization warnings: "
            f"{mesh['warnings']}")
    write_section("conv-layout", "Convolutions in loops: canonical layout (`canonical_conv`)", body)


if __name__ == "__main__":
    main()
