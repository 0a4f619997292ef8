"""jb.jit(mesh=) on the arguments users give it: static values of other
types, a batch split into micro-batches inside the step, Flax variables
with logical axis names (and stacked by jb.stack_layers), linen params
boxed with logical axis names (and scanned by linen), a Flax state's
dims named by the path a user indexes, rules naming a dim by any input
axis holding it, rules for dims the program lacks (and misspelt ones),
and one naming a scan's axis."""

import re

import jax
import jax.numpy as jnp
import pytest

import jaxbackend as jb
from jaxbackend import sharding, testing


@pytest.fixture(scope="module")
def mesh():
    return sharding.auto_mesh((2, 4), ("data", "model"))


@pytest.mark.parametrize("how", ["argnums", "argnames"])
def test_equal_static_values_of_other_types_are_planned_apart(mesh, how):
    # 1 == True == 1.0 (and they hash alike), but they trace different
    # programs; JAX's cache keys on the type too, and so must the plans'
    def fn(x, n):
        return x * 2, jnp.asarray(n)

    x = jnp.ones((8, 4))
    f = jb.jit(fn, mesh=mesh, **{"static_" + how: (1,) if how == "argnums" else "n"})
    call = (lambda n: f(x, n)) if how == "argnums" else (lambda n: f(x, n=n))
    for n in (1, True, 1.0, 1):
        assert call(n)[1].dtype == jnp.asarray(n).dtype, n
    assert f.trace_count == 3


def test_the_micro_batch_dim_of_gradient_accumulation_is_searched(mesh):
    """A step that splits its batch (16, ...) into 2 micro-batches of 8 and
    scans over them: the per-micro-batch dim is no input's whole dim (the
    input's axis 0 is micro * batch), but a factor of one; the search must
    consider it (it once could not, and sharded the MLP alone: 9 MiB moved on
    a LLaMA step against data parallel's 5), and list what it chose."""
    import optax

    from jaxbackend.sharding import _hlo

    micro, batch, width = 2, 16, 64
    keys = jax.random.split(jax.random.key(0), 4)
    params = [{"w1": jax.random.normal(k, (width, 4 * width)) / 8,
               "w2": jax.random.normal(k, (4 * width, width)) / 16} for k in keys]
    tx = optax.adamw(1e-3)

    def loss(p, x, y):
        for layer in p:
            x = x + jax.nn.gelu(x @ layer["w1"]) @ layer["w2"]
        return jnp.mean((x - y) ** 2)

    def step(p, o, x, y):
        xs, ys = (a.reshape(micro, batch // micro, *a.shape[1:]) for a in (x, y))

        def one(acc, xy):
            l, g = jax.value_and_grad(loss)(p, *xy)
            return (acc[0] + l, jax.tree.map(jnp.add, acc[1], g)), None

        (l, g), _ = jax.lax.scan(one, (0.0, jax.tree.map(jnp.zeros_like, p)), (xs, ys))
        u, o = tx.update(jax.tree.map(lambda a: a / micro, g), o, p)
        return optax.apply_updates(p, u), o, l / micro

    x = jax.random.normal(jax.random.key(1), (batch, 32, width))
    args = (params, tx.init(params), x, jnp.tanh(x))
    f = jb.jit(step, mesh=mesh)
    text = f.lower(*args).compile().as_text()
    split = [d for d in f.plan.rules if d.startswith("reshape@")]
    assert split and f.plan.rules[split[0]] is not None, f.plan.rules
    dp = jb.jit(step, mesh=mesh, rules={split[0]: ("data", "model")})
    dp_text = dp.lower(*args).compile().as_text()
    assert dp.plan.rules[split[0]] == ("data", "model")
    moved = {n: sum(v["bytes"] for v in _hlo.collectives(t).values())
             for n, t in (("searched", text), ("dp", dp_text))}
    assert moved["searched"] <= moved["dp"], (moved, f.plan.rules)
    testing.assert_close(f(*args), jax.jit(step)(*args),
                         scale=lambda: testing.abs_scale(step, *args), what="accumulating step")
    # a rule naming the input's merged axis says which dims to name instead
    with pytest.raises(ValueError, match=r"'args\[2\]:0' is split by a reshape in the program "
                                         r"into the dims \['reshape@.*:0', 'reshape@.*:1'\]"):
        jb.jit(step, mesh=mesh, rules={"args[2]:0": "data"}).lower(*args)


def test_flax_logical_axis_names_are_the_plans_dim_names(mesh):
    """Params annotated with `nnx.with_partitioning` and split by `nnx.split`
    (their values inside `nnx.Variable`s): the plan calls their axes by the
    logical names, so `rules=` takes the names `nn.partition_specs` takes
    (it once refused them, naming the dims after argument paths)."""
    import optax
    from flax import nnx

    from jaxbackend import nn

    up = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))
    down = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("mlp", "embed"))

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(16, 64, kernel_init=up, use_bias=False, rngs=rngs)
            self.down = nnx.Linear(64, 16, kernel_init=down, use_bias=False, rngs=rngs)

        def __call__(self, x):
            return ((x + self.down(jax.nn.gelu(self.up(x)))) ** 2).mean()

    with nnx.use_eager_sharding(False):     # names only: jb.jit places the params
        model = MLP(nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    tx = optax.sgd(0.1)

    def step(params, opt_state, x):
        loss, g = jax.value_and_grad(lambda p: nnx.merge(graphdef, p, copy=True)(x))(params)
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    args = (params, tx.init(params), jax.random.normal(jax.random.key(1), (8, 16)))
    searched = jb.jit(step, mesh=mesh)
    searched.lower(*args)
    assert {"embed", "mlp"} <= set(searched.plan.rules), searched.plan.rules
    rules = {"mlp": "model", "args[2]:0": "data"}
    f = jb.jit(step, mesh=mesh, rules=rules)
    got = f(*args)
    kernel = got[0]["up"]["kernel"]
    assert kernel.sharding.spec == nn.partition_specs(model, {"mlp": "model"})["up"]["kernel"]
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "model")
    testing.assert_close(got, jax.jit(step)(*args),
                         scale=lambda: testing.abs_scale(step, *args), what="annotated step")
    # stacked (`jb.stack_layers`), a variable's names are its trailing axes'
    from jaxbackend.sharding import _plan

    with nnx.use_eager_sharding(False):
        layers = [nnx.split(MLP(nnx.Rngs(i)), nnx.Param)[1] for i in range(3)]
    assert set(_plan.dims_of(jb.stack_layers(layers))) == {(None, "embed", "mlp"),
                                                           (None, "mlp", "embed")}


