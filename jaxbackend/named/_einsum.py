"""`einsum`: the named contraction primitive.

One `einsum` equation stands for one contraction of two operands. Its
parameters carry the dim names of each operand and of the result:

    einsum[lhs_dims=('batch','time','embd') rhs_dims=('embd','head')
           out_dims=('batch','time','head')] x w

Semantics, stated in names (no positions): a dim in both operands and in the
result is a batch dim; a dim in both operands but not the result is
contracted; a dim in one operand only is free and must be in the result. So
every operand dim appears in the other operand or in the result. That closure
is what makes the two transpose rules (the backward contractions) einsums of
the same form, so reverse-mode AD keeps names: d/dlhs = einsum(ct, rhs ->
lhs_dims), d/drhs = einsum(lhs, ct -> rhs_dims).

The primitive lowers by itself (a `dot_general` plus a `transpose` only where
`out_dims` is not dot_general's natural order), so `jax.jit` of a named
program needs no pass; `passes.inline` uses the same `einsum_to_dot_general`
to rewrite the jaxpr for XLA.

Dtypes are dot_general's, since the primitive is one: the result dtype and
weak type come from dot_general's own rule (mixed operand dtypes allowed,
`preferred_element_type` as there), and the transpose rules do what
dot_general's do: contract the cotangent with the forward
`preferred_element_type` (bf16 operands accumulated in float32 get float32
accumulated cotangents), then cast to the primal operand's dtype and weak
type, so every cotangent has its primal's type.

vmap adds an axis with no name: the batching rule names it
`__vmap<k>__` (unused elsewhere) where it sits in each operand and returns it
where dot_general's natural order puts it (first if `out_dims` already needs
a transpose), so vmap adds no moveaxis and no transpose of its own. JAX calls
the rule for every einsum bound under vmap, also when neither operand is
batched (the primal einsum under `jacfwd`, `hessian`, vmap of `jvp`); then
the einsum is bound as is and its result is unbatched (`None`).
"""

from __future__ import annotations

import jax
from jax import lax

from jaxbackend import _jax

einsum_p = _jax.define_primitive("einsum")


def natural_out_dims(lhs_dims, rhs_dims, contract) -> tuple:
    """dot_general's output order: batch (lhs order), lhs free, rhs free."""
    contract = set(contract)
    rhs_set, lhs_set = set(rhs_dims), set(lhs_dims)
    batch = [d for d in lhs_dims if d in rhs_set and d not in contract]
    lhs_free = [d for d in lhs_dims if d not in rhs_set]
    rhs_free = [d for d in rhs_dims if d not in lhs_set]
    return tuple(batch + lhs_free + rhs_free)


def _dimension_numbers(lhs_dims, rhs_dims, out_dims):
    out_set = set(out_dims)
    rhs_set = set(rhs_dims)
    contract = [d for d in lhs_dims if d in rhs_set and d not in out_set]
    batch = [d for d in lhs_dims if d in rhs_set and d in out_set]
    dn = (
        (tuple(lhs_dims.index(d) for d in contract), tuple(rhs_dims.index(d) for d in contract)),
        (tuple(lhs_dims.index(d) for d in batch), tuple(rhs_dims.index(d) for d in batch)),
    )
    return dn, natural_out_dims(lhs_dims, rhs_dims, contract)


def einsum_to_dot_general(lhs, rhs, *, lhs_dims, rhs_dims, out_dims, precision=None,
                          preferred_element_type=None):
    """The einsum as `dot_general` (+ `transpose` iff out_dims needs it)."""
    dn, natural = _dimension_numbers(lhs_dims, rhs_dims, out_dims)
    out = lax.dot_general(lhs, rhs, dn, precision=precision,
                          preferred_element_type=preferred_element_type)
    if natural != tuple(out_dims):
        out = lax.transpose(out, tuple(natural.index(d) for d in out_dims))
    return out


def _check(lhs_shape, rhs_shape, lhs_dims, rhs_dims, out_dims):
    # Internal invariants: nx.dot validates user input before binding.
    assert len(lhs_shape) == len(lhs_dims) and len(rhs_shape) == len(rhs_dims), (
        lhs_shape, lhs_dims, rhs_shape, rhs_dims)
    sizes = dict(zip(lhs_dims, lhs_shape))
    for d, n in zip(rhs_dims, rhs_shape):
        assert sizes.setdefault(d, n) == n, f"einsum: dim {d!r} sizes {sizes[d]} vs {n}"
    lhs_set, rhs_set, out_set = set(lhs_dims), set(rhs_dims), set(out_dims)
    assert len(out_set) == len(out_dims) and out_set <= lhs_set | rhs_set, out_dims
    assert lhs_set <= rhs_set | out_set and rhs_set <= lhs_set | out_set, (
        "every operand dim must appear in the other operand or the result",
        lhs_dims, rhs_dims, out_dims)
    return tuple(sizes[d] for d in out_dims)


