"""`reroll`'s element-wise tail: the per-layer optimizer update applied once
per weight kind to the stacks (`passes/_reroll_vector.py`).

Reference: the same program rolled with `vectorize=False` (the tail kept per
layer) and the unrolled program itself, by `jaxbackend.testing`'s error model.
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import optax

from jaxbackend import _jax
from jaxbackend.passes.reroll import reroll_with_stats
from jaxbackend.programs.small import rand
from jaxbackend.testing import assert_same_values

N, D = 6, 6


def _layers(x, ws):
    for w1, w2, b in ws:
        x = x + jnp.tanh(x @ w1 + b) @ w2
    return (x ** 2).sum()


def _step_jaxpr(tail, n=N, d=D):
    """The flat jaxpr of value_and_grad over the layers followed by `tail`
    (grads, weights, state) -> outputs, and its flat inputs."""
    x = rand(7, 3, d)
    ws = [(rand(10 + i, d, d) * 0.3, rand(20 + i, d, d) * 0.3, rand(30 + i, d) * 0.1)
          for i in range(n)]
    state = tail.init(ws) if hasattr(tail, "init") else None

    def step(ws, state, x):
        # grads of x too: then layer 0's blocks match the others (two runs of N)
        loss, (_, g) = jax.value_and_grad(_layers, argnums=(0, 1))(x, ws)
        return loss, tail(g, ws, state)

    leaves, tree = jax.tree.flatten((ws, state, x))
    closed = jax.make_jaxpr(lambda *xs: step(*jax.tree.unflatten(tree, xs)))(*leaves)
    return closed, leaves


class _AdamW:
    def __init__(self, **kw):
        self.tx = optax.adamw(1e-2, **kw)

    def init(self, ws):
        return self.tx.init(ws)

    def __call__(self, g, ws, state):
        updates, state = self.tx.update(g, state, ws)
        return optax.apply_updates(ws, updates), state


def _tail_counts(closed):
    eqns = _jax.open_jaxpr(closed).eqns
    last = max(i for i, e in enumerate(eqns) if e.primitive.name == "scan")
    return collections.Counter(e.primitive.name for e in eqns[last + 1:])


def _check(tail):
    closed, leaves = _step_jaxpr(tail)
    out, stats = reroll_with_stats(closed, min_repeats=2)
    per_layer, _ = reroll_with_stats(closed, min_repeats=2, vectorize=False)
    assert stats.repeats == [N, N]
    assert_same_values(per_layer, out, leaves, what="vectorised tail vs per-layer tail")
    assert_same_values(closed, out, leaves, what="vectorised tail vs unrolled program")
    return out, per_layer, stats


def test_adamw_update_is_applied_once_per_weight_kind():
    out, per_layer, stats = _check(_AdamW())
    # every per-layer equation of the update belongs to a family of N members
    assert stats.vectorized_eqns == N * stats.vectorized > 0
    before, after = _tail_counts(per_layer), _tail_counts(out)
    for prim in ("mul", "add", "div", "sqrt"):
        # per weight kind: N equations before, one after (plus the one or
        # two scalar equations of the bias corrections, not per layer)
        assert after[prim] <= before[prim] // N + 2, (prim, before[prim], after[prim])


def test_same_shape_weights_in_two_roles_get_a_family_each():
    out, _, stats = _check(lambda g, ws, _: jax.tree.map(lambda w, d: w - 0.1 * d, ws, g))
    # 3 weights per layer, 2 equations each (mul, sub): 6 families, w1 and w2
    # (one shape) in a family each
    assert stats.vectorized == 6 and stats.vectorized_eqns == 6 * N


def test_per_layer_reductions_shift_their_axes():
    out, _, stats = _check(lambda g, ws, _: [jnp.sum(gi * gi, axis=0) for gi, *_ in g])
    assert stats.vectorized == 2   # mul and reduce_sum, each once for N layers
    assert _tail_counts(out)["reduce_sum"] == 1


def test_copies_are_applied_per_kind():
    # jnp.array(sum) per layer is a `copy` of it (as in optax's global norm)
    def tail(g, ws, _):
        sums = [jnp.array(jnp.sum(gi[0] * gi[0])) for gi in g]
        total = jnp.float32(0)
        for s in sums:
            total = total + s
        return total
    out, per_layer, stats = _check(tail)
    assert stats.vectorized == 3 and stats.vectorized_eqns == 3 * N   # mul, reduce_sum, copy
    before, after = _tail_counts(per_layer), _tail_counts(out)
    assert before["copy"] >= N and after["copy"] == before["copy"] - N + 1
    assert after["reduce_sum"] == 1


def _growing(g, ws, _):
    acc = jnp.zeros((0,))
    for gi in g:   # concatenate (not element-wise) reads each sum before the next exists
        acc = jnp.concatenate([acc, jnp.sum(gi[0])[None]])
    return acc


def test_a_result_read_before_the_last_member_is_computed_before_its_first_reader():
    # every member's input is a gradient, a stack entry when the tail starts:
    # the family is applied there, before the first concatenate reads a sum
    out, _, stats = _check(_growing)
    assert _tail_counts(out)["reduce_sum"] == 1
    assert stats.vectorized_eqns == N


def _growing_from_itself(g, ws, _):
    acc = jnp.ones((1,))
    for gi in g:   # each sum reads the one before: no point precedes every reader
        acc = jnp.concatenate([acc, jnp.sum(gi[0] * acc[-1])[None]])
    return acc


def test_a_member_reading_a_later_value_keeps_its_family_per_layer():
    out, _, stats = _check(_growing_from_itself)
    assert _tail_counts(out)["reduce_sum"] == N
    assert stats.vectorized_eqns == 0


def test_global_norm_clipping_matches():
    # optax's running sum of squares is itself a chain of identical blocks
    # (rolled into a third scan); each layer's squared norm, between the
    # backward scan and that one, and the scaling after it are applied once
    # per kind (the chain itself stays a sum in the program's order)
    clip = optax.clip_by_global_norm(1e-3)
    clipped, leaves = _step_jaxpr(lambda g, ws, _: clip.update(g, None)[0])
    out, stats = reroll_with_stats(clipped, min_repeats=2)
    per_layer, _ = reroll_with_stats(clipped, min_repeats=2, vectorize=False)
    assert len(stats.runs) == 3 and stats.vectorized_eqns == 21 * N
    before = collections.Counter(e.primitive.name for e in _jax.open_jaxpr(per_layer).eqns)
    after = collections.Counter(e.primitive.name for e in _jax.open_jaxpr(out).eqns)
    for prim in ("square", "reduce_sum", "mul"):   # (and two scalar muls, not per layer)
        assert after[prim] <= before[prim] // N + 2, (prim, before[prim], after[prim])
    assert_same_values(clipped, out, leaves, what="clipped tail")


def test_an_index_mismatch_between_stacks_is_not_merged():
    # layer i's gradient combined with layer N-1-i's weight: the entries of
    # two stacks at different indices are never one family member
    out, _, stats = _check(lambda g, ws, _: [gi[0] * wj[0] for gi, wj in zip(g, ws[::-1])])
    assert stats.vectorized_eqns == 0
    assert _tail_counts(out)["mul"] >= N


def test_hold_returns_its_inputs_bit_for_bit_whether_its_loop_runs_or_not():
    from jaxbackend.passes._stacks import hold
    x = jnp.array([-0.0, 0.0, jnp.inf, -jnp.inf, jnp.nan, 1e-45, -3.5], jnp.float32)
    bits = lambda a: jax.lax.bitcast_convert_type(a, jnp.int32)  # noqa: E731
    others = (jnp.array([-1, 0, 7]), jnp.ones(3, jnp.bfloat16), jnp.array([True, False]),
              jnp.array([1 + 2j, 3j], jnp.complex64), jnp.zeros((0, 2)))
    for trips in (0, 1):   # 0 in the pass; had the body run once, xs still
        got = jax.jit(hold)((x,) + others, jnp.int32(trips))   # one loop holds them all
        assert len(got) == 1 + len(others)
        assert got[0].dtype == x.dtype and (bits(got[0]) == bits(x)).all(), trips
        for g, o in zip(got[1:], others):
            assert g.dtype == o.dtype and g.shape == o.shape and (g == o).all(), (trips, o)


def test_the_vectorised_update_is_not_recomputed_in_every_entry_read():
    # Read entry by entry, a computed stack is materialised once: XLA:CPU
    # drops optimization barriers, and without the hold it fused the AdamW
    # chain into each layer's slice, one kernel per layer and weight kind.
    import re

    out = {}
    for n in (4, 8):
        closed, leaves = _step_jaxpr(_AdamW(), n=n, d=32)
        rolled, stats = reroll_with_stats(closed, min_repeats=2)
        assert stats.repeats == [n, n] and stats.vectorized
        hlo = jax.jit(_jax.jaxpr_as_fun(rolled)).lower(*leaves).compile().as_text()
        out[n] = len(re.findall(r"= \S+ (?:multiply|divide|sqrt)\(", hlo))
    # the update's arithmetic does not grow with the number of layers
    assert out[8] <= out[4] + 4, out


def _fused_bodies(hlo: str) -> list:
    """The text of each fused computation of an optimised HLO module."""
    import re
    return [c for c in re.split(r"\n(?=\S)", hlo) if c.lstrip("%").startswith("fused")]


def test_a_short_stack_is_not_fused_into_every_optimizer_kernel():
    # XLA:CPU fuses a concatenate of <= 8 operands into its element-wise
    # readers: a stack of 6 layers' weights or moments, made for the
    # vectorised AdamW update, went into every kernel of that update (each
    # one large to compile). Held (`_stacks.hold`), it is made once.
    closed, leaves = _step_jaxpr(_AdamW(), n=6, d=32)
    rolled, stats = reroll_with_stats(closed, min_repeats=2)
    assert stats.vectorized
    hlo = jax.jit(_jax.jaxpr_as_fun(rolled)).lower(*leaves).compile().as_text()
    mixed = [b.split("\n", 1)[0] for b in _fused_bodies(hlo)
             if " concatenate(" in b and any(f" {op}(" in b for op in ("multiply", "divide", "sqrt"))]
    assert not mixed, mixed


def test_opaque_indices_from_an_integer_input_are_0_to_n_and_not_folded():
    from jaxbackend.passes import _stacks

    for first in (2, 3):   # trip count 0 or 1: the indices are 0..n-1 either way
        like = jnp.array([first, 5], jnp.int32)
        assert [int(i) for i in jax.jit(lambda a: _stacks.opaque_indices(4, a))(like)] == [0, 1, 2, 3]
    hlo = jax.jit(lambda a: _stacks.opaque_indices(4, a)).lower(jnp.zeros(2, jnp.int32)).compile()
    assert " while(" in hlo.as_text()   # `x != x` would fold for integers, and the loop with it


def test_a_rolled_program_with_a_held_stack_is_differentiable():
    # jax.grad of jb.jit(step): reverse mode cannot go through the hold's
    # while loop; hold is the identity under AD
    from jaxbackend.passes._stacks import hold

    x, y = jnp.arange(6.0).reshape(2, 3), jnp.arange(2.0)
    gx, gy = jax.grad(lambda x, y: sum((h ** 2).sum() for h in hold((x, y), jnp.int32(0))),
                      argnums=(0, 1))(x, y)
    assert (gx == 2 * x).all() and (gy == 2 * y).all()


class _SharedScalarPerLayer:
    """Each layer computes its step size from one shared scalar (as optax's
    schedule-free and Muon updates do): `lr * 0.5` is traced once per layer,
    every input shared by all of them."""

    def init(self, ws):
        return jnp.float32(0.1)

    def __call__(self, g, ws, lr):
        return [w - (lr * 0.5) * gi for (w, *_), (gi, *_) in zip(ws, g)]


def test_a_family_of_shared_scalars_is_stacked_for_its_readers():
    # the members of `lr * 0.5` read nothing per layer: applied once, their
    # result must still be a stack of N entries for the per-layer families
    # that read it (it was one scalar, and the reader's broadcast failed)
    out, _, stats = _check(_SharedScalarPerLayer())
    assert stats.vectorized_eqns >= 3 * N
