"""A pre-LayerNorm transformer, written twice: as a Python loop and as a scan.

`loop_transformer` is what users write: a Python `for` loop over a list of
per-layer weight dicts, so the traced jaxpr holds one copy of the layer per
depth (XLA then compiles every copy). `scan_transformer` is the same model
written by hand with `jax.lax.scan` over the weights stacked on a leading
layer axis (`stack_layers`), which keeps one copy of the layer in the jaxpr.
They share weights and agree to float reassociation; the `reroll` pass turns
the first into the second automatically. `cached_loop_transformer` is the
for-loop with the layer wrapped in `jb.layer` (traced once, not per layer).

Sizes default to B=2, S=16, D=64, 4 heads, MLP 256 with gelu.
Per layer: LayerNorm -> causal multi-head attention -> residual add ->
LayerNorm -> gelu MLP -> residual add. Plain jnp only. Both functions return
`(loss, out)` with loss the sum of the output, for
`jax.value_and_grad(..., argnums=1, has_aux=True)`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxbackend._layer import layer

# sorted, so a layer dict flattens in this order (jax sorts dict keys)
PARAM_NAMES = ("b1", "b2", "ln1_b", "ln1_g", "ln2_b", "ln2_g", "w1", "w2", "wk", "wo", "wq", "wv")


def init_transformer(key, n_layers: int, *, batch=2, seq=16, d=64, heads=4, mlp=256,
                     dtype=jnp.float32):
    """x (batch, seq, d) and a list of `n_layers` weight dicts (PARAM_NAMES)."""
    assert d % heads == 0, (d, heads)
    keys = jax.random.split(key, 6 * n_layers + 1)
    x = jax.random.normal(keys[0], (batch, seq, d), dtype)
    layers = []
    for i in range(n_layers):
        k = keys[1 + 6 * i: 7 + 6 * i]
        s_d, s_m = 1 / math.sqrt(d), 1 / math.sqrt(mlp)
        layers.append(dict(
            ln1_g=jnp.ones((d,), dtype), ln1_b=jnp.zeros((d,), dtype),
            wq=jax.random.normal(k[0], (d, d), dtype) * s_d,
            wk=jax.random.normal(k[1], (d, d), dtype) * s_d,
            wv=jax.random.normal(k[2], (d, d), dtype) * s_d,
            wo=jax.random.normal(k[3], (d, d), dtype) * s_d,
            ln2_g=jnp.ones((d,), dtype), ln2_b=jnp.zeros((d,), dtype),
            w1=jax.random.normal(k[4], (d, mlp), dtype) * s_d,
            b1=jnp.zeros((mlp,), dtype),
            w2=jax.random.normal(k[5], (mlp, d), dtype) * s_m,
            b2=jnp.zeros((d,), dtype),
        ))
    return x, layers


def stack_layers(layers):
    """A list of weight dicts -> one dict of arrays with a leading layer axis."""
    return jax.tree.map(lambda *ws: jnp.stack(ws), *layers)


def layer_norm(x, g, b, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + eps) * g + b


def transformer_layer(x, p, heads: int = 4):
    """One pre-LN block; x (batch, seq, d), p one layer's weight dict."""
    b, s, d = x.shape
    hd = d // heads
    h = layer_norm(x, p["ln1_g"], p["ln1_b"])
    q = (h @ p["wq"]).reshape(b, s, heads, hd)
    k = (h @ p["wk"]).reshape(b, s, heads, hd)
    v = (h @ p["wv"]).reshape(b, s, heads, hd)
    att = jnp.einsum("bqhe,bkhe->bhqk", q, k) / math.sqrt(hd)
    causal = jnp.arange(s)[:, None] >= jnp.arange(s)[None, :]
    att = jax.nn.softmax(jnp.where(causal, att, -1e9), axis=-1)
    o = jnp.einsum("bhqk,bkhe->bqhe", att, v).reshape(b, s, d)
    x = x + o @ p["wo"]
    h = layer_norm(x, p["ln2_g"], p["ln2_b"])
    return x + jax.nn.gelu(h @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def loop_transformer(x, layers, heads: int = 4):
    """The Python-for-loop model (unrolled in the jaxpr): (loss, out)."""
    for p in layers:
        x = transformer_layer(x, p, heads)
    return x.sum(), x


@functools.cache
def _cached_layer(heads: int):
    return layer(functools.partial(transformer_layer, heads=heads))


def cached_loop_transformer(x, layers, heads: int = 4):
    """`loop_transformer` with the layer a `jb.layer` call: the for-loop
    traces one layer and binds the same `jit` equation per layer (which
    `reroll` rolls into `scan`): (loss, out)."""
    block = _cached_layer(heads)
    for p in layers:
        x = block(x, p)
    return x.sum(), x


def scan_transformer(x, stacked, heads: int = 4):
    """The hand-written scan model over `stack_layers(layers)`: (loss, out)."""
    def body(x, p):
        return transformer_layer(x, p, heads), None

    x, _ = jax.lax.scan(body, x, stacked)
    return x.sum(), x
