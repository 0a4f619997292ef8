"""The slow, obvious reference: a GPT written positionally in plain Flax NNX
(`nnx.Embed`, `nnx.Linear`, `nnx.LayerNorm`/`nnx.RMSNorm`, jnp einsums and
axis numbers), reading the same `GPTConfig`; and `to_positional`, the map
from the named GPT's parameters to this model's (reshapes only).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx


class PlainAttention(nnx.Module):
    def __init__(self, c, rngs):
        self.h, self.kv = c.heads, c.kv_heads or c.heads
        self.d = c.embd // c.heads
        self.rotary = c.rotary
        b = c.use_bias
        self.q = nnx.Linear(c.embd, self.h * self.d, use_bias=b, rngs=rngs)
        self.k = nnx.Linear(c.embd, self.kv * self.d, use_bias=b, rngs=rngs)
        self.v = nnx.Linear(c.embd, self.kv * self.d, use_bias=b, rngs=rngs)
        self.o = nnx.Linear(self.h * self.d, c.embd, use_bias=b, rngs=rngs)

    def rope(self, x):  # x: (B, T, heads, D)
        t, d = x.shape[1], x.shape[-1]
        inv = 1.0 / (10000.0 ** (jnp.arange(0, d // 2, dtype=jnp.float32) * 2.0 / d))
        ang = jnp.arange(t, dtype=jnp.float32)[:, None] * inv[None, :]
        cos, sin = jnp.cos(ang)[None, :, None, :], jnp.sin(ang)[None, :, None, :]
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    def __call__(self, x):
        B, T, _ = x.shape
        q = self.q(x).reshape(B, T, self.h, self.d)
        k = self.k(x).reshape(B, T, self.kv, self.d)
        v = self.v(x).reshape(B, T, self.kv, self.d)
        if self.rotary:
            q, k = self.rope(q), self.rope(k)
        k = jnp.repeat(k, self.h // self.kv, axis=2)
        v = jnp.repeat(v, self.h // self.kv, axis=2)
        s = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(self.d)
        causal = jnp.tril(jnp.ones((T, T), bool))
        s = jnp.where(causal, s, jnp.finfo(s.dtype).min)
        a = jax.nn.softmax(s, axis=-1)
        o = jnp.einsum("bhts,bshd->bthd", a, v).reshape(B, T, self.h * self.d)
        return self.o(o)


class PlainMLP(nnx.Module):
    def __init__(self, c, rngs):
        m, b = c.mlp_ratio * c.embd, c.use_bias
        self.swiglu = c.activation == "swiglu"
        self.up = nnx.Linear(c.embd, m, use_bias=b, rngs=rngs)
        self.gate = nnx.Linear(c.embd, m, use_bias=b, rngs=rngs) if self.swiglu else None
        self.down = nnx.Linear(m, c.embd, use_bias=b, rngs=rngs)

    def __call__(self, x):
        h = jax.nn.silu(self.gate(x)) * self.up(x) if self.swiglu else jax.nn.gelu(self.up(x))
        return self.down(h)


def _norm(c, rngs):
    if c.norm == "layernorm":
        return nnx.LayerNorm(c.embd, epsilon=1e-6, rngs=rngs)
    return nnx.RMSNorm(c.embd, epsilon=1e-6, rngs=rngs)


class PlainBlock(nnx.Module):
    def __init__(self, c, rngs):
        self.ln1, self.attn = _norm(c, rngs), PlainAttention(c, rngs)
        self.ln2, self.mlp = _norm(c, rngs), PlainMLP(c, rngs)

    def __call__(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class PlainGPT(nnx.Module):
    def __init__(self, c, rngs):
        self.c = c
        self.tok = nnx.Embed(c.vocab_size, c.embd, rngs=rngs)
        self.pos = None if c.rotary else nnx.Param(jnp.zeros((c.seq_len, c.embd)))
        self.blocks = nnx.List([PlainBlock(c, rngs) for _ in range(c.n_layers)])
        self.ln_f = _norm(c, rngs)
        self.head = None if c.tie_embeddings else nnx.Linear(c.embd, c.vocab_size, use_bias=False,
                                                             rngs=rngs)

    def __call__(self, tokens):  # (B, T) ints -> (B, T, V)
        x = self.tok(tokens)
        if self.pos is not None:
            x = x + self.pos[...][: tokens.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        x = self.ln_f(x)
        return self.tok.attend(x) if self.head is None else self.head(x)




def to_positional(p: dict, c) -> dict:
    """Named GPT params (pure dict) -> PlainGPT params (pure dict)."""
    def lin(d, shape_k, shape_b=None):
        out = {"kernel": d["kernel"].reshape(shape_k)}
        if "bias" in d:
            out["bias"] = d["bias"].reshape(shape_b if shape_b is not None else (shape_k[-1],))
        return out

    def norm(d):
        return {k: v for k, v in d.items()}

    E, H, D = c.embd, c.heads, c.embd // c.heads
    KV = c.kv_heads or c.heads
    out = {"tok": {"embedding": p["tok"]["embedding"]}, "blocks": {}, "ln_f": norm(p["norm"])}
    if not c.rotary:
        out["pos"] = p["pos"]
    if not c.tie_embeddings:
        out["head"] = {"kernel": p["head"]["kernel"]}
    for i, b in p["blocks"].items():
        a, m = b["attn"], b["mlp"]
        blk = {"ln1": norm(b["norm1"]), "ln2": norm(b["norm2"]), "attn": {
            "q": lin(a["query"], (E, H * D)), "k": lin(a["key"], (E, KV * D)),
            "v": lin(a["value"], (E, KV * D)), "o": lin(a["out"], (H * D, E))},
            "mlp": {"up": lin(m["up"], m["up"]["kernel"].shape),
                    "down": lin(m["down"], m["down"]["kernel"].shape)}}
        if "gate" in m and m["gate"] is not None:
            blk["mlp"]["gate"] = lin(m["gate"], m["gate"]["kernel"].shape)
        out["blocks"][i] = blk
    return out
