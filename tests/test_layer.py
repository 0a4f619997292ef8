"""`jb.layer`: a layer traced once and called L times gives the same values
as the Python loop it replaces, binds one jaxpr object L times (so JAX's
JVP / partial-eval / transpose caches hit), and keeps NNX state updates."""

import jax
import jax.numpy as jnp
from flax import nnx

import jaxbackend as jb
from jaxbackend import _jax
from jaxbackend import named as nx
from jaxbackend import nn
from jaxbackend.testing import abs_scale, assert_close


def _block(h, w):
    return h + jnp.tanh(h @ w["a"]) @ w["b"]


def _weights(n):
    ks = jax.random.split(jax.random.key(0), 2 * n)
    return [{"a": jax.random.normal(ks[2 * i], (8, 16)) / 4,
             "b": jax.random.normal(ks[2 * i + 1], (16, 8)) / 4} for i in range(n)]


def _loss(block):
    def loss(ws, x):
        for w in ws:
            x = block(x, w)
        return jnp.sum(x ** 2)
    return loss


def _calls(closed):
    """The program's own `jit` equations (not those nested in their bodies)."""
    return [e for e in closed.jaxpr.eqns if e.primitive.name == "jit"]


def test_a_loop_of_layers_traces_the_body_once_and_matches_the_plain_loop():
    traced = []

    @jb.layer
    def block(h, w):
        traced.append(1)
        return _block(h, w)

    ws, x = _weights(12), jax.random.normal(jax.random.key(1), (4, 8))
    closed = jax.make_jaxpr(jax.value_and_grad(_loss(block)))(ws, x)
    assert len(traced) == 1
    calls = _calls(closed)
    # forward and backward per layer; the first layer's differ (x is not
    # differentiated), every other layer binds the same two jaxpr objects
    assert len(calls) == 24
    assert len({id(_jax.call_body(e)) for e in calls}) <= 4
    got = jax.value_and_grad(_loss(block))(ws, x)
    want = jax.value_and_grad(_loss(_block))(ws, x)
    assert_close(got, want, scale=abs_scale(jax.value_and_grad(_loss(_block)), ws, x))


def test_transformer_blocks_in_a_loop_share_one_call_and_match_their_equations():
    blocks = [nn.TransformerBlock(16, 4, kv_heads=2, rngs=nnx.Rngs(i)) for i in range(6)]
    x = nx.as_named(jax.random.normal(jax.random.key(2), (2, 8, 16)), ("batch", "time", "embd"))

    def run(call):
        h = x
        for b in blocks:
            h = call(b, h)
        return h.values

    closed = jax.make_jaxpr(lambda: run(lambda b, h: b(h)))()
    calls = _calls(closed)
    assert len(calls) == 6 and len({id(_jax.call_body(e)) for e in calls}) == 1
    assert_close(run(lambda b, h: b(h)), run(lambda b, h: b.forward(h)),
                 scale=jnp.abs(run(lambda b, h: b.forward(h))) + 1)


def test_dropout_state_advances_as_without_the_cache():
    def make():
        return nn.TransformerBlock(16, 4, dropout=0.5, rngs=nnx.Rngs(0, dropout=1))

    cached, plain = make(), make()
    x = nx.as_named(jax.random.normal(jax.random.key(3), (2, 8, 16)), ("batch", "time", "embd"))
    a1, a2 = cached(x).values, cached(x).values
    b1, b2 = plain.forward(x).values, plain.forward(x).values
    assert not jnp.allclose(a1, a2)            # the RNG counter moved between calls
    assert_close(a1, b1, scale=jnp.abs(b1) + 1)
    assert_close(a2, b2, scale=jnp.abs(b2) + 1)


def test_the_cached_transformer_program_matches_its_plain_loop_rolled():
    from jaxbackend.programs import transformer as T

    # 5 layers: the default pipeline rolls from REROLL_MIN_REPEATS = 5
    x, layers = T.init_transformer(jax.random.key(0), 5, seq=8, d=16, heads=2, mlp=32)
    vg = lambda model: jax.value_and_grad(  # noqa: E731
        lambda x, ls: model(x, ls, heads=2), argnums=(0, 1), has_aux=True)
    closed = jax.make_jaxpr(vg(T.cached_loop_transformer))(x, layers)
    calls = _calls(closed)
    assert len(calls) == 10 and len({id(_jax.call_body(e)) for e in calls}) <= 4
    f = jb.jit(vg(T.cached_loop_transformer))
    report = f.trace_passes(x, layers)
    assert "reroll.blocks_rolled: 10" in str(report)   # forward and backward, all 5 layers
    assert_close(f(x, layers), jax.jit(vg(T.loop_transformer))(x, layers),
                 scale=lambda: abs_scale(vg(T.loop_transformer), x, layers))


