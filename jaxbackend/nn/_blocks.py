"""Composite named layers: `MLP` (gelu or SwiGLU) and the pre-norm
`TransformerBlock` (x + attn(norm(x)), then x + mlp(norm(x))).

The hidden dim of the MLP is named `mlp`, so a sharding rule `mlp -> model`
gives Megatron-style column/row-parallel projections without any layer
knowing about meshes.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxbackend import named as nx
from jaxbackend._layer import layer
from jaxbackend.nn._attention import MultiHeadAttention
from jaxbackend.nn._layers import Dropout, LayerNorm, Linear, RMSNorm

ACTIVATIONS = ("gelu", "swiglu")
NORMS = {"layernorm": LayerNorm, "rmsnorm": RMSNorm}


class MLP(nnx.Module):
    """embd -> mlp -> embd. `activation="gelu"`: down(gelu(up(x)));
    `"swiglu"`: down(silu(gate(x)) * up(x))."""

    def __init__(self, embd: int, hidden: int, *, activation: str = "gelu",
                 use_bias: bool = True, dropout: float = 0.0, dtype=None,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        if activation not in ACTIVATIONS:
            raise ValueError(f"MLP: activation={activation!r} is not one of {ACTIVATIONS}.")
        self.activation = activation
        kw = dict(use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.up = Linear({"embd": embd}, {"mlp": hidden}, **kw)
        self.gate = Linear({"embd": embd}, {"mlp": hidden}, **kw) if activation == "swiglu" else None
        self.down = Linear({"mlp": hidden}, {"embd": embd}, **kw)
        self.dropout = Dropout(dropout, rngs=rngs)

    def __call__(self, x: nx.NamedArray) -> nx.NamedArray:
        if self.gate is not None:      # swiglu
            h = nx.silu(self.gate(x)) * self.up(x)
        else:
            h = nx.gelu(self.up(x))
        return self.dropout(self.down(h))


class TransformerBlock(nnx.Module):
    """Pre-norm block: x + attn(norm1(x)); then x + mlp(norm2(x)). `time`
    names the sequence dim attention runs over; `decode` is the same block
    over the attention's key/value cache (`MultiHeadAttention.decode`)."""

    def __init__(self, embd: int, heads: int, *, kv_heads: int | None = None,
                 mlp_hidden: int | None = None, activation: str = "gelu", norm: str = "layernorm",
                 rotary: bool = False, sliding_window: int | None = None, use_bias: bool = True,
                 dropout: float = 0.0, time: str = "time", dtype=None, param_dtype=jnp.float32,
                 rngs: nnx.Rngs):
        if norm not in NORMS:
            raise ValueError(f"TransformerBlock: norm={norm!r} is not one of {tuple(NORMS)}.")
        Norm = NORMS[norm]
        dt = dict(dtype=dtype, param_dtype=param_dtype)
        self.norm1 = Norm({"embd": embd}, **dt, rngs=rngs)
        self.attn = MultiHeadAttention(embd, heads, kv_heads=kv_heads, rotary=rotary,
                                       sliding_window=sliding_window, use_bias=use_bias,
                                       dropout=dropout, time=time, **dt, rngs=rngs)
        self.norm2 = Norm({"embd": embd}, **dt, rngs=rngs)
        self.mlp = MLP(embd, mlp_hidden or 4 * embd, activation=activation, use_bias=use_bias,
                       dropout=dropout, **dt, rngs=rngs)

    def __call__(self, x: nx.NamedArray) -> nx.NamedArray:
        """The block, traced once per distinct block structure and input
        (`jb.layer`): a for-loop over L blocks traces, differentiates and
        transposes one block's equations, not L copies."""
        return _block_call(self, x)

    def forward(self, x: nx.NamedArray) -> nx.NamedArray:
        """The block's equations, traced at every call (`__call__` caches them)."""
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))

    def init_cache(self, sizes: dict, length: int, dtype) -> tuple:
        """The attention's empty k/v buffers (`MultiHeadAttention.init_cache`)."""
        return self.attn.init_cache(sizes, length, dtype)

    def decode(self, x: nx.NamedArray, cache: tuple, pos) -> tuple:
        """The block on positions pos .. pos+t-1 of x: (out, updated cache)."""
        h, cache = self.attn.decode(self.norm1(x), cache, pos)
        x = x + h
        return x + self.mlp(self.norm2(x)), cache


@layer
def _block_call(block: TransformerBlock, x: nx.NamedArray) -> nx.NamedArray:
    return block.forward(x)
