"""`canonical_conv`: every convolution in the layout XLA runs fastest.

Precondition: any ClosedJaxpr.

Invariant established: every `conv_general_dilated` equation, at any depth
(loop and branch bodies, calls, remat), has the dimension numbers
(batch, spatial..., feature) for its input and its result and
(spatial..., in feature, out feature) for its kernel: NHWC / HWIO / NHWC in
2-D. An equation with other dimension numbers is replaced by transposes of
its operands into that layout, the same convolution in it, and a transpose
of the result back to the equation's own.

Why: automatic differentiation writes convolutions in other layouts (the
input gradient of an NHWC/HWIO convolution reads the kernel with its two
feature axes swapped; the kernel gradient contracts the batch, reading the
input as (C, N, H, W)), and XLA:CPU runs those inside a loop body 20-40x
slower than outside one (JAX 0.10, `benchmarks/conv_layout.py`: 8 layers of
3x3 convolutions over 32x16x16x32, a kernel gradient 710 ms per call in a
`scan` vs 17 ms unrolled, an input gradient 196 vs 9.5 ms). Once `reroll`
rolls a backward pass into a scan, or a user writes one (`nnx.scan`,
`lax.scan`), that is the whole step: a residual ConvNet's training step ran
18.6x slower than under `jax.jit`. In the canonical layout the same loops
take 14.4 and 10.6 ms, unrolled convolutions are no slower (14.6, 9.3 ms),
and the ConvNet step runs in 0.92x `jax.jit`'s time. (On GPU, XLA's layout
assignment picks convolution layouts itself and may absorb the transposes;
not measured: no GPU here.)

When it preserves `jax.jit`'s results: the transposes move values without
arithmetic, and the convolution multiplies and sums the same terms: its
strides, padding, dilations, feature and batch group counts, precision
and preferred element type are kept, and they index spatial axes in the
order of the dimension numbers, which the transposes keep. Integer
convolutions are therefore exact; a floating-point convolution's order of
additions is XLA's choice in any layout (as between any two of its
convolution algorithms), so it may round differently, within the error
model of one contraction (`testing.abs_scale`). An equation with an
explicit `out_sharding` is left alone (its sharding names the result's
axes in their own order).
"""

from __future__ import annotations

from jax import lax

from jaxbackend import _jax
from jaxbackend.passes import _rewrite


def canonical_specs(n: int) -> tuple:
    """(lhs, rhs, out) specs of the canonical layout of a rank-n
    convolution: each lists the axis of (batch or out feature, feature or in
    feature, spatial...)."""
    spatial = tuple(range(1, n - 1))
    return (0, n - 1) + spatial, (n - 1, n - 2) + tuple(range(n - 2)), (0, n - 1) + spatial


def _is_canonical(eqn) -> bool:
    specs, _ = _jax.conv_dims(eqn)
    return specs == canonical_specs(len(specs[0]))


def _conv_rule(ctx, eqn):
    params = _jax.eqn_params(eqn)
    if _is_canonical(eqn) or params.get("out_sharding") is not None:
        return None
    (lhs, rhs, out), _ = _jax.conv_dims(eqn)
    canon = canonical_specs(len(lhs))
    to_lhs = (lhs[0],) + lhs[2:] + (lhs[1],)          # -> (batch, spatial..., feature)
    to_rhs = rhs[2:] + (rhs[1], rhs[0])                # -> (window..., in, out)
    back = [0] * len(out)                              # canonical result -> eqn's order
    for k, a in enumerate(out):
        back[a] = canon[2][k]
    params["dimension_numbers"] = lax.ConvDimensionNumbers(*canon)
    prim = eqn.primitive
    pk = _jax.params_key(params)

    def conv(x, w):
        y = prim.bind(lax.transpose(x, to_lhs), lax.transpose(w, to_rhs), **params)
        return lax.transpose(y, tuple(back))

    outs = ctx.emit(conv, eqn.invars, None if pk is None else ("canonical_conv", pk, to_lhs,
                                                               to_rhs, tuple(back)))
    _rewrite.same_types(eqn, outs, "canonical convolution")
    ctx.count("convolution made canonical")
    return outs


def canonical_conv(closed):
    """Every convolution in the canonical layout (see module doc)."""
    return _rewrite.rewrite(closed, {"conv_general_dilated": _conv_rule})


def remaining(closed) -> int:
    """Convolutions not in the canonical layout (what the pass leaves at 0,
    but for those with an explicit out_sharding)."""
    return sum(1 for e in _rewrite.iter_eqns(closed)
               if e.primitive.name == "conv_general_dilated" and not _is_canonical(e))
