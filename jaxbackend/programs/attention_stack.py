"""A multi-layer causal self-attention stack, written twice.

`named_attention_stack` uses `jaxbackend.named`; `jnp_attention_stack` is the
same computation as a person would write it in plain jnp (einsum strings,
axis numbers). They share weights and must agree to float tolerance. Per
layer: four contractions, a softmax, a causal `where` mask and a residual
add: the program whose compile time grows superlinearly with depth in
PyTensor's xtensor, and the one the demo, the pass-scaling benchmark and
the notebooks use.

Both return `(loss, out)` where loss is the sum of the output, so
`jax.value_and_grad(..., has_aux=True)` differentiates the same scalar.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxbackend import named as nx

DEFAULT_SIZES = dict(batch=4, time=32, embd=64, head=4, hd=16)


def init_attention_stack(key, n_layers: int, *, batch=4, time=32, embd=64, head=4, hd=16,
                         dtype=jnp.float32):
    """Plain arrays: x (batch, time, embd) and per layer wq/wk/wv (embd, head,
    hd) and wo (head, hd, embd), scaled so activations stay O(1)."""
    keys = jax.random.split(key, 4 * n_layers + 1)
    x = jax.random.normal(keys[0], (batch, time, embd), dtype)
    layers = []
    for i in range(n_layers):
        k = keys[1 + 4 * i: 5 + 4 * i]
        s_in, s_out = 1 / math.sqrt(embd), 1 / math.sqrt(head * hd)
        layers.append(dict(
            wq=jax.random.normal(k[0], (embd, head, hd), dtype) * s_in,
            wk=jax.random.normal(k[1], (embd, head, hd), dtype) * s_in,
            wv=jax.random.normal(k[2], (embd, head, hd), dtype) * s_in,
            wo=jax.random.normal(k[3], (head, hd, embd), dtype) * s_out,
        ))
    return x, layers


# the dims of each per-layer weight
DIMS = dict(wq=("embd", "head", "hd"), wk=("embd", "head", "hd"),
             wv=("embd", "head", "hd"), wo=("head", "hd", "embd"))


def name_params(x, layers):
    """The same arrays as NamedArrays."""
    nx_x = nx.as_named(x, ("batch", "time", "embd"))
    nx_layers = [{k: nx.as_named(v, DIMS[k]) for k, v in layer.items()} for layer in layers]
    return nx_x, nx_layers


def named_attention_stack(x, layers):
    """x: NamedArray (batch, time, embd); layers: dicts of NamedArrays."""
    t = x.sizes["time"]
    causal = nx.arange(t, dim="time") >= nx.arange(t, dim="time_k")
    for p in layers:
        q = nx.dot(x, p["wq"], dim="embd")                       # batch time head hd
        k = nx.dot(x, p["wk"], dim="embd").rename(time="time_k")
        v = nx.dot(x, p["wv"], dim="embd").rename(time="time_k")
        s = nx.dot(q, k, dim="hd") / math.sqrt(q.sizes["hd"])    # batch head time time_k
        s = nx.where(causal, s, -1e9)
        a = nx.softmax(s, dim="time_k")
        o = nx.dot(a, v, dim="time_k")                           # batch head time hd
        x = x + nx.dot(o, p["wo"], dim=("head", "hd"))           # batch time embd
    return x.sum().values, x


def jnp_attention_stack(x, layers):
    """x: (batch, time, embd) array; layers: dicts of arrays."""
    t = x.shape[1]
    causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
    for p in layers:
        q = jnp.einsum("bte,ehd->bthd", x, p["wq"])
        k = jnp.einsum("bte,ehd->bthd", x, p["wk"])
        v = jnp.einsum("bte,ehd->bthd", x, p["wv"])
        s = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(q.shape[-1])
        s = jnp.where(causal, s, -1e9)
        a = jax.nn.softmax(s, axis=-1)
        o = jnp.einsum("bhts,bshd->bhtd", a, v)
        x = x + jnp.einsum("bhtd,hde->bte", o, p["wo"])
    return x.sum(), x
