"""Named-axis code in Levanter's style (Haliax), written with
`jaxbackend.named`: every projection contracts by dim name, grouped-query
attention keeps `kv_head` and `group` as separate named dims (as Levanter's
`q_heads_per_group` axis does), RMSNorm and a SwiGLU MLP are named
reductions and dots.

Every contraction is a named `einsum`, forward and backward: no flatten
chain and no repeated head for the rewriting passes; cleanup fires (the
mask's broadcasts, AD's duplicates) and `inline` lowers each einsum to a
`dot_general` last.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from _expect import Expect, repeated_operands_of_dots, einsums, calls
from jaxbackend import named as nx
from jaxbackend._corpus import variants

SIZES = dict(batch=2, position=8, embed=16, kv_head=2, group=2, head_size=4, mlp=32)
DIMS = dict(wq=("embed", "kv_head", "group", "head_size"), wk=("embed", "kv_head", "head_size"),
            wv=("embed", "kv_head", "head_size"), wo=("kv_head", "group", "head_size", "embed"),
            gate=("embed", "mlp"), up=("embed", "mlp"), down=("mlp", "embed"), norm=("embed",))


def rms_norm(x, scale, eps=1e-6):
    return x * nx.rsqrt((x * x).mean(dim="embed") + eps) * scale


def attention(p, x):
    q = nx.dot(x, p["wq"], dim="embed")
    k = nx.dot(x, p["wk"], dim="embed").rename(position="key_position")
    v = nx.dot(x, p["wv"], dim="embed").rename(position="key_position")
    scores = nx.dot(q, k, dim="head_size") / math.sqrt(SIZES["head_size"])
    t = SIZES["position"]
    causal = nx.arange(t, dim="position") >= nx.arange(t, dim="key_position")
    probs = nx.softmax(nx.where(causal, scores, -1e9), dim="key_position")
    o = nx.dot(probs, v, dim="key_position")
    return nx.dot(o, p["wo"], dim=("kv_head", "group", "head_size"))


def mlp(p, x):
    return nx.dot(nx.silu(nx.dot(x, p["gate"], dim="embed")) * nx.dot(x, p["up"], dim="embed"),
                  p["down"], dim="mlp")


def _named(params, x):
    p = {k: nx.as_named(v, DIMS[k]) for k, v in params.items()}
    return p, nx.as_named(x, ("batch", "position", "embed"))


def levanter_attention(params, x):
    p, x = _named(params, x)
    return attention(p, rms_norm(x, p["norm"])).transpose("batch", "position", "embed").values


def levanter_block(params, x):
    p, x = _named(params, x)
    h = x + attention(p, rms_norm(x, p["norm"]))
    return (h + mlp(p, rms_norm(h, p["norm"]))).transpose("batch", "position", "embed").values


def args():
    keys = jax.random.split(jax.random.key(40), len(DIMS) + 1)
    params = {k: jax.random.normal(key, [SIZES[d] for d in dims]) / math.sqrt(SIZES[dims[0]])
              for key, (k, dims) in zip(keys, DIMS.items())}
    params["norm"] = jnp.ones((SIZES["embed"],))
    return params, jax.random.normal(keys[-1], (2, 8, 16))


_CHECKS = (einsums, calls, repeated_operands_of_dots)

# Every named contraction lowers once (forward: 6 and 9 einsums; with the
# gradient, three per contraction). The causal mask's two broadcasts of
# `arange` compose; softmax and the norms' nested calls are inlined.
_ALWAYS = ("inline_calls", "hoist_broadcast", "cse", "dce")

CORPUS = [
    *variants("levanter_attention", levanter_attention, args,
              expect=Expect(matches={"inline": {"einsum->dot_general": 6}}, fire=_ALWAYS,
                            checks=_CHECKS),
              expect_grad=Expect(matches={"inline": {"einsum->dot_general": 18}}, fire=_ALWAYS,
                                 checks=_CHECKS)),
    *variants("levanter_block", levanter_block, args,
              expect=Expect(matches={"inline": {"einsum->dot_general": 9}}, fire=_ALWAYS,
                            checks=_CHECKS),
              expect_grad=Expect(matches={"inline": {"einsum->dot_general": 27}}, fire=_ALWAYS,
                                 checks=_CHECKS)),
]
