"""Architectures the other benchmarks never use, written as a user would
(Flax NNX modules over `jaxbackend.nn` and `named`, a Python for-loop over
an `nnx.List` of blocks), for `other_models.py`:

* `vit`: patches by `nx.rearrange`, a learned position table (an
  `nnx.Param` of dims (patch, embd)), bidirectional pre-norm blocks over
  `patch`, mean pooling, a classifier;
* `dit`: adaLN-conditioned blocks: every layer reads the class embedding
  (its gradient is a sum over the layers), an MSE loss;
* `moe`: dense (soft) mixtures of expert MLPs (weights with an `expert`
  dim, one of them a raw 3-d `nnx.Param`) plus a load-balancing loss the
  loop sums from `aux = 0.0`;
* `encdec`: an encoder (library blocks over `src`) and a decoder of custom
  blocks with causal self-attention and cross-attention to the encoder
  output (read by every decoder layer);
* `localglobal`: a decoder whose layers alternate sliding-window (16
  positions) and global causal attention (Gemma 2, Mistral variants), with
  grouped-query attention, rotary positions, RMSNorm and SwiGLU: no two
  consecutive forward layers are alike, so the forward rolls by pairs;
* `linen`: a GPT in Flax linen with no dim names at all (`nn.Embed`,
  `nn.MultiHeadDotProductAttention` with a causal mask, `nn.LayerNorm`,
  `nn.Dense`, a gelu MLP): per-layer params are linen's numbered entries
  (`LinenBlock_0`, `LinenBlock_1`, ...); stacked params are linen's own
  `nn.scan` over the block (`jb.stack_layers` refuses linen's numbered
  entries and says so).
  Its hand rule sets name the dims by their paths, as the plan does.
* `nnx`: a GPT in plain Flax NNX, no dim names either (`nnx.Embed`, whose
  `attend` is the output layer: tied weights; `nnx.MultiHeadAttention` with
  a causal mask, `nnx.LayerNorm`, `nnx.Linear`), trained as nanoGPT-style
  recipes do: gradients clipped to global norm 1, AdamW on a warmup-cosine
  schedule. Stacked params are `jb.stack_layers` of the `nnx.State`; the
  loss merges `jb.unstack_layers(params)` (`nnx.merge` wants the State
  layer by layer, and gets it, split in the traced program). With
  `traced_once`, the model calls each block through one `jb.layer`, so
  JAX traces a block once, not once per layer.

`setup(name, layers, stacked, traced_once)` returns (params, optax tx, step, batch, hand
rule sets); `step(params, opt_state, *batch)` is the AdamW training step.
"""

from __future__ import annotations

import math

import flax.linen as linen
import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jaxbackend as jb
from jaxbackend import named as nx
from jaxbackend import nn

MODELS = ("vit", "dit", "moe", "encdec", "localglobal", "linen", "nnx")
KINDS = ("per-layer", "stacked")   # the params' forms measured, every model
# setup's arguments per form ("stacked, jb.layer": the nnx model only)
FORMS = {"per-layer": {}, "stacked": {"stacked": True},
         "stacked, jb.layer": {"stacked": True, "traced_once": True}}


