"""04 · The pass pipeline and the sharding search on one GPT gradient.

Traces the gradient of a named GPT loss, runs jaxbackend's pass pipeline
(checking numerics with `jaxbackend.testing`), then searches sharding rules
on a (2, 4) mesh of 8 simulated CPU devices and prints the plan table.

Run: python examples/04_passes_and_sharding.py [--tiny]
"""

import argparse

import jaxbackend as jb

# 8 simulated CPU devices: must be set before JAX creates its CPU client.
jb.simulate_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from jaxbackend import nn, passes, sharding, testing  # noqa: E402
from jaxbackend.models import GPT, GPTConfig  # noqa: E402


def main(tiny: bool) -> None:
    cfg = GPTConfig(vocab_size=64, seq_len=16, n_layers=1, embd=32, heads=4) if tiny else \
        GPTConfig(vocab_size=128, seq_len=64, n_layers=4, embd=128, heads=4)
    model = GPT(cfg, rngs=nnx.Rngs(0))
    params, loss = nn.functional(model, "loss")
    pstate = nnx.state(model, nnx.Param)  # dims metadata, for the sharding specs

    tokens = jax.random.randint(jax.random.key(1), (8, cfg.seq_len), 0, cfg.vocab_size)
    targets = jnp.roll(tokens, -1, axis=1)
    grad = jax.grad(loss)

    closed = jax.make_jaxpr(grad)(params, tokens, targets)
    after, report = passes.run_pipeline(closed)
    print(report)
    check = testing.assert_pass_preserves(None, loss, params, tokens, targets, grads=not tiny)
    print("pipeline preserves numerics:", check)

    mesh = sharding.auto_mesh((2, 4), ("data", "model"))
    plan = sharding.plan(grad, params, tokens, targets, mesh=mesh)
    print(plan.table())
    specs = nn.partition_specs(pstate, plan)
    print("mlp up kernel ->", specs["blocks"][0]["mlp"]["up"]["kernel"])


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="small sizes (tests)")
    main(ap.parse_args().tiny)
