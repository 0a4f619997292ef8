"""`reroll` on an encoder-decoder shape: jitted encoder blocks next to an
inlined decoder (candidate periods), and the decoder's cross-layer gradient
sum of the encoder output; a sum over layers started at a literal;
per-layer dropout keys (`_reroll_seed`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxbackend import _jax
from jaxbackend.passes import _reroll_find, _reroll_seed, _rewrite
from jaxbackend.passes.reroll import reroll_with_stats
from jaxbackend.programs.small import rand
from jaxbackend.testing import assert_same_values

D = 6


@jax.jit
def _enc_block(x, w):
    return x + jnp.tanh(x @ w[0]) @ w[1]


def _dec_block(y, m, w):
    # reads the encoder output m twice (keys and values): its gradient is a
    # sum over every decoder layer, two terms each
    a = jax.nn.softmax((y @ w[0]) @ (m @ w[1]).T, axis=-1) @ (m @ w[2])
    y = y + a
    h = y - y.mean(-1, keepdims=True)
    return y + jnp.tanh(h @ w[3]) @ w[4]


def _loss(src, tgt, enc_ws, dec_ws):
    m = src
    for w in enc_ws:
        m = _enc_block(m, w)
    y = tgt
    for w in dec_ws:
        y = _dec_block(y, m, w)
    return (y ** 2).sum()


def _encdec_jaxpr(layers):
    enc_ws = [(rand(10 + i, D, 8) * .4, rand(20 + i, 8, D) * .4) for i in range(layers)]
    dec_ws = [tuple(rand(30 + 5 * i + k, D, D) * .4 for k in range(5)) for i in range(layers)]
    args = (rand(1, 5, D), rand(2, 4, D), enc_ws, dec_ws)
    closed = jax.make_jaxpr(jax.value_and_grad(_loss, argnums=(0, 1, 2, 3)))(*args)
    return closed, jax.tree.leaves(args)


@pytest.mark.parametrize("layers", [6, 12])
def test_an_encoder_decoder_step_rolls_all_four_runs(layers):
    closed, leaves = _encdec_jaxpr(layers)
    # the failure this guards: the jitted encoder's period (1) scored below
    # the decoder's many partial periods and was cut from the candidates
    keys = _rewrite.StructuralKeys()
    eqns = closed.jaxpr.eqns
    periods = _reroll_find.candidate_periods(_reroll_find.signatures(eqns, keys),
                                             [keys.weight(e) for e in eqns], 2)
    assert 1 not in periods[:_reroll_find.MAX_PERIOD_CANDIDATES] and 1 in periods
    # and the decoder's backward run lacks its first block before seeding
    raw = [r.repeats for r in _reroll_find.find_runs(closed.jaxpr, 2)]
    assert sorted(raw) == [layers - 1] + [layers] * 3, raw

    out, stats = reroll_with_stats(closed)
    assert stats.repeats == [layers] * 4   # encoder, decoder, decoder back, encoder back
    assert stats.seeds >= 1
    assert_same_values(closed, out, leaves)


def test_a_seeded_sum_keeps_every_bit():
    closed, leaves = _encdec_jaxpr(6)
    runs = _reroll_find.find_runs(closed.jaxpr, 2)
    seeded, n = _reroll_seed.seeded(closed.jaxpr, runs)
    assert n >= 1 and len(seeded.eqns) > len(closed.jaxpr.eqns)
    want = jax.jit(_jax.jaxpr_as_fun(closed))(*leaves)
    got = jax.jit(_jax.jaxpr_as_fun(_jax.ClosedJaxpr(seeded, closed.consts)))(*leaves)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g).view(np.uint32), np.asarray(w).view(np.uint32))


def test_minus_zero_is_the_additive_identity_here():
    # what the seed relies on, on this backend: -0.0 + x is x, bit for bit,
    # for signed zeros, infinities, NaN and normal numbers (+0.0 would turn
    # -0.0 into +0.0; subnormals are flushed by XLA:CPU, as documented). The
    # seed is an argument, so XLA cannot fold the addition away.
    x = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.5, -3e-30, 3e38], np.float32)
    got = jax.jit(jnp.add)(np.full(x.shape, -0.0, np.float32), x)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32), x.view(np.uint32))


def _aux_loss(x, ws):
    aux = 0.0   # a per-layer statistic summed over the layers, as MoE losses do
    for w1, w2 in ws:
        h = jnp.tanh(x @ w1)
        aux = aux + (h * h).mean()
        x = x + h @ w2
    return (x ** 2).sum() + 0.01 * aux


@pytest.mark.parametrize("grad", [False, True])
def test_a_sum_over_layers_started_at_a_literal_rolls_every_layer(grad):
    layers = 6
    ws = [(rand(10 + i, D, 8) * .4, rand(40 + i, 8, D) * .4) for i in range(layers)]
    args = (rand(7, 3, D), ws)
    fn = jax.value_and_grad(_aux_loss, argnums=(0, 1)) if grad else _aux_loss
    closed = jax.make_jaxpr(fn)(*args)
    leaves = jax.tree.leaves(args)
    raw = sorted(r.repeats for r in _reroll_find.find_runs(closed.jaxpr, 2))
    assert raw[0] == layers - 1, raw   # layer 0 adds to the literal
    out, stats = reroll_with_stats(closed)
    assert stats.repeats == [layers] * (2 if grad else 1) and stats.seeds >= 1
    assert_same_values(closed, out, leaves)
    seeded, _ = _reroll_seed.seeded(closed.jaxpr, _reroll_find.find_runs(closed.jaxpr, 2))
    want = jax.jit(_jax.jaxpr_as_fun(closed))(*leaves)
    got = jax.jit(_jax.jaxpr_as_fun(_jax.ClosedJaxpr(seeded, closed.consts)))(*leaves)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g).view(np.uint32), np.asarray(w).view(np.uint32))


def test_a_seeded_encoder_decoder_step_under_a_mesh_equals_jax_jit():
    # the seeded, rolled program through the planner and XLA's partitioner
    import jaxbackend as jb
    from jaxbackend import sharding, testing

    layers = 6
    enc_ws = [(rand(10 + i, D, 8) * .4, rand(20 + i, 8, D) * .4) for i in range(layers)]
    dec_ws = [tuple(rand(30 + 5 * i + k, D, D) * .4 for k in range(5)) for i in range(layers)]
    args = (rand(1, 8, D), rand(2, 8, D), enc_ws, dec_ws)
    vg = jax.value_and_grad(_loss, argnums=(0, 1, 2, 3))
    f = jb.jit(vg, mesh=sharding.auto_mesh((2, 4), ("data", "model")))
    report = str(f.trace_passes(*args))
    assert "reroll.seeds: 0" not in report and "reroll.blocks_rolled: 24" in report, report
    testing.assert_close(f(*args), jax.jit(vg)(*args), scale=lambda: testing.abs_scale(vg, *args),
                         what="seeded encoder-decoder gradient under a mesh")


def _dropout_loss(key, x, ws, how):
    keys = jax.random.split(key, len(ws))
    for i, (w1, w2) in enumerate(ws):
        h = jnp.tanh(x @ w1) @ w2
        k = jax.random.fold_in(key, i) if how == "fold_in" else keys[i]
        keep = jax.random.bernoulli(k, 0.8, h.shape)
        x = x + jnp.where(keep, h / 0.8, 0.0)
    return (x ** 2).sum()


@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey], ids=["typed", "raw"])
@pytest.mark.parametrize("how", ["fold_in", "split"])
@pytest.mark.parametrize("grad", [False, True])
def test_per_layer_dropout_keys_roll_every_layer(grad, how, make_key):
    # fold_in(key, i): each layer reads its own literal i; keys[i]: each
    # layer slices the split keys at its own index (a raw PRNGKey's split:
    # its uint32 data). No two blocks are alike until
    # `_reroll_seed.lifted` makes the keys before the layers
    layers = 6
    ws = [(rand(10 + i, D, 8) * .4, rand(40 + i, 8, D) * .4) for i in range(layers)]
    args = (make_key(5), rand(7, 3, D), ws)
    loss = functools.partial(_dropout_loss, how=how)
    fn = jax.value_and_grad(loss, argnums=(1, 2)) if grad else loss
    closed = jax.make_jaxpr(fn)(*args)
    leaves = jax.tree.leaves(args)
    # unlifted, only the backward layers (their masks are residuals) repeat
    raw = [r.repeats for r in _reroll_find.find_runs(closed.jaxpr, 2)]
    assert raw == ([layers] if grad else []), raw
    out, stats = reroll_with_stats(closed)
    assert stats.repeats == [layers] * (2 if grad else 1) and stats.seeds == layers
    want = jax.jit(_jax.jaxpr_as_fun(closed))(*leaves)
    got = jax.jit(_jax.jaxpr_as_fun(out))(*leaves)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):   # the same masks: every bit
        np.testing.assert_array_equal(np.asarray(g).view(np.uint32), np.asarray(w).view(np.uint32))
