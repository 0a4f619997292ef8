"""`reroll` and `cse` never merge equations that compute different things.

Layer equality is structural (`_rewrite.StructuralKeys`), never printed
text: a function-valued parameter (custom_vjp `bwd`, a custom_jvp rule, a
`pure_callback` function) prints as a bare name, so layers differing only
there printed alike and became one scan running layer 0's function. Each
program below has layers that differ only in such a parameter; the
reference is `jax.jit` of the same function. Also: zero-size arrays,
`jax_enable_x64`, effects, and the rolls that used to be missed (layers
calling `jax.nn.relu`, layers that are one `jax.checkpoint` equation).
"""

from __future__ import annotations

import functools
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxbackend as jb
from jaxbackend import _jax
from jaxbackend.passes import _rewrite
from jaxbackend.passes.cse import cse
from jaxbackend.passes.reroll import reroll, reroll_with_stats
from jaxbackend.testing import abs_scale, assert_close

N = 6   # layers: above the pipeline's REROLL_MIN_REPEATS (5)


def _x(*shape, value=0.3):
    return jnp.asarray(np.full(shape, value, np.float32))   # not weakly typed, like real inputs


def _ws(n=N, d=3, scale=0.9):
    return [jnp.eye(d) * scale + 0.01 * k for k in range(n)]


def _rolled(closed, min_repeats=5):
    return reroll_with_stats(closed, min_repeats=min_repeats)


def _scans(closed):
    return _rewrite.count_eqns(closed, "scan")


def _run(closed, *args):
    return jax.jit(_jax.jaxpr_as_fun(closed))(*jax.tree.leaves(args))


# --- function-valued parameters that differ per layer ------------------------

@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _clip_gradient(c, x):
    return x


_clip_gradient.defvjp(lambda c, x: (x, None), lambda c, _, g: (jnp.clip(g, -c, c),))


def _clip_model(x, ws):
    for i, w in enumerate(ws):
        x = jax.checkpoint(lambda x: _clip_gradient(0.1 * (i + 1), x))(x @ w)  # noqa: B023
        x = jnp.sin(x) * 2.0 + 0.1
    return x.sum()


def test_custom_vjp_bwd_differing_per_layer_is_not_merged():
    # the layers print alike (`bwd=<lambda>`); each clips at its own bound
    x, ws = jnp.ones((2, 3)), [jnp.eye(3)] * N
    want = jax.grad(jax.jit(_clip_model))(x, ws)
    got = jax.grad(jb.jit(_clip_model))(x, ws)
    np.testing.assert_array_equal(np.asarray(want), np.full((2, 3), -0.1, np.float32))
    assert_close(got, want, what="grad through per-layer custom_vjp clips")
    closed = jax.make_jaxpr(_clip_model)(x, ws)
    assert _rolled(closed)[1].runs == []


def _make_ste(scale):
    """Straight-through round whose gradient is scaled by `scale`."""
    @jax.custom_jvp
    def ste(x):
        return jnp.round(x)

    @ste.defjvp
    def _(primals, tangents):
        return ste(primals[0]), tangents[0] * scale

    return ste


_STES = [_make_ste(float(i + 1)) for i in range(N)]


def _ste_cond_model(x, ws):
    for i, w in enumerate(ws):
        x = lax.cond(x.sum() > -1e9, _STES[i], lambda x: x, x @ w)
        x = jnp.sin(x) * 2.0 + 0.1
    return x.sum()


@partial(jax.jit, static_argnums=1)
def _apply(x, f):
    return f(x)


def _ste_static_jit_model(x, ws):
    # a per-layer `jax.jit(static_argnums=...)` body: one jit equation per
    # layer whose sub-jaxprs print alike
    for i, w in enumerate(ws):
        x = _apply(x @ w, _STES[i])
        x = jnp.sin(x) * 2.0 + 0.1
    return x.sum()


def _ste_top_model(x, ws):
    for i, w in enumerate(ws):
        x = jnp.sin(_STES[i](x @ w)) * 2.0 + 0.1
    return x.sum()


