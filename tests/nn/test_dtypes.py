"""Mixed precision the Flax way: `param_dtype` stores, `dtype` computes.

Every layer keeps float32 parameters under `dtype=jnp.bfloat16`, computes
in bfloat16 (so gradients reach the parameters in float32), matches the
float32 layer within bfloat16's error model, and emits no cast at all when
every dtype is float32 already."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxbackend import named as nx
from jaxbackend import nn, testing

BF16, F32 = jnp.bfloat16, jnp.float32


def _layers(dtype, param_dtype=F32):
    kw = dict(dtype=dtype, param_dtype=param_dtype)
    return {
        "linear": lambda: nn.Linear({"embd": 16}, {"head": 2, "hd": 8}, **kw, rngs=nnx.Rngs(0)),
        "layernorm": lambda: nn.LayerNorm({"embd": 16}, **kw),
        "rmsnorm": lambda: nn.RMSNorm({"embd": 16}, **kw),
        "attention": lambda: nn.MultiHeadAttention(16, 4, kv_heads=2, rotary=True, **kw,
                                                   rngs=nnx.Rngs(0)),
        "block": lambda: nn.TransformerBlock(16, 4, activation="swiglu", norm="rmsnorm", **kw,
                                             rngs=nnx.Rngs(0)),
    }


def _x(dtype=F32):
    x = jax.random.normal(jax.random.key(1), (2, 8, 16), dtype)
    return nx.as_named(x, ("batch", "time", "embd"))


def _loss(model, x):
    return jnp.mean(jnp.square(model(x).values.astype(F32)))


@pytest.mark.parametrize("name", list(_layers(None)))
def test_bf16_compute_keeps_f32_params_and_grads(name):
    model = _layers(BF16)[name]()
    params = nnx.state(model, nnx.Param)
    assert {p.dtype for p in jax.tree.leaves(params)} == {jnp.dtype(F32)}
    y = model(_x(BF16))     # a bf16 residual stream (a block adds its input back)
    assert y.dtype == BF16, f"{name}: dtype=bfloat16 computes in bfloat16, got {y.dtype}"
    grads = nnx.grad(_loss)(model, _x(BF16))
    assert {g.dtype for g in jax.tree.leaves(nnx.state(grads, nnx.Param))} == {jnp.dtype(F32)}


@pytest.mark.parametrize("name", list(_layers(None)))
def test_bf16_compute_matches_f32_within_bf16_error(name):
    ref = _layers(None)[name]()          # same init seeds: same float32 parameters
    low = _layers(BF16)[name]()
    x = _x()
    expected = ref(x).values
    graphdef, state = nnx.split(ref)
    scale = testing.abs_scale(lambda s, v: nnx.merge(graphdef, s)(nx.as_named(v, x.dims)).values,
                              state, x.values)
    testing.assert_close(low(x).values.astype(F32), expected, scale=scale,
                         rtol=testing.tolerance(BF16)[0], what=name)


@pytest.mark.parametrize("name", list(_layers(None)))
def test_param_dtype_stores_and_dtype_none_promotes(name):
    model = _layers(None, param_dtype=BF16)[name]()
    assert {p.dtype for p in jax.tree.leaves(nnx.state(model, nnx.Param))} == {jnp.dtype(BF16)}
    assert model(_x(BF16)).dtype == BF16                 # bf16 input, bf16 params
    assert model(_x(F32)).dtype == F32                   # promoted, as Flax's promote_dtype


@pytest.mark.parametrize("name", ["linear", "block"])
def test_all_float32_emits_no_cast(name):
    model = _layers(None)[name]()
    jaxpr = jax.make_jaxpr(lambda x: model(x).values)(_x())
    assert "convert_element_type" not in str(jaxpr), f"{name}: a float32 layer cast something"


def test_norm_statistics_in_float32_under_bf16():
    norm = nn.RMSNorm({"embd": 16}, dtype=BF16)
    jaxpr = jax.make_jaxpr(lambda x: norm(x).values)(_x(BF16))
    sums = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "reduce_sum"]
    assert sums and all(e.invars[0].aval.dtype == F32 for e in sums)


def test_attention_softmax_in_float32_under_bf16():
    attn = nn.MultiHeadAttention(16, 4, dtype=BF16, rngs=nnx.Rngs(0))
    jaxpr = jax.make_jaxpr(lambda x: attn(x).values)(_x(BF16))
    maxes = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "reduce_max"]
    assert maxes and all(e.invars[0].aval.dtype == F32 for e in maxes)


def test_gpt_mixed_precision_f32_params_bf16_logits_f32_loss():
    from jaxbackend.models import GPT, GPTConfig

    cfg = GPTConfig(n_layers=1, embd=16, heads=4, kv_heads=2, seq_len=8)
    ref, low = GPT(cfg, rngs=nnx.Rngs(0)), GPT(cfg, dtype=BF16, rngs=nnx.Rngs(0))
    assert {p.dtype for p in jax.tree.leaves(nnx.state(low, nnx.Param))} == {jnp.dtype(F32)}
    tokens = jax.random.randint(jax.random.key(2), (2, 8), 0, cfg.vocab_size)
    assert low(tokens).dtype == BF16
    loss = low.loss(tokens, tokens)
    assert loss.dtype == F32
    grads = nnx.grad(lambda m: m.loss(tokens, tokens))(low)
    assert {g.dtype for g in jax.tree.leaves(nnx.state(grads, nnx.Param))} == {jnp.dtype(F32)}
    # Against the float32 GPT, within bfloat16's error model of the logits.
    graphdef, state = nnx.split(ref)
    scale = testing.abs_scale(lambda s: nnx.merge(graphdef, s)(tokens).values, state)
    testing.assert_close(low(tokens).values.astype(F32), ref(tokens).values, scale=scale,
                         rtol=testing.tolerance(BF16)[0], what="GPT logits")
