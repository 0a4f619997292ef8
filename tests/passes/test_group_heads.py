"""`group_heads`: GQA contractions read K/V heads once, forward and backward."""

import math

import einops
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxbackend as jb
from jaxbackend import _jax, passes
from jaxbackend.passes import _rewrite
from jaxbackend.passes.group_heads import remaining
from jaxbackend.programs import gqa as P
from jaxbackend.testing import abs_scale, assert_close, check_pass

ARGS = P.gqa_args(batch=2, time=5, kv=2, group=3, hd=4)
FORMS = [P.gqa_repeat, P.gqa_broadcast, P.gqa_tile, P.gqa_repeat_bhtd]


def _group(closed):
    return passes.dce(passes.group_heads(passes.inline_calls(closed)))


def _copies(closed, kv_size):
    """Equations anywhere that make a copy of K or V per query head: a
    broadcast or tile of a K-sized array whose result is `group` (3) times
    bigger."""
    return sum(1 for e in _rewrite.iter_eqns(closed)
               if e.primitive.name in ("broadcast_in_dim", "tile")
               and e.invars[0].aval.size == kv_size and e.outvars[0].aval.size == 3 * kv_size)


@pytest.mark.parametrize("form", FORMS, ids=lambda f: f.__name__)
def test_repeat_forms_read_kv_once_forward_and_backward(form):
    loss = P.gqa_loss(form)
    kv_size = ARGS[1].size
    before = passes.inline_calls(jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1, 2)))(*ARGS))
    assert remaining(before) == 6          # QK and PV forward, dP and dQ read copies; dK, dV sums
    assert _copies(before, kv_size) >= 2
    with _rewrite.collect_stats() as stats:
        fwd, grad = check_pass(_group, loss, ARGS, argnums=(0, 1, 2))
    assert remaining(fwd) == 0 and remaining(grad) == 0
    assert _copies(fwd, kv_size) == 0 and _copies(grad, kv_size) == 0
    assert stats["group sum folded into contraction"] >= 2   # dK and dV


def _mqa_broadcast(q, k, v):
    """One KV head broadcast to every query head (no reshape)."""
    shape = k.shape[:2] + q.shape[2:]
    return P._attend(q, jnp.broadcast_to(k, shape), jnp.broadcast_to(v, shape))


@pytest.mark.parametrize("form", [P.gqa_repeat, P.gqa_tile, _mqa_broadcast],
                         ids=lambda f: f.__name__)
def test_one_kv_head_multi_query_attention(form):
    """kv = 1: the copies are a broadcast of a size-1 head axis (through a
    reshape or not), and AD's sum over the heads has no group axis of its own."""
    args = P.gqa_args(batch=2, time=5, kv=1, group=3, hd=4)
    loss = P.gqa_loss(form)
    before = jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1, 2)))(*args)
    assert remaining(passes.inline_calls(before)) == 6
    fwd, grad = check_pass(_group, loss, args, argnums=(0, 1, 2))
    assert remaining(fwd) == 0 and remaining(grad) == 0
    assert _copies(grad, args[1].size) == 0


def test_batch_of_one_through_matmuls_squeezes():
    """`@` squeezes a batch of one: the pass looks through squeeze and the
    size-1 broadcasts of the backward."""
    args = P.gqa_args(batch=1, time=5, kv=2, group=3, hd=4)
    loss = P.gqa_loss(P.gqa_repeat_bhtd)
    before = jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1, 2)))(*args)
    assert _rewrite.count_eqns(before, "squeeze") > 0 and remaining(before) == 6
    fwd, grad = check_pass(_group, loss, args, argnums=(0, 1, 2))
    assert remaining(fwd) == 0 and remaining(grad) == 0


def test_rewritten_repeat_form_does_the_grouped_forms_contractions():
    """Same dot shapes (up to the order of operands' axes) and the same flops
    as the hand-written grouped form; same values as it."""
    def dots(closed):
        return sorted(math.prod(e.outvars[0].aval.shape) for e in closed.jaxpr.eqns
                      if e.primitive.name == "dot_general")

    grad = jax.value_and_grad(P.gqa_loss(P.gqa_repeat), argnums=(0, 1, 2))
    ref = jax.value_and_grad(P.gqa_loss(P.gqa_grouped), argnums=(0, 1, 2))
    rewritten = _group(jax.make_jaxpr(grad)(*ARGS))
    assert dots(rewritten) == dots(jax.make_jaxpr(ref)(*ARGS))
    assert_close(jax.jit(_jax.jaxpr_as_fun(rewritten))(*ARGS), jax.tree.leaves(ref(*ARGS)),
                 what="grouped repeat form vs hand-written grouped form",
                 scale=lambda: abs_scale(ref, *ARGS))


