"""Short stacks of a rolled program's own inputs are made through a `hold`
loop when `jb.jit` evaluates the program (`passes._stacks.HeldInputStacks`):
XLA:CPU then copies their parts with no kernel to compile, instead of fusing
each concatenate into its reshape.

Reference: the unrolled step under `jax.jit`, by `jaxbackend.testing`'s
error model; `HeldInputStacks` itself is checked against the stacks it must
and must not take.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import optax

import jaxbackend as jb
from jaxbackend import sharding
from jaxbackend.passes import _stacks
from jaxbackend.programs.small import rand
from jaxbackend.testing import assert_close

D = 32
TX = optax.adamw(1e-2)


def _loss(ws, x):
    for w1, w2, b in ws:
        x = x + jnp.tanh(x @ w1 + b) @ w2
    return (x ** 2).sum()


def _step(ws, state, x):
    loss, g = jax.value_and_grad(_loss)(ws, x)
    updates, state = TX.update(g, state, ws)
    return optax.apply_updates(ws, updates), state, loss


def _args(n):
    ws = [(rand(10 + i, D, D) * 0.3, rand(20 + i, D, D) * 0.3, rand(30 + i, D) * 0.1)
          for i in range(n)]
    return ws, TX.init(ws), rand(7, 3, D)


def _fused_concatenates(hlo: str) -> list:
    """The fused computations of an optimised HLO module holding a concatenate."""
    return [c.split("\n", 1)[0] for c in re.split(r"\n(?=\S)", hlo)
            if c.lstrip("%").startswith("fused") and " concatenate(" in c]


def _check_step(f, args):
    got = f(*args)
    assert_close(got, jax.jit(_step)(*args), what="rolled step with held stacks vs jax.jit")
    return f.lower(*args).compile().as_text()


def test_a_rolled_steps_input_stacks_compile_to_no_concatenate_kernel():
    # 6 layers: every stack of weights and moments has 6 parts, which
    # XLA:CPU would fuse into the reshape after it (one kernel per shape)
    args = _args(6)
    f = jb.jit(_step)
    hlo = _check_step(f, args)
    assert " while(" in hlo                # rolled
    assert not _fused_concatenates(hlo)
    assert len(re.findall(r"= \S+ concatenate\(", hlo)) >= 3   # made, as copies


def test_under_a_mesh_the_input_stacks_are_held_too():
    args = _args(6)
    f = jb.jit(_step, mesh=sharding.auto_mesh((2, 4), ("data", "model")))
    assert not _fused_concatenates(_check_step(f, args))


def _stack_jaxpr(fn, *shapes):
    return jax.make_jaxpr(fn)(*[jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes])


def _held(fn, *shapes, skip=()):
    """The groups of stack equations `HeldInputStacks` finds in fn's jaxpr,
    each a list of equation indices; `get` must give each a value, and
    every other equation None."""
    closed = _stack_jaxpr(fn, *shapes)
    eqns = closed.jaxpr.eqns
    out = []

    def run(*xs):
        held = _stacks.HeldInputStacks(
            closed.jaxpr, xs, skip={e for e in eqns if e.primitive.name in skip})
        out.extend([eqns.index(e) for e in g] for g in held.groups)
        assert all(held.get(e) is not None for g in held.groups for e in g)
        assert all(held.get(e) is None for e in eqns if e not in held.group_of)
        return 0
    jax.make_jaxpr(run)(*[jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes])
    return out


def test_which_stacks_are_held():
    stack = lambda *xs: _stacks.stack(xs)   # noqa: E731
    assert _held(stack, *[(4, 3)] * 8) == [[0]]   # 8 parts, all inputs, one reshape reads it
    assert not _held(stack, *[(4, 3)] * 9)        # 9: XLA does not fuse it
    assert not _held(lambda a, b: stack(a * 2, b), (3,), (3,))   # a computed part
    assert not _held(lambda a, b: jnp.concatenate([a, b]), (3,), (3,))   # no stack reshape
    two_readers = lambda a, b: (lambda c: (c.reshape(2, 3), c.sum()))(   # noqa: E731
        jax.lax.concatenate([a, b], 0))
    assert not _held(two_readers, (3,), (3,))
    assert not _held(stack, (0, 3), (0, 3))                      # empty
    assert not _held(stack, (4, 3), (4, 3), skip=("concatenate",))   # `skip`


def test_stacks_made_one_after_another_share_a_loop_and_no_stack_is_made_early():
    # two stacks, then other work, then a third: two loops, the third made
    # where the program made it (earlier, its buffer would live longer)
    def fn(a, b, c, d, e, f):
        s1, s2 = _stacks.stack((a, b)), _stacks.stack((c, d))
        y = jnp.tanh(s1 * s2).sum()
        return y * _stacks.stack((e, f))
    groups = _held(fn, *[(4,)] * 6)
    assert [len(g) for g in groups] == [2, 1]
    assert groups[1][0] > groups[0][-1] + 3   # after the tanh and the sum


def test_a_held_stack_is_the_concatenate_bit_for_bit():
    x = jnp.array([[-0.0, jnp.inf], [jnp.nan, 1e-45]], jnp.float32)
    parts = [x, -x, x * 0, x + 1]
    got = jax.jit(lambda *xs: _stacks.stack(xs))(*parts)
    closed = _stack_jaxpr(lambda *xs: _stacks.stack(xs), *[(2, 2)] * 4)

    def run(*xs):
        held = _stacks.HeldInputStacks(closed.jaxpr, xs)
        (e,), = held.groups
        return held.get(e)[0]
    flat = jax.jit(run)(*parts)
    bits = lambda a: jax.lax.bitcast_convert_type(a, jnp.int32)  # noqa: E731
    assert (bits(flat.reshape(got.shape)) == bits(got)).all()


def test_hold_one_returns_its_inputs_bit_for_bit_whether_its_loop_runs_or_not():
    x = jnp.array([[-0.0, jnp.inf], [jnp.nan, 1e-45]], jnp.float32)
    others = (jnp.array([-1, 0, 7]), jnp.ones(3, jnp.bfloat16), jnp.array([True, False]),
              jnp.array([1 + 2j, 3j], jnp.complex64))
    bits = lambda a: jax.lax.bitcast_convert_type(a, jnp.int32)  # noqa: E731
    for trips in (0, 1):   # 0 in `jb.jit`; had the body run once, xs still
        got = jax.jit(_stacks.hold_one)((x,) + others, jnp.int32(trips))
        assert got[0].dtype == x.dtype and (bits(got[0]) == bits(x)).all(), trips
        for g, o in zip(got[1:], others):
            assert g.dtype == o.dtype and g.shape == o.shape and (g == o).all(), (trips, o)
    # differentiated, it is the identity (a `while` has no reverse mode)
    g = jax.grad(lambda y: (_stacks.hold_one((y,), jnp.int32(0))[0] ** 2).sum())(
        jnp.full((2, 2), 3.0))
    assert (g == 6).all()
