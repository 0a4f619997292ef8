"""The one module that touches JAX internals.

Everything jaxbackend needs beyond JAX's stable public API is imported or
wrapped here, so a JAX upgrade is a change to this file only. Each shim says
which JAX versions it was written against ("JAX 0.10" = checked on 0.10.2,
the version this project's CI installs; GPU machines carry 0.11).

Public-but-low-level modules (`jax.extend.core`, `jax.interpreters.*`) are
preferred over `jax._src`; where `jax._src` is unavoidable the reason is
written next to the import.
"""

from __future__ import annotations

import jax
from jax.extend import core as jex_core
from jax.interpreters import ad, batching, mlir

JAX_VERSION = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())

Primitive = jex_core.Primitive
ClosedJaxpr = jex_core.ClosedJaxpr
Jaxpr = jex_core.Jaxpr
JaxprEqn = jex_core.JaxprEqn
Literal = jex_core.Literal
Var = jex_core.Var
jaxpr_as_fun = jex_core.jaxpr_as_fun
check_jaxpr = jex_core.check_jaxpr

# `ShapedArray` is public via jax.core in JAX 0.10 (jax.extend.core lacks it).
from jax.core import ShapedArray  # noqa: E402


def define_primitive(name: str) -> Primitive:
    """A new primitive with a plain `bind`; rules are attached by the caller."""
    return Primitive(name)


def register_bilinear_ad(prim: Primitive, lhs_transpose, rhs_transpose) -> None:
    """JVP and transpose rules for a primitive linear in each of two operands.

    JAX 0.10: `ad.defbilinear(prim, lhs_rule, rhs_rule)`; each rule is called
    as `rule(cotangent, lhs, rhs, **params)` where the operand being
    transposed is an `UndefinedPrimal` carrying `.aval`.
    """
    ad.defbilinear(prim, lhs_transpose, rhs_transpose)


def is_undefined_primal(x) -> bool:
    return ad.is_undefined_primal(x)


def register_batching(prim: Primitive, rule) -> None:
    """vmap rule `rule(axis_size, vals, dims, **params) -> (out, out_dim)`.

    JAX 0.10 changed batching-rule signatures: `fancy_primitive_batchers`
    rules receive `(axis_data, vals, dims, **params)`; the older
    `primitive_batchers` table is a shim marked for deletion, so we register
    with the new table and adapt here. Under vmap with no batched operand JAX
    never calls the rule.
    """

    def wrapped(axis_data, vals, dims, **params):
        return rule(axis_data.size, vals, dims, **params)

    batching.fancy_primitive_batchers[prim] = wrapped


def register_lowering_from_fun(prim: Primitive, fun) -> None:
    """MLIR lowering for `prim` by tracing `fun` (a jnp/lax function)."""
    mlir.register_lowering(prim, mlir.lower_fun(fun, multiple_results=False))