@pytest.mark.parametrize("model", [_ste_cond_model, _ste_static_jit_model, _ste_top_model],
                         ids=["in_cond", "in_static_jit", "top_level"])
def test_custom_jvp_rule_differing_per_layer_is_not_merged(model):
    x, ws = _x(2, 3), _ws()
    want = jax.value_and_grad(jax.jit(model), argnums=(0, 1))(x, ws)
    got = jax.value_and_grad(jb.jit(model), argnums=(0, 1))(x, ws)
    assert abs(float(want[1][0].sum())) > 1e3   # (layer 0's rule alone gives ~100)
    assert_close(got, want, what="value and grads through per-layer custom_jvp rules")
    assert _rolled(jax.make_jaxpr(model)(x, ws))[1].runs == []


def test_pure_callback_differing_per_layer_is_not_merged():
    def model(x, ws):
        for i, w in enumerate(ws):
            cb = (lambda k: lambda a: np.asarray(a * (k + 1), np.float32))(i)  # prints `<lambda>`
            spec = jax.ShapeDtypeStruct(x.shape, x.dtype)
            x = jax.checkpoint(lambda x: jax.pure_callback(cb, spec, x))(x @ w)  # noqa: B023
            x = jnp.sin(x) * 2.0 + 0.1
        return x.sum()

    x, ws = _x(2, 3), _ws()
    assert_close(jb.jit(model)(x, ws), jax.jit(model)(x, ws), what="per-layer callbacks")
    assert _rolled(jax.make_jaxpr(model)(x, ws))[1].runs == []


def _nested_rule_model(x, ws, scales):
    """g's rule is the same in every layer (its primal is g, its tangent uses
    h's primal), but h's rule, used by second derivatives only, differs."""
    for s, w in zip(scales, ws):
        h = jax.custom_jvp(jnp.sin)
        h.defjvp(lambda p, t, s=s: (h(p[0]), jnp.cos(p[0]) * t[0] * s))
        g = jax.custom_jvp(jnp.sin)
        g.defjvp(lambda p, t, g=g, h=h: (g(p[0]), jnp.cos(p[0]) * t[0] + 0.0 * h(p[0])))
        x = g(x @ w) * 1.5 + 0.1
    return x.sum()


def test_nested_custom_jvp_rules_are_compared_too():
    # second derivatives run the rules nested inside a rule: compared too
    x, ws, scales = _x(2, 3), _ws(), [1.0 + k for k in range(N)]
    closed = jax.make_jaxpr(lambda x, ws: _nested_rule_model(x, ws, scales))(x, ws)
    out, stats = _rolled(closed)
    assert stats.runs == []
    same = jax.make_jaxpr(lambda x, ws: _nested_rule_model(x, ws, [2.0] * N))(x, ws)
    assert _scans(_rolled(same)[0]) == 1          # identical rules roll


def _const_model(x, ws, step=0.25):
    # a per-layer array closed over by a jitted body: a ClosedJaxpr const
    for i, w in enumerate(ws):
        c = np.full((3,), 0.5 + step * i, np.float32)
        x = jax.jit(lambda x: jnp.tanh(x * c) + x * 0.5)(x @ w)  # noqa: B023
        x = jnp.sin(x) * 2.0 + 0.1
    return x.sum()


def test_closure_consts_are_compared_by_value():
    x, ws = _x(2, 3), _ws()
    want = jax.value_and_grad(jax.jit(_const_model), argnums=(0, 1))(x, ws)
    assert_close(jax.value_and_grad(jb.jit(_const_model), argnums=(0, 1))(x, ws), want,
                 what="per-layer closed-over consts")
    assert _rolled(jax.make_jaxpr(_const_model)(x, ws))[1].runs == []
    # equal values in distinct arrays: the same layer, rolled
    same = jax.make_jaxpr(partial(_const_model, step=0.0))(x, ws)
    assert _scans(_rolled(same)[0]) == 1


