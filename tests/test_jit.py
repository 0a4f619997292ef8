"""`jaxbackend.jit`: mirrors jax.jit, runs the passes, never retraces."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxbackend as jb
from jaxbackend import named as nx
from jaxbackend.programs.attention_stack import init_attention_stack, name_params, named_attention_stack
from jaxbackend.passes import _rewrite
from jaxbackend.testing import abs_scale, assert_close


def _stack(n_layers=1):
    x, layers = init_attention_stack(jax.random.key(0), n_layers, batch=2, time=4, embd=8, head=2, hd=4)
    return name_params(x, layers)


def _loss(x, layers):
    return named_attention_stack(x, layers)[0]


def _assert_trees_close(a, b, what="value"):
    """Leaf by leaf, at assert_close's per-dtype tolerance (relative to each
    reference leaf's largest entry)."""
    (la, ta), (lb, tb) = jax.tree.flatten(a), jax.tree.flatten(b)
    assert ta == tb, f"{what}: tree {ta} != reference tree {tb}"
    for i, (u, v) in enumerate(zip(la, lb)):
        assert_close(u, v, what=f"{what} leaf {i}")


def test_jit_matches_jax_and_runs_the_pipeline():
    x, layers = _stack()
    f = jb.jit(_loss)
    _assert_trees_close(f(x, layers), jax.jit(_loss)(x, layers))
    stats = {s.name: s for s in f.last_report.stats}
    assert stats["inline"].matches["einsum->dot_general"] > 0
    text = f.lower(x, layers).as_text()
    assert "einsum" not in text and "dot_general" in text


def test_same_shapes_never_retrace_new_shapes_dtypes_and_statics_trace_once():
    traces = []

    def f(x, y, scale):
        traces.append(1)
        return jnp.sum(jnp.tanh(x) * y) * scale

    g = jb.jit(f, static_argnums=2)
    a, b = jnp.ones((2, 3)), jnp.ones((2, 3))
    for _ in range(3):
        g(a, b, 2.0)
    assert len(traces) == 1 and g.trace_count == 1
    g(a * 2, b, 2.0)                          # new values, same shapes: no trace
    assert len(traces) == 1
    g(jnp.ones((4, 3)), jnp.ones((4, 3)), 2.0)   # new shape
    g(a.astype(jnp.bfloat16), b, 2.0)            # new dtype
    g(a, b, 3.0)                                 # new static arg
    assert g.trace_count == 4
    for _ in range(3):
        g(jnp.ones((4, 3)), jnp.ones((4, 3)), 2.0)
        g(a, b, 3.0)
    assert g.trace_count == 4 and len(traces) == 4


def test_value_and_grad_of_jit_and_jit_of_value_and_grad():
    x, layers = _stack(2)
    ref_v, ref_g = jax.value_and_grad(_loss, argnums=1)(x, layers)
    v1, g1 = jb.jit(jax.value_and_grad(_loss, argnums=1))(x, layers)
    v2, g2 = jax.value_and_grad(jb.jit(_loss), argnums=1)(x, layers)
    _assert_trees_close(v1, ref_v)
    _assert_trees_close(v2, ref_v)
    _assert_trees_close(g1, ref_g)
    _assert_trees_close(g2, ref_g)


def test_lower_compile_cost_analysis_and_trace_report():
    x, layers = _stack()
    f = jb.jit(jax.value_and_grad(_loss, argnums=1))
    lowered = f.lower(x, layers)
    compiled = lowered.compile()
    assert compiled.cost_analysis()["flops"] > 0
    assert "HloModule" in compiled.as_text()
    t = f.trace_passes(x, layers)
    assert [n for n, _ in t.jaxprs] == ["input"] + list(jb.passes.DEFAULT_PIPELINE)
    assert _rewrite.count_eqns(t.before, "einsum") > 0 and _rewrite.count_eqns(t.after, "einsum") == 0
    assert t.jaxpr_after("cse") is t.jaxprs[1 + list(jb.passes.DEFAULT_PIPELINE).index("cse")][1]
    screen = str(t)
    assert len(screen.splitlines()) <= 24 and "einsum->dot_general" in screen