class ViT(nnx.Module):
    def __init__(self, layers, embd, heads, patch, img, classes, rngs):
        self.p = patch
        self.inp = nn.Linear({"pix": patch * patch * 3}, {"embd": embd}, rngs=rngs)
        self.pos = nnx.Param(jax.random.normal(rngs.params(), ((img // patch) ** 2, embd)) * 0.02,
                             dims=("patch", "embd"))
        self.blocks = nnx.List([nn.TransformerBlock(embd, heads, time="patch", rngs=rngs)
                                for _ in range(layers)])
        self.norm = nn.LayerNorm({"embd": embd}, rngs=rngs)
        self.head = nn.Linear({"embd": embd}, {"cls": classes}, rngs=rngs)

    def loss(self, images, labels):
        x = nx.rearrange(nx.as_named(images, ("batch", "h", "w", "c")),
                         "batch (hp p1) (wp p2) c -> batch (patch: hp wp) (pix: p1 p2 c)",
                         p1=self.p, p2=self.p)
        x = self.inp(x) + nn.named(self.pos)
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.norm(x).mean(dim="patch"))
        return nx.cross_entropy(logits, nx.as_named(labels, ("batch",)), dim="cls").values.mean()


class DiTBlock(nnx.Module):
    def __init__(self, embd, heads, rngs):
        self.n1 = nn.LayerNorm({"embd": embd}, use_bias=False, rngs=rngs)
        self.attn = nn.MultiHeadAttention(embd, heads, causal=False, rngs=rngs)
        self.n2 = nn.LayerNorm({"embd": embd}, use_bias=False, rngs=rngs)
        self.mlp = nn.MLP(embd, 4 * embd, rngs=rngs)
        self.ada = nn.Linear({"cemb": embd}, {"mod": 4, "embd": embd}, rngs=rngs)

    def __call__(self, x, c):
        s1, b1, s2, b2 = (self.ada(nx.silu(c)).isel(mod=i) for i in range(4))
        x = x + self.attn(self.n1(x) * (1 + s1) + b1)
        return x + self.mlp(self.n2(x) * (1 + s2) + b2)


class DiT(nnx.Module):
    def __init__(self, layers, embd, heads, feat, classes, rngs):
        self.inp = nn.Linear({"feat": feat}, {"embd": embd}, rngs=rngs)
        self.cls = nn.Embedding(classes, embd, vocab_dim="cls", rngs=rngs)
        self.blocks = nnx.List([DiTBlock(embd, heads, rngs) for _ in range(layers)])
        self.out = nn.Linear({"embd": embd}, {"feat": feat}, rngs=rngs)

    def loss(self, x, labels, y):
        c = self.cls(nx.as_named(labels, ("batch",))).rename(embd="cemb")
        h = self.inp(nx.as_named(x, ("batch", "time", "feat")))
        for b in self.blocks:
            h = b(h, c)
        d = self.out(h) - nx.as_named(y, ("batch", "time", "feat"))
        return (d * d).values.mean()


class MoEBlock(nnx.Module):
    def __init__(self, embd, experts, hidden, rngs):
        self.norm = nn.RMSNorm({"embd": embd}, rngs=rngs)
        self.gate = nn.Linear({"embd": embd}, {"expert": experts}, use_bias=False, rngs=rngs)
        self.w1 = nn.Linear({"embd": embd}, {"expert": experts, "mlp": hidden}, rngs=rngs)
        self.w2 = nnx.Param(jax.random.normal(rngs.params(), (experts, hidden, embd))
                            * hidden ** -0.5, dims=("expert", "mlp", "embd"))

    def __call__(self, x):
        h = self.norm(x)
        g = nx.softmax(self.gate(h), dim="expert")
        y = nx.dot(nx.gelu(self.w1(h)), nn.named(self.w2), dim="mlp")
        balance = g.mean(dim=("batch", "time"))
        return x + nx.dot(y, g, dim="expert"), (balance * balance).sum().values


class MoE(nnx.Module):
    def __init__(self, layers, embd, experts, hidden, vocab, rngs):
        self.tok = nn.Embedding(vocab, embd, rngs=rngs)
        self.blocks = nnx.List([MoEBlock(embd, experts, hidden, rngs) for _ in range(layers)])
        self.out = nn.Linear({"embd": embd}, {"vocab": vocab}, rngs=rngs)

    def loss(self, tokens, targets):
        x = self.tok(nx.as_named(tokens, ("batch", "time")))
        aux = 0.0
        for b in self.blocks:
            x, a = b(x)
            aux = aux + a
        ce = nx.cross_entropy(self.out(x), nx.as_named(targets, ("batch", "time")), dim="vocab")
        return ce.values.mean() + 0.01 * aux


class CrossAttention(nnx.Module):
    def __init__(self, embd, heads, rngs):
        self.hd = embd // heads
        proj = dict(in_sizes={"embd": embd}, out_sizes={"head": heads, "hd": self.hd})
        self.q, self.k, self.v = (nn.Linear(**proj, rngs=rngs) for _ in range(3))
        self.o = nn.Linear({"head": heads, "hd": self.hd}, {"embd": embd}, rngs=rngs)

    def __call__(self, x, mem):
        s = nx.dot(self.q(x), self.k(mem), dim="hd") / math.sqrt(self.hd)
        return self.o(nx.dot(nx.softmax(s, dim="src"), self.v(mem), dim="src"))


class DecBlock(nnx.Module):
    def __init__(self, embd, heads, rngs):
        self.n1 = nn.LayerNorm({"embd": embd}, rngs=rngs)
        self.self_attn = nn.MultiHeadAttention(embd, heads, rngs=rngs)
        self.n2 = nn.LayerNorm({"embd": embd}, rngs=rngs)
        self.cross = CrossAttention(embd, heads, rngs)
        self.n3 = nn.LayerNorm({"embd": embd}, rngs=rngs)
        self.mlp = nn.MLP(embd, 4 * embd, rngs=rngs)

    def __call__(self, x, mem):
        x = x + self.self_attn(self.n1(x))
        x = x + self.cross(self.n2(x), mem)
        return x + self.mlp(self.n3(x))


class EncDec(nnx.Module):
    def __init__(self, layers, embd, heads, vocab, rngs):
        self.src_tok = nn.Embedding(vocab, embd, rngs=rngs)
        self.tgt_tok = nn.Embedding(vocab, embd, rngs=rngs)
        self.enc = nnx.List([nn.TransformerBlock(embd, heads, time="src", rngs=rngs)
                             for _ in range(layers)])
        self.dec = nnx.List([DecBlock(embd, heads, rngs) for _ in range(layers)])
        self.norm = nn.LayerNorm({"embd": embd}, rngs=rngs)
        self.out = nn.Linear({"embd": embd}, {"vocab": vocab}, rngs=rngs)

    def loss(self, src, tgt_in, tgt_out):
        m = self.src_tok(nx.as_named(src, ("batch", "src")))
        for b in self.enc:
            m = b(m)
        x = self.tgt_tok(nx.as_named(tgt_in, ("batch", "time")))
        for b in self.dec:
            x = b(x, m)
        return nx.cross_entropy(self.out(self.norm(x)), nx.as_named(tgt_out, ("batch", "time")),
                                dim="vocab").values.mean()


class LocalGlobal(nnx.Module):
    def __init__(self, layers, embd, heads, vocab, window, rngs):
        self.tok = nn.Embedding(vocab, embd, rngs=rngs)
        self.blocks = nnx.List([
            nn.TransformerBlock(embd, heads, kv_heads=heads // 2, rotary=True, norm="rmsnorm",
                                activation="swiglu", use_bias=False,
                                sliding_window=window if i % 2 == 0 else None, rngs=rngs)
            for i in range(layers)])
        self.norm = nn.RMSNorm({"embd": embd}, rngs=rngs)
        self.out = nn.Linear({"embd": embd}, {"vocab": vocab}, use_bias=False, rngs=rngs)

    def loss(self, tokens, targets):
        x = self.tok(nx.as_named(tokens, ("batch", "time")))
        for b in self.blocks:
            x = b(x)
        return nx.cross_entropy(self.out(self.norm(x)), nx.as_named(targets, ("batch", "time")),
                                dim="vocab").values.mean()


class LinenBlock(linen.Module):
    heads: int

    @linen.compact
    def __call__(self, x, _=None):
        mask = linen.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        x = x + linen.MultiHeadDotProductAttention(self.heads)(linen.LayerNorm()(x), mask=mask)
        h = linen.Dense(4 * x.shape[-1])(linen.LayerNorm()(x))
        return x + linen.Dense(x.shape[-1])(linen.gelu(h)), None


class LinenGPT(linen.Module):
    layers: int
    embd: int
    heads: int
    vocab: int
    scan: bool   # linen's nn.scan over the block: params stacked on a leading axis

    @linen.compact
    def __call__(self, tokens):
        x = linen.Embed(self.vocab, self.embd)(tokens)
        if self.scan:
            x, _ = linen.scan(LinenBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                              length=self.layers)(self.heads)(x, None)
        else:
            for _ in range(self.layers):
                x, _ = LinenBlock(self.heads)(x)
        return linen.Dense(self.vocab)(linen.LayerNorm()(x))


class NNXBlock(nnx.Module):
    def __init__(self, embd: int, heads: int, rngs):
        self.ln1, self.ln2 = nnx.LayerNorm(embd, rngs=rngs), nnx.LayerNorm(embd, rngs=rngs)
        self.att = nnx.MultiHeadAttention(heads, embd, decode=False, rngs=rngs)
        self.w1 = nnx.Linear(embd, 4 * embd, rngs=rngs)
        self.w2 = nnx.Linear(4 * embd, embd, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.att(self.ln1(x), mask=mask)
        return x + self.w2(nnx.gelu(self.w1(self.ln2(x))))


# a block's call traced once, reused by every layer (`jb.layer`, NNX modules
# as arguments): what `NNXGPT(..., traced_once=True)` calls
_block_once = jb.layer(lambda block, x, mask: block(x, mask))


class NNXGPT(nnx.Module):
    def __init__(self, layers: int, embd: int, heads: int, vocab: int, rngs,
                 traced_once: bool = False):
        self.emb = nnx.Embed(vocab, embd, rngs=rngs)
        self.blocks = nnx.List([NNXBlock(embd, heads, rngs) for _ in range(layers)])
        self.ln = nnx.LayerNorm(embd, rngs=rngs)
        self.traced_once = traced_once

    def __call__(self, tokens):
        x = self.emb(tokens)
        mask = nnx.make_causal_mask(tokens)
        for b in self.blocks:
            x = _block_once(b, x, mask) if self.traced_once else b(x, mask)
        return self.emb.attend(self.ln(x))   # the output layer is the embedding, tied


def _nnx(layers: int, stacked: bool, traced_once: bool):
    """(params, loss, megatron rules) of the plain NNX GPT, dims named by input
    path and axis (the first layer's path names that axis in every layer).
    stacked: `jb.stack_layers` of the `nnx.State`, which the loss gives
    `nnx.merge` as `jb.unstack_layers(params)` (the per-layer State again,
    split in the traced program the way `reroll` reads straight from the
    stacks); a stacked param's axes count its leading layer axis.
    traced_once: the model calls its blocks through `jb.layer`."""
    gd, params = nnx.split(NNXGPT(layers, 128, 4, 256, nnx.Rngs(0), traced_once), nnx.Param)
    if stacked:
        params = jb.stack_layers(params)

    def loss(params, tokens, targets):
        logits = nnx.merge(gd, jb.unstack_layers(params) if stacked else params)(tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    at, k = ("args[0]['blocks'].stacked", 1) if stacked else ("args[0]['blocks'][0]", 0)
    megatron = {"args[2]:0": "data", f"{at}['att']['key']['bias']:{k}": "model",
                f"{at}['w1']['bias']:{k}": "model", "args[0]['emb']['embedding']:0": "model"}
    return params, loss, megatron


def _linen(layers: int, stacked: bool, batch):
    """(params, loss, megatron rules) of the linen GPT: its dims are named by
    path (the first layer's path names that axis in every layer, and a
    scanned param's axes count its leading layer axis)."""
    lm = LinenGPT(layers, 128, 4, 256, stacked)
    params = jax.jit(lm.init)(jax.random.key(0), batch[0])

    def loss(params, tokens, targets):
        return optax.softmax_cross_entropy_with_integer_labels(lm.apply(params, tokens),
                                                               targets).mean()

    block = "['ScanLinenBlock_0']" if stacked else "['LinenBlock_0']"
    at = "args[0]['params']" + block
    k = int(stacked)   # a scanned param's own axes start after the layer axis
    megatron = {"args[2]:0": "data",
                f"{at}['MultiHeadDotProductAttention_0']['query']['kernel']:{1 + k}": "model",
                f"{at}['Dense_0']['kernel']:{1 + k}": "model",
                "args[0]['params']['Embed_0']['embedding']:0": "model"}
    return params, loss, megatron


def setup(name: str, layers: int, stacked: bool = False, traced_once: bool = False):
    """(params, tx, step, batch, hand rule sets) for model `name`; stacked:
    `jb.stack_layers` of its params (linen: its own `nn.scan`); traced_once
    (nnx only): its blocks called through `jb.layer`."""
    if traced_once and name != "nnx":
        raise ValueError(f"setup: traced_once is the nnx model's option; {name!r}'s blocks are "
                         f"called as they are (the library's blocks trace once by themselves).")
    tx, r = optax.adamw(1e-3), nnx.Rngs(0)
    k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
    batch_dim = "batch"
    attn = {"batch": "data", "head": "model", "mlp": "model"}
    if name == "vit":
        model = ViT(layers, 128, 4, 4, 32, 10, r)
        batch = (jax.random.normal(k1, (32, 32, 32, 3)), jax.random.randint(k2, (32,), 0, 10))
        megatron = attn
    elif name == "dit":
        model = DiT(layers, 128, 4, 32, 10, r)
        batch = (jax.random.normal(k1, (16, 64, 32)), jax.random.randint(k2, (16,), 0, 10),
                 jax.random.normal(k3, (16, 64, 32)))
        megatron = attn
    elif name == "moe":
        model = MoE(layers, 128, 4, 256, 256, r)
        x = jax.random.randint(k1, (16, 64), 0, 256)
        batch = (x, jnp.roll(x, -1, axis=1))
        megatron = {"batch": "data", "expert": "model", "vocab": "model"}
    elif name == "encdec":
        model = EncDec(layers, 128, 4, 256, r)
        t = jax.random.randint(k2, (16, 65), 0, 256)
        batch = (jax.random.randint(k1, (16, 64), 0, 256), t[:, :-1], t[:, 1:])
        megatron = dict(attn, vocab="model")
    elif name == "localglobal":
        model = LocalGlobal(layers, 128, 8, 256, 16, r)
        x = jax.random.randint(k1, (16, 64), 0, 256)
        batch = (x, jnp.roll(x, -1, axis=1))
        megatron = {"batch": "data", "head": "model", "kv_head": "model", "mlp": "model",
                    "vocab": "model"}
    elif name == "linen":
        x = jax.random.randint(k1, (16, 64), 0, 256)
        batch = (x, jnp.roll(x, -1, axis=1))
        params, loss, megatron = _linen(layers, stacked, batch)
        batch_dim = "args[2]:0"
    elif name == "nnx":
        x = jax.random.randint(k1, (16, 64), 0, 256)
        batch = (x, jnp.roll(x, -1, axis=1))
        params, loss, megatron = _nnx(layers, stacked, traced_once)
        batch_dim = "args[2]:0"
        tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(
            optax.warmup_cosine_decay_schedule(0.0, 1e-3, 100, 1000)))
    else:
        raise ValueError(f"setup: model {name!r} is not one of {MODELS}; pick one of those.")
    if name not in ("linen", "nnx"):
        params, loss = nn.functional(model, "loss")
        if stacked:
            params = jb.stack_layers(params)

    def step(params, opt_state, *batch):
        value, grads = jax.value_and_grad(loss)(params, *batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    step.loss = loss
    hand = {"dp": {batch_dim: ("data", "model")}, "megatron": megatron}
    return params, tx, step, batch, hand
