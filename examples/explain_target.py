"""A small model that gives every pass something to do; target of `explain`.

    python -m jaxbackend explain examples/explain_target.py:loss
    python -m jaxbackend explain examples/explain_target.py:train_step --jaxpr
    python examples/explain_target.py [--tiny]

The `explain` convention: the script defines `example_inputs()` returning the
positional arguments of the function to explain (a tuple), or, per function,
`example_inputs_<function>()`, which wins. A module-level `EXAMPLE_ARGS`
tuple works too. Nothing runs at import time beyond building small arrays.

The model mixes the three kinds of code the passes target:
* a named causal attention layer (`jaxbackend.named`): every contraction is
  a named `einsum` (forward and backward), lowered last by `inline`;
* a hand-written MLP that flattens, `x.reshape(-1, d) @ w`, which
  `fuse_projections` turns back into batch-keeping contractions;
* a GQA XSA projection in "expand" form, whose normalisation
  `hoist_broadcast` moves above the broadcast;
and `jnp.linalg.norm` (a nested `jit`, inlined), plus the duplicated work of
AD for `cse` and `dce`.
"""

from __future__ import annotations

import argparse
import math
import sys

import jax
import jax.numpy as jnp

from jaxbackend import named as nx
from jaxbackend.programs.small import xsa_expand

SIZES = dict(batch=2, time=8, embd=16, kv=2, group=2, hidden=32)
TINY = dict(batch=1, time=4, embd=8, kv=2, group=2, hidden=8)


def init(key, sizes=SIZES):
    e, h, kv, g = sizes["embd"], sizes["hidden"], sizes["kv"], sizes["group"]
    hd = e // (kv * g)
    ks = jax.random.split(key, 7)
    s = 1 / math.sqrt(e)
    params = dict(
        wq=jax.random.normal(ks[0], (e, kv, g, hd)) * s,
        wk=jax.random.normal(ks[1], (e, kv, hd)) * s,
        wv=jax.random.normal(ks[2], (e, kv, hd)) * s,
        wo=jax.random.normal(ks[3], (kv, g, hd, e)) * s,
        w1=jax.random.normal(ks[4], (e, h)) * s,
        w2=jax.random.normal(ks[5], (h, e)) / math.sqrt(h),
    )
    x = jax.random.normal(ks[6], (sizes["batch"], sizes["time"], e))
    return params, x


def forward(params, x):
    t = x.shape[1]
    nx_x = nx.as_named(x, ("batch", "time", "embd"))
    p = {k: nx.as_named(params[k], d) for k, d in dict(
        wq=("embd", "kv", "group", "hd"), wk=("embd", "kv", "hd"),
        wv=("embd", "kv", "hd"), wo=("kv", "group", "hd", "embd")).items()}
    q = nx.dot(nx_x, p["wq"], dim="embd")
    k = nx.dot(nx_x, p["wk"], dim="embd").rename(time="time_k")
    v = nx.dot(nx_x, p["wv"], dim="embd")
    s = nx.dot(q, k, dim="hd") / math.sqrt(q.sizes["hd"])
    causal = nx.arange(t, dim="time") >= nx.arange(t, dim="time_k")
    a = nx.softmax(nx.where(causal, s, -1e9), dim="time_k")
    o = nx.dot(a, v.rename(time="time_k"), dim="time_k")
    o = o.transpose("batch", "time", "kv", "group", "hd")
    v_plain = v.transpose("batch", "time", "kv", "hd").values
    y = nx.as_named(xsa_expand(v_plain, o.values), o.dims)
    h = (nx_x + nx.dot(y, p["wo"], dim=("kv", "group", "hd"))).transpose("batch", "time", "embd").values
    b, tt, e = h.shape
    m = jax.nn.gelu((h.reshape(-1, e) @ params["w1"]).reshape(b, tt, -1))
    return h + (m.reshape(b * tt, -1) @ params["w2"]).reshape(b, tt, e)


def loss(params, x):
    return jnp.mean(forward(params, x) ** 2)


def train_step(params, x):
    """One SGD step: value_and_grad inside, so the passes see AD's code."""
    value, grads = jax.value_and_grad(loss)(params, x)
    return value, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def example_inputs():
    return init(jax.random.key(0))


def main(argv=None) -> int:
    import jaxbackend as jb

    ap = argparse.ArgumentParser(description="train a few steps with jb.jit; print the pass report")
    ap.add_argument("--tiny", action="store_true", help="smallest sizes (CI)")
    args = ap.parse_args(argv)
    params, x = init(jax.random.key(0), TINY if args.tiny else SIZES)
    step = jb.jit(train_step)
    first = None
    for _ in range(5):
        value, params = step(params, x)
        first = float(value) if first is None else first
    print(f"loss {first:.4f} -> {float(value):.4f} (5 SGD steps, traced {step.trace_count}x)")
    print(step.last_report)
    from jaxbackend import testing

    ours, ref = jb.jit(loss)(params, x), jax.jit(loss)(params, x)
    print(f"jb.jit loss {float(ours):.6f} vs jax.jit {float(ref):.6f}")
    # equal up to float32 rounding, at the error model's scale (sum of |terms|)
    testing.assert_close(ours, ref, scale=lambda: testing.abs_scale(loss, params, x))
    return 0


if __name__ == "__main__":
    sys.exit(main())
