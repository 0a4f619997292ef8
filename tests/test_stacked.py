"""`jb.stack_layers`: per-layer state kept stacked while the for-loop stays
as written. The container round-trips, iterates and differentiates like the
list it replaces; `reroll` feeds the stack itself to its scans and returns
the stacked gradient without splitting it; the sharding search never shards
the layer axis; the library GPT's AdamW step over stacked params equals the
per-layer step; a plain Flax NNX model takes them through
`nnx.merge(graphdef, jb.unstack_layers(params))`."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxbackend as jb
from jaxbackend import _jax, _stacked, testing

L = 6   # > passes.REROLL_MIN_REPEATS: the loops below are rolled


def _weights(n=L, d=8):
    ks = jax.random.split(jax.random.key(0), 2 * n)
    return [{"w": jax.random.normal(ks[2 * i], (d, d)) / 3,
             "b": jax.random.normal(ks[2 * i + 1], (d,)) / 3} for i in range(n)]


def _loss(ws, x):
    for w in ws:
        x = x + jnp.tanh(x @ w["w"] + w["b"])
    return jnp.sum(x ** 2)


def _x():
    return jax.random.normal(jax.random.key(1), (4, 8))


def _same(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for p, q in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(p), np.asarray(q))


@pytest.mark.parametrize("kind", ["list", "tuple", "dict"])
def test_stack_layers_round_trips_each_container(kind):
    ws = _weights()
    tree = {"list": ws, "tuple": tuple(ws), "dict": dict(enumerate(ws))}[kind]
    s = jb.stack_layers({"blocks": tree, "head": jnp.ones(3)})
    assert isinstance(s["blocks"], jb.Stacked) and len(s["blocks"]) == L
    assert [a.shape for a in jax.tree.leaves(s["blocks"])] == [(L, 8), (L, 8, 8)]
    _same(jb.unstack_layers(s), {"blocks": tree, "head": jnp.ones(3)})


def test_stacked_indexes_slices_and_iterates_like_the_list():
    ws = _weights()
    s = jb.stack_layers(ws)
    _same(s[2], ws[2])
    _same(s[-1], ws[-1])
    _same(list(s[1:3]), ws[1:3])
    _same(list(s), ws)
    with pytest.raises(IndexError, match="layer 6 of 6"):
        s[L]
    # a pytree: the leaves are the stacked arrays, and map keeps the container
    doubled = jax.tree.map(lambda a: 2 * a, s)
    assert isinstance(doubled, jb.Stacked)
    _same(list(doubled), [jax.tree.map(lambda a: 2 * a, w) for w in ws])


def test_layers_that_differ_are_kept_and_a_tree_without_layers_is_an_error():
    ws = _weights()
    ws[3] = {"w": jnp.zeros((8, 4)), "b": jnp.zeros((8,))}      # another width
    with pytest.raises(ValueError, match=r"at \['blocks'\], layer 3 differs from layer 0 "
                                         r"\(leaf 1: shape \(8, 4\) float32, not \(8, 8\)"):
        jb.stack_layers({"blocks": ws})
    mixed = jb.stack_layers({"blocks": ws, "more": _weights(3)})
    assert isinstance(mixed["more"], jb.Stacked)
    _same(mixed["blocks"], ws)
    # layers named by number (Flax linen's h0, h1, ...): looked up by name, so
    # the error says why they stay and what keeps them stacked
    linen = {"params": {"wte": jnp.zeros(3), **{f"h{i}": w for i, w in enumerate(_weights(3))}}}
    with pytest.raises(ValueError, match=r"the layers 'h0'..'h2' are dict entries named by "
                                         r"number .*nn.scan"):
        jb.stack_layers(linen)


def test_the_gradient_through_a_stacked_loop_is_the_stacked_gradient():
    ws, x = _weights(), _x()
    want = jax.grad(_loss)(ws, x)
    got = jax.jit(jax.grad(_loss))(jb.stack_layers(ws), x)
    assert isinstance(got, jb.Stacked)
    testing.assert_close(got, jb.stack_layers(want), scale=lambda: testing.abs_scale(
        lambda w: jb.stack_layers(jax.grad(_loss)(w, x)), ws), what="stacked gradient")


def _eqns(closed):
    out, todo = [], [closed.jaxpr]
    while todo:
        j = todo.pop()
        out += j.eqns
        for e in j.eqns:
            todo += [_jax.open_jaxpr(s) for s in _jax.sub_jaxprs(e)]
    return out


@pytest.mark.parametrize("argnums", [(0, 1), 0], ids=["x too", "weights only"])
def test_rolled_stacked_loop_reads_the_stack_and_returns_its_gradient_stacked(argnums):
    # "x too": every layer's backward is alike, the weight gradient is the
    # backward scan's stacked output itself. "weights only": layer 0's
    # backward (no gradient for x) stays outside the run, so the gradient is
    # that layer's and one slice of the stack, joined.
    ws, x = _weights(), _x()
    vg = jax.value_and_grad(_loss, argnums=argnums)
    f = jb.jit(vg)
    s = jb.stack_layers(ws)
    got = f(s, x)
    report = str(f.last_report)
    assert "reroll.runs: 2" in report
    eqns = _eqns(jax.make_jaxpr(f)(s, x).eqns[0].params["jaxpr"])
    # no copy into a stack: no concatenate of per-layer weights, and the
    # stack's entries are not split out (nor are gradients indexed out)
    assert not [e for e in eqns if e.primitive.name == "concatenate" and len(e.invars) > 2]
    assert not [e for e in eqns if e.primitive.name == "custom_vjp_call"]
    assert "reroll.stacked_copies: 0" in report and "jb.stack_layers" not in report
    # the gradient, joined from the stack (and layer 0's) and split again
    # into layers, is built as a stack of layers: no reshape merges a layer
    # axis into rows (to the sharding model, rows whose minor dim must be
    # unsharded)
    assert not [e for e in eqns if e.primitive.name == "reshape"
                and e.invars[0].aval.shape[:1] in ((L,), (L - 1,))
                and len(e.outvars[0].aval.shape) < len(e.invars[0].aval.shape)]
    restack = (lambda out: (out[0], jb.stack_layers(out[1])) if argnums == 0 else  # noqa: E731
               (out[0], (jb.stack_layers(out[1][0]), out[1][1])))
    testing.assert_close(got, restack(vg(ws, x)),
                         scale=lambda: restack(testing.abs_scale(vg, ws, x)),
                         what="rolled stacked value_and_grad")


def test_the_report_of_a_rolled_per_layer_list_points_to_stack_layers():
    # per-layer weights are copied into stacks at every call: the report says
    # so and names the fix (the stacked form's report does not: above)
    f = jb.jit(jax.value_and_grad(_loss))
    f(_weights(), _x())
    report = str(f.last_report)
    assert "reroll.stacked_copies: 2" in report, report      # w and b
    assert "note: reroll copied 2 per-layer lists" in report and "jb.stack_layers" in report


def test_a_stacked_loop_shorter_than_the_reroll_minimum_is_rolled():
    # rolling stacked layers copies nothing, so it pays from 2 layers
    from jaxbackend import passes

    n = passes.REROLL_MIN_REPEATS - 2
    ws, x = _weights(n), _x()
    vg = jax.value_and_grad(_loss, argnums=(0, 1))
    f = jb.jit(vg)
    got = f(jb.stack_layers(ws), x)
    assert "reroll.runs: 2" in str(f.last_report)
    f_list = jb.jit(vg)
    f_list(ws, x)
    assert "reroll.runs: 0" in str(f_list.last_report)     # the list: not rolled
    want = vg(ws, x)
    testing.assert_close(got, (want[0], (jb.stack_layers(want[1][0]), want[1][1])),
                         scale=lambda: testing.abs_scale(vg, jb.stack_layers(ws), x),
                         what="short stacked loop")


def _reversed_split(a):
    return tuple(a[a.shape[0] - 1 - i] for i in range(a.shape[0]))


rev = jax.custom_vjp(_reversed_split)
rev.defvjp(lambda a: (rev(a), None), lambda _, cts: (jnp.stack(cts[::-1]),))


def test_only_a_body_of_in_order_unit_slices_counts_as_the_layers():
    a = jnp.arange(24.0).reshape(L, 4)
    ok = jax.make_jaxpr(_stacked.split_layers)(a).eqns[0]
    bad = jax.make_jaxpr(rev)(a).eqns[0]
    assert _stacked.splits_entries(ok)
    assert not _stacked.splits_entries(bad)

    def loss(stack, x):     # the layers in reverse: reroll must not read them in order
        for w in rev(stack):
            x = jnp.tanh(x * w)
        return jnp.sum(x)

    f = jax.value_and_grad(loss, argnums=(0, 1))
    x = jnp.linspace(-1, 1, 4)
    testing.assert_close(jb.jit(f)(a / 24, x), f(a / 24, x),
                         scale=lambda: testing.abs_scale(f, a / 24, x), what="reversed layers")


doubled = jax.custom_vjp(_stacked._slices)    # the same slices, another gradient rule
doubled.defvjp(lambda a: (doubled(a), None), lambda _, cts: (2 * jnp.stack(cts),))


def test_a_split_with_another_gradient_rule_keeps_its_rule_through_jb_jit():
    a = jax.random.normal(jax.random.key(2), (L, 4)) / 2
    assert not _stacked.splits_entries(jax.make_jaxpr(doubled)(a).eqns[0])

    def loss(stack, x):
        for w in doubled(stack):
            x = x + jnp.tanh(x * w) * jnp.cos(w) - 0.1 * jnp.sin(x)
        return jnp.sum(x)

    x = jnp.linspace(-1, 1, 4)
    f = jb.jit(loss)
    f(a, x)
    assert "reroll.runs: 1" in str(f.last_report)        # rolled, reading a copied stack
    g = jax.grad(loss)
    testing.assert_close(jax.grad(f)(a, x), g(a, x), scale=lambda: testing.abs_scale(g, a, x),
                         what="gradient through the rolled program")


GPT_LAYERS = 3


@functools.cache
def _gpt():
    """The library GPT's AdamW step (returning its gradients too), per-layer
    and stacked params, the per-layer result under jax.jit and its
    abs_scale (computed once: it compiles the step's error model)."""
    import optax
    from flax import nnx

    from jaxbackend import nn
    from jaxbackend.models import GPT, GPTConfig

    # 3 layers: stacked layers roll from 2 (`reroll`), under the per-layer minimum
    model = GPT(GPTConfig(vocab_size=32, seq_len=8, n_layers=GPT_LAYERS, embd=16, heads=2),
                rngs=nnx.Rngs(0))
    params, loss_fn = nn.functional(model, "loss")
    stacked, _ = nn.functional(model, "loss", stacked=True)
    tx = optax.adamw(1e-2)

    def step(params, opt_state, x, y):     # loss_fn takes either form of params
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, grads

    x = jax.random.randint(jax.random.key(1), (8, 8), 0, 32)
    args = (params, tx.init(params), x, jnp.roll(x, -1, axis=1))
    stacked_args = (stacked, tx.init(stacked), *args[2:])
    # AdamW divides by sqrt(nu): the moments' and updates' rounding is the
    # gradient's, carried by |derivative| in the error model (taken over the
    # rolled program, whose error model compiles as a loop: the same terms)
    scale = testing.abs_scale(jb.jit(step), *stacked_args)
    return step, stacked_args, jb.stack_layers(jax.jit(step)(*args)), scale


def test_gpt_adamw_step_over_stacked_params_equals_the_per_layer_step():
    step, args, want, scale = _gpt()
    assert isinstance(args[0]["blocks"], jb.Stacked)
    assert len(args[0]["blocks"]) == GPT_LAYERS
    f = jb.jit(step)
    got = f(*args)
    assert "reroll.runs: 2" in str(f.last_report)
    testing.assert_close(got, want, scale=scale, what="stacked GPT AdamW step")


@pytest.mark.parametrize("traced_once", [False, True],
                         ids=["blocks called as they are", "blocks called through jb.layer"])
def test_a_plain_nnx_model_merges_the_unstacked_layers_and_reads_the_stacks(traced_once):
    """A plain Flax NNX model (no dim names, `nnx.MultiHeadAttention`) over
    `jb.stack_layers` of its `nnx.State`: the loss gives `nnx.merge`
    `jb.unstack_layers(params)`, the per-layer State again, and the rolled
    program reads the stacks themselves (no copies into stacks). Loss and
    gradients equal the per-layer program's under jax.jit. With its blocks
    called through one `jb.layer`, JAX traces a block once: the program
    the passes get holds one layer's equations, not L layers'."""
    import optax
    from flax import nnx

    from benchmarks._other_models import NNXGPT

    gd, state = nnx.split(NNXGPT(L, 16, 2, 32, nnx.Rngs(0), traced_once=traced_once),
                          nnx.Param)

    def loss(params, x, y):
        logits = nnx.merge(gd, params)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def loss_stacked(params, x, y):
        return loss(jb.unstack_layers(params), x, y)

    x = jax.random.randint(jax.random.key(1), (4, 8), 0, 32)
    y = jnp.roll(x, -1, axis=1)
    stacked = jb.stack_layers(state)
    assert isinstance(stacked["blocks"], jb.Stacked) and len(stacked["blocks"]) == L
    f = jb.jit(jax.value_and_grad(loss_stacked))
    got = f(stacked, x, y)
    report = str(f.last_report)
    assert "reroll.runs: 2" in report and "reroll.stacked_copies: 0" in report, report
    # traced once: every layer is one call of one jaxpr (the block's 16
    # weights, x and the mask in); else no call takes a block's inputs
    fwd = jax.make_jaxpr(loss_stacked)(stacked, x, y).jaxpr
    calls = [e for e in fwd.eqns
             if e.primitive.name in _jax.CALL_PRIMITIVES and len(e.invars) >= 18]
    bodies = {id(_jax.call_body(e)) for e in calls}
    assert (len(calls), len(bodies)) == ((L, 1) if traced_once else (0, 0)), (len(calls), bodies)
    vg = jax.value_and_grad(loss)
    restack = lambda out: (out[0], jb.stack_layers(out[1]))   # noqa: E731
    testing.assert_close(got, restack(jax.jit(vg)(state, x, y)),
                         scale=lambda: restack(testing.abs_scale(vg, state, x, y)),
                         what="plain NNX loss and gradients over stacked params")


def test_gpt_over_stacked_params_under_a_mesh_never_shards_the_layer_axis():
    from jaxbackend import sharding

    step, args, want, scale = _gpt()
    mesh = sharding.auto_mesh((2, 4), ("data", "model"))
    f = jb.jit(step, mesh=mesh)
    got = f(*args)
    n = GPT_LAYERS
    layer_axes = [spec[0] if len(spec) else None for spec, leaf in
                  zip(f.plan.in_specs(), jax.tree.leaves(args)) if leaf.ndim and leaf.shape[0] == n]
    assert len(layer_axes) >= 2 * 16 and all(a is None for a in layer_axes), layer_axes
    testing.assert_close(got, want, scale=scale, what="sharded stacked GPT step")


def test_stacked_named_layers_keep_their_dim_names_under_a_mesh():
    """Layers of NamedArrays stack into NamedArrays whose values have the
    layer axis in front of the named ones: the plan must name the trailing
    axes (it once named the leading ones, so `hidden` was no dim of the
    program and `embd` had size 1)."""
    from jaxbackend import named as nx
    from jaxbackend import sharding

    ks = jax.random.split(jax.random.key(0), 9)
    def w(k, shape, dims):
        return nx.as_named(jax.random.normal(k, shape) / shape[0] ** 0.5, dims)

    layers = [{"w1": w(ks[2 * i], (16, 32), ("embd", "hidden")),
               "w2": w(ks[2 * i + 1], (32, 16), ("hidden", "embd"))} for i in range(4)]
    x = nx.as_named(jax.random.normal(ks[-1], (8, 16)), ("batch", "embd"))

    def loss(layers, x):
        for w in layers:
            x = x + nx.dot(nx.relu(nx.dot(x, w["w1"], dim="embd")), w["w2"], dim="hidden")
        return x.values.sum()

    vg = jax.value_and_grad(loss)
    mesh = sharding.auto_mesh((2, 4), ("data", "model"))
    stacked = jb.stack_layers(layers)
    f = jb.jit(vg, mesh=mesh, rules={"batch": "data", "hidden": "model"})
    got = f(stacked, x)
    assert f.plan.rules["hidden"] == "model"
    w1 = [spec for spec, leaf in zip(f.plan.in_specs(), jax.tree.leaves((stacked, x)))
          if leaf.shape == (4, 16, 32)]
    assert w1 == [jax.sharding.PartitionSpec(None, None, "model")], w1
    want = vg(stacked, x)
    testing.assert_close(got, want, scale=lambda: testing.abs_scale(vg, stacked, x),
                         what="named stacked layers")


def test_stacked_params_round_trip_through_a_checkpoint(tmp_path):
    from jaxbackend import train

    state = {"blocks": jb.stack_layers(_weights(3)), "head": jnp.ones(3)}
    train.save_checkpoint(tmp_path, state, {"step": 1})
    restored, _ = train.load_checkpoint(tmp_path, state)
    assert isinstance(restored["blocks"], jb.Stacked) and len(restored["blocks"]) == 3
    _same(restored, state)