def test_kwargs_static_argnames_donation_and_explicit_passes():
    def f(x, *, n, bias):
        return jnp.exp(x) * n + bias

    g = jb.jit(f, static_argnames="n", donate_argnums=0, passes=("cse", "dce"))
    x = jnp.arange(4.0)
    out = g(jnp.arange(4.0), n=3, bias=jnp.ones(4))
    _assert_trees_close(out, f(x, n=3, bias=jnp.ones(4)))
    assert [s.name for s in g.last_report.stats] == ["cse", "dce"]
    with pytest.raises(ValueError, match="unknown pass"):
        jb.jit(f, passes=("nope",))


def test_transform_hook_runs_after_the_pipeline():
    seen = []

    def hook(closed):
        seen.append(_rewrite.count_eqns(closed, "einsum"))
        return closed

    x, layers = _stack()
    jb.jit(_loss, _transform=hook)(x, layers)
    assert seen == [0]


def test_named_outputs_and_pytrees_round_trip():
    x, layers = _stack()
    out = jb.jit(lambda x, l: named_attention_stack(x, l)[1])(x, layers)
    assert isinstance(out, nx.NamedArray) and out.dims == ("batch", "time", "embd")


def test_static_argname_passed_by_position_and_static_argnum_by_name():
    def f(x, n):
        return jnp.zeros(n) + x[0]   # raises if n arrives as a tracer

    by_name = jb.jit(f, static_argnames="n")
    by_num = jb.jit(f, static_argnums=1)
    x = jnp.ones(3)
    for g in (by_name, by_num):
        assert g(x, 3).shape == (3,) and g(x, n=3).shape == (3,)
        assert g(x, 4).shape == (4,)
    assert by_name.__name__ == "f"


def _mesh_setup():
    from jax.sharding import AxisType

    from jaxbackend.programs import attention_stack as A

    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    x, layers = A.init_attention_stack(jax.random.key(0), 1, batch=8, time=8)
    nx_x, nx_layers = A.name_params(x, layers)
    vg = jax.value_and_grad(lambda x, L: A.named_attention_stack(x, L)[0], argnums=1)
    return mesh, vg, (nx_x, nx_layers)


@pytest.mark.parametrize("rules", [None, {"batch": "data", "head": "model"}])
def test_jit_with_mesh_matches_single_device(rules):
    mesh, vg, args = _mesh_setup()
    f = jb.jit(vg, mesh=mesh, rules=rules)
    v, g = f(*args)
    v0, g0 = jax.jit(vg)(*args)
    assert f.plan is not None and "inline" not in f.passes
    if rules is not None:
        assert {d: a for d, a in f.plan.rules.items() if a} == rules
    assert_close(v, v0, scale=lambda: abs_scale(vg, *args)[0], what="loss")
    assert_close(g, g0, scale=lambda: abs_scale(vg, *args)[1], what="gradient")
    # the gradient of a weight comes back sharded as the plan's rules say
    spec = tuple(g[0]["wq"].values.sharding.spec) + (None,) * 3
    assert spec[:3] == tuple(f.plan.rules.get(d) for d in ("embd", "head", "hd"))


def test_jit_sharding_arguments_need_mesh():
    with pytest.raises(ValueError, match="need mesh="):
        jb.jit(lambda x: x, rules={"batch": "data"})
    mesh, vg, args = _mesh_setup()
    # under a mesh the plan sets the layouts: a given one must agree with it
    bad = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("model"))
    with pytest.raises(ValueError, match="in_shardings lays out argument"):
        jb.jit(vg, mesh=mesh, rules={"batch": "data"}, in_shardings=bad)(*args)


def _scan_count(closed) -> int:
    return sum(e.primitive.name == "scan" for e in closed.jaxpr.eqns)


