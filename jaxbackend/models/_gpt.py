"""A GPT (decoder-only transformer) built from `jaxbackend.nn` named layers.

Dims: tokens (batch, time) -> embd vectors -> `n_layers` pre-norm
TransformerBlocks -> final norm -> logits (batch, time, vocab). Positions
are a learned table with dims (pos, embd), sliced to the input length and
renamed to `time`, or rotary (`rotary=True`, no table). The output head is a
`Linear` embd -> vocab, or the token table itself (`tie_embeddings=True`).

`GPT.loss` is the mean next-token cross entropy; `generate` samples with one
compiled step of fixed shape (the context window is right-padded; causality
means padding never influences the position read).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxbackend import named as nx
from jaxbackend import nn
from jaxbackend.nn import _params


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 128
    seq_len: int = 64          # longest context (size of the position table)
    n_layers: int = 2
    embd: int = 64
    heads: int = 4
    kv_heads: int | None = None  # fewer than `heads`: grouped-query attention
    mlp_ratio: int = 4
    activation: str = "gelu"     # or "swiglu"
    norm: str = "layernorm"      # or "rmsnorm"
    rotary: bool = False
    dropout: float = 0.0
    use_bias: bool = True
    tie_embeddings: bool = False

    def __post_init__(self):
        for f in ("vocab_size", "seq_len", "n_layers", "embd", "heads", "mlp_ratio"):
            if int(getattr(self, f)) < 1:
                raise ValueError(f"GPTConfig: {f}={getattr(self, f)} must be a positive integer.")
        if self.embd % self.heads:
            raise nx.DimError(f"GPTConfig: embd={self.embd} does not divide by heads={self.heads}; "
                              f"pick embd a multiple of heads.")
        if self.kv_heads is not None and (self.kv_heads < 1 or self.heads % self.kv_heads):
            raise nx.DimError(f"GPTConfig: heads={self.heads} is not a multiple of "
                              f"kv_heads={self.kv_heads}; pick kv_heads dividing heads.")


class GPT(nnx.Module):
    """`GPT(config, rngs=nnx.Rngs(0))(tokens)` -> logits NamedArray
    (batch, time, vocab); tokens: int array (batch, time) or a NamedArray.

    Mixed precision the Flax way: `param_dtype` stores the parameters
    (float32), `dtype` is the compute dtype of every layer (None: promote);
    `GPT.loss` is float32 whatever `dtype` is."""

    def __init__(self, config: GPTConfig, *, dtype=None, param_dtype=jnp.float32,
                 rngs: nnx.Rngs):
        c = self.config = config
        dt = dict(dtype=dtype, param_dtype=param_dtype)
        self.tok = nn.Embedding(c.vocab_size, c.embd, **dt, rngs=rngs)
        self.pos = (None if c.rotary else _params.param(
            lambda k, s, d: jax.random.normal(k, s, d) * 0.02, rngs.params(),
            {"pos": c.seq_len, "embd": c.embd}, param_dtype))
        self.drop = nn.Dropout(c.dropout, rngs=rngs)
        self.blocks = nnx.List([
            nn.TransformerBlock(c.embd, c.heads, kv_heads=c.kv_heads,
                                mlp_hidden=c.mlp_ratio * c.embd, activation=c.activation,
                                norm=c.norm, rotary=c.rotary, use_bias=c.use_bias,
                                dropout=c.dropout, **dt, rngs=rngs)
            for _ in range(c.n_layers)])
        Norm = nn.LayerNorm if c.norm == "layernorm" else nn.RMSNorm
        self.norm = Norm({"embd": c.embd}, **dt)
        self.head = (None if c.tie_embeddings else
                     nn.Linear({"embd": c.embd}, {"vocab": c.vocab_size}, use_bias=False,
                               **dt, rngs=rngs))

    def __call__(self, tokens) -> nx.NamedArray:
        if not isinstance(tokens, nx.NamedArray):
            tokens = nx.as_named(tokens, ("batch", "time"))
        t = tokens.sizes.get("time")
        if t is None or t > self.config.seq_len:
            raise nx.DimError(f"GPT: tokens have dims {tokens.sizes}; they need a 'time' dim of "
                              f"size <= seq_len={self.config.seq_len}.")
        x = self.tok(tokens)
        if self.pos is not None:
            # In the embedding's (compute) dtype: a float32 table must not
            # promote a bfloat16 stream.
            pos = _params.named(self.pos).isel(pos=slice(0, t)).rename(pos="time")
            x = x + pos.astype(x.dtype)
        x = self.drop(x)
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        logits = self.tok.attend(x) if self.head is None else self.head(x)
        return logits.transpose(*tokens.dims, "vocab")

    def loss(self, tokens, targets) -> jax.Array:
        """Mean cross entropy of predicting `targets` (same shape as tokens),
        in float32 whatever the compute dtype (`nx.cross_entropy`)."""
        return lm_loss(self(tokens), targets)


def lm_loss(logits, targets) -> jax.Array:
    """Mean next-token cross entropy of `logits` against integer `targets`,
    in float32 at least (`nx.cross_entropy`). Logits: a NamedArray with a
    `vocab` dim and the tokens' dims, or an array whose last axis is the
    vocabulary; targets: a NamedArray, or an array laid out like the tokens
    (the logits' dims without `vocab`)."""
    if not isinstance(logits, nx.NamedArray):
        logits = jnp.asarray(logits)
        logits = nx.as_named(logits, tuple(f"axis{i}" for i in range(logits.ndim - 1)) + ("vocab",))
    if "vocab" not in logits.dims:
        raise nx.DimError(f"lm_loss: logits have dims {logits.dims}; they need a 'vocab' dim "
                          f"(the model's output classes).")
    if not isinstance(targets, nx.NamedArray):
        targets = nx.as_named(jnp.asarray(targets), tuple(d for d in logits.dims if d != "vocab"))
    return nx.cross_entropy(logits, targets.astype(jnp.int32), dim="vocab").values.mean()


_MODE_FLAGS = ("deterministic", "use_running_average")  # what nnx's eval()/train() set


@nnx.jit
def _next_logits(model, window, pos):
    # Module level, so repeated `generate` calls reuse one compiled program.
    out = model(window[None, :])
    if isinstance(out, nx.NamedArray):
        if "vocab" not in out.dims:
            raise nx.DimError(f"generate: the model returned dims {out.dims}; its logits need a "
                              f"'vocab' dim.")
        out = out.transpose(..., "vocab").values
    # batch is 1, so (batch, time) and (time, batch) both flatten to time.
    logits = out.reshape(window.shape[0], out.shape[-1])
    return jax.lax.dynamic_index_in_dim(logits, pos, 0, keepdims=False)


def generate(model: nnx.Module, prompt, steps: int, *, key, temperature: float = 1.0,
             seq_len: int | None = None) -> list:
    """Sample `steps` tokens after `prompt` (a list of ints); returns the new ids.

    `model` is the GPT or any causal language model whose call maps int
    tokens (batch, time) to logits with a `vocab` dim (a NamedArray) or
    last axis (an array); `seq_len` (default: `model.config.seq_len`) is the
    window. One compiled function of fixed shape (1, seq_len): the window
    holds the last seq_len tokens, right-padded with zeros; we read the
    logits at the last real position, which padding cannot affect (causal
    attention).
    """
    n = seq_len if seq_len is not None else getattr(getattr(model, "config", None), "seq_len", None)
    if n is None:
        raise TypeError(f"generate: {type(model).__name__} has no config.seq_len; pass "
                        f"seq_len=<the model's context length>.")
    # Sampling runs in eval mode; afterwards every module's mode flag is
    # what the caller had (a model in eval mode stays in eval mode).
    modes = [(m, a, getattr(m, a)) for _, m in nnx.iter_graph(model)
             if isinstance(m, nnx.Module) for a in _MODE_FLAGS if hasattr(m, a)]
    model.eval()
    ids = list(prompt) or [0]
    out = []
    try:
        for _ in range(steps):
            ctx = ids[-n:]
            window = jnp.asarray(ctx + [0] * (n - len(ctx)), jnp.int32)
            logits = _next_logits(model, window, len(ctx) - 1)
            key, sub = jax.random.split(key)
            nxt = int(jax.random.categorical(sub, logits / max(temperature, 1e-6)))
            ids.append(nxt)
            out.append(nxt)
    finally:
        for m, a, v in modes:
            setattr(m, a, v)
    return out