def test_structural_keys_compare_values_by_type_and_bits():
    keys = _rewrite.StructuralKeys()
    assert keys(0.0) != keys(-0.0) and keys(1) != keys(True) and keys(1.0) != keys(1)
    f, g = (lambda: 0), (lambda: 0)
    assert keys(f) == keys(f) and keys(f) != keys(g)
    assert keys(np.float32(0.5)) == keys(np.float32(0.5))
    assert keys((1, "a", (2,))) == keys((1, "a", (2,)))


# --- cse uses the same keys ---------------------------------------------------

def test_cse_compares_call_bodies_by_structure_not_by_print():
    # two jitted bodies that print alike but clip gradients at other bounds
    # stay apart; two that are the same program (distinct objects) merge
    def f(x):
        a = jax.jit(lambda x: _clip_gradient(0.1, x) * 2.0)(x)
        b = jax.jit(lambda x: _clip_gradient(0.2, x) * 2.0)(x)
        c = jax.jit(lambda x: jnp.sin(x) * 2.0)(x)
        d = jax.jit(lambda x: jnp.sin(x) * 2.0)(x)
        return (a * 3.0 + b + c + d).sum()

    x = _x(3, value=2.0)
    closed = jax.make_jaxpr(f)(x)
    assert str(closed.jaxpr.eqns[0].params["jaxpr"]) == str(closed.jaxpr.eqns[1].params["jaxpr"])
    out = cse(closed)
    # a and b stay two calls, d is merged into c
    assert [e.primitive.name for e in out.jaxpr.eqns].count("jit") == 3
    assert _rewrite.count_eqns(out, "custom_vjp_call") == 2
    assert_close(jax.grad(lambda x: _jax.eval_jaxpr(out, x)[0])(x), jax.grad(f)(x),
                 what="grad after cse")


def test_cse_keeps_custom_rules_apart_and_merges_equal_ones():
    def f(x):
        return _STES[0](x) + _STES[1](x) + jax.nn.relu(x) + jax.nn.relu(x)

    x = jnp.full(3, 0.7)
    closed = jax.make_jaxpr(f)(x)
    out = cse(closed)
    assert _rewrite.count_eqns(out.jaxpr, "custom_jvp_call") == 3   # the two relus merge
    assert_close(jax.grad(lambda x: _jax.eval_jaxpr(out, x)[0].sum())(x),
                 jax.grad(lambda x: f(x).sum())(x), what="grad after cse")

    def g(x):
        return _clip_gradient(0.1, x) + _clip_gradient(0.2, x)

    closed = jax.make_jaxpr(g)(x)
    assert _rewrite.count_eqns(cse(closed).jaxpr, "custom_vjp_call") == 2


# --- zero-size arrays, x64 ----------------------------------------------------

def test_zero_size_activations_roll_and_match():
    def model(x, ws):
        outs = []
        for w in ws:
            x = jnp.tanh(x @ w) * 2.0 + x
            outs.append(x)
        return outs

    x, ws = jnp.zeros((0, 4)), [jnp.eye(4)] * N
    got, want = jb.jit(model)(x, ws), jax.jit(model)(x, ws)
    assert [g.shape for g in got] == [w.shape for w in want] == [(0, 4)] * N


def test_zero_size_weights_under_value_and_grad():
    def loss(x, ws):
        for w in ws:
            x = jnp.tanh(x) * 2.0 + (x @ w).sum() + x * 0.5
        return x.sum()

    x, ws = _x(2, 4, value=0.1), [jnp.zeros((4, 0))] * N
    closed = jax.make_jaxpr(jax.value_and_grad(loss, argnums=1))(x, ws)
    out, stats = _rolled(closed)
    assert stats.runs
    want = jax.jit(jax.value_and_grad(loss, argnums=1))(x, ws)
    assert_close(_run(out, x, ws), jax.tree.leaves(want), what="value_and_grad, zero-size weights")
    got = jax.value_and_grad(jb.jit(loss), argnums=1)(x, ws)
    assert_close(got, want, what="jb.jit value_and_grad, zero-size weights")