@pytest.fixture(scope="module")
def six_layer_transformer():
    """A 6-layer transformer's value_and_grad, its arguments, jax.jit's value
    and gradient, and (lazily, once) the gradient's abs_scale: shared by the
    reroll settings compared against them."""
    import functools

    from jaxbackend.programs import transformer as T

    x, layers = T.init_transformer(jax.random.key(1), 6, seq=8, d=32, mlp=64)
    vg = jax.value_and_grad(lambda x, L: T.loop_transformer(x, L)[0], argnums=(0, 1))
    # v is a sum of 512 O(1) outputs that cancel (-0.467): its float32 error
    # scales with the sum of their absolute values, not with the result
    # (rolled, unrolled and eager differ by ~3e-5 across CPU kinds)
    loss_scale = float(jnp.abs(T.loop_transformer(x, layers)[1]).sum())
    grad_scale = functools.cache(lambda: abs_scale(vg, x, layers)[1])
    return vg, (x, layers), jax.jit(vg)(x, layers), loss_scale, grad_scale


@pytest.mark.parametrize("reroll, rolled", [(True, True), (False, False), (12, False), (4, True)])
def test_reroll_is_on_by_default_and_configurable(reroll, rolled, six_layer_transformer):
    vg, (x, layers), (v0, g0), loss_scale, grad_scale = six_layer_transformer
    f = jb.jit(vg, reroll=reroll)
    after = f.trace_passes(x, layers).jaxprs[-1][1]
    assert (_scan_count(after) > 0) == rolled
    v, g = f(x, layers)
    assert_close(v, v0, scale=loss_scale, what="loss")
    assert_close(g, g0, scale=grad_scale, what="gradient")


def test_default_rolls_from_reroll_min_repeats_layers():
    from jaxbackend.programs import transformer as T
    from jaxbackend.passes import REROLL_MIN_REPEATS as k

    for n, rolled in ((k - 1, False), (k, True)):
        x, layers = T.init_transformer(jax.random.key(1), n, seq=8, d=32, mlp=64)
        vg = jax.value_and_grad(lambda x, L: T.loop_transformer(x, L)[0], argnums=(0, 1))
        after = jb.jit(vg).trace_passes(x, layers).jaxprs[-1][1]
        assert _scan_count(after) == (2 if rolled else 0), n


def test_reroll_argument_is_checked():
    with pytest.raises(ValueError, match="reroll=1"):
        jb.jit(lambda x: x, reroll=1)


def test_jit_with_mesh_rolls_layers_and_constrains_every_contraction_in_the_loop():
    from jax.sharding import AxisType

    from jaxbackend.programs import attention_stack as A

    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    texts = {}
    for n in (8, 16):
        x, layers = A.init_attention_stack(jax.random.key(0), n, batch=8, time=8)
        vg = jax.value_and_grad(lambda x, L: A.named_attention_stack(x, L)[0], argnums=1)
        f = jb.jit(vg, mesh=mesh, rules={"batch": "data", "head": "model"})
        assert "reroll" in f.passes and "inline" not in f.passes
        args = A.name_params(x, layers)
        text = texts[n] = f.lower(*args).as_text()
        # the layers run in loops, and every contraction (forward and
        # backward, in the loop bodies) is constrained, besides one
        # constraint per input and output leaf (the plan's layouts), where
        # the per-layer gradients, rows of the scan's stacks, take one per
        # stack (`_planned._rows_of_stacks`)
        from jaxbackend import _planned

        rows, stacks = _planned._rows_of_stacks(f.plan, f.plan.out_specs())
        assert len(rows) >= n and len(stacks) < len(rows), (rows, stacks)
        n_io = (len(jax.tree.leaves(args)) + len(jax.tree.leaves(jax.eval_shape(vg, *args)))
                - len(rows) + len(stacks))
        assert "stablehlo.while" in text
        assert text.count("sdy.sharding_constraint") - n_io == text.count("dot_general") > 0
    # flat in depth: 16 layers hold no more contractions than 8
    assert texts[16].count("dot_general") == texts[8].count("dot_general") < 8 * 6
    with pytest.raises(ValueError, match="btach"):
        jb.jit(vg, mesh=mesh, rules={"btach": "data"})(*A.name_params(x, layers))
