"""KV-cache decoding equals the full-window computation.

`generate` (the cached path, the GPT's default) samples the same tokens as
`generate(cache=False)` (the full window re-run per token) for a fixed key:
learned and rotary positions, MHA and GQA, a dropout model, prompts shorter
than, equal to and longer than seq_len, and steps running past seq_len (the
cache is refilled). A low temperature makes the tokens depend on the logits,
not only on the key. `GPT.decode`'s logits, position by position, equal the
full forward's within the float32 error model, and the per-token step
compiles once.
"""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxbackend import named as nx
from jaxbackend import nn, testing
from jaxbackend.models import GPT, GPTConfig, _gpt, generate

SEQ = 12
CONFIGS = {
    "learned-mha": dict(),
    "rotary-gqa": dict(rotary=True, kv_heads=2),
    "learned-gqa-swiglu-tied": dict(kv_heads=2, activation="swiglu", norm="rmsnorm",
                                    tie_embeddings=True, use_bias=False),
    "rotary-mha-dropout": dict(rotary=True, dropout=0.1),
}


def _model(name):
    cfg = GPTConfig(vocab_size=40, seq_len=SEQ, n_layers=2, embd=32, heads=4, **CONFIGS[name])
    return GPT(cfg, rngs=nnx.Rngs(0))


# Every config and every prompt length (shorter than, equal to and longer
# than seq_len), each pair once: each run goes past seq_len anyway.
@pytest.mark.parametrize("name, prompt_len", [("learned-mha", 3), ("rotary-gqa", SEQ + 4),
                                              ("learned-gqa-swiglu-tied", SEQ),
                                              ("rotary-mha-dropout", 3)])
def test_cached_generation_samples_the_full_window_tokens(name, prompt_len):
    model = _model(name)
    prompt = [(7 * i + 3) % 40 for i in range(prompt_len)]
    steps = 2 * SEQ  # past seq_len: the window slides, the cache is refilled
    key = jax.random.key(4)
    ref = generate(model, prompt, steps, key=key, temperature=0.1, cache=False)
    got = generate(model, prompt, steps, key=key, temperature=0.1)
    assert got == ref
    assert len(set(ref)) > 3  # the logits, not one repeated token, decide


def test_a_window_shorter_than_seq_len_slides_alike():
    model = _model("rotary-gqa")
    kw = dict(key=jax.random.key(3), temperature=0.1, seq_len=5)  # the cache holds 5 positions
    assert generate(model, [1, 2], 9, **kw) == generate(model, [1, 2], 9, cache=False, **kw)


def test_cached_generation_keeps_the_callers_mode():
    model = _model("rotary-mha-dropout")
    drops = lambda: {m.deterministic for _, m in nnx.iter_graph(model)  # noqa: E731
                     if isinstance(m, nnx.Dropout)}
    assert drops() == {False}  # a new model trains
    generate(model, [1, 2], 3, key=jax.random.key(0))
    assert drops() == {False}
    model.eval()
    generate(model, [1, 2], 3, key=jax.random.key(0))
    assert drops() == {True}


@pytest.mark.parametrize("name", ["learned-mha", "rotary-gqa"])
def test_decode_logits_equal_the_full_forward(name):
    model = _model(name)
    model.eval()
    tokens = jax.random.randint(jax.random.key(1), (2, SEQ), 0, 40)
    full = nnx.jit(lambda m, t: m(t).values)(model, tokens)  # (batch, time, vocab)
    step = nnx.jit(lambda m, t, c, p: m.decode(t, c, p))
    p = 5  # prefill the first p positions, then one position per call
    logits, cache = step(model, tokens[:, :p], model.init_cache(2), 0)
    testing.assert_close(logits.values, full[:, :p], what="prefill logits")
    for i in range(p, SEQ):
        logits, cache = step(model, tokens[:, i:i + 1], cache, i)
        assert logits.dims == ("batch", "time", "vocab")
        testing.assert_close(logits.values[:, 0], full[:, i], what=f"logits at position {i}")
    k, _ = cache[0]
    assert k.dims == ("batch", "kv_time", "head" if name == "learned-mha" else "kv_head", "hd")


def test_the_per_token_step_compiles_once():
    # a config no other test uses, so this test sees its first trace
    model = GPT(GPTConfig(vocab_size=40, seq_len=10, n_layers=1, embd=16, heads=2),
                rngs=nnx.Rngs(0))
    before = dict(_gpt.TRACES)
    generate(model, [1, 2, 3], 15, key=jax.random.key(0), temperature=0.7)
    generate(model, [4] * 7, 4, key=jax.random.key(1), temperature=1.3)
    other = GPT(model.config, rngs=nnx.Rngs(5))  # same structure, other weights
    generate(other, [1], 3, key=jax.random.key(2))
    assert _gpt.TRACES["step"] - before.get("step", 0) == 1
    assert _gpt.TRACES["prefill"] - before.get("prefill", 0) == 1


def test_cache_errors_name_the_argument():
    model = _model("learned-mha")
    with pytest.raises(TypeError, match="cache=False"):
        generate(nn.Linear({"embd": 4}, {"vocab": 4}, rngs=nnx.Rngs(0)), [1], 1,
                 key=jax.random.key(0), seq_len=4, cache=True)
    with pytest.raises(ValueError, match="length=13"):
        model.init_cache(1, SEQ + 1)
    with pytest.raises(ValueError, match="init_cache"):
        model.decode(jnp.zeros((1, 1), jnp.int32), model.init_cache(1)[:1], 0)
    attn = nn.MultiHeadAttention(32, 4, rngs=nnx.Rngs(0))
    x = nx.zeros({"batch": 1, "time": 1, "embd": 32})
    with pytest.raises(nx.DimError, match="init_cache"):
        attn.decode(x, attn.init_cache({"batch": 2}, SEQ, jnp.float32), 0)
    with pytest.raises(ValueError, match="causal=False"):
        nn.MultiHeadAttention(32, 4, causal=False, rngs=nnx.Rngs(0)).decode(
            x, attn.init_cache({"batch": 1}, SEQ, jnp.float32), 0)
