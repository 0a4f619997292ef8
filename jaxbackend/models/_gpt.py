"""A GPT (decoder-only transformer) built from `jaxbackend.nn` named layers.

Dims: tokens (batch, time) -> embd vectors -> `n_layers` pre-norm
TransformerBlocks -> final norm -> logits (batch, time, vocab). Positions
are a learned table with dims (pos, embd), sliced to the input length and
renamed to `time`, or rotary (`rotary=True`, no table). The output head is a
`Linear` embd -> vocab, or the token table itself (`tie_embeddings=True`).

`GPT.loss` is the mean next-token cross entropy. `GPT.decode` runs the same
network on positions pos .. pos+t-1 against a key/value cache
(`GPT.init_cache`: per layer, k and v buffers with dims (batch, kv_time,
kv_head or head, hd)), returning the logits and the updated cache.

`generate` samples in one of two ways, both compiled once per shape:

* full window (`cache=False`, any causal LM): every token runs the model
  over the last seq_len tokens, right-padded (causality means padding never
  influences the position read): seq_len positions per token.
* cached (`cache=True`, the GPT's default): one call over the padded prompt
  window fills the cache (prefill), then each token is one position: a
  jitted step of fixed shape (1, 1) writes its k/v at `pos` and attends over
  the buffer masked to positions <= pos. Once the buffer is full the next
  token needs a window that has slid by one, whose positions (learned or
  rotary) have all moved, so the cache is refilled from the last seq_len
  tokens: past seq_len each token costs what the full window costs, and
  both paths compute the same logits at every step.
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxbackend import named as nx
from jaxbackend import nn
from jaxbackend.nn import _params
from jaxbackend._layer import _Static
from jaxbackend.nn._layers import compute_dtype


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
    `decode(tokens, cache, pos)` is the same network on positions pos ..
    against the key/value buffers of `init_cache()`.

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
        tokens = self._tokens(tokens, "GPT")
        x = self.drop(self._embed(tokens, 0))
        for block in self.blocks:
            x = block(x)
        return self._logits(x, tokens)

    def init_cache(self, batch: int = 1, length: int | None = None) -> tuple:
        """Empty key/value buffers for `decode`, one (k, v) pair per layer,
        dims (batch, kv_time, kv_head or head, hd), `length` (default seq_len)
        positions, in the layers' compute dtype."""
        n = self.config.seq_len if length is None else length
        if not 1 <= n <= self.config.seq_len:
            raise ValueError(f"GPT.init_cache: length={n} must be in 1 .. seq_len="
                             f"{self.config.seq_len}; the model has no positions beyond.")
        dt = compute_dtype(self.tok.dtype, self.tok.embedding[...])
        return tuple(block.init_cache({"batch": batch}, n, dt) for block in self.blocks)

    def decode(self, tokens, cache: tuple, pos) -> tuple:
        """The model on positions pos .. pos+t-1 (tokens: (batch, time), t
        positions) given the cache of the positions before: returns (logits
        (batch, time, vocab), the cache with these positions written). `pos`
        may be traced; the caller keeps pos + t <= the cache length."""
        tokens = self._tokens(tokens, "GPT.decode")
        if len(cache) != len(self.blocks):
            raise ValueError(f"GPT.decode: cache has {len(cache)} entries but the model has "
                             f"{len(self.blocks)} layers; build it with model.init_cache().")
        x = self.drop(self._embed(tokens, pos))
        new = []
        for block, c in zip(self.blocks, cache):
            x, c = block.decode(x, c, pos)
            new.append(c)
        return self._logits(x, tokens), tuple(new)

    def _tokens(self, tokens, op: str) -> nx.NamedArray:
        # int ids (batch, time), named if they are not, with time <= seq_len
        if not isinstance(tokens, nx.NamedArray):
            tokens = nx.as_named(tokens, ("batch", "time"))
        t = tokens.sizes.get("time")
        if t is None or t > self.config.seq_len:
            raise nx.DimError(f"{op}: tokens have dims {tokens.sizes}; they need a 'time' dim of "
                              f"size <= seq_len={self.config.seq_len}.")
        return tokens

    def _embed(self, tokens: nx.NamedArray, pos) -> nx.NamedArray:
        # Token vectors plus the positions pos .. pos+t-1 of the table.
        x = self.tok(tokens)
        if self.pos is None:
            return x
        t = tokens.sizes["time"]
        table = _params.named(self.pos)
        if isinstance(pos, int) and pos == 0:
            rows = table.isel(pos=slice(0, t))
        else:  # a traced start: one compiled step serves every position
            rows = nx.NamedArray(jax.lax.dynamic_slice_in_dim(
                table.values, pos, t, axis=table.axis("pos")), table.dims)
        # In the embedding's (compute) dtype: a float32 table must not
        # promote a bfloat16 stream.
        return x + rows.rename(pos="time").astype(x.dtype)

    def _logits(self, x: nx.NamedArray, tokens: nx.NamedArray) -> nx.NamedArray:
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
             seq_len: int | None = None, cache: bool | None = None) -> list:
    """Sample `steps` tokens after `prompt` (a list of ints); returns the new ids.

    `model` is the GPT or any causal language model whose call maps int
    tokens (batch, time) to logits with a `vocab` dim (a NamedArray) or
    last axis (an array); `seq_len` (default: `model.config.seq_len`) is the
    window: each token is sampled from the logits of the last seq_len ids.

    `cache` picks the path (module docstring): True, the key/value cache (a
    GPT only); False, the full window, re-run per token; None (default), the
    cache for a GPT and the full window otherwise. For a fixed `key` both
    give the same tokens: they sample from the same logits, up to float
    rounding, with the same key splits. Sampling runs in eval mode;
    afterwards every module's mode flag is what the caller had.
    """
    n = seq_len if seq_len is not None else getattr(getattr(model, "config", None), "seq_len", None)
    if n is None:
        raise TypeError(f"generate: {type(model).__name__} has no config.seq_len; pass "
                        f"seq_len=<the model's context length>.")
    use_cache = isinstance(model, GPT) if cache is None else cache
    if use_cache and not isinstance(model, GPT):
        raise TypeError(f"generate: cache=True needs a GPT (init_cache/decode), got "
                        f"{type(model).__name__}; pass cache=False for the full-window path.")
    # Sampling runs in eval mode; afterwards every module's mode flag is what
    # the caller had (a model in eval mode stays in eval mode).
    modes = [(m, a, getattr(m, a)) for _, m in nnx.iter_graph(model)
             if isinstance(m, nnx.Module) for a in _MODE_FLAGS if hasattr(m, a)]
    model.eval()
    try:
        run = _generate_cached if use_cache else _generate_window
        return run(model, list(prompt) or [0], steps, key, temperature, n)
    finally:
        for m, a, v in modes:
            setattr(m, a, v)


