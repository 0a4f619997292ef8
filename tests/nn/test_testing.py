"""`jaxbackend.testing` must pass correct programs and fail wrong ones."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxbackend import _jax, testing
from jaxbackend.programs.attention_stack import (init_attention_stack, name_params,
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
    rep = testing.assert_pass_preserves(None, named_attention_stack, *_args())
    assert rep["forward"]["eqns_after"] > 0


def test_a_pass_that_changes_numerics_fails():
    with pytest.raises(AssertionError, match="forward output"):
        testing.assert_pass_preserves(lambda c: _rescaled(c, 1.001), named_attention_stack,
                                      *_args(), idempotent=False)


def test_a_non_idempotent_pass_fails():
    with pytest.raises(AssertionError, match="twice"):
        testing.assert_pass_preserves(lambda c: _rescaled(c, 1.0), named_attention_stack, *_args())


def test_tolerances_follow_the_error_model():
    # rtol = ROUNDINGS * eps per dtype, atol 0; the loosest compared dtype wins
    assert testing.tolerance(jnp.float32) == (64 * 2.0 ** -23, 0.0)
    assert testing.tolerance(jnp.float64) == (64 * 2.0 ** -52, 0.0)
    assert testing.tolerance(jnp.float16) == (4 * 2.0 ** -10, 0.0)
    assert testing.tolerance(jnp.float32, jnp.bfloat16) == testing.TOLERANCES["bfloat16"]
    assert testing.tolerance(jnp.int32, jnp.bool_) == (0.0, 0.0)
    testing.assert_close(jnp.array([1.0, 2.0], jnp.bfloat16), jnp.array([1.0, 2.01]))
    with pytest.raises(AssertionError, match="differ by more than"):
        testing.assert_close(jnp.array([1.0, 2.0]), jnp.array([1.0, 2.001]))
    testing.assert_close(jnp.float32(1.0) + 2 ** -20, jnp.float32(1.0))     # 8 eps: inexact
    with pytest.raises(AssertionError, match="differ by more than"):
        testing.assert_close(jnp.float32(1.0) + 2 ** -15, jnp.float32(1.0))  # 256 eps: a bug


def test_a_cancelling_sum_is_judged_by_the_sum_of_its_terms():
    # 512 terms of size ~100 summing to ~0.5: two summation orders differ by
    # far more than eps of the result, but by ~1 eps of sum|terms| (the AMD
    # EPYC failure of the loss tests)
    t = 100 * jax.random.normal(jax.random.key(0), (512,), jnp.float32)
    t = t - t.mean() + 0.5 / 512
    tree_order, reverse_order = jnp.sum(t), np.cumsum(np.asarray(t)[::-1])[-1]
    with pytest.raises(AssertionError, match="max.reference"):
        testing.assert_close(reverse_order, tree_order)          # at max|result|: fails
    scale = testing.abs_scale(jnp.sum, t)
    np.testing.assert_allclose(scale, np.abs(np.asarray(t, np.float64)).sum(), rtol=1e-6)
    testing.assert_close(reverse_order, tree_order, scale=scale, what="sum")
    wrong = tree_order + 1e-3 * float(scale)        # 8000 eps of the terms: a bug
    with pytest.raises(AssertionError, match="sum:.*given"):
        testing.assert_close(wrong, tree_order, scale=scale, what="sum")
    # lazy: the default (max|expected|) first, the scale only where that fails
    testing.assert_close(reverse_order, tree_order, scale=lambda: testing.abs_scale(jnp.sum, t))
    with pytest.raises(AssertionError, match="given"):
        testing.assert_close(wrong, tree_order, scale=lambda: testing.abs_scale(jnp.sum, t))


def test_abs_scale_of_contractions_and_programs():
    a = jnp.array([[1.0, -2.0], [3.0, 4.0]])
    b = jnp.array([[1.0, -1.0], [-1.0, 1.0]])
    np.testing.assert_array_equal(testing.abs_scale(jnp.matmul, a, b), np.abs(a) @ np.abs(b))
    # a - b rounds relative to |a| + |b|; exact data movement adds nothing
    np.testing.assert_array_equal(testing.abs_scale(lambda x, y: (x - y).T, a, b),
                                  (np.abs(a) + np.abs(b)).T)
    assert testing.abs_scale(lambda x: x[::-1].reshape(4), a).max() == 0.0
    # through a scan, a cond and a jit: finite, positive, one per output entry
    def prog(x):
        y = jax.jit(jnp.tanh)(x) @ b
        y = jax.lax.cond(y.sum() > 0, lambda q: q * 3.0, lambda q: -q, y)
        return jax.lax.scan(lambda c, r: (c + jnp.exp(r), c), jnp.zeros(2), y)
    (carry, ys) = testing.abs_scale(prog, a)
    assert carry.shape == (2,) and ys.shape == (2, 2)
    assert np.isfinite(carry).all() and (carry > 0).all() and (ys[1] > 0).all()
    # integer outputs and non-finite outputs carry no scale
    ints, infs = testing.abs_scale(lambda x: (x.astype(jnp.int32), x / 0.0), a)
    assert ints.max() == 0.0 and infs.max() == 0.0
    # products of rounding noise (a sum that cancels to 0, squared or times
    # another): the first-order terms vanish at 0, the product of the errors
    # does not (u**2 w0 w1; 2 u**2 w**2 for a square)
    x = jnp.array([1.0, -1.0, 0.5, -0.5])
    u = np.finfo(np.float32).eps / 2
    assert testing.abs_scale(jnp.sum, x) == 3.0
    np.testing.assert_allclose(testing.abs_scale(lambda v: jnp.sum(v) ** 2, x),
                               np.sqrt(2) * u * 9.0, rtol=1e-6)
    np.testing.assert_allclose(testing.abs_scale(lambda v: jnp.sum(v) * jnp.sum(2 * v), x),
                               u * 3.0 * testing.abs_scale(lambda v: jnp.sum(2 * v), x),
                               rtol=1e-6)
    # one optimization_barrier moving a float and an integer: the float keeps
    # its scale, the integer has none (this raised in jnp.finfo once)
    def barrier(x, i):
        y, j = jax.lax.optimization_barrier((x @ b, i + 1))
        return y, j
    y_scale, j_scale = testing.abs_scale(barrier, a, jnp.arange(3))
    np.testing.assert_array_equal(y_scale, np.abs(a) @ np.abs(b))
    assert j_scale.shape == (3,) and j_scale.max() == 0.0


def test_abs_scale_of_a_pow_by_a_float_literal_on_a_weak_typed_value():
    # optax's cosine schedule raises its (weak-typed) decay to the literal
    # power 1.0: the derivative rule met the literal as float64 under x64
    # and raised a dtype error (a training step with that schedule could
    # not be compared at all)
    import optax

    def f(c):   # variances (units of u**2): convert 9; mul 2.25 + 0.25 * 9; pow 2.25 + 1 * 4.5
        return jnp.power(0.5 * c, 1.0)

    assert "weak_type=True" in str(jax.make_jaxpr(f)(jnp.int32(3)))
    np.testing.assert_allclose(testing.abs_scale(f, jnp.int32(3)), np.sqrt(6.75), rtol=1e-12)
    schedule = optax.cosine_decay_schedule(1e-3, 100)
    scale = testing.abs_scale(schedule, jnp.int32(3))
    assert np.isfinite(scale) and scale > abs(float(schedule(3)))


def test_each_rounding_counts_at_its_own_dtypes_size():
    bf16, f32 = jnp.bfloat16, jnp.float32
    x = jnp.float32(1.0)                   # exact in both dtypes
    # two bfloat16 roundings (the narrowing convert, the product), each
    # 2**16 float32 roundings, in a float32 result's units
    up = testing.abs_scale(lambda x: (x.astype(bf16) * 3).astype(f32), x)
    np.testing.assert_allclose(up, 2.0 ** 16 * 3 * np.sqrt(2), rtol=1e-12)
    # the same roundings in a bfloat16 result's units
    same = testing.abs_scale(lambda x: x.astype(bf16) * 3, x)
    np.testing.assert_allclose(same, 3 * np.sqrt(2), rtol=1e-12)
    # float32 work under a bfloat16 result counts at its own, finer size
    down = testing.abs_scale(lambda x: (x * 3).astype(bf16), x)
    np.testing.assert_allclose(down, 3 * np.sqrt(1 + 2.0 ** -32), rtol=1e-12)


def test_a_mixed_precision_loss_is_judged_at_its_bfloat16_roundings():
    # the loss is float32, its matmul's result bfloat16. XLA:CPU keeps that
    # result in float32 (excess precision); a GPU rounds it to bfloat16, as
    # `rounded` does: two evaluations equal within the error model, not
    # within float32 roundings
    kx, kw = jax.random.split(jax.random.key(0))
    x, w = jax.random.normal(kx, (16, 64)), jax.random.normal(kw, (64, 32)) / 8
    bf16, f32 = jnp.bfloat16, jnp.float32

    def loss(x, w):
        return jnp.mean(jnp.tanh((x.astype(bf16) @ w.astype(bf16)).astype(f32)))

    def rounded(x, w):
        y = x.astype(bf16).astype(f32) @ w.astype(bf16).astype(f32)
        return jnp.mean(jnp.tanh(y.astype(bf16).astype(f32)))

    got, want = jax.jit(rounded)(x, w), jax.jit(loss)(x, w)
    with pytest.raises(AssertionError, match="differ by more than"):
        testing.assert_close(got, want)            # max|loss|: float32 roundings only
    scale = testing.abs_scale(loss, x, w)
    testing.assert_close(got, want, scale=scale)
    with pytest.raises(AssertionError, match="differ by more than"):   # still not anything
        testing.assert_close(got + 0.1, want, scale=scale)


def test_exact_kinds_and_patterns():
    testing.assert_close(jnp.array([1, 2], jnp.int32), np.array([1, 2]))
    with pytest.raises(AssertionError, match="integer/bool values differ"):
        testing.assert_close(jnp.array([1, 3], jnp.int32), np.array([1, 2]))
    with pytest.raises(AssertionError, match="integer/bool"):
        testing.assert_close(jnp.array([True]), jnp.array([False]))
    nonfinite = jnp.array([1.0, jnp.inf, -jnp.inf, jnp.nan])
    testing.assert_close(nonfinite, np.array([1.0, np.inf, -np.inf, np.nan]))
    for other in ([1.0, -np.inf, -np.inf, np.nan], [1.0, np.inf, np.nan, np.nan],
                  [1.0, np.inf, -np.inf, 5.0]):
        with pytest.raises(AssertionError, match="non-finite pattern"):
            testing.assert_close(nonfinite, np.array(other))
    with pytest.raises(AssertionError, match="shape"):
        testing.assert_close(jnp.ones(3), jnp.ones((3, 1)))
    with pytest.raises(AssertionError, match="dtype"):
        testing.assert_close(jnp.ones(3, jnp.float16), jnp.ones(3), check_dtype=True)
    with pytest.raises(AssertionError, match="weak_type"):
        testing.assert_close(jnp.asarray(1.0), jnp.float32(1.0) + 0, check_dtype=True)
    # pytrees leaf by leaf, an exact comparison when asked for
    testing.assert_close({"a": jnp.ones(2), "b": (jnp.zeros(()),)},
                         {"a": np.ones(2), "b": (np.zeros(()),)}, rtol=0, atol=0)
    with pytest.raises(ValueError, match="scale of shape"):
        testing.assert_close(jnp.ones((2, 3)), jnp.ones((2, 3)), scale=np.ones(2))
    # typed PRNG keys (an NNX step's RngState) are compared by their bits, exactly
    key = jax.random.key(0)
    testing.assert_close({"w": jnp.ones(2), "key": key}, {"w": np.ones(2), "key": key})
    with pytest.raises(AssertionError, match="integer/bool values differ"):
        testing.assert_close(jax.random.key(1), key)
    for other in (jax.random.key_data(key), jax.random.key(0, impl="rbg")):
        with pytest.raises(AssertionError, match="a PRNG key compared with another kind"):
            testing.assert_close(key, other)


def test_complex_values_are_compared_as_points_of_the_plane():
    # the imaginary part was dropped (a cast to float64): [1+1j] passed as [1+5j]
    a = jnp.array([1 + 1j, 2 + 0j], jnp.complex64)
    with pytest.raises(AssertionError, match="abs error 4"):
        testing.assert_close(a, jnp.array([1 + 5j, 2 + 0j], jnp.complex64))
    testing.assert_close(a, a * (1 + 2 ** -22))          # rounding of the parts passes
    assert testing.tolerance(np.complex64) == testing.tolerance(np.float32)
    assert testing.tolerance(np.complex128) == testing.tolerance(np.float64)
    with pytest.raises(AssertionError, match="non-finite pattern"):
        testing.assert_close(jnp.array([complex(np.nan, 1.0)]), jnp.array([complex(1.0, np.nan)]))


def test_abs_scale_of_an_fft_is_the_sum_of_its_terms():
    # each output of an n-point FFT sums n inputs times unit roots (an
    # inverse divides by n); a program with complex values inside raised in
    # lax.is_finite before, so an FNet's step could not be compared at scale
    x = jax.random.normal(jax.random.key(0), (4, 8))
    row = np.abs(np.asarray(x, np.float64)).sum(1, keepdims=True)
    np.testing.assert_allclose(testing.abs_scale(jnp.fft.fft, x), np.broadcast_to(row, (4, 8)),
                               rtol=1e-6)
    np.testing.assert_allclose(testing.abs_scale(jnp.fft.ifft, x), np.broadcast_to(row / 8, (4, 8)),
                               rtol=1e-6)
    np.testing.assert_allclose(testing.abs_scale(jnp.fft.fft2, x), np.abs(np.asarray(x)).sum(),
                               rtol=1e-6)
    s = testing.abs_scale(lambda v: jnp.fft.irfft(jnp.fft.rfft(v) * 2.0).real.sum(), x)
    assert np.isfinite(s) and s > 0
