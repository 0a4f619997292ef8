"""Names survive into the jaxpr, and nothing else changes.

1. The named jaxpr of a 2-layer attention under `jax.value_and_grad` is
   printed and its `einsum` equations asserted exactly: the multiset of
   (lhs_dims, rhs_dims, out_dims) triples, forward and backward, written out
   by hand from the model (not computed from the implementation).
2. Primitive counts: the named attention and its hand-written jnp twin emit
   the same primitives, counting each `einsum` as what it lowers to (one
   dot_general, plus one transpose iff its out_dims differ from
   dot_general's natural order), recursively through sub-jaxprs. Also
   checked after lowering, on the StableHLO op counts of `jax.jit(...)`.
"""

from __future__ import annotations

import collections
import re

import jax

from jaxbackend import _jax
from jaxbackend import named as nx
from jaxbackend.programs.attention_stack import (init_attention_stack, jnp_attention_stack,
                                                 name_params, named_attention_stack)
from jaxbackend.named._einsum import natural_out_dims

SMALL = dict(batch=2, time=8, embd=16, head=2, hd=8)

B, T, TK, E, H, D = "batch", "time", "time_k", "embd", "head", "hd"
# Per layer, forward: q, k, v projections (k and v are renamed to time_k
# only after their einsum), scores, attention-weighted values, output.
PROJ = ((B, T, E), (E, H, D), (B, T, H, D))
SCORES = ((B, T, H, D), (B, TK, H, D), (B, H, T, TK))
VALUES = ((B, H, T, TK), (B, TK, H, D), (B, H, T, D))
OUT = ((B, H, T, D), (H, D, E), (B, T, E))
FORWARD = [PROJ, PROJ, PROJ, SCORES, VALUES, OUT]


def _d_lhs(lhs, rhs, out):  # cotangent of the lhs: einsum(ct, rhs -> lhs)
    return (out, rhs, lhs)


def _d_rhs(lhs, rhs, out):  # cotangent of the rhs: einsum(lhs, ct -> rhs)
    return (lhs, out, rhs)


def _expected(n_layers, weight_grads):
    per_layer = list(FORWARD)
    for eq in FORWARD:
        per_layer.append(_d_lhs(*eq))
        # The rhs of the projections and the output is a weight: its
        # cotangent einsum exists only when weights are differentiated.
        if weight_grads or eq in (SCORES, VALUES):
            per_layer.append(_d_rhs(*eq))
    return collections.Counter(per_layer * n_layers)


def _setup(n_layers):
    x, layers = init_attention_stack(jax.random.PRNGKey(0), n_layers, **SMALL)
    return (x, layers), name_params(x, layers)


def _einsum_triples(jaxpr):
    return collections.Counter(
        (e.params["lhs_dims"], e.params["rhs_dims"], e.params["out_dims"])
        for e in _all_eqns(jaxpr) if e.primitive is nx.einsum_p)


def _all_eqns(jaxpr):
    """Equations of `jaxpr` and, recursively, of its sub-jaxprs."""
    for e in jaxpr.eqns:
        yield e
        for v in e.params.values():
            for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                if isinstance(sub, _jax.ClosedJaxpr):
                    yield from _all_eqns(sub.jaxpr)
                elif isinstance(sub, _jax.Jaxpr):
                    yield from _all_eqns(sub)


