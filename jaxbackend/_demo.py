"""`python -m jaxbackend demo`: the named front end in one screen.

Builds a multi-layer causal attention with `jaxbackend.named`, prints the
jaxpr of `value_and_grad` of its sum (the forward and backward contractions
are `einsum` equations carrying dim names), then checks value and gradients
against the same model written in plain jnp.
"""

from __future__ import annotations

import argparse
import collections

import jax

from jaxbackend import testing
from jaxbackend.named import einsum_p
from jaxbackend.programs import attention_stack as A


def _einsum_lines(jaxpr) -> list[str]:
    out = []
    for e in jaxpr.eqns:
        if e.primitive is einsum_p:
            p = e.params
            fmt = lambda ds: " ".join(ds)  # noqa: E731
            out.append(f"einsum  [{fmt(p['lhs_dims'])}] x [{fmt(p['rhs_dims'])}] -> [{fmt(p['out_dims'])}]")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxbackend demo", description=__doc__)
    ap.add_argument("--layers", type=int, default=2, help="attention layers (default 2)")
    ap.add_argument("--full-jaxpr", action="store_true", help="print the whole jaxpr")
    args = ap.parse_args(argv)
    if args.layers < 1:
        ap.error(f"--layers must be >= 1, got {args.layers}")

    x, layers = A.init_attention_stack(jax.random.key(0), args.layers)
    nx_x, nx_layers = A.name_params(x, layers)
    named = jax.value_and_grad(lambda x, L: A.named_attention_stack(x, L)[0], argnums=(0, 1))
    plain = jax.value_and_grad(lambda x, L: A.jnp_attention_stack(x, L)[0], argnums=(0, 1))

    jaxpr = jax.make_jaxpr(named)(nx_x, nx_layers).jaxpr
    print(f"value_and_grad of a {args.layers}-layer named causal attention "
          f"(sizes {A.DEFAULT_SIZES}):")
    if args.full_jaxpr:
        print(jaxpr)
    lines = _einsum_lines(jaxpr)
    counts = collections.Counter(e.primitive.name for e in jaxpr.eqns)
    print(f"{len(jaxpr.eqns)} equations, {len(lines)} named einsums "
          f"(forward and backward), {sum(counts.values()) - len(lines)} others:")
    for line in lines:
        print("  " + line)

    (v_n, g_n), (v_p, g_p) = jax.jit(named)(nx_x, nx_layers), jax.jit(plain)(x, layers)
    # float32 sums differ by rounding from program to program: compared at
    # the error model's scale (the sum of |terms| behind each entry,
    # `testing.abs_scale`), not at a tolerance picked to pass here
    try:
        err = testing.assert_close((v_n, g_n), (v_p, g_p), what="loss and grads",
                                   scale=lambda: testing.abs_scale(plain, x, layers))
        ok, verdict = True, f"OK (max abs error {err:.2e}, within float32 rounding)"
    except AssertionError as e:
        ok, verdict = False, f"MISMATCH: {e}"
    print(f"\nloss named={float(v_n):.6f} jnp={float(v_p):.6f}")
    print("named == jnp: " + verdict)
    return 0 if ok else 1
