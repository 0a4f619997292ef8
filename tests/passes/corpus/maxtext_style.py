"""Hand-written jnp in MaxText's style: parameters in a dict, `DenseGeneral`
projections as einsums over named-looking subscripts ("btd,dnh->btnh"),
RMSNorm computed in float32, rotary embeddings, grouped-query attention
that reshapes the query into (kv heads, group) and contracts against the
un-repeated K/V ("btkgd,bskd->bkgts"), a SwiGLU MLP (`wi_0`, `wi_1`, `wo`),
and a decoder stack unrolled in Python (`scan_layers=False`).

Already grouped: `group_heads` must not fire, and the contractions read no
repeated K/V. The unrolled stack of identical layers is what `reroll` is
for.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from _expect import Expect, repeated_operands_of_dots, einsums, calls
from jaxbackend._corpus import variants

B, T, E, KV, G, D, F = 2, 8, 16, 2, 2, 4, 32
N = KV * G


def _normal(key, shape, fan_in):
    return jax.random.normal(key, shape) / math.sqrt(fan_in)


def rms_norm(x, scale, eps=1e-6):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    return (y * scale).astype(x.dtype)


def rope(x, positions, base=10_000.0):
    """Rotary embedding on (b, t, heads, d): rotate halves by a per-position angle."""
    half = x.shape[-1] // 2
    freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions[:, :, None, None] * freq
    sin, cos = jnp.sin(angle), jnp.cos(angle)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def grouped_attention(q, k, v):
    """q: (b, t, kv*g, d) reshaped to its groups; k, v: (b, s, kv, d)."""
    b, t, n, d = q.shape
    q = q.reshape(b, t, k.shape[2], n // k.shape[2], d)
    logits = jnp.einsum("btkgd,bskd->bkgts", q, k) / math.sqrt(d)
    causal = jnp.tril(jnp.ones((t, k.shape[1]), bool))
    logits = jnp.where(causal, logits, jnp.finfo(logits.dtype).min)
    probs = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(b, t, n, d)


def mlp(p, x):
    gate = jnp.einsum("btd,df->btf", x, p["wi_0"])
    up = jnp.einsum("btd,df->btf", x, p["wi_1"])
    return jnp.einsum("btf,fd->btd", jax.nn.silu(gate) * up, p["wo"])


def decoder_layer(p, x, positions):
    h = rms_norm(x, p["pre_norm"])
    q = rope(jnp.einsum("btd,dnh->btnh", h, p["query"]), positions)
    k = rope(jnp.einsum("btd,dnh->btnh", h, p["key"]), positions)
    v = jnp.einsum("btd,dnh->btnh", h, p["value"])
    o = jnp.einsum("btnh,nhd->btd", grouped_attention(q, k, v), p["out"])
    x = x + o
    return x + mlp(p, rms_norm(x, p["post_norm"]))


def layer_params(seed):
    ks = jax.random.split(jax.random.key(seed), 7)
    return dict(pre_norm=jnp.ones((E,)), post_norm=jnp.ones((E,)),
                query=_normal(ks[0], (E, N, D), E), key=_normal(ks[1], (E, KV, D), E),
                value=_normal(ks[2], (E, KV, D), E), out=_normal(ks[3], (N, D, E), N * D),
                wi_0=_normal(ks[4], (E, F), E), wi_1=_normal(ks[5], (E, F), E),
                wo=_normal(ks[6], (F, E), F))


def inputs():
    x = jax.random.normal(jax.random.key(10), (B, T, E))
    return x, jnp.broadcast_to(jnp.arange(T, dtype=jnp.float32), (B, T))


def maxtext_decoder(p, x, positions):
    return decoder_layer(p, x, positions)


def maxtext_stack(layers, x):
    """Six MLP blocks, unrolled (MaxText with scan_layers=False)."""
    for p in layers:
        x = x + mlp(p, rms_norm(x, p["pre_norm"]))
    return x


_CHECKS = (einsums, calls, repeated_operands_of_dots)

# jnp.einsum emits dot_general itself: `inline` has no einsum to lower.
# RoPE's angles, sin and cos are computed for q and for k: cse keeps one.
CORPUS = [
    *variants("maxtext_decoder", maxtext_decoder, lambda: (layer_params(0), *inputs()),
              expect=Expect(fire=("inline_calls",), removes={"cse": 9}, checks=_CHECKS),
              expect_grad=Expect(fire=("inline_calls", "dce"), removes={"cse": 9},
                                 checks=_CHECKS)),
    *variants("maxtext_stack", maxtext_stack,
              lambda: ([layer_params(i) for i in range(6)], inputs()[0]),
              expect=Expect(matches={"reroll": {"reroll.runs": 1, "reroll.blocks_rolled": 6}},
                            fire=("inline_calls",), checks=_CHECKS),
              # the backward scan recomputes rms_norm's and the gated product's
              # multiplies (two from the stored layer input); dce drops those six residuals
              expect_grad=Expect(fire=("reroll", "inline_calls", "dce"), removes={"cse": 20},
                                 matches={"remat_residuals": {"residuals recomputed": 6}},
                                 checks=_CHECKS)),
]