@pytest.fixture
def x64():
    old = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", old)


def _tanh_chain(x, ws):
    for w in ws:
        x = jnp.tanh(x @ w) * 2.0 + x
    return (x ** 2).sum()


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_rolled_value_and_grad_under_x64(x64, dtype):
    x, ws = jnp.full((2, 4), 0.1, dtype), [jnp.eye(4, dtype=dtype) * 0.5] * N
    vg = jax.value_and_grad(_tanh_chain, argnums=(0, 1))
    closed = jax.make_jaxpr(vg)(x, ws)
    out, stats = _rolled(closed)
    assert stats.runs
    _jax.check_closed_jaxpr(out)
    want = jax.jit(vg)(x, ws)
    assert_close(_run(out, x, ws), jax.tree.leaves(want), what=f"x64 value_and_grad ({dtype})")
    assert_close(jax.value_and_grad(jb.jit(_tanh_chain), argnums=(0, 1))(x, ws), want,
                 what=f"jb.jit under x64 ({dtype})")


# --- rolls that used to be missed -----------------------------------------------

@pytest.mark.parametrize("act", [jax.nn.relu, jax.nn.relu6], ids=["relu", "relu6"])
def test_layers_calling_a_custom_jvp_function_roll(act):
    def model(x, ws):
        for w in ws:
            x = act(x @ w) * 1.5 + 0.1
        return (x ** 2).sum()

    x, ws = _x(2, 3), _ws()
    fwd = jax.make_jaxpr(model)(x, ws)
    vg = jax.make_jaxpr(jax.value_and_grad(model, argnums=(0, 1)))(x, ws)
    assert _scans(_rolled(fwd)[0]) == 1
    out = _rolled(vg)[0]
    assert _scans(out) == 2
    assert reroll(out, min_repeats=5) is out      # idempotent
    want = jax.value_and_grad(jax.jit(model), argnums=(0, 1))(x, ws)
    assert_close(jax.value_and_grad(jb.jit(model), argnums=(0, 1))(x, ws), want,
                 what="grad of the rolled forward")
    assert_close(jb.jit(jax.value_and_grad(model, argnums=(0, 1)))(x, ws), want,
                 what="rolled value_and_grad")


def test_layers_that_are_one_checkpoint_equation_roll():
    def layer(x, w):
        return jnp.tanh(x @ w) * 2.0 + x

    def model(x, ws):
        for w in ws:
            x = jax.checkpoint(layer)(x, w)
        return (x ** 2).sum()

    x, ws = _x(2, 4, value=0.1), [jnp.eye(4) * 0.5 + 0.01 * k for k in range(N)]
    fwd = jax.make_jaxpr(model)(x, ws)
    assert len(fwd.jaxpr.eqns) == N + 2   # one equation per layer
    out, stats = _rolled(fwd)
    assert _scans(out) == 1 and stats.runs[0][1:3] == (1, N)
    vg = jax.make_jaxpr(jax.value_and_grad(model, argnums=(0, 1)))(x, ws)
    out, stats = _rolled(vg)
    assert _scans(out) == 2 and stats.repeats == [N, N]
    assert reroll(out, min_repeats=5) is out      # idempotent
    want = jax.value_and_grad(jax.jit(model), argnums=(0, 1))(x, ws)
    # the gradient of a 6-layer chain: its rounding is the error model's
    # (abs_scale), not max|reference|'s; codegen alone moved it 77 eps
    scale = functools.cache(lambda: abs_scale(jax.value_and_grad(model, argnums=(0, 1)), x, ws))
    assert_close(jax.value_and_grad(jb.jit(model), argnums=(0, 1))(x, ws), want, scale=scale,
                 what="grad of the rolled checkpointed forward")
    assert_close(_run(out, x, ws), jax.tree.leaves(want), scale=lambda: jax.tree.leaves(scale()),
                 what="rolled value_and_grad")


