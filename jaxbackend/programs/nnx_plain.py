"""A decoder-only transformer written with Flax NNX's own layers only.

No `jaxbackend.nn`, no named dims, no `jb.layer`: `nnx.Embed`,
`nnx.LayerNorm`, `nnx.MultiHeadAttention` (causal mask from
`nnx.make_causal_mask`), `nnx.Linear` and a gelu MLP, blocks in an
`nnx.List` and a Python for-loop over them. It stands for a model the
library's authors did not write: benchmarks and tests run jaxbackend's
passes and sharding search on it as a user would (`nn.functional`,
`jb.stack_layers`, `jb.jit`).
"""

from __future__ import annotations

import jax
import optax
from flax import nnx


class PlainBlock(nnx.Module):
    def __init__(self, d: int, heads: int, *, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(heads, d, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class PlainLM(nnx.Module):
    def __init__(self, layers: int, d: int = 128, heads: int = 4, vocab: int = 128, *,
                 rngs: nnx.Rngs):
        self.emb = nnx.Embed(vocab, d, rngs=rngs)
        self.blocks = nnx.List([PlainBlock(d, heads, rngs=rngs) for _ in range(layers)])
        self.out = nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, ids):
        x = self.emb(ids)
        mask = nnx.make_causal_mask(ids)
        for block in self.blocks:
            x = block(x, mask)
        return self.out(x)


def lm_loss(model: PlainLM, ids, targets):
    """Mean next-token cross-entropy."""
    return optax.softmax_cross_entropy_with_integer_labels(model(ids), targets).mean()
