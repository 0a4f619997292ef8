"""Each named layer against a positional reference on the same weights
(values and grads), plus the NNX plumbing: dims metadata, nnx.jit/grad,
split/merge, optax, and errors that name the dim."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxbackend import named as nx
from jaxbackend import nn, testing
from jaxbackend.jit import jit as jb_jit
from jaxbackend.models import GPTConfig

from positional_gpt import PlainAttention, PlainMLP


def _x(shape=(2, 5, 8), dims=("batch", "time", "embd"), seed=0):
    return nx.as_named(jax.random.normal(jax.random.key(seed), shape), dims)


def test_linear_matches_einsum_with_extra_dims_in_any_order():
    lin = nn.Linear({"embd": 8}, {"head": 2, "hd": 3}, rngs=nnx.Rngs(0))
    lin.bias[...] = jax.random.normal(jax.random.key(1), (2, 3))
    x = _x().transpose("embd", "batch", "time")
    y = lin(x)
    assert y.dims == ("batch", "time", "head", "hd")
    def affine(x, k, b):
        return jnp.einsum("ebt,ehd->bthd", x, k) + b
    args = (x.values, lin.kernel[...], lin.bias[...])
    testing.assert_close(y.values, affine(*args), scale=testing.abs_scale(affine, *args),
                         what="Linear")
    assert lin.kernel.get_metadata("dims") == ("embd", "head", "hd")
    assert lin.bias.get_metadata("dims") == ("head", "hd")


def test_linear_errors_name_the_dim():
    lin = nn.Linear({"embd": 8}, {"mlp": 4}, rngs=nnx.Rngs(0))
    with pytest.raises(nx.DimError, match="'embd'.*size 6.*expects 8"):
        lin(_x((2, 6), ("batch", "embd")))
    with pytest.raises(nx.DimError, match="needs dim 'embd'"):
        lin(_x((2, 8), ("batch", "hidden")))
    with pytest.raises(nx.DimError, match="both input and output"):
        nn.Linear({"embd": 8}, {"embd": 8}, rngs=nnx.Rngs(0))
    with pytest.raises(nx.DimError, match="must be a NamedArray"):
        lin(jnp.ones((2, 8)))


def test_embedding_lookup_and_tied_attend():
    emb = nn.Embedding(11, 6, rngs=nnx.Rngs(0))
    ids = nx.as_named(jnp.array([[1, 5, 10], [0, 0, 3]]), ("batch", "time"))
    e = emb(ids)
    assert e.dims == ("batch", "time", "embd")
    np.testing.assert_array_equal(e.values, emb.embedding[...][ids.values])
    logits = emb.attend(e)
    assert logits.sizes == {"batch": 2, "time": 3, "vocab": 11}
    # a contraction over embd: its rounding is relative to sum|e * emb|, not
    # to the (here small and cancelling) logits themselves
    args = (e.values, emb.embedding[...].T)
    testing.assert_close(logits.values, jnp.matmul(*args),
                         scale=testing.abs_scale(jnp.matmul, *args), what="tied attend")
    with pytest.raises(nx.DimError, match="integer"):
        emb(nx.as_named(jnp.ones((2, 3)), ("batch", "time")))


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_norms_match_flax(kind):
    named = (nn.LayerNorm if kind == "layernorm" else nn.RMSNorm)({"embd": 8})
    ref = (nnx.LayerNorm if kind == "layernorm" else nnx.RMSNorm)(8, epsilon=1e-6, rngs=nnx.Rngs(0))
    # Non-trivial scale/bias so their gradients and effect are exercised.
    for name in ("scale", "bias"):
        if getattr(named, name, None) is not None:
            getattr(named, name)[...] = 1 + jax.random.normal(jax.random.key(len(name)), (8,))
    x = _x((2, 5, 8), ("batch", "time", "embd"))
    rep = testing.assert_modules_match(named, ref, lambda p: p, (x,), reference_inputs=(x.values,))
    assert set(rep["grad_err"]) == ({"['scale']", "['bias']"} if kind == "layernorm" else {"['scale']"})


def test_dropout_train_and_eval():
    d = nn.Dropout(0.5, rngs=nnx.Rngs(dropout=0))
    x = nx.ones({"batch": 200, "embd": 50})
    y = d(x)
    kept = np.asarray(y.values != 0)
    assert 0.4 < kept.mean() < 0.6
    np.testing.assert_array_equal(np.asarray(y.values)[kept], 2.0)  # 1 / (1 - 0.5): exact
    d.eval()
    assert d(x) is x or np.array_equal(d(x).values, x.values)
    with pytest.raises(ValueError, match="rate"):
        nn.Dropout(1.0)


def _attn_pair(kv_heads, rotary):
    c = GPTConfig(embd=16, heads=4, kv_heads=kv_heads, rotary=rotary)
    named = nn.MultiHeadAttention(16, 4, kv_heads=kv_heads, rotary=rotary, rngs=nnx.Rngs(0))
    ref = PlainAttention(c, nnx.Rngs(1))
    kv = kv_heads or 4

    def to_ref(p):
        def lin(d, k_shape):
            return {"kernel": d["kernel"].reshape(k_shape), "bias": d["bias"].reshape(-1)}
        return {"q": lin(p["query"], (16, 16)), "k": lin(p["key"], (16, kv * 4)),
                "v": lin(p["value"], (16, kv * 4)), "o": lin(p["out"], (16, 16))}
    return named, ref, to_ref


@pytest.mark.parametrize("kv_heads,rotary", [(None, False), (2, False), (1, True)])
def test_attention_matches_positional(kv_heads, rotary):
    named, ref, to_ref = _attn_pair(kv_heads, rotary)
    x = _x((2, 6, 16), ("batch", "time", "embd"), seed=3)
    testing.assert_modules_match(named, ref, to_ref, (x,), reference_inputs=(x.values,))
    if kv_heads and kv_heads < 4:
        assert named.key.kernel.get_metadata("dims") == ("embd", "kv_head", "hd")


def test_equivalence_check_catches_a_wrong_weight_map():
    named, ref, to_ref = _attn_pair(2, False)

    def wrong(p):  # kv heads laid out (hd, kv_head) instead of (kv_head, hd)
        out = to_ref(p)
        k = p["key"]["kernel"]
        out["k"]["kernel"] = jnp.swapaxes(k, 1, 2).reshape(k.shape[0], -1)
        return out

    x = _x((2, 6, 16), ("batch", "time", "embd"), seed=3)
    with pytest.raises(AssertionError, match="module output"):
        testing.assert_modules_match(named, ref, wrong, (x,), reference_inputs=(x.values,))


def test_attention_is_causal():
    attn = nn.MultiHeadAttention(16, 4, kv_heads=2, rotary=True, rngs=nnx.Rngs(0))
    x = _x((1, 6, 16), ("batch", "time", "embd"))
    changed = nx.as_named(x.values.at[:, 4:].set(7.0), x.dims)
    a, b = attn(x).values, attn(changed).values
    testing.assert_close(a[:, :4], b[:, :4], what="outputs before the changed positions")
    assert not np.allclose(a[:, 4:], b[:, 4:])


@pytest.mark.parametrize("causal", [True, False])
def test_sliding_window_is_full_attention_over_the_window(causal):
    # reference: the layer without a window, run on only the positions the
    # window keeps (rotary scores depend on relative positions only), read at
    # the query's place in that slice
    w, t = 3, 8
    kw = dict(kv_heads=2, rotary=True, causal=causal)
    local = nn.MultiHeadAttention(16, 4, sliding_window=w, **kw, rngs=nnx.Rngs(0))
    full = nn.MultiHeadAttention(16, 4, **kw, rngs=nnx.Rngs(0))   # the same weights
    x = _x((2, t, 16), ("batch", "time", "embd"), seed=5)
    got = local(x).values
    run = jax.jit(lambda xs: full(nx.as_named(xs, x.dims)).values)   # one compile per length
    for q in range(t):
        lo, hi = max(0, q - w + 1), (q + 1 if causal else min(t, q + w))
        xs = x.values[:, lo:hi]
        testing.assert_close(got[:, q], run(xs)[:, q - lo], what=f"query {q}",
                             scale=lambda: testing.abs_scale(lambda v: run(v)[:, q - lo], xs))
    assert not np.allclose(got, full(x).values)      # the window did cut something


def test_sliding_window_decode_matches_the_full_window_and_checks_its_argument():
    attn = nn.MultiHeadAttention(16, 4, rotary=True, sliding_window=2, rngs=nnx.Rngs(0))
    x = _x((1, 5, 16), ("batch", "time", "embd"), seed=6)
    want = attn(x).values
    cache = attn.init_cache({"batch": 1}, 5, jnp.float32)
    for pos in range(5):
        out, cache = attn.decode(nx.as_named(x.values[:, pos:pos + 1], x.dims), cache, pos)
        testing.assert_close(out.values[:, 0], want[:, pos], what=f"decoded position {pos}")
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match=f"sliding_window={bad!r}"):
            nn.MultiHeadAttention(16, 4, sliding_window=bad, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_mlp_matches_positional(activation):
    c = GPTConfig(embd=8, heads=2, mlp_ratio=2, activation=activation)
    named = nn.MLP(8, 16, activation=activation, rngs=nnx.Rngs(0))
    ref = PlainMLP(c, nnx.Rngs(1))
    x = _x((2, 3, 8))
    testing.assert_modules_match(named, ref, lambda p: p, (x,), reference_inputs=(x.values,))
    assert named.up.kernel.get_metadata("dims") == ("embd", "mlp")


def test_block_trains_with_nnx_jit_grad_split_merge_and_optax():
    block = nn.TransformerBlock(16, 4, kv_heads=2, activation="swiglu", norm="rmsnorm",
                                rotary=True, rngs=nnx.Rngs(0))
    x = _x((2, 6, 16), seed=1)
    target = _x((2, 6, 16), seed=2)
    opt = nnx.Optimizer(block, optax.adamw(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(block, opt, x, t):
        loss, g = nnx.value_and_grad(lambda m: ((m(x) - t) ** 2).mean().values)(block)
        opt.update(block, g)
        return loss

    losses = [float(step(block, opt, x, target)) for _ in range(15)]
    assert losses[-1] < 0.7 * losses[0]
    graphdef, state = nnx.split(block)
    again = nnx.merge(graphdef, state)
    np.testing.assert_array_equal(again(x).values, block(x).values)


def test_block_under_jaxbackend_jit_matches_jax_jit():
    block = nn.TransformerBlock(16, 4, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(block, nnx.Param, ...)

    def loss(params, x):
        return (nnx.merge(graphdef, params, rest)(x) ** 2).sum().values

    x = _x((2, 6, 16))
    g_ref = jax.jit(jax.grad(loss))(params, x)
    g = jb_jit(jax.grad(loss))(params, x)
    # the key bias's gradient is zero by symmetry: compare with the rounding
    # bound of its terms, not with its own (noise-sized) largest entry
    testing.assert_close(g, g_ref, scale=lambda: testing.abs_scale(jax.grad(loss), params, x),
                         what="gradient")


def test_rules_become_param_shardings_and_flax_logical_rules():
    from jax.sharding import AxisType, PartitionSpec as P

    block = nn.TransformerBlock(16, 4, mlp_hidden=32, rngs=nnx.Rngs(0))
    rules = {"head": "model", "mlp": "model", "batch": "data", "embd": None}
    specs = nn.partition_specs(block, rules)
    assert specs["attn"]["query"]["kernel"] == P(None, "model", None)
    assert specs["mlp"]["down"]["kernel"] == P("model", None)
    assert specs["norm1"]["scale"] == P(None)
    # The same specs through Flax's own logical-axis machinery.
    nn.annotate_logical_axes(block)
    with nnx.logical_axis_rules(nn.flax_logical_axis_rules(rules, block)):
        flax_specs = nnx.get_partition_spec(nnx.state(block))
    mine = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))
    theirs = jax.tree.leaves(flax_specs, is_leaf=lambda s: isinstance(s, P))
    assert [tuple(s) for s in mine] == [tuple(s) for s in theirs]
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    placed = jax.device_put(nnx.state(block), nn.shardings(block, rules, mesh))
    q = placed["attn"]["query"]["kernel"][...]
    assert q.sharding.spec == P(None, "model", None) and q.addressable_shards[0].data.shape == (16, 1, 4)
    bad = nn.TransformerBlock(16, 4, mlp_hidden=30, rngs=nnx.Rngs(0))
    with pytest.raises(nx.DimError, match="dim 'mlp'.*size 30"):
        nn.shardings(bad, rules, mesh)


def test_named_contractions_reach_the_jaxpr():
    attn = nn.MultiHeadAttention(16, 4, kv_heads=2, rngs=nnx.Rngs(0))
    x = _x((2, 6, 16))
    jaxpr = jax.make_jaxpr(lambda x: attn(x).values)(x)
    einsums = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "einsum"]
    assert len(einsums) == 6
    assert any("kv_head" in e.params["out_dims"] and "group" in e.params["out_dims"] for e in einsums)
    assert not any(e.primitive.name == "dot_general" for e in jaxpr.jaxpr.eqns)
    assert math.isfinite(float(attn(x).values.sum()))
