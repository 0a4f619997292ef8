"""01 · Named arrays: the same attention scores by name and by position.

Run: python examples/01_named_arrays.py [--tiny]
"""

import argparse

import jax
import jax.numpy as jnp

from jaxbackend import named as nx
from jaxbackend import testing


def main(tiny: bool) -> None:
    b, t, e, h, d = (2, 8, 16, 2, 8) if tiny else (4, 64, 128, 4, 32)
    k0, k1, k2 = jax.random.split(jax.random.key(0), 3)
    x = nx.as_named(jax.random.normal(k0, (b, t, e)), ("batch", "time", "embd"))
    wq = nx.as_named(jax.random.normal(k1, (e, h, d)) / e**0.5, ("embd", "head", "hd"))
    wk = nx.as_named(jax.random.normal(k2, (e, h, d)) / e**0.5, ("embd", "head", "hd"))

    def scores_named(x, wq, wk):
        q = nx.dot(x, wq, dim="embd")
        k = nx.dot(x, wk, dim="embd").rename(time="time_k")
        s = nx.dot(q, k, dim="hd") / d**0.5                       # batch head time time_k
        causal = nx.arange(t, dim="time") >= nx.arange(t, dim="time_k")
        return nx.softmax(nx.where(causal, s, -1e9), dim="time_k")

    def scores_jnp(x, wq, wk):
        q = jnp.einsum("bte,ehd->bthd", x, wq)
        k = jnp.einsum("bte,ehd->bthd", x, wk)
        s = jnp.einsum("bthd,bshd->bhts", q, k) / d**0.5
        causal = jnp.tril(jnp.ones((t, t), bool))
        return jax.nn.softmax(jnp.where(causal, s, -1e9), axis=-1)

    a = jax.jit(scores_named)(x, wq, wk)
    ref = jax.jit(scores_jnp)(x.values, wq.values, wk.values)
    a = a.transpose("batch", "head", "time", "time_k")
    # equal up to float32 rounding, judged at the error model's scale (the
    # sum of |terms| behind each entry), as a pytest suite would
    testing.assert_close(a, ref, scale=lambda: testing.abs_scale(
        scores_jnp, x.values, wq.values, wk.values))
    print("named result dims:", a.dims, "sizes:", a.sizes)
    print("named == jnp: max abs diff", float(jnp.max(jnp.abs(a.values - ref))))
    jaxpr = jax.make_jaxpr(scores_named)(x, wq, wk)
    for eqn in jaxpr.jaxpr.eqns:
        if eqn.primitive.name == "einsum":
            p = eqn.params
            print(f"einsum {p['lhs_dims']} x {p['rhs_dims']} -> {p['out_dims']}")
    try:
        nx.dot(x, nx.as_named(jnp.ones((e + 1,)), ("embd",)), dim="embd")
    except nx.DimError as err:
        print("a wrong size is caught by name:", err)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="small sizes (tests)")
    main(ap.parse_args().tiny)
