"""`reroll` on layers that index one array by their number (`W[i]` of
weights the user keeps stacked, per-layer scales): the reads move up and the
gradient's sum of row pads becomes one join (`_reroll_index`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxbackend import _jax
from jaxbackend.passes import _reroll_find, _reroll_index
from jaxbackend.passes.reroll import reroll_with_stats
from jaxbackend.programs.small import rand
from jaxbackend.testing import assert_same_values

D, LAYERS = 6, 6


def _loss(W, x, scale):
    for i in range(W.shape[0]):     # W: (layers, D, D), kept stacked by the user
        x = x + jnp.tanh(x @ W[i]) * scale[i]
    return (x ** 2).sum()


def _args():
    return rand(3, LAYERS, D, D) * .4, rand(4, 5, D), jnp.linspace(0.5, 1.0, LAYERS)


def _bits(x):
    return np.asarray(x).view(np.uint32)


@pytest.mark.parametrize("grad", [False, True])
def test_layers_reading_rows_of_one_array_roll_every_layer(grad):
    args = _args()
    fn = jax.value_and_grad(_loss, argnums=(0, 1, 2)) if grad else _loss
    closed = jax.make_jaxpr(fn)(*args)
    # each layer slices its own row: no two blocks are alike
    assert _reroll_find.find_runs(closed.jaxpr, 2) == []
    out, stats = reroll_with_stats(closed)
    # forward: every layer; backward: all but the last layer's, whose
    # gradient of x starts the sum (`_reroll_seed` then seeds it)
    assert stats.repeats[0] == LAYERS and len(stats.repeats) == (2 if grad else 1), stats.repeats
    if grad:
        assert stats.repeats[1] >= LAYERS - 1
    assert_same_values(closed, out, jax.tree.leaves(args))


def test_the_joined_gradient_keeps_every_bit():
    # rows of cotangent -0.0 too: a sum of zero pads turns -0.0 into +0.0,
    # and so does the join (a select); every other value is the row's own
    def loss(W, c):
        return sum((W[i] * c[i]).sum() for i in range(W.shape[0]))

    W = rand(1, 4, 3)
    c = jnp.array([[-0.0, 1.0, jnp.inf], [2.0, -0.0, -1.5], [jnp.nan, 0.0, -0.0], [1e-30, -3.0, 0.5]])
    closed = jax.make_jaxpr(jax.grad(loss))(W, c)
    joined, n = _reroll_index.joined_pads(closed.jaxpr)
    assert n == 1 and not any(e.primitive.name == "pad" for e in joined.eqns)
    want = jax.jit(_jax.jaxpr_as_fun(closed))(W, c)
    got = jax.jit(_jax.jaxpr_as_fun(_jax.ClosedJaxpr(joined, closed.consts)))(W, c)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(_bits(g), _bits(w))
    assert (_bits(want[0]) != _bits(jnp.float32(-0.0))).all()   # no -0.0 survives either


def test_sums_of_pads_that_miss_a_row_or_are_read_midway_stay():
    W = rand(1, 4, 3)
    some = jax.make_jaxpr(jax.grad(lambda W: (W[0] ** 2).sum() + (W[2] ** 2).sum()))(W)
    assert _reroll_index.joined_pads(some.jaxpr) == (None, 0)     # rows 1 and 3 are zeros

    def midway(W):   # the partial sum of the first two rows' pads is read on its own
        g = jax.grad(lambda W: (W[0] ** 2).sum() + (W[1] ** 2).sum())(W)
        return g, g + jax.grad(lambda W: (W[2] ** 2).sum() + (W[3] ** 2).sum())(W)

    closed = jax.make_jaxpr(midway)(W)
    joined, n = _reroll_index.joined_pads(closed.jaxpr)
    assert n == 0 or joined is None


def test_rows_read_at_one_index_only_are_no_per_layer_read():
    closed = jax.make_jaxpr(lambda W: W[0] * 2 + W[0])(rand(1, 4, 3))
    assert _reroll_index.index_reads(closed.jaxpr) == set()
    closed = jax.make_jaxpr(lambda W: W[0] * W[1] + W[:, :1])(rand(1, 4, 3))
    assert len(_reroll_index.index_reads(closed.jaxpr)) == 1


def test_a_user_stacked_step_under_a_mesh_equals_jax_jit():
    import jaxbackend as jb
    from jaxbackend import sharding, testing

    args = (rand(3, LAYERS, D, D) * .4, rand(4, 8, D), jnp.linspace(0.5, 1.0, LAYERS))
    vg = jax.value_and_grad(_loss, argnums=(0, 1, 2))
    f = jb.jit(vg, mesh=sharding.auto_mesh((2, 4), ("data", "model")))
    testing.assert_close(f(*args), jax.jit(vg)(*args), scale=lambda: testing.abs_scale(vg, *args),
                         what="user-stacked layers under a mesh")
    stats = {s.name: s for s in f.last_report.stats}["reroll"].matches
    assert stats["reroll.runs"] == 2, stats


def _upfront_loss(params, x):
    # the rows taken before the loop (jax.tree.map(lambda a: a[i], ...)), as
    # a model written for per-layer lists is fed from stacked weights
    layers = [jax.tree.map(lambda a, i=i: a[i], params) for i in range(params["w"].shape[0])]
    for p in layers:
        x = x + jnp.tanh(x @ p["w"] + p["b"])
    return (x ** 2).sum()


def test_stacked_weights_read_before_the_loop_are_the_scans_stacks():
    params = {"w": rand(3, LAYERS, D, D) * .4, "b": rand(5, LAYERS, D) * .1}
    args = (params, rand(4, 5, D))
    closed = jax.make_jaxpr(jax.value_and_grad(_upfront_loss))(*args)
    out, stats = reroll_with_stats(closed)
    assert [r.repeats for r in stats.runs][0] == LAYERS and len(stats.runs) == 2, stats
    # the scans read the inputs and write the gradients' stacks: no copy of
    # the weights, no pad; the one backward layer left out of its scan (layer
    # 0's, which computes no gradient of x) joins the scan's stack
    assert stats.stacked_copies == 0, stats
    eqns = out.jaxpr.eqns
    assert not any(e.primitive.name == "pad" for e in eqns)
    scans = {v for e in eqns if e.primitive.name == "scan" for v in e.outvars}
    joins = [e for e in eqns if e.primitive.name == "concatenate"]
    assert len(joins) == 2 and all(e.invars[1] in scans for e in joins), joins
    assert_same_values(closed, out, jax.tree.leaves(args))


def test_rows_kept_unit_axis_are_joined_as_rows():
    # W[i:i+1] (no squeeze): the pads' operands are rows, joined as rows
    def loss(W, x):
        for i in range(W.shape[0]):
            x = x + jnp.tanh(x @ W[i:i + 1].reshape(D, D))
        return (x ** 2).sum()

    args = (rand(3, LAYERS, D, D) * .4, rand(4, 5, D))
    closed = jax.make_jaxpr(jax.grad(loss))(*args)
    joined, n = _reroll_index.joined_pads(closed.jaxpr)
    assert n == 1 and not any(e.primitive.name == "pad" for e in joined.eqns)
    want = jax.jit(_jax.jaxpr_as_fun(closed))(*args)
    got = jax.jit(_jax.jaxpr_as_fun(_jax.ClosedJaxpr(joined, closed.consts)))(*args)
    np.testing.assert_array_equal(_bits(got[0]), _bits(want[0]))


def test_an_input_split_into_rows_only_where_every_row_is_read_and_squeezed():
    W = rand(1, 4, 3)
    every = jax.make_jaxpr(lambda W: [W[i] * 2 for i in range(4)])(W)
    split, n = _reroll_index.split_rows(every.jaxpr)
    assert n == 1 and [e.primitive.name for e in split.eqns].count("slice") == 0
    np.testing.assert_array_equal(np.stack(_jax.jaxpr_as_fun(_jax.ClosedJaxpr(split, []))(W)),
                                  np.stack(_jax.jaxpr_as_fun(every)(W)))
    missing = jax.make_jaxpr(lambda W: [W[i] * 2 for i in range(3)])(W)         # row 3 unread
    kept_unit = jax.make_jaxpr(lambda W: [W[i:i + 1] * 2 for i in range(4)])(W)  # no squeeze
    for closed in (missing, kept_unit):
        assert _reroll_index.split_rows(closed.jaxpr)[1] == 0