def _generate_window(model, ids: list, steps: int, key, temperature: float, n: int) -> list:
    out = []
    for _ in range(steps):
        ctx = ids[-n:]
        logits = _next_logits(model, _window(ctx, n), len(ctx) - 1)
        key, sub = jax.random.split(key)
        nxt = int(jax.random.categorical(sub, logits / max(temperature, 1e-6)))
        ids.append(nxt)
        out.append(nxt)
    return out


def _window(ctx: list, n: int) -> jax.Array:
    return jnp.asarray(ctx + [0] * (n - len(ctx)), jnp.int32)


def _generate_cached(model, ids: list, steps: int, key, temperature: float, n: int) -> list:
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    static = _Static(graphdef, treedef)
    temperature = float(temperature)  # a weakly typed float32 scalar: one trace for any value
    first = len(ids)
    pos = n          # where the last sampled token goes; n: the cache is full (or absent)
    tok = buf = None
    for _ in range(steps):
        if pos < n:
            tok, buf, key = _step(static, leaves, tok, buf, pos, key, temperature)
            pos += 1
        else:        # the first token, or a full window: (re)fill from the last n ids
            ids[-n:] = [int(t) for t in ids[-n:]]
            ctx = ids[-n:]
            tok, buf, key = _prefill(static, leaves, _window(ctx, n), len(ctx) - 1, key,
                                     temperature)
            pos = len(ctx)
        ids.append(tok)  # a device scalar: no host sync per token
    return [int(t) for t in ids[first:]]


# Traces of the cached path's two compiled functions, by name (the tests
# check that the per-token step compiles once).
TRACES: collections.Counter = collections.Counter()


def _sample(logits, key, temperature):
    # The full-window path's sampling, in the compiled step.
    key, sub = jax.random.split(key)
    return jax.random.categorical(sub, logits / jnp.maximum(temperature, 1e-6)), key


@functools.partial(jax.jit, static_argnums=0)
def _prefill(static: _Static, leaves, window, last, key, temperature):
    TRACES["prefill"] += 1
    model = static.merge(leaves)
    logits, cache = model.decode(window[None, :], model.init_cache(1, window.shape[0]), 0)
    logits = jax.lax.dynamic_index_in_dim(logits.values[0], last, 0, keepdims=False)
    tok, key = _sample(logits, key, temperature)
    return tok, cache, key


@functools.partial(jax.jit, static_argnums=0, donate_argnums=3)
def _step(static: _Static, leaves, tok, cache, pos, key, temperature):
    TRACES["step"] += 1
    logits, cache = static.merge(leaves).decode(tok.reshape(1, 1), cache, pos)
    tok, key = _sample(logits.values[0, 0], key, temperature)
    return tok, cache, key
