"""`passes.reroll`: repeated layer blocks -> scan, and the near-misses it must leave alone.

Reference: the unrolled jaxpr itself (before the pass), evaluated by XLA; the
rolled one must agree on the forward value and on every gradient by the
error model of `jaxbackend.testing.assert_close` (float32). Sizes are tiny; each check compiles both programs once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxbackend import _jax
from jaxbackend.programs import attention_stack as attn
from jaxbackend.programs import transformer as T
from jaxbackend.passes.reroll import reroll, reroll_with_stats
from jaxbackend.testing import abs_scale, assert_close
from jaxbackend.programs.small import rand
from jaxbackend.testing import assert_same_values, check_pass

SMALL = dict(batch=1, seq=4, d=16, heads=2, mlp=32)


def _run(closed, leaves):
    return jax.jit(_jax.jaxpr_as_fun(closed))(*leaves)


def _scans(closed):
    return [e for e in closed.jaxpr.eqns if e.primitive.name == "scan"]


def _transformer(n_layers):
    x, layers = T.init_transformer(jax.random.key(0), n_layers, **SMALL)
    for i, p in enumerate(layers):  # non-trivial LayerNorm params, distinct per layer
        p["ln1_g"] = p["ln1_g"] + 0.1 * rand(100 + i, SMALL["d"])
        p["b1"] = p["b1"] + 0.1 * rand(200 + i, SMALL["mlp"])
    return x, layers


def _vg_jaxpr(fn, args, argnums):
    leaves, tree = jax.tree.flatten(args)
    n0 = len(jax.tree.leaves(args[0]))
    flat_argnums = (tuple(range(len(leaves))) if argnums == "all"
                    else tuple(range(n0, len(leaves))))

    def flat(*xs):
        return fn(*jax.tree.unflatten(tree, xs))[0]

    vg = jax.value_and_grad(flat, argnums=flat_argnums)
    return jax.make_jaxpr(vg)(*leaves), leaves


@pytest.mark.parametrize("argnums, rolled", [("all", 3), ("weights", 2)])
def test_transformer_value_and_grad_rolls_into_forward_and_reverse_scan(argnums, rolled):
    # with grads w.r.t. weights only, layer 0 sees no input tangent, so its
    # forward and backward blocks differ from the others and stay unrolled
    closed, leaves = _vg_jaxpr(lambda x, ls: T.loop_transformer(x, ls, SMALL["heads"]),
                               _transformer(3), argnums)
    out, stats = reroll_with_stats(closed)
    _jax.check_closed_jaxpr(out)
    scans = _scans(out)
    assert len(scans) == 2 and stats.repeats == [rolled, rolled]
    # forward scan first, backward scan reversed, consuming the forward stacks
    assert [s.params["reverse"] for s in scans] == [False, True]
    assert [s.params["length"] for s in scans] == [rolled, rolled]
    # only the 12 weight lists are stacked by copying; every residual and the
    # weights the backward pass re-reads come from stacks the forward scan made
    assert stats.stacked_copies == len(T.PARAM_NAMES)
    assert stats.stacks_reused >= len(T.PARAM_NAMES)
    assert out.in_avals == closed.in_avals and out.out_avals == closed.out_avals
    assert len(out.jaxpr.eqns) < len(closed.jaxpr.eqns) / 2
    assert_same_values(closed, out, leaves)


def test_reroll_passes_the_common_pass_checks():
    # type-checks, before == after (forward, value_and_grad, grad), idempotent
    ws = _chain_ws(3)
    fwd, vg = check_pass(reroll, lambda x, ws: _chain(x, ws)[0], (rand(7, 3, 6), ws),
                         argnums=tuple(range(7)))
    assert [s.params["length"] for s in _scans(fwd)] == [3]
    assert [s.params["length"] for s in _scans(vg)] == [3, 3]


def test_rolled_equals_hand_written_scan():
    x, layers = _transformer(3)
    closed = jax.make_jaxpr(lambda x, ls: T.loop_transformer(x, ls, SMALL["heads"]))(x, layers)
    got = _run(reroll(closed), jax.tree.leaves((x, layers)))
    want = jax.jit(lambda x, s: T.scan_transformer(x, s, SMALL["heads"]))(x, T.stack_layers(layers))
    assert_close(got, want, what="rolled vs hand-written scan",
                 scale=lambda: abs_scale(lambda x, s: T.scan_transformer(x, s, SMALL["heads"]),
                                         x, T.stack_layers(layers)))


def test_named_attention_grad_rolls_and_keeps_dim_names_in_the_body():
    x, layers = attn.init_attention_stack(jax.random.key(1), 2, batch=1, time=4, embd=8,
                                          head=2, hd=4)
    nx_x, nx_layers = attn.name_params(x, layers)
    closed, leaves = _vg_jaxpr(attn.named_attention_stack, (nx_x, nx_layers), "all")
    out, stats = reroll_with_stats(closed)
    assert stats.repeats == [2, 2]
    body = _scans(out)[0].params["jaxpr"].jaxpr
    einsums = [e for e in body.eqns if e.primitive.name == "einsum"]
    assert len(einsums) == 6   # q, k, v, scores, mix, out projection
    assert ("embd", "head", "hd") in {e.params["rhs_dims"] for e in einsums}
    assert_same_values(closed, out, leaves)


# --- near-misses -----------------------------------------------------------

def _chain(x, ws, *, skip=False, key=None, same_key=False):
    """x + tanh(x @ w1) @ w2 per layer; optional skip across two layers, or
    dropout whose key is folded with the layer index (or the same key)."""
    prev = x
    for i, (w1, w2) in enumerate(ws):
        h = jnp.tanh(x @ w1) @ w2
        if key is not None:
            k = key if same_key else jax.random.fold_in(key, i)
            h = jnp.where(jax.random.bernoulli(k, 0.8, h.shape), h / 0.8, 0.0)
        new = x + h + (prev if skip else 0.0)
        prev, x = x, new
    return (x ** 2).sum(), x


def _chain_ws(n, widths=None):
    widths = widths or [8] * n
    return [(rand(10 + i, 6, w) * 0.4, rand(40 + i, w, 6) * 0.4) for i, w in enumerate(widths)]


def _check_chain(fn, ws, expect_repeats):
    x = rand(7, 3, 6)
    closed, leaves = _vg_jaxpr(fn, (x, ws), "all")
    out, stats = reroll_with_stats(closed)
    assert stats.repeats == expect_repeats
    if not expect_repeats:
        assert out is closed
    assert_same_values(closed, out, leaves)
    return out


def test_plain_chain_rolls():  # the positive control for the near-misses below
    _check_chain(_chain, _chain_ws(4), [4, 4])


def test_last_layer_of_another_width_stays_outside_the_run():
    out = _check_chain(_chain, _chain_ws(4, [8, 8, 8, 12]), [3, 3])
    hidden = {e.outvars[0].aval.shape for e in out.jaxpr.eqns if e.primitive.name == "tanh"}
    assert hidden == {(3, 12)}   # the wide layer is still unrolled, the others are not


def test_skip_connection_across_two_layers_is_not_rolled():
    _check_chain(lambda x, ws: _chain(x, ws, skip=True), _chain_ws(5), [])


def test_dropout_key_folded_with_the_layer_index_rolls():
    # each layer folds its own index into the key, a literal per layer:
    # `_reroll_seed.lifted` reads the indices from variables, which the
    # forward scan takes as a per-layer input (the backward reads only masks)
    key = jax.random.PRNGKey(3)
    fn = lambda x, ws: _chain(x, ws, key=key)  # noqa: E731
    ws, x = _chain_ws(4), rand(7, 3, 6)
    fwd = jax.make_jaxpr(lambda x, ws: fn(x, ws)[0])(x, ws)
    rolled, stats = reroll_with_stats(fwd)
    assert stats.repeats == [4] and stats.seeds == 4
    assert_same_values(fwd, rolled, jax.tree.leaves((x, ws)))
    out = _check_chain(fn, ws, [4, 4])
    assert not [e for e in out.jaxpr.eqns if e.primitive.name == "random_fold_in"]   # in the scan
    assert len(_scans(out)) == 2


def test_dropout_with_one_shared_key_rolls():
    key = jax.random.PRNGKey(3)
    _check_chain(lambda x, ws: _chain(x, ws, key=key, same_key=True), _chain_ws(4), [4, 4])


def test_parallel_look_alike_equations_are_not_a_loop():
    # q, k, v projections of one layer are identical equations side by side,
    # but none feeds the next: no scan
    x, layers = _transformer(1)
    closed = jax.make_jaxpr(lambda x, ls: T.loop_transformer(x, ls, SMALL["heads"]))(x, layers)
    assert reroll(closed) is closed


def test_min_repeats():
    x, layers = _transformer(3)
    closed = jax.make_jaxpr(lambda x, ls: T.loop_transformer(x, ls, SMALL["heads"]))(x, layers)
    assert reroll(closed, min_repeats=4) is closed
    assert _scans(reroll(closed, min_repeats=3))[0].params["length"] == 3
    with pytest.raises(ValueError, match="min_repeats=1"):
        reroll(closed, min_repeats=1)


def test_weight_gradients_are_unstacked_without_constant_offset_slices():
    # each per-layer result is read with a runtime index, so XLA compiles one
    # slicing kernel per shape instead of one per layer
    closed, leaves = _vg_jaxpr(_chain, (rand(7, 3, 6), _chain_ws(6)), "all")
    out = reroll(closed)
    # (the one static slice left reads a single element: the opaque indices'
    # trip count, `_stacks.corner`)
    assert not [e for e in out.jaxpr.eqns if e.primitive.name == "slice"
                and e.invars[0].aval.shape[:1] == (6,) and e.outvars[0].aval.size > 1]
    hlo = jax.jit(_jax.jaxpr_as_fun(out)).lower(*leaves).compile().as_text()
    assert hlo.count("dynamic-slice(") >= 1


def test_equations_outside_runs_are_kept_not_retraced():
    # the pass splices: every equation outside the rolled runs is the very
    # same equation object afterwards (same variables), only its inputs renamed
    closed, leaves = _vg_jaxpr(_chain, (rand(7, 3, 6), _chain_ws(5)), "all")
    out, stats = reroll_with_stats(closed, min_repeats=4)
    rolled = set()
    for start, period, n, _ in stats.runs:
        rolled.update(range(start, start + period * n))
    kept = [e for i, e in enumerate(closed.jaxpr.eqns) if i not in rolled]
    assert kept and len(rolled) > len(kept)
    new_outvars = {id(v) for e in out.jaxpr.eqns for v in e.outvars}
    assert all(id(v) in new_outvars for e in kept for v in e.outvars)
    assert_same_values(closed, out, leaves)


def test_layers_inside_a_nested_jit_are_rolled_there():
    inner = jax.jit(lambda x, ws: _chain(x, ws)[0])
    x, ws = rand(7, 3, 6), _chain_ws(4)
    closed, leaves = _vg_jaxpr(lambda x, ws: (inner(x, ws), None), (x, ws), "all")
    out = reroll(closed)
    assert not _scans(out)  # the top level is a few calls, not a loop
    subs = [sub for e in out.jaxpr.eqns for sub in _jax.jaxprs_in_params(e.params)]
    lengths = [e.params["length"] for sub in subs for e in sub.eqns if e.primitive.name == "scan"]
    assert lengths and all(n == 4 for n in lengths)
    assert reroll(out) is out   # idempotent: nothing left to roll anywhere
    assert_same_values(closed, out, leaves)


def _alternating(x, ws):
    # even layers keep the first 3 features, odd ones all but the first: the
    # forward blocks differ (lt vs ge on an iota) and roll two layers per
    # block; the backward blocks only read each layer's mask, so alike
    for i, w in enumerate(ws):
        col = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
        keep = col < 3 if i % 2 == 0 else col >= 1
        x = x + jnp.where(keep, jnp.tanh(x @ w), 0.0)
    return jnp.sum(x * x)


def test_alternating_layers_roll_backward_at_the_forward_period():
    # rolled one layer per block, the backward would read each residual from
    # two forward stacks (even and odd layers) and copy their interleaving:
    # every residual held twice. At the forward's period it scans the forward
    # stacks themselves, reversed.
    ws = [0.3 * rand(300 + i, 6, 6) for i in range(12)]
    closed, leaves = _vg_jaxpr(lambda x, ws: (_alternating(x, ws), None), (rand(7, 3, 6), ws),
                               "all")
    out, stats = reroll_with_stats(closed, min_repeats=3)
    assert [(r.repeats, r.reverse) for r in stats.runs] == [(6, False), (6, True)]
    # the only copies: the weights, stacked once for both scans
    assert stats.stacked_copies == 2 and stats.stacks_reused >= 4
    assert reroll(out, min_repeats=3) is out
    assert_same_values(closed, out, leaves)
    # min_repeats 2: a block of two alike backward layers would be a run
    # itself, so the backward stays one layer per block
    assert [r.repeats for r in reroll_with_stats(closed)[1].runs] == [6, 12]


def _bf16_chain(x, ws, dtype):
    for w in ws:   # a residual kept in `dtype` per layer for the backward pass
        y = jnp.tanh(x.astype(dtype) @ w.astype(dtype))
        x = x + y.astype(jnp.float32)
    return jnp.sum(x * x)


def test_half_precision_residuals_are_stacked_as_their_bits():
    # XLA:CPU has no bfloat16 dynamic-update-slice: a bf16 residual stack
    # filled by the forward scan was carried converted to float32 (3x its
    # bytes with the result). Stacked as uint16 (bitcast, the same bits) it
    # costs its own bytes: the rolled bf16 program needs less memory than
    # the float32 one, and computes the unrolled program's values exactly.
    x, ws = rand(7, 256, 64), [0.1 * rand(400 + i, 64, 64) for i in range(8)]
    temps = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        closed, leaves = _vg_jaxpr(lambda x, ws: (_bf16_chain(x, ws, dtype), None), (x, ws), "all")
        out = reroll(closed, min_repeats=3)
        assert [e.params["length"] for e in _scans(out)] == [8, 8]
        assert_same_values(closed, out, leaves)
        compiled = jax.jit(_jax.jaxpr_as_fun(out)).lower(*leaves).compile()
        temps[dtype] = compiled.memory_analysis().temp_size_in_bytes
        text = compiled.as_text()
    assert temps[jnp.bfloat16] < temps[jnp.float32], temps
    assert "u16[8,256,64]" in text


def _two_halves(x, ws):
    # a residual block of two alike conv -> batch-norm -> relu halves: its
    # backward repeats every equation twice per block and none once, so the
    # block's period is no distance between neighbouring equal equations
    def half(h, w):
        h = jax.lax.conv_general_dilated(h, w, (1, 1), "SAME",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
        m = h.mean((0, 1, 2))
        v = (h * h).mean((0, 1, 2)) - m * m
        return jax.nn.relu((h - m) * jax.lax.rsqrt(v + 1e-5))

    for w1, w2 in ws:
        x = x + half(half(x, w1), w2)
    return jnp.sum(x * x)


def test_a_block_of_two_alike_halves_rolls_forward_and_backward():
    ws = [(0.3 * rand(400 + i, 3, 3, 4, 4), 0.3 * rand(500 + i, 3, 3, 4, 4)) for i in range(6)]
    closed, leaves = _vg_jaxpr(lambda x, ws: (_two_halves(x, ws), None), (rand(8, 2, 5, 5, 4), ws),
                               "all")
    out, stats = reroll_with_stats(closed, min_repeats=5)   # the pipeline's minimum
    assert [(r.repeats, r.reverse) for r in stats.runs] == [(6, False), (6, True)]
    assert reroll(out, min_repeats=5) is out
    assert_same_values(closed, out, leaves)
