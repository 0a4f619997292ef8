"""A whole LLaMA-style decoder (token embedding, `n_layers` layers of GQA
attention and SwiGLU MLP with RMSNorm, final norm, unembedding, cross
entropy), written twice.

`named_llama_loss` uses `jaxbackend.named`: every projection is one named
`einsum`, so the traced jaxpr says which axis is `batch`, `kv`, `mlp`, ...
`jnp_llama_loss` is the same computation as it is usually written without
names: activations flattened to `(batch*time, embd)`, `reshape -> matmul ->
reshape` around each projection, weights reshaped to matrices, attention with
`jnp.einsum`. Both take the same parameter pytree (plain arrays for the jnp
twin, NamedArrays for the named one: `name_llama_params`) and must agree to
float tolerance; the sharding search must reach the same plan for both.

Sizes are a `LlamaConfig`; `llama_shapes` gives `jax.ShapeDtypeStruct`
parameters (never materialised) for the LLaMA-8B-shaped benchmark.
`sgd_step` makes either loss a training step (plain SGD, no optimizer state).
No RoPE: it adds no contraction and no dim, so it does not change the plan.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxbackend import named as nx


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    n_layers: int = 1
    batch: int = 8
    time: int = 16
    embd: int = 32
    kv: int = 4          # key/value heads
    grp: int = 2         # query heads per kv head (heads = kv * grp)
    hd: int = 8          # head size
    mlp: int = 64
    vocab: int = 64
    dtype: object = jnp.float32

    @property
    def heads(self) -> int:
        return self.kv * self.grp


LLAMA_8B = dict(embd=4096, kv=8, grp=4, hd=128, mlp=14336, vocab=128256)

_LAYER_DIMS = dict(
    norm1=("embd",), wq=("embd", "kv", "grp", "hd"), wk=("embd", "kv", "hd"),
    wv=("embd", "kv", "hd"), wo=("kv", "grp", "hd", "embd"), norm2=("embd",),
    wg=("embd", "mlp"), wu=("embd", "mlp"), wd=("mlp", "embd"))
_TOP_DIMS = dict(embed=("vocab", "embd"), norm_f=("embd",), unembed=("embd", "vocab"))


def _shape(cfg: LlamaConfig, dims) -> tuple:
    return tuple(getattr(cfg, d) for d in dims)


def init_llama_params(seed: int, cfg: LlamaConfig) -> dict:
    """Plain arrays, scaled so activations stay O(1); norms start at 1.
    (numpy's generator: one device transfer per leaf, no per-shape compiles.)"""
    rng = np.random.default_rng(seed)

    def w(dims, fan_in):
        return jnp.asarray(rng.standard_normal(_shape(cfg, dims)) / math.sqrt(fan_in), cfg.dtype)

    def norm(dims):
        return jnp.ones(_shape(cfg, dims), cfg.dtype)

    params = dict(embed=w(_TOP_DIMS["embed"], 1), norm_f=norm(("embd",)),
                  unembed=w(_TOP_DIMS["unembed"], cfg.embd), layers=[])
    for _ in range(cfg.n_layers):
        params["layers"].append(dict(
            norm1=norm(("embd",)), wq=w(_LAYER_DIMS["wq"], cfg.embd),
            wk=w(_LAYER_DIMS["wk"], cfg.embd), wv=w(_LAYER_DIMS["wv"], cfg.embd),
            wo=w(_LAYER_DIMS["wo"], cfg.heads * cfg.hd), norm2=norm(("embd",)),
            wg=w(_LAYER_DIMS["wg"], cfg.embd), wu=w(_LAYER_DIMS["wu"], cfg.embd),
            wd=w(_LAYER_DIMS["wd"], cfg.mlp)))
    return params


def llama_shapes(cfg: LlamaConfig, *, stacked: bool = False) -> dict:
    """The parameter pytree as `jax.ShapeDtypeStruct`s (nothing allocated);
    `stacked`: layers as one dict of arrays with a leading layer axis."""
    sd = lambda dims, lead=(): jax.ShapeDtypeStruct(lead + _shape(cfg, dims), cfg.dtype)  # noqa: E731
    out: dict = dict(embed=sd(_TOP_DIMS["embed"]), norm_f=sd(("embd",)), unembed=sd(_TOP_DIMS["unembed"]))
    if stacked:
        out["layers"] = {k: sd(d, (cfg.n_layers,)) for k, d in _LAYER_DIMS.items()}
    else:
        out["layers"] = [{k: sd(d) for k, d in _LAYER_DIMS.items()} for _ in range(cfg.n_layers)]
    return out


def stack_llama_layers(params: dict) -> dict:
    """Layers as one dict of arrays stacked on a leading axis (for `scan`)."""
    layers = params["layers"]
    return dict(params, layers={k: jnp.stack([p[k] for p in layers]) for k in layers[0]})


def llama_batch(seed, cfg: LlamaConfig, *, abstract: bool = False):
    """(tokens, targets), each (batch, time) int32."""
    shape = (cfg.batch, cfg.time)
    if abstract:
        s = jax.ShapeDtypeStruct(shape, jnp.int32)
        return s, s
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.integers(0, cfg.vocab, shape), jnp.int32),
            jnp.asarray(rng.integers(0, cfg.vocab, shape), jnp.int32))