def _einops_repeat(q, k, v):
    """`einops.repeat(k, "b s k d -> b s (k g) d")`: reshape -> broadcast ->
    reshape forward; AD's transpose sums the group through two reshapes
    (split the heads, then insert size-1 axes)."""
    g = q.shape[2] // k.shape[2]
    return P._attend(q, einops.repeat(k, "b s k d -> b s (k g) d", g=g),
                     einops.repeat(v, "b s k d -> b s (k g) d", g=g))


def test_einops_repeat_group_sums_fold_through_a_reshape_chain():
    """After `hoist_broadcast` composes einops' forward merges, the backward
    group sums of dK and dV are read through two reshapes: both fold, and
    the value_and_grad matches jax.jit's."""
    loss = P.gqa_loss(_einops_repeat)

    def group(closed):
        return _group(passes.hoist_broadcast(passes.inline_calls(closed)))

    before = jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1, 2)))(*ARGS)
    hoisted = passes.hoist_broadcast(passes.inline_calls(before))
    chains = [e for e in hoisted.jaxpr.eqns if e.primitive.name == "reduce_sum"
              and e.invars[0].aval.ndim > 5]          # sums of (.., 1, kv, g, 1, ..) splits
    assert len(chains) == 2 and remaining(hoisted) == 6
    with _rewrite.collect_stats() as stats:
        fwd, grad = check_pass(group, loss, ARGS, argnums=(0, 1, 2))
    assert stats["group sum folded into contraction"] == 2
    assert remaining(fwd) == 0 and remaining(grad) == 0
    assert _copies(grad, ARGS[1].size) == 0


def _split_twice(s):
    """(2, kv*g, 5, 5) -> (2, kv, g, 5, 5) -> (1, 2, 1, kv, g, 1, 5, 5), as
    einops' transpose of a repeat writes it."""
    return s.reshape(2, 2, 3, 5, 5).reshape(1, 2, 1, 2, 3, 1, 5, 5)


def test_group_sum_through_two_reshapes_matches_jax_jit():
    """The split of the heads and the size-1 axes come from two reshapes,
    and the sum covers the group axis and size-1 axes: one contraction,
    the same values as jax.jit's (int32: bit-identical, wrapping included)."""
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.integers(-2 ** 20, 2 ** 20, (2, 5, 6, 4)), jnp.int32)

    def f(q):
        return _split_twice(jnp.einsum("bthd,bshd->bhts", q, q)).sum((0, 4, 5))

    closed = jax.make_jaxpr(f)(q)
    assert remaining(closed) == 1
    with _rewrite.collect_stats() as stats:
        out = passes.dce(passes.group_heads(closed))
    assert stats["group sum folded into contraction"] == 1 and remaining(out) == 0
    assert _rewrite.count_eqns(out, "reduce_sum") == 0
    assert_close(jax.jit(_jax.jaxpr_as_fun(out))(q)[0], jax.jit(f)(q), what="int32 folded sum")
    qf = q.astype(jnp.float32) / 2 ** 20
    check_pass(lambda c: passes.dce(passes.group_heads(c)), lambda q: jnp.sum(jnp.tanh(f(q))),
               (qf,))


def test_group_sum_through_a_reshape_read_twice_is_left_alone():
    q = ARGS[0]

    def f(q):   # the per-head split is read again: folding would compute the scores twice
        split = jnp.einsum("bthd,bshd->bhts", q, q).reshape(2, 2, 3, 5, 5)
        return split.reshape(1, 2, 1, 2, 3, 1, 5, 5).sum((0, 4, 5)), split

    closed = jax.make_jaxpr(f)(q)
    assert remaining(closed) == 0 and passes.group_heads(closed) is closed


def test_repeat_along_a_contracted_dim_is_left_alone():
    q, k, _ = ARGS

    def f(q, k):   # k's feature dim repeated to q's 2x wider one, then contracted
        return jnp.einsum("bthd,bshd->bhts", jnp.concatenate([q, q], -1)[:, :, :2],
                          jnp.repeat(k, 2, axis=-1))

    closed = passes.inline_calls(jax.make_jaxpr(f)(q, k))
    assert passes.group_heads(closed) is closed