def test_named_jaxpr_of_two_layer_attention_forward_and_backward():
    _, (nxx, nl) = _setup(2)
    for argnums, weight_grads in ((0, False), ((0, 1), True)):
        fn = jax.value_and_grad(named_attention_stack, argnums=argnums, has_aux=True)
        closed = jax.make_jaxpr(fn)(nxx, nl)
        print(f"\n-- einsum equations, value_and_grad(argnums={argnums}) --")
        for e in _all_eqns(closed.jaxpr):
            if e.primitive is nx.einsum_p:
                p = e.params
                print(f"einsum [{' '.join(p['lhs_dims'])}] x [{' '.join(p['rhs_dims'])}] -> "
                      f"[{' '.join(p['out_dims'])}]")
        got = _einsum_triples(closed.jaxpr)
        want = _expected(2, weight_grads)
        assert got == want, (got - want, want - got)
        assert sum(want.values()) == (36 if weight_grads else 28)
        # No contraction escapes naming: every dot_general is an einsum.
        assert not any(e.primitive.name == "dot_general" for e in _all_eqns(closed.jaxpr))
    # The forward alone: exactly the forward einsums, in program order.
    fwd = jax.make_jaxpr(named_attention_stack)(nxx, nl).jaxpr
    order = [(e.params["lhs_dims"], e.params["rhs_dims"], e.params["out_dims"])
             for e in fwd.eqns if e.primitive is nx.einsum_p]
    assert order == FORWARD * 2


def _lowered_counts(jaxpr):
    """Primitive counts with each einsum counted as what it lowers to."""
    c = collections.Counter()
    for e in _all_eqns(jaxpr):
        if e.primitive is nx.einsum_p:
            p = e.params
            contract = [d for d in p["lhs_dims"] if d in p["rhs_dims"] and d not in p["out_dims"]]
            c["dot_general"] += 1
            if natural_out_dims(p["lhs_dims"], p["rhs_dims"], contract) != p["out_dims"]:
                c["transpose"] += 1
        else:
            c[e.primitive.name] += 1
    return c


def _both(n_layers, wrap):
    (x, layers), (nxx, nl) = _setup(n_layers)
    named = _lowered_counts(jax.make_jaxpr(wrap(named_attention_stack))(nxx, nl).jaxpr)
    plain = _lowered_counts(jax.make_jaxpr(wrap(jnp_attention_stack))(x, layers).jaxpr)
    return named, plain


def test_primitive_counts_match_jnp_forward():
    for n in (1, 2):
        named, plain = _both(n, lambda f: f)
        assert named == plain, (named - plain, plain - named)
        assert named["dot_general"] == 6 * n and named["transpose"] == 0


def test_primitive_counts_match_jnp_with_grad():
    named, plain = _both(1, lambda f: jax.value_and_grad(f, has_aux=True))
    assert named == plain, (named - plain, plain - named)
    assert named["dot_general"] == 14 and named["transpose"] == 4
    # With weight gradients too, the named backward needs FEWER transposes:
    # its weight-cotangent einsums ask for the weight's own dim order, which
    # is dot_general's natural order there, while jnp.einsum's transpose rule
    # emits dot_general + transpose. Everything else is equal.
    named, plain = _both(1, lambda f: jax.value_and_grad(f, argnums=(0, 1), has_aux=True))
    assert named["transpose"] == 4 and plain["transpose"] == 8
    named.pop("transpose"), plain.pop("transpose")
    assert named == plain, (named - plain, plain - named)


def _hlo_counts(fn, *args):
    text = jax.jit(fn).lower(*args).as_text()
    return collections.Counter(re.findall(r"stablehlo\.[a-z_]+|call @\w+", text))


def test_lowered_stablehlo_matches_jnp():
    (x, layers), (nxx, nl) = _setup(2)
    for argnums in (None, 0, (0, 1)):
        if argnums is None:
            wrap = lambda f: f  # noqa: E731
        else:
            wrap = lambda f: jax.value_and_grad(f, argnums=argnums, has_aux=True)  # noqa: E731,B023
        named = _hlo_counts(wrap(named_attention_stack), nxx, nl)
        plain = _hlo_counts(wrap(jnp_attention_stack), x, layers)
        nt, pt = named.pop("stablehlo.transpose", 0), plain.pop("stablehlo.transpose", 0)
        assert named == plain, (argnums, named - plain, plain - named)
        if argnums == (0, 1):  # see test_primitive_counts_match_jnp_with_grad
            assert (nt, pt) == (8, 16)
        else:
            assert nt == pt, (argnums, nt, pt)
