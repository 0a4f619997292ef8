"""`jb.jit` behaves like `jax.jit` where users meet it, and its errors are clear.

Each test is a regression test for a way `jb.jit` once differed from
`jax.jit` (or let a mistake through), checked against `jax.jit` itself.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxbackend as jb
from jaxbackend.passes import pipeline

x3 = jnp.arange(3.0)


def _f(x):
    return jnp.sin(x) * 2.0


# -- 1. JAX's own jit methods work on jb.jit's object --------------------------

def test_jax_transformations_of_jb_jit_match_jax_jit():
    g = jb.jit(_f)
    want = jax.make_jaxpr(jax.jit(_f))(x3).out_avals
    assert jax.make_jaxpr(g)(x3).out_avals == want
    assert jax.make_jaxpr(jax.jit(g))(x3).out_avals == want
    assert jax.eval_shape(g, x3) == jax.eval_shape(jax.jit(_f), x3)
    compiled = g.trace(x3).lower().compile()                 # JAX's own Traced
    np.testing.assert_array_equal(compiled(x3), g(x3))
    assert g.eval_shape(x3).shape == (3,)


def test_extras_do_not_shadow_any_attribute_of_jaxs_jit_object():
    ours, theirs = jb.jit(_f), jax.jit(_f)
    extras = set(vars(ours)) - set(vars(theirs))
    assert {"trace_passes", "passes", "trace_count", "last_report"} <= extras
    assert not extras & set(dir(type(theirs))), extras & set(dir(type(theirs)))
    assert type(ours) is type(theirs)        # JAX's jit object: its C++ fast path


def test_trace_passes_returns_the_pipeline_trace():
    t = jb.jit(_f, passes=("cse", "dce")).trace_passes(x3)
    assert [n for n, _ in t.jaxprs] == ["input", "cse", "dce"]


# -- 2. a non-callable is refused at once ----------------------------------------

@pytest.mark.parametrize("bad", [3, "f", None])
def test_non_callable_raises_type_error_at_once_like_jax(bad):
    with pytest.raises(TypeError):
        jax.jit(bad)
    with pytest.raises(TypeError, match="callable"):
        jb.jit(bad)


def test_generator_function_raises_type_error_at_once_like_jax():
    def gen(x):
        yield x

    with pytest.raises(TypeError):
        jax.jit(gen)
    with pytest.raises(TypeError, match="generator"):
        jb.jit(gen)


# -- 3. each pass's result is checked -----------------------------------------------

def _returns_none(closed):
    return None


def _shrinks_output(closed):
    return jax.make_jaxpr(lambda x: x[:1])(*[jax.ShapeDtypeStruct(a.shape, a.dtype)
                                              for a in closed.in_avals])


def _changes_input(closed):
    return jax.make_jaxpr(lambda x: x * 2)(jax.ShapeDtypeStruct((3,), jnp.int32))


def _strong_output(closed):
    return jax.make_jaxpr(lambda x: (x * 2).astype(jnp.float32))(
        jax.ShapeDtypeStruct((), jnp.float32, weak_type=True))


@pytest.mark.parametrize("bad_pass, error, match", [
    (_returns_none, TypeError, "pass '_returns_none' returned NoneType, not a ClosedJaxpr"),
    (_shrinks_output, ValueError, r"pass '_shrinks_output' changed output 0 from float32\[3\] "
                                  r"to float32\[1\]"),
    (_changes_input, ValueError, r"pass '_changes_input' changed input 0 from float32\[3\] "
                                 r"to int32\[3\]"),
])
def test_a_pass_that_breaks_the_program_type_is_named(bad_pass, error, match):
    with pytest.raises(error, match=match):
        jb.jit(_f, passes=("cse", bad_pass))(x3)
    with pytest.raises(error, match=match):
        jb.jit(_f, passes=(bad_pass,)).trace_passes(x3)
    mesh = jb.sharding.auto_mesh((2, 4), ("data", "model"))
    with pytest.raises(error, match=f"pass '{bad_pass.__name__}'"):     # planned passes too
        jb.jit(_f, mesh=mesh, passes=(bad_pass,))(jnp.arange(8.0))


def test_a_pass_that_drops_a_weak_type_is_named():
    closed = jax.make_jaxpr(lambda x: x * 2)(2.0)
    with pytest.raises(ValueError, match=r"pass '_strong_output' changed output 0 from "
                                         r"~float32\[\] to float32\[\]"):
        pipeline.run_pipeline(closed, (_strong_output,))


def test_every_builtin_pass_keeps_the_program_type_of_weak_and_strong_inputs():
    def f(a, b, n):
        return jnp.tanh(a * b).sum() + n, a * 3

    out = jb.jit(f)(2.0, jnp.ones(4, jnp.bfloat16), 3)
    ref = jax.jit(f)(2.0, jnp.ones(4, jnp.bfloat16), 3)
    assert [jax.typeof(o) for o in out] == [jax.typeof(o) for o in ref]


# -- 4. negative static_argnums resolve per call, as jax.jit does -------------------

def _which_traced(fn):
    """fn's positional parameters' "is a tracer" flags, recorded per trace:
    ints passed statically stay ints, dynamic ones arrive as tracers."""
    seen = []

    def probe(*vs):
        seen.append(tuple(isinstance(v, jax.Array) for v in vs))
        return jnp.zeros(())

    return seen, fn(probe)


def _abc(probe):
    def f(a, b, c=1):
        return probe(a, b, c)
    return f


def _star(probe):
    def f(*xs):
        return probe(*xs)
    return f


def _posonly(probe):
    def f(a, /, b, *, c=1):
        return probe(a, b, c)
    return f


@pytest.mark.parametrize("make, nums, args, kwargs", [
    (_abc, -1, (1, 2, 3), {}),
    (_abc, -1, (1, 2), {}),              # jax: b is static (last positional passed)
    (_abc, -1, (1, 2), {"c": 3}),        # c by name stays dynamic: -1 has no name
    (_abc, -1, (1,), {"b": 2, "c": 3}),
    (_abc, -2, (1, 2), {"c": 3}),
    (_abc, 1, (1,), {"b": 2}),           # a positive argnum is static by name too
    (_star, -1, (1, 2, 3), {}),
    (_star, -1, (1, 2), {}),
    (_posonly, -1, (1, 2), {}),
    (_posonly, -1, (1,), {"b": 2}),
])
def test_static_argnums_match_jax_jit(make, nums, args, kwargs):
    seen_jax, f_jax = _which_traced(make)
    seen_ours, f_ours = _which_traced(make)
    jax.jit(f_jax, static_argnums=nums)(*args, **kwargs)
    jb.jit(f_ours, static_argnums=nums, passes=())(*args, **kwargs)
    assert seen_ours == seen_jax
    seen_ours.clear()
    jb.jit(f_ours, static_argnums=nums, passes=()).trace_passes(*args, **kwargs)
    assert seen_ours == seen_jax


def test_static_argnums_and_argnames_both_given_are_taken_as_given_like_jax():
    seen_jax, f_jax = _which_traced(_abc)
    seen_ours, f_ours = _which_traced(_abc)
    jax.jit(f_jax, static_argnums=1, static_argnames="c")(1, b=2, c=3)
    jb.jit(f_ours, static_argnums=1, static_argnames="c")(1, b=2, c=3)
    assert seen_ours == seen_jax == [(True, True, False)]


def test_negative_static_argnum_beyond_the_call_raises_like_jax():
    seen, f = _which_traced(_star)
    with pytest.raises(ValueError, match="-3"):
        jax.jit(f, static_argnums=-3)(1, 2)
    with pytest.raises(ValueError, match="-3"):
        jb.jit(f, static_argnums=-3)(1, 2)
    with pytest.raises(ValueError, match="-3"):
        jb.jit(f, static_argnums=-3).trace_passes(1, 2)


def _types(avals):
    return [(a.shape, a.dtype, a.weak_type) for a in avals]


# -- 5. weak types of Python scalars and weak arrays are kept -------------------------

@pytest.mark.parametrize("scalar", [2.0, 3, jnp.asarray(2.0) * 1])
@pytest.mark.parametrize("dtype", [jnp.int8, jnp.bfloat16, jnp.float32])
def test_weak_types_match_jax_jit(scalar, dtype):
    def f(s, a):
        return s * a, s + 1

    a = jnp.ones(3, dtype)
    want = [jax.typeof(o) for o in jax.jit(f)(scalar, a)]
    assert [jax.typeof(o) for o in jb.jit(f)(scalar, a)] == want
    t = jb.jit(f).trace_passes(scalar, a)
    assert _types(t.before.in_avals) == _types(jax.jit(f).trace(scalar, a).jaxpr.in_avals)
    assert _types(t.after.out_avals) == _types(want)


# -- 6. reroll= takes any integer -------------------------------------------------------

def _four_layers():
    from jaxbackend.programs import transformer as T

    x, layers = T.init_transformer(jax.random.key(1), 4, seq=8, d=32, mlp=64)
    return (lambda x, L: T.loop_transformer(x, L)[0]), x, layers


@pytest.mark.parametrize("k", [3, np.int64(3), np.int32(4)])
def test_reroll_takes_numpy_integers(k):
    loss, x, layers = _four_layers()
    after = jb.jit(loss, reroll=k).trace_passes(x, layers).after
    assert sum(e.primitive.name == "scan" for e in after.jaxpr.eqns) == 1


@pytest.mark.parametrize("bad", [0, 1, -3, np.int64(1), 2.5, np.float64(3.0), "3", None])
def test_reroll_rejects_other_values_in_one_line(bad):
    with pytest.raises(ValueError, match=r"reroll=.*pass True, False, or .*>= 2") as e:
        jb.jit(_f, reroll=bad)
    assert "\n" not in str(e.value)


# -- 7. a mesh must have Auto axes --------------------------------------------------------

@pytest.mark.parametrize("types, bad", [(None, "'data', 'model'"), ("mixed", "'model'")])
def test_mesh_with_explicit_axes_is_refused_up_front(types, bad):
    from jax.sharding import AxisType

    kw = {} if types is None else {"axis_types": (AxisType.Auto, AxisType.Explicit)}
    mesh = jax.make_mesh((2, 4), ("data", "model"), **kw)      # jax's default: Explicit
    with pytest.raises(ValueError, match=rf"mesh axes \({bad}\) are not Auto") as e:
        jb.jit(_f, mesh=mesh)                                  # before any call
    assert "axis_types=(jax.sharding.AxisType.Auto,) * 2" in str(e.value)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="are not Auto"):
        jb.jit(_f, mesh=mesh, rules={})


@pytest.mark.parametrize("mesh, what", [("data", "is of type str"), ((2, 4), "is of type tuple"),
                                        ("abstract", "is an abstract mesh")])
def test_a_mesh_that_is_not_a_mesh_of_devices_is_refused_up_front(mesh, what):
    from jaxbackend import sharding

    if mesh == "abstract":
        mesh = sharding.abstract_mesh((2, 4), ("data", "model"))
    with pytest.raises(TypeError, match=rf"mesh=.* {what}.*sharding.auto_mesh") as e:
        jb.jit(_f, mesh=mesh)                                  # before any call
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("rules, match", [
    ({"batch": 0}, r"sharding rule 'batch': 0 is not a mesh axis name"),
    ({"batch": {"a": 1}}, r"sharding rule 'batch': \{'a': 1\} is not a mesh axis name"),
    ("batch", r"sharding rules 'batch': give a dict"),
    ({"batch"}, r"sharding rules \{'batch'\}: give a dict")])
def test_rules_of_the_wrong_type_are_refused_in_one_line(rules, match):
    from jaxbackend import sharding

    with pytest.raises(TypeError, match=match) as e:
        sharding.normalize_rules(rules)
    assert "\n" not in str(e.value)


def test_an_unknown_mesh_axis_or_profile_is_named_with_the_dim_and_the_choices():
    from jaxbackend import sharding

    mesh = sharding.auto_mesh((2, 4), ("data", "model"))
    x = jnp.ones((8, 4))
    with pytest.raises(ValueError, match=r"dim 'args\[0\]:0' is mapped to 'dat', but the mesh "
                                         r"has no axis 'dat'; its axes are \('data', 'model'\)"):
        jb.jit(lambda x: x * 2, mesh=mesh, rules={"args[0]:0": "dat"})(x)
    with pytest.raises(ValueError, match=r"profile='tpu' is not a known machine \(cpu, h100"):
        jb.jit(lambda x: x * 2, mesh=mesh, profile="tpu")(x)
    with pytest.raises(TypeError, match=r"profile=3 is of type int; pass a name"):
        sharding.plan(lambda x: x * 2, x, mesh=mesh, profile=3)


# -- 8. Flax NNX state updates are not silently dropped --------------------------------------

def _nnx_setup():
    import optax
    from flax import nnx

    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    return nnx, model, opt, jnp.ones((4, 2)), jnp.zeros((4, 3))


def test_nnx_state_update_is_refused_with_the_fix():
    nnx, model, opt, x, y = _nnx_setup()

    def step(model, opt, x, y):
        loss, g = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        opt.update(model, g)
        return loss

    # the optimizer updates the module's parameters: the first argument found changed
    where = r"args\[0\]\.(kernel|bias)\.value \(Linear\)"
    with pytest.raises(TypeError, match=rf"step updated Flax NNX state at {where}") as e:
        jb.jit(step)(model, opt, x, y)
    assert "nnx.jit" in str(e.value) and "nnx.split" in str(e.value)
    assert "\n" not in str(e.value)


def test_nnx_variable_update_is_refused():
    nnx, model, _, x, _ = _nnx_setup()

    def bump(v, x):
        v[...] = v[...] + x.sum()
        return v[...]

    with pytest.raises(TypeError, match=r"bump updated Flax NNX state at args\[0\]\.value "
                                        r"\(Variable\)"):
        jb.jit(bump)(nnx.Variable(jnp.zeros(())), x)
    with pytest.raises(TypeError, match=r"bump updated Flax NNX state at kwargs\['v'\]"):
        jb.jit(bump).trace_passes(v=nnx.Variable(jnp.zeros(())), x=x)


def test_nnx_state_update_returned_as_state_is_kept_like_jax_jit():
    # a functional step with dropout: the module's Rngs advance inside, and the
    # step returns their new state, so nothing is lost (as under jax.jit)
    from flax import nnx

    graphdef, state = nnx.split(nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=1)))

    def step(state, x):
        m = nnx.merge(graphdef, state)
        return m(x), nnx.state(m)

    x = jnp.ones((64,))
    got, want = jb.jit(step), jax.jit(step)
    for _ in range(2):   # the second call draws from the returned (advanced) state
        (y, state_got), (y_want, state) = got(state, x), want(state, x)
        np.testing.assert_array_equal(y, y_want)
        bits = [jax.random.key_data(a) if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key)
                else a for a in jax.tree.leaves((state_got, state))]
        half = len(bits) // 2
        for a, b in zip(bits[:half], bits[half:]):
            np.testing.assert_array_equal(a, b)
    assert not np.array_equal(y, want(nnx.split(nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=1)))[1],
                                      x)[0])   # the state did advance
    # the Variable itself returned keeps its update too; its bare value does not
    bump = lambda v, x: (v.__setitem__(..., v[...] + x.sum()), v)[1]
    v = jb.jit(bump)(nnx.Variable(jnp.zeros(())), x)
    assert float(v[...]) == 64.0


def test_nnx_remat_writing_params_back_unchanged_is_not_an_update():
    # nnx.remat writes every Variable of its module back: the Params the
    # step was given hold new tracers of the same values, which loses
    # nothing, so the step runs as under jax.jit; a Param really changed
    # inside the remat is still refused
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(4, 4, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.drop(self.lin(x))

    graphdef, params, rest = nnx.split(Net(nnx.Rngs(0, dropout=1)), nnx.Param, ...)

    def step(params, rest, x):
        m = nnx.merge(graphdef, params, rest)
        y = nnx.remat(lambda m, x: m(x))(m, x)
        return y.sum(), nnx.state(m, nnx.Not(nnx.Param))

    def bump(m, x):
        m.lin.bias[...] = m.lin.bias[...] + 1.0
        return m(x)

    def bumping(params, rest, x):
        m = nnx.merge(graphdef, params, rest)
        return nnx.remat(bump)(m, x).sum()

    x = jnp.ones((2, 4))
    (loss, _), (want, _) = jb.jit(step)(params, rest, x), jax.jit(step)(params, rest, x)
    np.testing.assert_array_equal(loss, want)
    with pytest.raises(TypeError, match=r"bumping updated Flax NNX state at "
                                        r"args\[0\]\['lin'\]\['bias'\]"):
        jb.jit(bumping)(params, rest, x)


def test_nnx_module_read_only_works_like_jax_jit():
    nnx, model, _, x, _ = _nnx_setup()
    out = jb.jit(lambda m, x: m(x))(model, x)
    np.testing.assert_array_equal(out, jax.jit(lambda m, x: m(x))(model, x))