def _abstract_eval(lhs, rhs, *, lhs_dims, rhs_dims, out_dims, precision,
                   preferred_element_type):
    shape = _check(lhs.shape, rhs.shape, lhs_dims, rhs_dims, out_dims)
    dn, _ = _dimension_numbers(lhs_dims, rhs_dims, out_dims)
    dot = _jax.dot_general_out_aval(lhs, rhs, dimension_numbers=dn, precision=precision,
                                    preferred_element_type=preferred_element_type)
    return _jax.ShapedArray(shape, dot.dtype, weak_type=dot.weak_type)


def _impl(lhs, rhs, **params):
    return einsum_to_dot_general(lhs, rhs, **params)


def _cast_like(x, primal):
    # dot_general's transpose rule: the contraction ran in the forward
    # preferred_element_type; the cotangent takes the primal's type.
    aval = primal.aval
    if x.dtype == aval.dtype:
        return x
    return _jax.convert_element_type(x, aval.dtype, aval.weak_type)


def _transpose_lhs(ct, lhs, rhs, *, lhs_dims, rhs_dims, out_dims, precision,
                   preferred_element_type):
    return _cast_like(einsum_p.bind(ct, rhs, lhs_dims=out_dims, rhs_dims=rhs_dims,
                                    out_dims=lhs_dims, precision=precision,
                                    preferred_element_type=preferred_element_type), lhs)


def _transpose_rhs(ct, lhs, rhs, *, lhs_dims, rhs_dims, out_dims, precision,
                   preferred_element_type):
    return _cast_like(einsum_p.bind(lhs, ct, lhs_dims=lhs_dims, rhs_dims=out_dims,
                                    out_dims=rhs_dims, precision=precision,
                                    preferred_element_type=preferred_element_type), rhs)


def _fresh_name(taken) -> str:
    k = 0
    while f"__vmap{k}__" in taken:
        k += 1
    return f"__vmap{k}__"


def _batch_rule(axis_size, vals, bdims, *, lhs_dims, rhs_dims, out_dims, precision,
                preferred_element_type):
    # Name the mapped axis where it already sits in each operand (dims are
    # names, so no moveaxis is needed) and return it where dot_general puts
    # it, so vmap adds no transpose beyond what `out_dims` already needed.
    if all(b is None for b in bdims):  # e.g. the primal einsum under jacfwd
        return einsum_p.bind(*vals, lhs_dims=lhs_dims, rhs_dims=rhs_dims, out_dims=out_dims,
                             precision=precision,
                             preferred_element_type=preferred_element_type), None
    name = _fresh_name(set(lhs_dims) | set(rhs_dims))
    dims = [tuple(lhs_dims), tuple(rhs_dims)]
    for i, b in enumerate(bdims):
        if b is not None:
            dims[i] = dims[i][:b] + (name,) + dims[i][b:]
    contract = [d for d in dims[0] if d in dims[1] and d not in out_dims and d != name]
    natural = natural_out_dims(dims[0], dims[1], contract)
    if tuple(d for d in natural if d != name) == tuple(out_dims):
        new_out = natural
    else:
        new_out = (name,) + tuple(out_dims)
    out = einsum_p.bind(*vals, lhs_dims=dims[0], rhs_dims=dims[1], out_dims=new_out,
                        precision=precision, preferred_element_type=preferred_element_type)
    return out, new_out.index(name)


einsum_p.def_impl(_impl)
einsum_p.def_abstract_eval(_abstract_eval)
_jax.register_bilinear_ad(einsum_p, _transpose_lhs, _transpose_rhs)
_jax.register_batching(einsum_p, _batch_rule)
_jax.register_lowering_from_fun(einsum_p, _impl)


def einsum(lhs, rhs, *, lhs_dims, rhs_dims, out_dims, precision=None,
           preferred_element_type=None):
    """Bind one `einsum` equation on raw arrays (dims already validated)."""
    # Canonical dtype (as lax.dot_general stores it): hashable, comparable
    # params, so equal einsums look equal to CSE and to the fuse pass.
    if preferred_element_type is not None:
        preferred_element_type = jax.dtypes.canonicalize_dtype(preferred_element_type)
    return einsum_p.bind(lhs, rhs, lhs_dims=tuple(lhs_dims), rhs_dims=tuple(rhs_dims),
                         out_dims=tuple(out_dims), precision=precision,
                         preferred_element_type=preferred_element_type)
