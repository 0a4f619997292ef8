"""The rolled Adafactor step of `test_collective_order` (not collected by
pytest), in a process of its own on 8 simulated CPU devices set up by
`jaxbackend.simulate_cpu_devices` (the flags are read once per process, and
the suite's own process keeps XLA's default scheduler). Prints "equal" when
the step's loss and gradients equal `jax.jit`'s on one device."""

import jaxbackend as jb

jb.simulate_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from jaxbackend import nn, sharding, testing  # noqa: E402
from jaxbackend.models import GPT, GPTConfig  # noqa: E402

MEGATRON = {"batch": "data", "head": "model", "mlp": "model"}

LAYERS = 3   # rolled (reroll=LAYERS below); without the flag this step still deadlocked, 3/3 runs
cfg = GPTConfig(seq_len=64, n_layers=LAYERS, embd=64, heads=4, vocab_size=128)
params, loss = nn.functional(GPT(cfg, rngs=nnx.Rngs(0)), "loss")
tx = optax.adafactor(1e-3)


def step(params, opt_state, x, y):
    value, grads = jax.value_and_grad(loss)(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value, grads


x = jax.random.randint(jax.random.key(1), (16, 64), 0, 128, jnp.int32)
args = (params, tx.init(params), x, jnp.roll(x, -1, axis=1))
f = jb.jit(step, mesh=sharding.auto_mesh((2, 4), ("data", "model")), rules=MEGATRON,
           reroll=LAYERS)
got = f(*args)
rolled = next(s for s in f.last_report.stats if s.name == "reroll")
assert rolled.matches["reroll.blocks_rolled"] == 2 * LAYERS   # the layers run as loops
want = jax.jit(step)(*args)
# the loss and gradients (Adafactor's normalised update amplifies a gradient
# that is zero up to rounding; the gradients are compared)
testing.assert_close(got[2:], want[2:], what="adafactor step: loss and grads",
                     scale=lambda: testing.abs_scale(jax.value_and_grad(loss), params, *args[2:]))
print("equal")
