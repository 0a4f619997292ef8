"""`canonical_conv`: every convolution in the canonical layout (NHWC / HWIO in
2-D), at any depth, computing what it computed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jaxbackend import _jax
from jaxbackend.passes import _rewrite
from jaxbackend.passes.canonical_conv import canonical_conv, canonical_specs, remaining
from jaxbackend.testing import check_pass


def _normal(key, shape):
    return jax.random.normal(jax.random.key(key), shape)


# (convolution of (x, w), x shape, w shape): layouts, strides, dilations,
# padding and groups that AD and users write
CASES = {
    "2d NCHW/OIHW strided": (
        lambda x, w: lax.conv_general_dilated(x, w, (2, 1), "SAME",
                                              dimension_numbers=("NCHW", "OIHW", "NCHW")),
        (2, 4, 9, 8), (6, 4, 3, 3)),
    "1d NWC dilated": (
        lambda x, w: lax.conv_general_dilated(x, w, (1,), [(2, 1)], rhs_dilation=(2,),
                                              dimension_numbers=("NWC", "WIO", "NWC")),
        (2, 10, 3), (3, 3, 5)),
    "2d NHWC transposed (lhs dilated)": (
        lambda x, w: lax.conv_general_dilated(x, w, (1, 1), [(1, 1), (2, 0)], lhs_dilation=(2, 2),
                                              dimension_numbers=("NHWC", "HWIO", "NHWC")),
        (2, 5, 4, 3), (3, 2, 3, 4)),
    "3d NDHWC grouped": (
        lambda x, w: lax.conv_general_dilated(x, w, (1, 1, 1), "VALID", feature_group_count=2,
                                              dimension_numbers=("NDHWC", "DHWIO", "NDHWC")),
        (1, 4, 5, 6, 4), (2, 2, 2, 2, 6)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_convolutions_and_their_gradients_become_canonical_with_values_kept(name):
    conv, xs, ws = CASES[name]

    def loss(x, w):
        return jnp.sum(jnp.tanh(conv(x, w)))

    args = (_normal(0, xs), _normal(1, ws))
    # AD writes the input and kernel gradients in other layouts
    assert remaining(jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1)))(*args)) >= 2
    # forward and value_and_grad: values (error model), types, idempotence
    fwd, grad = check_pass(canonical_conv, loss, args, argnums=(0, 1))
    assert remaining(fwd) == 0 and remaining(grad) == 0
    for closed in (fwd, grad):
        for e in _rewrite.iter_eqns(closed):
            if e.primitive.name == "conv_general_dilated":
                specs, groups = _jax.conv_dims(e)
                assert specs == canonical_specs(len(specs[0]))


def test_an_integer_convolution_is_exact():
    x = jax.random.randint(jax.random.key(0), (2, 3, 6, 6), -50, 50, jnp.int32)
    w = jax.random.randint(jax.random.key(1), (4, 3, 3, 3), -50, 50, jnp.int32)

    def f(x, w):
        return lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                        dimension_numbers=("NCHW", "OIHW", "NCHW"),
                                        preferred_element_type=jnp.int32)

    closed = jax.make_jaxpr(f)(x, w)
    out = canonical_conv(closed)
    assert remaining(closed) == 1 and remaining(out) == 0
    got = jax.core.eval_jaxpr(out.jaxpr, out.consts, x, w)[0]
    np.testing.assert_array_equal(got, jax.jit(f)(x, w))


def test_convolutions_in_a_scan_body_are_made_canonical():
    """A user's own `lax.scan` over conv layers (or a rolled backward pass):
    the body is rewritten once, the loop stays a loop."""
    def loss(ws, x):
        def layer(h, w):
            return h + jnp.tanh(lax.conv_general_dilated(
                h, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))), None
        return jnp.sum(lax.scan(layer, x, ws)[0] ** 2)

    args = (_normal(0, (4, 3, 3, 5, 5)) * 0.1, _normal(1, (2, 6, 6, 5)))
    closed = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(*args)
    assert remaining(closed) == 2        # input and kernel gradient, in the backward body
    _, grad = check_pass(canonical_conv, loss, args, argnums=(0, 1))
    assert remaining(grad) == 0
    assert _rewrite.count_eqns(grad, "scan") == _rewrite.count_eqns(closed, "scan") == 2
