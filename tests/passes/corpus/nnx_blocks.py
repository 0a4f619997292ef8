"""Flax NNX layers as people stack them: `nnx.Linear` MLP, the built-in
`nnx.MultiHeadAttention` (multi-head and grouped-query, causal), a
pre-norm residual block with `nnx.RMSNorm` / `nnx.LayerNorm`, and a residual
block of two 3x3 `nnx.Conv` (NHWC).

Each program is a pure function of the module's `nnx.State` and the input
(`nnx.merge` inside), so `value_and_grad` differentiates the parameters.
NNX already emits batch-keeping `dot_general`s (no flatten chain) and its
GQA contracts a grouped query against un-repeated K/V, so neither
`fuse_projections` nor `group_heads` has anything to do. What fires is
cleanup: the attention's nested calls inlined, its mask broadcasts
composed, AD's duplicates removed, and, in the gradients, sums moved inside
constant factors (`hoist_broadcast`). The convolutions' gradients are
convolutions in other layouts (the kernel read with its features swapped,
the batch contracted): `canonical_conv` transposes them into NHWC / HWIO.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from _expect import Expect, repeated_operands_of_dots, einsums, calls, noncanonical_convs
from jaxbackend._corpus import variants

B, T, E = 2, 8, 16


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(E, 4 * E, rngs=rngs)
        self.down = nnx.Linear(4 * E, E, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x)))


class Block(nnx.Module):
    """Pre-norm residual block: RMSNorm -> Linear -> silu -> Linear, then LayerNorm."""

    def __init__(self, rngs):
        self.norm = nnx.RMSNorm(E, rngs=rngs)
        self.mlp = MLP(rngs)
        self.final = nnx.LayerNorm(E, rngs=rngs)

    def __call__(self, x):
        return self.final(x + self.mlp(self.norm(x)))


def _mha(kv_heads):
    return nnx.MultiHeadAttention(num_heads=4, in_features=E, num_kv_heads=kv_heads, decode=False,
                                  rngs=nnx.Rngs(0))


class ConvBlock(nnx.Module):
    """x + conv(relu(conv(x))), 3x3 convolutions over NHWC."""

    def __init__(self, rngs):
        self.c1 = nnx.Conv(E, E, (3, 3), rngs=rngs)
        self.c2 = nnx.Conv(E, E, (3, 3), rngs=rngs)

    def __call__(self, x):
        return x + self.c2(jax.nn.relu(self.c1(x)))


_MODULES = {"mlp": lambda: MLP(nnx.Rngs(0)), "block": lambda: Block(nnx.Rngs(0)),
            "mha": lambda: _mha(4), "gqa": lambda: _mha(2), "conv": lambda: ConvBlock(nnx.Rngs(0))}


@functools.cache
def _split(kind):
    return nnx.split(_MODULES[kind]())


def _x():
    return jax.random.normal(jax.random.key(1), (B, T, E))


def nnx_mlp(state, x):
    return nnx.merge(_split("mlp")[0], state)(x)


def nnx_block(state, x):
    return nnx.merge(_split("block")[0], state)(x)


def nnx_mha(state, x):
    return nnx.merge(_split("mha")[0], state)(x, is_causal=True)


def nnx_gqa(state, x):
    return nnx.merge(_split("gqa")[0], state)(x, is_causal=True)


def nnx_conv(state, x):
    return nnx.merge(_split("conv")[0], state)(x)


def _args(kind):
    if kind == "conv":   # (batch, height, width, channels)
        return lambda: (_split(kind)[1], jax.random.normal(jax.random.key(1), (B, T, T, E)))
    return lambda: (_split(kind)[1], _x())


_FLAT = (einsums, calls)
_ATTN = _FLAT + (repeated_operands_of_dots,)

# The MLP and norm block have no nested calls, no flatten chains and no
# duplicates: forward, nothing fires. Their gradients scale a cotangent by
# constant factors: `hoist_broadcast` sums first and scales after; sums
# whose operand a weight gradient also reads stay put (no added work). The attention masks are broadcast
# comparisons combined with `and` (hoisted, the broadcasts composed);
# `dot_product_attention` computes the mask's broadcast twice (cse).
_ATTN_FWD = Expect(fire=("inline_calls", "cse", "dce"), checks=_ATTN,
                   matches={"hoist_broadcast": {"hoisted and": 1}})
CORPUS = [
    *variants("nnx_mlp", nnx_mlp, _args("mlp"),
              expect=Expect(checks=_FLAT),
              expect_grad=Expect(matches={"hoist_broadcast": {"sum sunk past broadcast factors": 1}},
                                 checks=_FLAT)),
    *variants("nnx_block", nnx_block, _args("block"),
              expect=Expect(checks=_FLAT),
              expect_grad=Expect(matches={"hoist_broadcast": {"sum sunk past broadcast factors": 1}},
                                 fire=("cse",), checks=_FLAT)),
    *variants("nnx_mha", nnx_mha, _args("mha"), expect=_ATTN_FWD,
              expect_grad=Expect(fire=("inline_calls", "hoist_broadcast", "dce"), checks=_ATTN,
                                 removes={"cse": 3})),
    *variants("nnx_gqa", nnx_gqa, _args("gqa"), expect=_ATTN_FWD,
              expect_grad=Expect(fire=("inline_calls", "hoist_broadcast", "dce"), checks=_ATTN,
                                 removes={"cse": 3})),
    # jax.nn.relu is a nested jit (inlined). The forward convolutions are
    # canonical already; the gradient (of the parameters) has three others:
    # both kernel gradients and the second convolution's input gradient.
    # The bias gradients are sums of a broadcast cotangent (hoisted).
    *variants("nnx_conv", nnx_conv, _args("conv"),
              expect=Expect(fire=("inline_calls",), checks=_FLAT + (noncanonical_convs,)),
              expect_grad=Expect(fire=("inline_calls", "cse"),
                                 matches={
                                     "canonical_conv": {"convolution made canonical": 3},
                                     "hoist_broadcast": {"sum sunk past broadcast factors": 1}},
                                 checks=_FLAT + (noncanonical_convs,))),
]