def test_repeat_merged_into_a_free_dim_is_left_alone():
    def f(x, k):   # copies merged into the time axis, which stays free
        kk = jnp.broadcast_to(k[:, :, None], (2, 5, 3, 4)).reshape(2, 15, 4)
        return jnp.einsum("btd,bsd->bts", x, kk)

    closed = jax.make_jaxpr(f)(P.gqa_args()[0][:, :, 0], ARGS[1][:, :, 0])
    assert remaining(closed) == 0 and passes.group_heads(closed) is closed


def test_heads_reordered_after_the_repeat_is_left_alone():
    """A gather between the copies and the contraction changes which KV
    head each query head reads: not a repeat layout the pass knows."""
    perm = jnp.array([1, 0, 3, 2, 5, 4])

    def f(q, k):
        return jnp.einsum("bthd,bshd->bhts", q, jnp.repeat(k, 3, axis=2)[:, :, perm])

    closed = passes.inline_calls(jax.make_jaxpr(f)(*ARGS[:2]))
    assert remaining(closed) == 0 and passes.group_heads(closed) is closed


def test_group_sum_of_a_contraction_read_elsewhere_is_left_alone():
    q, k, _ = ARGS

    def f(q, k):   # the per-head scores are read twice: folding would compute them twice
        s = jnp.einsum("bthd,bshd->bhts", q, jnp.repeat(k, 3, axis=2))
        return s.reshape(2, 2, 3, 5, 5).sum(2), s

    closed = jax.make_jaxpr(f)(q, jnp.repeat(k, 1, axis=2))
    with _rewrite.collect_stats() as stats:
        passes.group_heads(closed)
    assert stats["repeated operand grouped"] == 1
    assert "group sum folded into contraction" not in stats


def test_integers_exact_with_wrapping_overflow():
    """int32 products near 2**40 wrap; the grouped forward and the folded
    group sum accumulate in int32 like the original: bit-identical."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.integers(-2 ** 20, 2 ** 20, (2, 5, 6, 4)), jnp.int32)
    k = jnp.asarray(rng.integers(-2 ** 20, 2 ** 20, (2, 5, 2, 4)), jnp.int32)

    def f(q, k):
        s = jnp.einsum("bthd,bshd->bhts", q, jnp.repeat(k, 3, axis=2))
        qq = jnp.einsum("bthd,bshd->bhts", q, q)
        return s, qq.reshape(2, 2, 3, 5, 5).sum(2)

    closed = jax.make_jaxpr(f)(q, k)
    with _rewrite.collect_stats() as stats:
        out = passes.group_heads(closed)
    assert stats["repeated operand grouped"] == 1
    assert stats["group sum folded into contraction"] == 1
    for got, want in zip(jax.jit(_jax.jaxpr_as_fun(out))(q, k), f(q, k)):
        assert_close(got, want, what="int32 GQA (exact)")


def test_precision_and_accumulation_dtype_kept():
    q, k, _ = (x.astype(jnp.bfloat16) for x in ARGS)

    def f(q, k):
        return jnp.einsum("bthd,bshd->bhts", q, jnp.repeat(k, 3, axis=2),
                          precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)

    out = passes.group_heads(jax.make_jaxpr(f)(q, k))
    (dot,) = [e for e in out.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert _jax.dot_options(dot) == {"precision": (jax.lax.Precision.HIGHEST,) * 2,
                                     "preferred_element_type": jnp.float32}
    assert dot.invars[1].aval.shape == k.shape
    assert_close(jax.jit(_jax.jaxpr_as_fun(out))(q, k)[0], f(q, k), what="bf16 GQA scores")


def test_inside_a_scan_body():
    def f(q, k, v):
        def layer(c, _):
            return c + P.gqa_repeat(c, k, v), None
        return jnp.sum(jax.lax.scan(layer, q, None, length=3)[0])

    before = jax.make_jaxpr(f)(*ARGS)
    assert remaining(before) == 2
    assert remaining(check_pass(_group, f, ARGS, argnums=(0, 1, 2))[1]) == 0


def test_default_pipeline_groups_heads_and_matches_jax_jit():
    grad = jax.value_and_grad(P.gqa_loss(P.gqa_repeat), argnums=(0, 1, 2))
    report = jb.jit(grad).trace_passes(*ARGS)
    (stat,) = [s for s in report.stats if s.name == "group_heads"]
    assert stat.matches == {"repeated operand grouped": 4, "group sum folded into contraction": 2}
    assert_close(jb.jit(grad)(*ARGS), grad(*ARGS), what="jb.jit vs jax.jit",
                 scale=lambda: abs_scale(grad, *ARGS))
