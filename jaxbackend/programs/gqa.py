"""Grouped-query attention written the ways JAX codebases write it, for
`passes.group_heads`, its tests and `benchmarks/gqa.py`.

q: (batch, time, heads, hd) with heads = kv * group; k, v: (batch, time,
kv, hd). Every form computes the same causal softmax attention, query head
h reading KV head h // group (or h % kv for `tile`):

* `gqa_repeat`: `jnp.repeat(k, group, axis=2)` before the two einsums (the
  MaxText / Gemma "repeat KV" path); `gqa_broadcast`: the same copies as
  `broadcast_to(k[:, :, :, None, :]).reshape(...)`;
* `gqa_tile`: `jnp.tile`, query head h reading KV head h % kv (a different
  head-to-group assignment, so a different function of the same weights);
* `gqa_repeat_bhtd`: heads-first layout, `repeat` along axis 1 and
  `q @ k.swapaxes(-1, -2)` (PyTorch-port style);
* `gqa_grouped`: the hand-written grouped form: q reshaped to (batch, time,
  kv, group, hd) and einsums with an explicit group dim
  (`"btkgd,bskd->bkgts"`), no copy of K or V. `gqa_repeat` and
  `gqa_broadcast` equal it.

`gqa_loss(form)` makes a scalar program of a form (for `value_and_grad`);
`gqa_args(...)` gives random (q, k, v).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def _mask(t: int, s: int):
    return jnp.tril(jnp.ones((t, s), bool))


def _attend(q, k, v):
    """Causal softmax attention over per-query-head k, v: (b, s, heads, hd)."""
    s = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(q.shape[-1])
    s = jnp.where(_mask(q.shape[1], k.shape[1]), s, -1e30)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v)


def _group(q, k) -> int:
    return q.shape[2] // k.shape[2]


def gqa_repeat(q, k, v):
    """KV heads copied with `jnp.repeat` (query head h reads KV head h // group)."""
    g = _group(q, k)
    return _attend(q, jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2))


def gqa_broadcast(q, k, v):
    """KV heads copied by broadcast + reshape (same layout as `repeat`)."""
    b, s, kv, d = k.shape
    shape = (b, s, kv, _group(q, k), d)

    def copies(x):
        return jnp.broadcast_to(x[:, :, :, None, :], shape).reshape(b, s, -1, d)
    return _attend(q, copies(k), copies(v))


def gqa_tile(q, k, v):
    """KV heads copied with `jnp.tile` (query head h reads KV head h % kv)."""
    reps = (1, 1, _group(q, k), 1)
    return _attend(q, jnp.tile(k, reps), jnp.tile(v, reps))


def gqa_repeat_bhtd(q, k, v):
    """Heads-first layout: `repeat` along axis 1 and `@` with swapped axes."""
    q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    g = q.shape[1] // k.shape[1]
    k, v = jnp.repeat(k, g, axis=1), jnp.repeat(v, g, axis=1)
    s = (q @ k.swapaxes(-1, -2)) / math.sqrt(q.shape[-1])
    s = jnp.where(_mask(q.shape[2], k.shape[2]), s, -1e30)
    return (jax.nn.softmax(s, axis=-1) @ v).transpose(0, 2, 1, 3)


def gqa_grouped(q, k, v):
    """The hand-written grouped form: an explicit group dim, no copies."""
    b, t, h, d = q.shape
    kv = k.shape[2]
    q = q.reshape(b, t, kv, h // kv, d)
    s = jnp.einsum("btkgd,bskd->bkgts", q, k) / math.sqrt(d)
    s = jnp.where(_mask(t, k.shape[1]), s, -1e30)
    o = jnp.einsum("bkgts,bskd->btkgd", jax.nn.softmax(s, axis=-1), v)
    return o.reshape(b, t, h, d)


def gqa_loss(form):
    """A scalar program of `form` (a nonlinear readout, so every output
    element's gradient differs)."""
    def loss(q, k, v):
        return jnp.sum(jnp.tanh(form(q, k, v)))
    loss.__name__ = f"{form.__name__}_loss"
    return loss


def gqa_args(batch: int = 2, time: int = 8, kv: int = 2, group: int = 3, hd: int = 4,
             dtype=jnp.float32, seed: int = 0):
    """Random (q, k, v) for a GQA of `kv` KV heads and `group` query heads each."""
    kq, kk, kv_ = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (batch, time, kv * group, hd), jnp.float32)
    k = jax.random.normal(kk, (batch, time, kv, hd), jnp.float32)
    v = jax.random.normal(kv_, (batch, time, kv, hd), jnp.float32)
    return tuple(x.astype(dtype) for x in (q, k, v))
