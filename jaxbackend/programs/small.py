"""Small programs, each the target of one pass, with their arguments.

* `hand_mlp` / `named_mlp`: a two-layer MLP written the usual way
  (`x.reshape(-1, d) @ w`, which `fuse_projections` turns back into named
  contractions) and with names (`einsum` equations, a nested `jit` call for
  `inline_calls`). Arguments: `mlp_args()`.
* `xsa_expand` / `xsa_unsqueeze`: the XSA projection of grouped-query
  attention, y - (y . v_hat) v_hat with v_hat = v / |v| per KV head, in the
  two ways it is written in jnp: broadcast v to every query head and then
  normalise (`expand`, PyTorch's `.expand`: the norm is computed `group`
  times per KV head), or normalise once and broadcast (`unsqueeze`).
  `hoist_broadcast` turns the first into the second. v: (batch, time, kv,
  hd); y: (batch, time, kv, group, hd). Arguments: `xsa_args()`.
* `xsa_reshape` / `xsa_repeat`: the expand form as GQA code writes it, the
  group merged into the head dim (query head = kv_i * group + g_i): by
  `broadcast_to(...).reshape(...)` (the PyTorch report's
  `.expand(...).reshape(...)`) or by `jnp.repeat(v, group, axis=2)`.
  y: (batch, time, kv * group, hd). Arguments: `xsa_merged_args()`.
* `attention_scan`: layers as a `scan` whose body holds a nested `jit`, a
  named einsum, a `cond` and a `while` loop: every kind of sub-jaxpr a pass
  must recurse into. Arguments: `scan_args()`.

Every program returns a scalar (or, for the xsa forms, `xsa_loss` makes
one), so `jax.value_and_grad` applies; `jaxbackend.testing.check_pass` runs
a pass on both.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxbackend import named as nx


def rand(key: int, *shape):
    """Standard normal float32 values of `shape` from the integer seed `key`."""
    return jax.random.normal(jax.random.key(key), shape, jnp.float32)


def hand_mlp(x, w1, w2):
    """The hand-written flatten pattern: x.reshape(-1, d) @ w."""
    h = jnp.tanh((x.reshape(-1, x.shape[-1]) @ w1).reshape(*x.shape[:-1], w1.shape[1]))
    y = (h.reshape(-1, h.shape[-1]) @ w2).reshape(*x.shape[:-1], w2.shape[1])
    return jnp.sum(y ** 2)


def mlp_args():
    return (rand(0, 2, 3, 4), rand(1, 4, 5) * 0.5, rand(2, 5, 6) * 0.5)


def named_mlp(x, w1, w2):
    """Named twin: contractions are einsum equations with dim names."""
    x = nx.as_named(x, ("batch", "time", "embd"))
    h = nx.tanh(nx.dot(x, nx.as_named(w1, ("embd", "hidden")), dim="embd"))
    y = nx.dot(h, nx.as_named(w2, ("hidden", "out")), dim="hidden")
    # jnp.linalg.norm is a nested `jit` equation: a call for `inline` to remove
    return nx.softmax(y, dim="out").max(dim="out").sum().values + jnp.linalg.norm(w1)


def xsa_expand(v, y):
    """XSA, "expand" form: broadcast KV heads to every query head, then
    normalise."""
    vb = jnp.broadcast_to(v[:, :, :, None, :], y.shape)
    vn = vb / jnp.linalg.norm(vb, axis=-1, keepdims=True)
    return y - jnp.sum(y * vn, axis=-1, keepdims=True) * vn


def xsa_unsqueeze(v, y):
    """The same projection, "unsqueeze" form: normalise once per KV head."""
    vn = (v / jnp.linalg.norm(v, axis=-1, keepdims=True))[:, :, :, None, :]
    return y - jnp.sum(y * vn, axis=-1, keepdims=True) * vn


def xsa_args():
    return (rand(3, 2, 4, 2, 8), rand(4, 2, 4, 2, 3, 8))


def _xsa_merged(vb, y):
    vn = vb / jnp.linalg.norm(vb, axis=-1, keepdims=True)
    return y - jnp.sum(y * vn, axis=-1, keepdims=True) * vn


def xsa_reshape(v, y):
    """XSA, expand form with the group merged into the head dim by a
    reshape: (b, t, kv, d) -> (b, t, kv, group, d) -> (b, t, kv * group, d)."""
    b, t, kv, d = v.shape
    group = y.shape[2] // kv
    vb = jnp.broadcast_to(v[:, :, :, None, :], (b, t, kv, group, d)).reshape(b, t, kv * group, d)
    return _xsa_merged(vb, y)


def xsa_repeat(v, y):
    """XSA, expand form by `jnp.repeat` (same head layout as `xsa_reshape`)."""
    return _xsa_merged(jnp.repeat(v, y.shape[2] // v.shape[2], axis=2), y)


def xsa_merged_args():
    v, y = xsa_args()
    return v, y.reshape(*y.shape[:2], -1, y.shape[-1])


def xsa_loss(v, y):
    return jnp.sum(jnp.sin(xsa_expand(v, y)))


def attention_scan(x, w):
    """Layers as a scan whose body has a nested jit, a named einsum, a cond
    and a while loop: exercises recursion into every sub-jaxpr kind."""

    @jax.jit
    def inner(h, wi):
        a = nx.dot(nx.as_named(h, ("t", "e")), nx.as_named(wi, ("e", "f")), dim="e")
        s = nx.softmax(a, dim="f")
        return jnp.tanh(s.values) @ wi.T / math.sqrt(wi.shape[0])

    def body(h, wi):
        h = h + inner(h, wi)
        h = jax.lax.cond(jnp.sum(h) > 0, lambda q: q * 0.9, lambda q: q * 1.1, h)
        # reverse-mode AD cannot cross a while loop: feed it a stopped value
        bump = jax.lax.while_loop(lambda c: c[0] < 2,
                                  lambda c: (c[0] + 1, c[1] + 0.01 * jnp.exp(-c[1] * c[1])),
                                  (0, jax.lax.stop_gradient(h)))[1]
        h = h + 0.1 * bump
        return h, jnp.sum(h)

    h, ys = jax.lax.scan(body, x, w)
    return jnp.sum(h ** 2) + jnp.sum(ys) + jnp.sum(jax.checkpoint(jnp.sin)(h))


def scan_args():
    return (rand(5, 4, 6), rand(6, 3, 6, 5) * 0.4)
