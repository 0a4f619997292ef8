"""`nn.functional` on models with dropout: jit, grad, fresh randomness.

`fn(params, *args)` must be a pure function, so it runs under `jax.jit`,
`jb.jit` and `jax.grad` (a model's RNG counters are Flax variables that may
only be advanced in the trace that made them). Randomness comes from the
`key=` argument: a fresh key per call gives fresh dropout masks, the same key
the same masks, eagerly or compiled; without a key the masks come from the
model's RNG state at `functional` time (the same on every call). In eval mode
the key changes nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxbackend as jb
from jaxbackend import named as nx
from jaxbackend import nn
from jaxbackend.models import GPT, GPTConfig
from jaxbackend.testing import abs_scale, assert_close

CFG = GPTConfig(vocab_size=16, seq_len=8, n_layers=1, embd=8, heads=2, dropout=0.5)


def _tokens():
    t = jax.random.randint(jax.random.key(1), (2, CFG.seq_len + 1), 0, CFG.vocab_size)
    return t[:, :-1], t[:, 1:]


class TwoDrops(nnx.Module):
    """ones -> two dropout layers; `loss` returns both masks (scaled)."""

    def __init__(self, rngs):
        self.w = nnx.Param(jnp.ones((6, 5)), dims=("a", "b"))
        self.d1 = nn.Dropout(0.5, rngs=rngs)
        self.d2 = nn.Dropout(0.5, rngs=rngs)

    def loss(self, x):
        h = nx.NamedArray(x * self.w[...], ("a", "b"))
        return self.d1(h).values, self.d2(h).values


def test_dropout_model_runs_under_jax_jit_and_jb_jit():
    x, y = _tokens()
    params, loss = nn.functional(GPT(CFG, rngs=nnx.Rngs(0)), "loss")
    eager = loss(params, x, y)
    assert_close(jax.jit(loss)(params, x, y), eager, what="jax.jit loss")
    assert_close(jb.jit(loss)(params, x, y), eager, what="jb.jit loss")
    # Pure: calling it again (eagerly or compiled) repeats the same masks.
    assert_close(loss(params, x, y), eager, rtol=0, atol=0, what="second eager call")


@functools.cache
def _keyed_step():
    """(step, args, eager result, lazy error-model scale): one of each for
    both compilers compared below."""
    x, y = _tokens()
    params, loss = nn.functional(GPT(CFG, rngs=nnx.Rngs(0)), "loss")

    def step(params, x, y, key):
        return jax.value_and_grad(loss)(params, x, y, key=key)

    args = (params, x, y, jax.random.key(7))
    return step, args, step(*args), functools.cache(lambda: abs_scale(step, *args))


@pytest.mark.parametrize("jit", [jax.jit, jb.jit], ids=["jax.jit", "jb.jit"])
def test_grad_under_jit_with_key(jit):
    step, args, (le, ge), scale = _keyed_step()
    lc, gc = jit(step)(*args)
    for a, b in zip(jax.tree.leaves(gc), jax.tree.leaves(ge)):
        assert a.dtype == b.dtype
    assert_close((lc, gc), (le, ge), scale=scale, what="loss and grad")
    assert jax.tree.structure(gc) == jax.tree.structure(args[0])


def test_key_gives_fresh_randomness_per_call():
    params, fn = nn.functional(TwoDrops(nnx.Rngs(0)), "loss")
    x = jnp.ones((6, 5))
    f = jax.jit(fn)
    a1, b1 = f(params, x, key=jax.random.key(1))
    a2, b2 = f(params, x, key=jax.random.key(2))
    a1_again, _ = f(params, x, key=jax.random.key(1))
    assert not np.array_equal(a1, a2)          # a new key, new masks
    np.testing.assert_array_equal(a1, a1_again)  # the same key, the same masks
    assert not np.array_equal(a1, b1)          # the layers' streams stay distinct
    # Eager and compiled agree for a key; a raw uint32 key works too.
    np.testing.assert_array_equal(fn(params, x, key=jax.random.key(1))[0], a1)
    raw = f(params, x, key=jax.random.PRNGKey(1))[0]
    np.testing.assert_array_equal(raw, fn(params, x, key=jax.random.PRNGKey(1))[0])
    # A training loop's per-step key: every step draws new masks.
    masks = {np.asarray(f(params, x, key=jax.random.fold_in(jax.random.key(0), s))[0]).tobytes()
             for s in range(4)}
    assert len(masks) == 4
    # Dropout at rate 0.5 keeps about half, scaled by 2.
    assert set(np.unique(np.asarray(a1)).tolist()) <= {0.0, 2.0}
    assert 0.2 < float(jnp.mean(a1 > 0)) < 0.8


def test_eval_mode_is_deterministic():
    x, y = _tokens()
    model = GPT(CFG, rngs=nnx.Rngs(0))
    model.eval()
    params, loss = nn.functional(model, "loss")
    want = model.loss(x, y)
    f = jax.jit(loss)
    for key in (None, jax.random.key(1), jax.random.key(2)):
        got = f(params, x, y) if key is None else f(params, x, y, key=key)
        assert_close(got, want, what=f"eval loss, key={key}")


def test_model_stays_usable_after_compiled_calls():
    x, y = _tokens()
    model = GPT(CFG, rngs=nnx.Rngs(0))
    params, loss = nn.functional(model, "loss")
    jax.jit(loss)(params, x, y, key=jax.random.key(3))
    jax.jit(jax.grad(loss))(params, x, y)
    assert np.isfinite(float(model.loss(x, y)))  # no leaked tracer in its RNG state


def test_bad_key_is_a_clear_error():
    params, fn = nn.functional(TwoDrops(nnx.Rngs(0)), "loss")
    with pytest.raises(TypeError, match="key"):
        fn(params, jnp.ones((6, 5)), key=3)
    with pytest.raises(TypeError, match="key"):
        fn(params, jnp.ones((6, 5)), key=jax.random.split(jax.random.key(0), 2))


class SharedDrop(nnx.Module):
    """One dropout layer reached by two attributes: not a plain pytree."""

    def __init__(self, rngs):
        self.w = nnx.Param(jnp.ones((6, 5)), dims=("a", "b"))
        self.d1 = nn.Dropout(0.5, rngs=rngs)
        self.d2 = self.d1

    def loss(self, x):
        h = nx.NamedArray(x * self.w[...], ("a", "b"))
        return self.d1(h).values, self.d2(h).values


@pytest.mark.parametrize("make", [lambda: GPT(CFG, rngs=nnx.Rngs(0)), lambda: TwoDrops(nnx.Rngs(0)),
                                  lambda: SharedDrop(nnx.Rngs(0))],
                         ids=["gpt", "two_drops", "shared_drop"])
def test_the_pytree_rebuild_gives_the_merge_paths_module(make, monkeypatch):
    """`fn` rebuilds the module as one pytree unflatten where the model is a
    plain pytree (`_Rebuild`): the same values, masks and gradients as the
    nnx.merge path, with and without a key, bitwise."""
    from jaxbackend.nn import _params

    model = make()
    x = _tokens() if isinstance(model, GPT) else (jnp.ones((6, 5)),)
    _, pstate, rest = nnx.split(model, nnx.Param, ...)
    fast = _params._Rebuild.of(model, nnx.to_pure_dict(pstate), rest)
    assert (fast is None) == isinstance(model, SharedDrop)
    params, fn = nn.functional(model, "loss")
    monkeypatch.setattr(_params._Rebuild, "of", classmethod(lambda cls, *a: None))
    _, slow = nn.functional(model, "loss")
    for key in (None, jax.random.key(5)):
        want = jax.value_and_grad(lambda p: jnp.sum(jnp.stack(jax.tree.leaves(
            slow(p, *x, key=key))) ** 2))(params)
        got = jax.value_and_grad(lambda p: jnp.sum(jnp.stack(jax.tree.leaves(
            fn(p, *x, key=key))) ** 2))(params)
        assert_close(got, want, rtol=0, atol=0, what=f"key={key}")