def test_a_layer_that_branches_on_its_index_is_not_merged_with_the_others():
    def make(i):
        @jb.layer
        def block(h, w):
            out = _block(h, w)
            return out * 0.5 if i == 3 else out   # the Python of layer 3 differs

        return block

    blocks = [make(i) for i in range(8)]

    def loss(ws, x):
        for blk, w in zip(blocks, ws):
            x = blk(x, w)
        return jnp.sum(x ** 2)

    def plain(ws, x):
        for i, w in enumerate(ws):
            x = _block(x, w) * (0.5 if i == 3 else 1.0)
        return jnp.sum(x ** 2)

    ws, x = _weights(8), jax.random.normal(jax.random.key(1), (4, 8))
    f = jb.jit(jax.value_and_grad(loss), reroll=2)
    report = str(f.trace_passes(ws, x))
    # layers 4..7 (and 0..2) roll, forward and backward; layer 3 stays its own call
    rolled = int(report.split("reroll.blocks_rolled: ")[1].split(",")[0])
    assert 0 < rolled <= 2 * 7
    assert_close(f(ws, x), jax.value_and_grad(plain)(ws, x),
                 scale=lambda: abs_scale(jax.value_and_grad(plain), ws, x))


class _Counter(nnx.Module):
    def __init__(self):
        self.n = nnx.BatchStat(jnp.zeros(()))

    def __call__(self, x):
        self.n[...] = self.n[...] + 1
        return x * self.n[...]


class _SharedCounter(nnx.Module):
    """One counter reached by two attributes: a pytree flatten would copy it."""

    def __init__(self):
        c = _Counter()
        self.a, self.b = c, c

    def __call__(self, x):
        return self.a(x) + self.b(x)


def test_a_module_shared_by_two_paths_is_updated_once_per_use_like_the_plain_call():
    from jaxbackend import _layer

    cached, plain = _SharedCounter(), _SharedCounter()
    assert _layer._TreeForm.split(((cached, jnp.ones(3)), {})) is None
    call = jb.layer(lambda m, x: m(x))
    x = jnp.arange(3.0)
    for _ in range(2):   # 1x + 2x, then 3x + 4x: the shared counter advances twice per call
        assert_close(call(cached, x), plain(x), scale=jnp.abs(plain.a.n[...] * x) * 4)
        assert float(cached.a.n[...]) == float(plain.a.n[...])
    assert cached.a is cached.b


def test_an_unshared_module_takes_the_pytree_path_and_writes_its_updates_back():
    from jaxbackend import _layer

    cached, plain = _Counter(), _Counter()
    assert _layer._TreeForm.split(((cached, jnp.ones(3)), {})) is not None
    call = jb.layer(lambda m, x: m(x))
    x = jnp.arange(3.0)
    for _ in range(3):
        assert_close(call(cached, x), plain(x), scale=jnp.abs(plain.n[...] * x))
    assert float(cached.n[...]) == 3.0


def test_a_python_flag_beside_a_module_is_static_as_under_nnx_split():
    """Python values among the arguments are part of the cache key, not
    traced inputs (as `nnx.split` keeps them), so the layer may branch on
    them; arrays and Variable values are the inputs."""
    from jaxbackend import _layer

    lin = nnx.Linear(3, 3, rngs=nnx.Rngs(0))
    x = jnp.ones((2, 3))
    inputs, static = _layer._TreeForm.split(((lin, x, True, "relu"), {}))
    assert len(inputs) == 3 and {v for _, v in static.consts} == {True, "relu"}
    call = jb.layer(lambda m, x, flag, act: (m(x) if flag else -m(x)) if act == "relu" else x)
    for flag in (True, False):
        assert_close(call(lin, x, flag, "relu"), lin(x) if flag else -lin(x),
                     scale=jnp.abs(lin(x)) + 1)