@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey], ids=["typed", "raw"])
def test_checkpointed_layers_taking_a_prng_key_each_roll(make_key):
    # dropout with one key per layer (fold_in(key, i)), the layer under
    # jax.checkpoint: the keys are per-layer inputs of the remat equations,
    # so the scan stacks them; a typed key's extended dtype is no np.dtype
    def layer(x, w, key):
        keep = jax.random.bernoulli(key, 0.8, x.shape)
        return jnp.where(keep, jnp.tanh(x @ w) / 0.8, 0.0) + x

    def model(x, ws, key):
        for i, w in enumerate(ws):
            x = jax.checkpoint(layer)(x, w, jax.random.fold_in(key, i))
        return (x ** 2).sum()

    x, ws, key = _x(4, 3), _ws(), make_key(0)
    vg = jax.make_jaxpr(jax.value_and_grad(model, argnums=(0, 1)))(x, ws, key)
    out, stats = _rolled(vg)
    assert _scans(out) == 2 and stats.repeats == [N, N]
    want = jax.jit(jax.value_and_grad(model, argnums=(0, 1)))(x, ws, key)
    scale = abs_scale(jax.value_and_grad(model, argnums=(0, 1)), x, ws, key)
    assert_close(jb.jit(jax.value_and_grad(model, argnums=(0, 1)))(x, ws, key), want,
                 scale=scale, what="rolled value_and_grad with per-layer keys")


def test_sub_layer_loops_inside_a_rolled_block_roll_in_the_same_pass():
    # each layer is one remat equation holding a loop of sub-layers: the
    # outer scan's body is block 0's equation, whose sub-jaxpr must be
    # rolled too, or a second pass would find more to roll
    def inner(x, ws):
        for w in ws:
            x = jnp.tanh(x @ w) * 0.5 + x
        return x

    def model(x, wss):
        for ws in wss:
            x = jax.checkpoint(inner)(x, ws)
        return (x ** 2).sum()

    x = _x(2, 4, value=0.1)
    wss = [[jnp.eye(4) * 0.3 + 0.01 * (i + k) for k in range(5)] for i in range(5)]
    closed = jax.make_jaxpr(model)(x, wss)
    out, stats = _rolled(closed)
    assert sorted(r[1:3] for r in stats.runs) == [(1, 5), (4, 5)]
    assert reroll(out, min_repeats=5) is out      # idempotent
    assert_close(_run(out, x, wss), [jax.jit(model)(x, wss)], what="nested rolled loops")


# --- effects ------------------------------------------------------------------

@pytest.mark.parametrize("wrap", ["none", "jit", "cond"])
def test_ordered_callbacks_are_never_merged_and_keep_their_order(wrap):
    from jax.experimental import io_callback

    seen = []

    def log(k, v):
        seen.append(int(k))
        return np.zeros((), np.float32)

    def step(x, w, i):
        x = jnp.tanh(x @ w) * 2.0 + x
        io_callback(log, jax.ShapeDtypeStruct((), jnp.float32), i, x.sum(), ordered=True)
        return x

    def model(x, ws):
        for i, w in enumerate(ws):
            if wrap == "jit":
                x = jax.jit(step)(x, w, i)
            elif wrap == "cond":
                x = lax.cond(x.sum() > -1e9, step, lambda x, w, i: x, x, w, i)
            else:
                x = step(x, w, i)
        return x.sum()

    x, ws = _x(2, 3), _ws()
    closed = jax.make_jaxpr(model)(x, ws)
    out = reroll(closed, min_repeats=2)
    effectful = [e for e in closed.jaxpr.eqns if e.effects]
    assert len(effectful) == N
    kept = {id(e) for e in out.jaxpr.eqns}
    assert all(id(e) in kept for e in effectful)   # the very same equations, in place
    assert len([e for e in cse(closed).jaxpr.eqns if e.effects]) == N
    assert_close(jb.jit(model)(x, ws), jax.jit(model)(x, ws), what="forward with callbacks")
    assert seen == list(range(N)) * 2