def name_llama_params(params: dict) -> dict:
    """The same leaves wrapped as NamedArrays (works on ShapeDtypeStructs too)."""
    wrap = lambda v, dims: nx.NamedArray(v, dims)  # noqa: E731 (no validation: may be abstract)
    out: dict = {k: wrap(params[k], d) for k, d in _TOP_DIMS.items()}
    if isinstance(params["layers"], dict):   # stacked: a leading "layer" dim
        out["layers"] = {k: wrap(params["layers"][k], ("layer",) + d) for k, d in _LAYER_DIMS.items()}
    else:
        out["layers"] = [{k: wrap(layer[k], d) for k, d in _LAYER_DIMS.items()}
                         for layer in params["layers"]]
    return out


def name_llama_batch(tokens, targets):
    return nx.NamedArray(tokens, ("batch", "time")), nx.NamedArray(targets, ("batch", "time"))


# -- named ------------------------------------------------------------------------

def _rms_norm(x, scale, eps=1e-5):
    return x * nx.rsqrt((x * x).mean(dim="embd") + eps) * scale


def _named_layer(x, p, causal):
    h = _rms_norm(x, p["norm1"])
    q = nx.dot(h, p["wq"], dim="embd")                              # batch time kv grp hd
    k = nx.dot(h, p["wk"], dim="embd").rename(time="time_k")
    v = nx.dot(h, p["wv"], dim="embd").rename(time="time_k")
    s = nx.dot(q, k, dim="hd") / math.sqrt(q.sizes["hd"])           # batch kv time grp time_k
    a = nx.softmax(nx.where(causal, s, -1e9), dim="time_k")
    o = nx.dot(a, v, dim="time_k")                                  # batch kv time grp hd
    x = x + nx.dot(o, p["wo"], dim=("kv", "grp", "hd"))
    h = _rms_norm(x, p["norm2"])
    m = nx.silu(nx.dot(h, p["wg"], dim="embd")) * nx.dot(h, p["wu"], dim="embd")
    return x + nx.dot(m, p["wd"], dim="mlp")


def named_llama_loss(params: dict, tokens, targets):
    """Mean next-token cross-entropy; tokens/targets NamedArray (batch, time).
    Stacked layers (`stack_llama_layers`) run as one `lax.scan` over "layer"."""
    x = params["embed"].isel(vocab=tokens)                         # batch time embd
    t = x.sizes["time"]
    causal = nx.arange(t, dim="time") >= nx.arange(t, dim="time_k")
    layers = params["layers"]
    if isinstance(layers, dict):
        dims = {k: v.dims[1:] for k, v in layers.items()}

        def body(x, vals):
            return _named_layer(x, {k: nx.NamedArray(v, dims[k]) for k, v in vals.items()}, causal), None
        x, _ = jax.lax.scan(body, x, {k: v.values for k, v in layers.items()})
    else:
        for p in layers:
            x = _named_layer(x, p, causal)
    logits = nx.dot(_rms_norm(x, params["norm_f"]), params["unembed"], dim="embd")
    logp = nx.log_softmax(logits, dim="vocab")
    onehot = nx.arange(logits.sizes["vocab"], dim="vocab") == targets
    return -nx.where(onehot, logp, 0.0).sum().values / (t * x.sizes["batch"])


# -- plain jnp: reshape -> matmul -> reshape ------------------------------------------

def _jnp_rms_norm(x, scale, eps=1e-5):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def jnp_llama_loss(params: dict, tokens, targets):
    """The same loss on plain arrays, projections as 2-d matmuls."""
    b, t = tokens.shape
    x = params["embed"][tokens]                                     # (b, t, e)
    e = x.shape[-1]
    causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
    for p in params["layers"]:
        kv, g, d = p["wq"].shape[1:]
        h = _jnp_rms_norm(x, p["norm1"]).reshape(b * t, e)
        q = (h @ p["wq"].reshape(e, kv * g * d)).reshape(b, t, kv, g, d)
        k = (h @ p["wk"].reshape(e, kv * d)).reshape(b, t, kv, d)
        v = (h @ p["wv"].reshape(e, kv * d)).reshape(b, t, kv, d)
        s = jnp.einsum("btkgd,bskd->bktgs", q, k) / math.sqrt(d)
        a = jax.nn.softmax(jnp.where(causal[:, None, :], s, -1e9), axis=-1)
        o = jnp.einsum("bktgs,bskd->btkgd", a, v).reshape(b * t, kv * g * d)
        x = x + (o @ p["wo"].reshape(kv * g * d, e)).reshape(b, t, e)
        h = _jnp_rms_norm(x, p["norm2"]).reshape(b * t, e)
        m = jax.nn.silu(h @ p["wg"]) * (h @ p["wu"])
        x = x + (m @ p["wd"]).reshape(b, t, e)
    logits = _jnp_rms_norm(x, params["norm_f"]).reshape(b * t, e) @ params["unembed"]
    logp = jax.nn.log_softmax(logits, axis=-1)
    onehot = jnp.arange(logits.shape[-1])[None, :] == targets.reshape(b * t, 1)
    return -jnp.where(onehot, logp, 0.0).sum() / (t * b)


def sgd_step(loss_fn, lr: float = 0.1):
    """`step(params, tokens, targets) -> (loss, new_params)`: one SGD step."""

    def step(params, tokens, targets):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, targets)
        return loss, jax.tree.map(lambda w, g: w - lr * g, params, grads)

    return step
