"""The named GPT equals a positional plain-Flax GPT with the same weights:
logits and every parameter gradient, by the error model of
`jaxbackend.testing.assert_close` (float32)."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxbackend import named as nx
from jaxbackend import testing
from jaxbackend.models import GPT, GPTConfig, generate

from positional_gpt import PlainGPT, to_positional

CONFIGS = {
    "gelu-layernorm-learned-pos": GPTConfig(vocab_size=40, seq_len=12, n_layers=2, embd=16, heads=4),
    "gqa-rotary-swiglu-rmsnorm-tied": GPTConfig(
        vocab_size=40, seq_len=12, n_layers=1, embd=16, heads=4, kv_heads=2, rotary=True,
        activation="swiglu", norm="rmsnorm", tie_embeddings=True, use_bias=False),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_named_gpt_equals_plain_flax_gpt(name):
    cfg = CONFIGS[name]
    named, plain = GPT(cfg, rngs=nnx.Rngs(0)), PlainGPT(cfg, nnx.Rngs(1))
    tokens = jax.random.randint(jax.random.key(2), (2, 10), 0, cfg.vocab_size)
    rep = testing.assert_modules_match(named, plain, lambda p: to_positional(p, cfg), (tokens,))
    n_params = len(jax.tree.leaves(nnx.state(named, nnx.Param)))
    assert len(rep["grad_err"]) == n_params  # every parameter's gradient was compared


def test_gpt_loss_and_named_inputs():
    cfg = CONFIGS["gelu-layernorm-learned-pos"]
    model = GPT(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(2), (2, 10), 0, cfg.vocab_size)
    logits = model(nx.as_named(tokens, ("batch", "time")))
    assert logits.sizes == {"batch": 2, "time": 10, "vocab": 40}
    lp = jax.nn.log_softmax(logits.values, axis=-1)
    ref = -jnp.take_along_axis(lp, tokens[..., None], axis=-1).mean()
    testing.assert_close(model.loss(tokens, tokens), ref, what="loss")  # a mean of positive terms
    with pytest.raises(nx.DimError, match="seq_len=12"):
        model(jnp.zeros((1, 13), jnp.int32))
    with pytest.raises(nx.DimError, match="kv_heads"):
        GPTConfig(heads=4, kv_heads=3)


def test_generate_reads_only_the_past():
    cfg = CONFIGS["gelu-layernorm-learned-pos"]
    model = GPT(cfg, rngs=nnx.Rngs(0))
    a = generate(model, [1, 2, 3], 5, key=jax.random.key(0))
    b = generate(model, [1, 2, 3], 5, key=jax.random.key(0))
    assert a == b and len(a) == 5 and all(0 <= t < cfg.vocab_size for t in a)
    # Greedy-ish check of the padding argument: the first sampled token's
    # logits equal those of the unpadded prompt.
    logits = nnx.jit(lambda m, t: m(t).values)
    full = logits(model, jnp.array([[1, 2, 3]]))[0, -1]
    padded = logits(model, jnp.array([[1, 2, 3] + [0] * 9]))[0, 2]
    testing.assert_close(padded, full, what="logits of the padded prompt")