def test_linen_logical_axis_names_are_the_plans_dim_names(mesh):
    """Flax linen params boxed by `nn.with_logical_partitioning`
    (`flax.core.meta.Partitioned` leaves, passed to `apply` and optax as they
    are): the plan calls their axes by the logical names, MaxText's style,
    and their paths carry no `.value` (`nn.partition_specs` reads the same
    names); linen's `nn.scan` names its layer axis (`PARTITION_NAME`),
    which stays unsharded under the search."""
    import flax.linen as linen
    import optax

    from jaxbackend import nn

    init = linen.initializers.lecun_normal()

    class Block(linen.Module):
        @linen.compact
        def __call__(self, x, _=None):
            h = linen.Dense(64, kernel_init=linen.with_logical_partitioning(init, ("embed", "mlp")),
                            use_bias=False)(x)
            return x + linen.Dense(16, kernel_init=linen.with_logical_partitioning(
                init, ("mlp", "embed")), use_bias=False)(jax.nn.gelu(h)), None

    class LM(linen.Module):
        scan: bool

        @linen.compact
        def __call__(self, x):
            if self.scan:
                return linen.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                                  length=2, metadata_params={linen.PARTITION_NAME: "layers"})()(
                                      x, None)[0]
            return Block()(Block()(x)[0])[0]

    x = jax.random.normal(jax.random.key(1), (8, 16))
    tx = optax.sgd(0.1)
    for scan in (False, True):
        lm = LM(scan)
        params = lm.init(jax.random.key(0), x)

        def step(params, opt_state, x):
            loss, g = jax.value_and_grad(lambda p: (lm.apply(p, x) ** 2).mean())(params)
            updates, opt_state = tx.update(g, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        args = (params, tx.init(params), x)
        searched = jb.jit(step, mesh=mesh)
        searched.lower(*args)
        assert {"embed", "mlp"} <= set(searched.plan.rules), searched.plan.rules
        assert not [n for n in searched.plan.model.g.key_names if ".value" in n]
        if scan:
            assert searched.plan.rules.get("layers") is None, searched.plan.rules
        f = jb.jit(step, mesh=mesh, rules={"mlp": "model", "args[2]:0": "data"})
        got = f(*args)
        block = "ScanBlock_0" if scan else "Block_0"
        kernel = got[0]["params"][block]["Dense_0"]["kernel"]
        assert kernel.value.sharding.spec == jax.sharding.PartitionSpec(*[None] * scan, None,
                                                                        "model")
        # the spec nn.partition_specs gives the same box
        specs = nn.partition_specs(params, {"mlp": "model"})
        assert kernel.value.sharding.spec == specs["params"][block]["Dense_0"]["kernel"]
        testing.assert_close(got, jax.jit(step)(*args), what=f"linen step, scan={scan}",
                             scale=lambda: testing.abs_scale(step, *args))


def test_a_rule_may_name_a_dim_by_any_input_axis_that_holds_it(mesh):
    # w1's columns, b1 and w2's rows are one dim (the program ties them),
    # named after the first of them: a rule naming another is that dim
    p = {"w1": jnp.ones((32, 64)) / 32, "b1": jnp.zeros((64,)), "w2": jnp.ones((64, 32)) / 64}
    x = jax.random.normal(jax.random.key(0), (16, 32))

    def loss(p, x):
        return jnp.mean(jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"])

    planned = {}
    for spelling in ("args[0]['b1']:0", "args[0]['w1']:1", "args[0]['w2']:0"):
        f = jb.jit(loss, mesh=mesh, rules={spelling: "model", "args[1]:0": "data"})
        testing.assert_close(f(p, x), loss(p, x), scale=lambda: testing.abs_scale(loss, p, x))
        planned[spelling] = {k: v for k, v in f.plan.rules.items() if v}
    assert all(r == {"args[0]['b1']:0": "model", "args[1]:0": "data"} for r in planned.values())
    with pytest.raises(ValueError, match=r"\"args\[0\]\['w2'\]:0\" and \"args\[0\]\['w1'\]:1\" "
                                         r"are one dim of the plan "
                                         r"\(called \"args\[0\]\['b1'\]:0\"\)"):
        jb.jit(loss, mesh=mesh, rules={"args[0]['w1']:1": "model",
                                       "args[0]['w2']:0": "data"}).lower(p, x)


def test_a_flax_state_dim_is_named_by_its_path_as_a_user_indexes_it(mesh):
    # an nnx.split state's leaves sit under each variable's `.value`; the
    # name is the path a user indexes (`params['kernel']`), and a rule
    # spelled so shards that dim
    from flax import nnx

    model = nnx.Linear(16, 32, rngs=nnx.Rngs(0))
    gd, params = nnx.split(model)
    x = jax.random.normal(jax.random.key(1), (8, 16))

    def loss(params, x):
        return jnp.mean(jnp.tanh(nnx.merge(gd, params)(x)))

    f = jb.jit(loss, mesh=mesh, rules={"args[0]['kernel']:1": "model", "args[1]:0": "data"})
    testing.assert_close(f(params, x), loss(params, x),
                         scale=lambda: testing.abs_scale(loss, params, x))
    names = set(f.plan.model.g.key_names)
    # the kernel's columns are the bias's dim, named after the first input
    # holding it (the state lists 'bias' first)
    assert {"args[0]['bias']:0", "args[0]['kernel']:0"} <= names, names
    assert not [n for n in names if ".value" in n], names
    assert f.plan.rules["args[0]['bias']:0"] == "model"
    assert f.plan.in_specs()[:2] == [jax.sharding.PartitionSpec("model"),
                                     jax.sharding.PartitionSpec(None, "model")]


def test_rules_for_dims_a_program_lacks_are_unused_and_misspellings_are_errors(mesh):
    # a hand rule set written for a family of models (Megatron's: head, mlp,
    # vocab on `model`) given to a model without a vocab or heads, as Flax's
    # logical axis rules allow; a name close to a dim of the program is a typo
    from jaxbackend import named as nx

    w = nx.as_named(jnp.ones((16, 32)) / 16, ("embd", "mlp"))
    x = nx.as_named(jax.random.normal(jax.random.key(0), (8, 16)), ("batch", "embd"))

    def loss(w, x):
        return jnp.mean(jnp.tanh(nx.dot(x, w, dim="embd").values))

    rules = {"batch": "data", "head": "model", "mlp": "model", "vocab": "model",
             "args[5]:0": "data"}
    f = jb.jit(loss, mesh=mesh, rules=rules)
    with pytest.warns(UserWarning, match=r"rules for \['args\[5\]:0', 'head', 'vocab'\]: this "
                                         r"program has no such dims, so those rules are unused"):
        got = f(w, x)
    testing.assert_close(got, loss(w, x), scale=lambda: testing.abs_scale(loss, w, x))
    assert {k: v for k, v in f.plan.rules.items() if v} == {"batch": "data", "mlp": "model"}
    assert f.plan.unused_rules == ["args[5]:0", "head", "vocab"]
    assert "unused rules (no such dim in this program): args[5]:0, head, vocab" in f.plan.table()
    assert "unused (no such dim in this program)" in f.plan._repr_html_()
    with pytest.raises(ValueError, match=r"'bacth' names no dim of this program; did you mean "
                                         r"'batch'\?"):
        jb.jit(loss, mesh=mesh, rules={"bacth": "data"}).lower(w, x)
    # so is an input path nearly one of the program's (args[5]:0 above names
    # an argument the program lacks: unused)
    for typo, meant in (("arg[1]:0", "args[1]:0"), ("args[1]]:0", "args[1]:0")):
        with pytest.raises(ValueError, match=rf"'{re.escape(typo)}' names no dim of this "
                                             rf"program; did you mean '{re.escape(meant)}'\?"):
            jb.jit(lambda w, x: loss(w, nx.as_named(x, ("batch", "embd"))), mesh=mesh,
                   rules={typo: "data"}).lower(w, x.values)
    # a list of pairs in Flax's (MaxText's) style: a dim's first rule is its
    # own, the later ones are fallbacks
    f = jb.jit(loss, mesh=mesh, rules=[("batch", "data"), ("mlp", "model"), ("mlp", "data")])
    f.lower(w, x)
    assert {k: v for k, v in f.plan.rules.items() if v} == {"batch": "data", "mlp": "model"}


def test_a_rule_sharding_the_axis_a_scan_runs_over_says_so(mesh):
    def f(w, xs):     # time-major: the scan runs over xs's leading axis
        return jax.lax.scan(lambda h, x: (jnp.tanh(h @ w + x), None), jnp.zeros((8, 16)), xs)[0]

    args = (jnp.ones((16, 16)) / 16, jnp.ones((32, 8, 16)))
    with pytest.raises(ValueError, match=r"dim 'args\[1\]:0' \(size 32\) is the axis a loop runs "
                                         r"over.*map 'args\[1\]:0' to None"):
        jb.jit(f, mesh=mesh, rules={"args[1]:0": "model"}).lower(*args)


def test_the_micro_batch_dim_is_no_other_dim_of_its_size(mesh):
    """Gradient accumulation over a patch embedding whose grid side (8) is the
    micro-batch's size (16 split into 2 x 8): the per-micro-batch dim, a
    factor of the input's axis 0, was tied with the grid side (unnamed dims
    of one size that no input holds were one key), so sharding the batch
    sharded the patches too: the model charged 5 MB of gathers to data
    parallel, and the search picked a plan moving 2.5x its bytes."""
    from jaxbackend.sharding import _hlo

    def loss(w, x):
        h = jax.lax.conv_general_dilated(x, w, (4, 4), "VALID",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
        h = h.reshape(h.shape[0], -1, h.shape[-1])            # (batch, 8 * 8 patches, 32)
        return jnp.mean(jnp.tanh(jnp.swapaxes(h, 1, 2) @ jnp.ones((64, 64)) / 64))

    def step(w, x):
        def one(acc, xb):
            return acc + jax.grad(loss)(w, xb), None
        return jax.lax.scan(one, jnp.zeros_like(w), x.reshape(2, 8, *x.shape[1:]))[0] / 2

    args = (jax.random.normal(jax.random.key(0), (4, 4, 3, 32)) / 7,
            jax.random.normal(jax.random.key(1), (16, 32, 32, 3)))
    f = jb.jit(step, mesh=mesh)
    f.lower(*args)
    split = f.plan.model.g.path_factors["args[1]:0"][-1]   # the per-micro-batch dim
    dp = jb.jit(step, mesh=mesh, rules={split: ("data", "model")})
    text = dp.lower(*args).compile().as_text()
    assert dp.plan.cost.all_gather.bytes == 0
    assert _hlo.collectives(text)["all-gather"]["bytes"] == 0
    testing.assert_close(dp(*args), jax.jit(step)(*args),
                         scale=lambda: testing.abs_scale(step, *args), what="accumulated gradient")
