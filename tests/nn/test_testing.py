"""`jaxbackend.testing` must pass correct programs and fail wrong ones."""

import jax
import jax.numpy as jnp
import pytest

from jaxbackend import _jax, testing
from jaxbackend.models._attention_stack import (init_attention_stack, name_params,
                                                named_attention_stack)


def _args():
    x, layers = init_attention_stack(jax.random.key(0), 1, batch=2, time=6, embd=8, head=2, hd=4)
    return name_params(x, layers)


def _rescaled(closed, factor):
    """A genuine ClosedJaxpr -> ClosedJaxpr callable that changes numerics."""
    def f(*xs):
        return [o * factor for o in _jax.jaxpr_as_fun(closed)(*xs)]
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in closed.in_avals]
    return jax.make_jaxpr(f)(*avals)


def test_identity_pass_preserves():
    rep = testing.assert_pass_preserves(lambda c: c, named_attention_stack, *_args())
    assert rep["forward"]["max_abs_err"] == 0.0
    assert rep["gradient"]["eqns_before"] > rep["forward"]["eqns_before"]


def test_default_pipeline_preserves_numerics():
    pytest.importorskip("jaxbackend.passes")
    rep = testing.assert_pass_preserves(None, named_attention_stack, *_args())
    assert rep["forward"]["eqns_after"] > 0


def test_a_pass_that_changes_numerics_fails():
    with pytest.raises(AssertionError, match="forward output"):
        testing.assert_pass_preserves(lambda c: _rescaled(c, 1.001), named_attention_stack,
                                      *_args(), idempotent=False)


def test_a_non_idempotent_pass_fails():
    with pytest.raises(AssertionError, match="twice"):
        testing.assert_pass_preserves(lambda c: _rescaled(c, 1.0), named_attention_stack, *_args())


def test_tolerances_per_dtype():
    assert testing.tolerance(jnp.float32) == (1e-5, 1e-5)
    assert testing.tolerance(jnp.float32, jnp.bfloat16) == testing.TOLERANCES["bfloat16"]
    testing.assert_close(jnp.array([1.0, 2.0], jnp.bfloat16), jnp.array([1.0, 2.01]))
    with pytest.raises(AssertionError, match="max abs error"):
        testing.assert_close(jnp.array([1.0, 2.0]), jnp.array([1.0, 2.001]))
