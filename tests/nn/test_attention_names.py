"""Attention's dim names: the sequence dim is an argument, and grouped-query
attention keeps the names that sharding rules are written in."""

import jax
import numpy as np
import pytest
from flax import nnx

import jaxbackend as jb
from jaxbackend import named as nx
from jaxbackend import nn


def _x(dims=("batch", "time", "embd"), shape=(2, 6, 16)):
    return nx.as_named(jax.random.normal(jax.random.key(1), shape), dims)


@pytest.mark.parametrize("kv_heads, rotary", [(4, False), (2, True)])
def test_sequence_dim_name_is_an_argument(kv_heads, rotary):
    ref = nn.MultiHeadAttention(16, 4, kv_heads=kv_heads, rotary=rotary, rngs=nnx.Rngs(0))
    seq = nn.MultiHeadAttention(16, 4, kv_heads=kv_heads, rotary=rotary, time="seq",
                                rngs=nnx.Rngs(0))
    x = _x()
    y = seq(x.rename(time="seq"))
    assert y.dims == ("batch", "seq", "embd")
    # the same program up to names: bitwise the same numbers
    np.testing.assert_array_equal(y.values, ref(x).values)
    jaxpr = jax.make_jaxpr(lambda v: seq(nx.as_named(v, ("batch", "seq", "embd"))).values)(x.values)
    dims = {d for e in jaxpr.jaxpr.eqns if e.primitive.name == "einsum"
            for k in ("lhs_dims", "rhs_dims", "out_dims") for d in e.params[k]}
    assert {"seq", "seq_k"} <= dims and not dims & {"time", "time_k"}
    with pytest.raises(nx.DimError, match="'seq'.*time="):
        seq(x)  # no `seq` dim in the input
    with pytest.raises(nx.DimError, match="'seq_k'"):
        seq(nx.as_named(jax.numpy.zeros((6, 6, 16)), ("seq_k", "seq", "embd")))


def test_transformer_block_passes_the_sequence_dim_name():
    ref = nn.TransformerBlock(16, 4, mlp_hidden=32, rngs=nnx.Rngs(0))
    blk = nn.TransformerBlock(16, 4, mlp_hidden=32, time="pos", rngs=nnx.Rngs(0))
    x = _x()
    y = blk(x.rename(time="pos"))
    assert y.dims == ("batch", "pos", "embd")
    np.testing.assert_array_equal(y.values, ref(x).values)


def test_grouped_query_attention_keeps_head_for_sharding_rules():
    from jax.sharding import AxisType

    # 8 query heads in 4 groups: `head` is laid out as kv_head, so model=4 divides it
    attn = nn.MultiHeadAttention(32, 8, kv_heads=4, rngs=nnx.Rngs(0))
    assert nn.param_dims(attn)["query"]["kernel"] == ("embd", "head", "hd")
    graphdef, params, rest = nnx.split(attn, nnx.Param, ...)

    def loss(params, x):
        return (nnx.merge(graphdef, params, rest)(x) ** 2).sum().values

    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    x = _x(shape=(2, 8, 32))
    vg = jax.value_and_grad(loss)
    f = jb.jit(vg, mesh=mesh, rules={"batch": "data", "head": "model"})
    (v, g), (v0, g0) = f(params, x), jax.jit(vg)(params, x)
    assert f.plan.rules["head"] == "model"
    # the rule reaches the parameters named by `head` (and kv_head, its major factor)
    assert tuple(g["query"]["kernel"].sharding.spec)[:2] == (None, "model")
    assert tuple(g["out"]["kernel"].sharding.spec)[:1] == ("model",)
    assert nn.partition_specs(attn, f.plan)["query"]["kernel"] == jax.sharding.PartitionSpec(
        None, "model", None)
    # the key bias's gradient is a cancelling sum (softmax ignores a shift,
    # so it is 0 up to rounding): compared at the error model's scale
    jb.testing.assert_close((v, g), (v0, g0), scale=lambda: jb.testing.abs_scale(vg, params, x),
                            what="sharded GQA value and gradient")


def test_reverse_mode_keeps_the_causal_mask_unbroadcast(monkeypatch):
    # the backward select needs the causal mask; kept broadcast to the
    # scores' (batch, head, time, time) shape it was a residual per layer
    # that a rolled step stacked (16 MiB a layer at batch 64, seq 256)
    import jax.numpy as jnp

    from jaxbackend.nn import _attention

    attn = nn.MultiHeadAttention(16, 4, rngs=nnx.Rngs(0))
    x = _x(shape=(3, 6, 16))
    g = jax.random.normal(jax.random.key(2), (3, 6, 16))

    def run():
        y, vjp = jax.vjp(lambda v: attn(nx.as_named(v, x.dims)).values, x.values)
        masks = [r.size for r in jax.tree.leaves(vjp) if r.dtype == bool]
        return y, vjp(g)[0], masks

    y, dx, masks = run()
    assert masks and max(masks) <= 6 * 6, masks   # (time, time_k) at most
    # the plain select: a mask of the scores' size saved; same numbers, bit for bit
    monkeypatch.setattr(_attention, "_causal",
                        lambda s, keep: nx.where(keep, s, jnp.finfo(s.dtype).min))
    y0, dx0, masks0 = run()
    assert max(masks0) == 3 * 4 * 6 * 6, masks0
    np.testing.assert_array_equal(y, y0)
    np.testing.assert_array_equal(dx, dx0)
