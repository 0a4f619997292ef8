"""Hand-written jnp in Gemma's style: bfloat16 activations with an RMSNorm
computed in float32 and scaled by `(1 + scale)`, a GeGLU feed-forward whose
gate and up projections are one stacked weight ("btd,gdf->gbtf"), and
attention whose K/V heads are copied to every query head with `jnp.repeat`
before the einsums (the repeat-KV path of the first Gemma ports and of
Hugging Face's Flax models), with Gemma 2's tanh soft-capping of the logits.

The repeated heads are the target of `group_heads`: afterwards no
contraction reads a copied K or V head, forward or backward, and the
attention costs within 1.10x the bytes and 1.05x the flops of the same
attention written grouped (`grouped_reference`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from _expect import Expect, repeated_operands_of_dots, einsums, calls
from jaxbackend._corpus import value_and_grad_of, variants

B, T, E, KV, G, H, F = 2, 8, 16, 2, 3, 4, 32
N = KV * G
CAP = 50.0


def rms_norm(x, scale, eps=1e-6):
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * (1 + scale)).astype(x.dtype)


def geglu(x, w_gating, w_linear):
    gate = jnp.einsum("btd,gdf->gbtf", x, w_gating)
    return jnp.einsum("btf,fd->btd", jax.nn.gelu(gate[0]) * gate[1], w_linear)


def _softmax_attend(logits, v, t):
    logits = jnp.tanh(logits / CAP) * CAP
    causal = jnp.tril(jnp.ones((t, t), bool))
    probs = jax.nn.softmax(jnp.where(causal, logits, -2.3819763e38), axis=-1)
    return probs, v


def repeat_kv_attention(p, x):
    q = jnp.einsum("btd,ndh->btnh", x, p["q"]) * H ** -0.5
    k = jnp.einsum("btd,kdh->btkh", x, p["k"])
    v = jnp.einsum("btd,kdh->btkh", x, p["v"])
    k, v = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
    probs, v = _softmax_attend(jnp.einsum("btnh,bsnh->bnts", q, k), v, x.shape[1])
    return jnp.einsum("btnh,nhd->btd", jnp.einsum("bnts,bsnh->btnh", probs, v), p["o"])


def grouped_reference(p, x):
    """The same attention with an explicit group dim: K/V read once."""
    q = jnp.einsum("btd,ndh->btnh", x, p["q"]) * H ** -0.5
    k = jnp.einsum("btd,kdh->btkh", x, p["k"])
    v = jnp.einsum("btd,kdh->btkh", x, p["v"])
    q = q.reshape(*q.shape[:2], KV, G, H)
    probs, v = _softmax_attend(jnp.einsum("btkgh,bskh->bkgts", q, k), v, x.shape[1])
    o = jnp.einsum("bkgts,bskh->btkgh", probs, v).reshape(*x.shape[:2], N, H)
    return jnp.einsum("btnh,nhd->btd", o, p["o"])


def gemma_block(p, x):
    h = x + repeat_kv_attention(p, rms_norm(x, p["attn_norm"]))
    return h + geglu(rms_norm(h, p["mlp_norm"]), p["gating"], p["linear"])


def _w(key, shape, fan_in, dtype=jnp.float32):
    return (jax.random.normal(key, shape) / math.sqrt(fan_in)).astype(dtype)


def params(dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(20), 6)
    return dict(q=_w(ks[0], (N, E, H), E, dtype), k=_w(ks[1], (KV, E, H), E, dtype),
                v=_w(ks[2], (KV, E, H), E, dtype), o=_w(ks[3], (N, H, E), N * H, dtype),
                gating=_w(ks[4], (2, E, F), E, dtype), linear=_w(ks[5], (F, E), F, dtype),
                attn_norm=jnp.zeros((E,)), mlp_norm=jnp.zeros((E,)))


def x_of(dtype=jnp.float32):
    return jax.random.normal(jax.random.key(21), (B, T, E)).astype(dtype)


def gemma_attention(p, x):
    return repeat_kv_attention(p, x)


def gemma_block_bf16(p, x):
    return gemma_block(p, x)


_CHECKS = (einsums, calls, repeated_operands_of_dots)
# Forward: K and V each grouped once. Backward: the two contractions of
# the gradient that read them again, and AD's group sums of dK and dV
# folded into their contractions.
_FWD = {"group_heads": {"repeated operand grouped": 2}}
_BWD = {"group_heads": {"repeated operand grouped": 4, "group sum folded into contraction": 2}}
_COST = {"flops": 1.05, "bytes accessed": 1.10}

CORPUS = [
    *variants("gemma_attention", gemma_attention, lambda: (params(), x_of()),
              expect=Expect(matches=_FWD, fire=("inline_calls", "dce"), checks=_CHECKS,
                            cost_le=(grouped_reference, _COST)),
              expect_grad=Expect(matches=_BWD, fire=("inline_calls", "cse", "dce"),
                                 checks=_CHECKS,
                                 cost_le=(value_and_grad_of(grouped_reference), _COST))),
    *variants("gemma_block_bf16", gemma_block_bf16,
              lambda: (params(jnp.bfloat16), x_of(jnp.bfloat16)),
              expect=Expect(matches=_FWD, fire=("inline_calls", "dce"), checks=_CHECKS),
              expect_grad=Expect(matches=_BWD, fire=("inline_calls", "cse", "dce"),
                                 checks=_CHECKS, rounding=jnp.bfloat16)),
]
