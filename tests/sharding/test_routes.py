"""The compiled step runs each gather and scatter the way the cost model
costs it (`CostModel.route`, pinned by `Plan.contraction_specs`): an operand
the model gathers is gathered; and a batching dim (a take along one dim and
its gradient) is one dim with its operand's, never a gather."""

import jax
from flax import nnx

import jaxbackend as jb
from jaxbackend import named as nx
from jaxbackend import nn, sharding, testing

REMAT = "Involuntary full rematerialization"


class _Conditioned(nnx.Module):
    """A class embedding read by a projection (an adaLN conditioning)."""

    def __init__(self, rngs):
        self.cls = nn.Embedding(10, 128, vocab_dim="cls", rngs=rngs)
        self.ada = nn.Linear({"cemb": 128}, {"mod": 4, "embd": 64}, rngs=rngs)

    def loss(self, labels):
        c = self.cls(nx.as_named(labels, ("batch",))).rename(embd="cemb")
        h = self.ada(nx.silu(c))
        return (h * h).values.mean()


def test_an_embedding_gradient_gathers_its_updates_as_costed(mesh24, capfd):
    # cemb on data, batch on (data, model): the model gathers the gradient's
    # (batch, cemb) updates and adds them into the table's cemb slice. Left
    # to itself, XLA reshards the updates to cemb on data, which it can only
    # do by replicating them (the warning), with all-to-alls and permutes.
    params, loss = nn.functional(_Conditioned(nnx.Rngs(0)), "loss")
    labels = jax.random.randint(jax.random.key(1), (16,), 0, 10)
    grad = jax.grad(loss)
    f = jb.jit(grad, mesh=mesh24, rules={"batch": ("data", "model"), "cemb": "data"})
    got = f(params, labels)
    pinned = [e.primitive.name for e, (ins, _) in f.plan.contraction_specs().items()
              if any(s is not None for s in ins)]
    assert sorted(pinned) == ["gather", "scatter-add"], pinned   # the lookup's table too
    colls = sharding.hlo_collectives(f.lower(params, labels).compile().as_text())
    assert REMAT not in capfd.readouterr().err
    assert colls["all-to-all"]["count"] == 0 and colls["collective-permute"]["count"] == 0, colls
    testing.assert_close(got, grad(params, labels), scale=lambda: testing.abs_scale(grad, params, labels),
                         what="gradient under the pinned routes")


def test_take_along_axis_and_its_gradient_keep_the_batch_dim():
    # a take along one dim gathers with batching dims (the others), and its
    # gradient scatters with them: each batch row reads and writes its own row, so
    # data parallelism moves no activations (the model used to charge an
    # all-gather of the indices and updates, and pinning that route would
    # have made XLA emit it)
    def loss(logits, y):    # the language-model loss: a take along vocab
        return nx.cross_entropy(nx.as_named(logits, ("batch", "time", "vocab")),
                                nx.as_named(y, ("batch", "time")), dim="vocab").values.mean()

    logits = jax.random.normal(jax.random.key(0), (16, 8, 32))
    y = jax.random.randint(jax.random.key(1), (16, 8), 0, 32)
    grad = jax.grad(loss)
    f = jb.jit(grad, mesh=sharding.auto_mesh((8,), ("data",)), rules={"args[0]:0": "data"})
    got = f(logits, y)
    # the targets' batch is the logits' (one dim through the batching dims)
    assert f.plan.in_specs()[1][0] == "data", f.plan.in_specs()
    assert f.plan.cost.all_gather.bytes == 0, f.plan.cost
    assert not [ins for ins, _ in f.plan.contraction_specs().values()
                if any(s is not None for s in ins)]
    colls = sharding.hlo_collectives(f.lower(logits, y).compile().as_text())
    assert sum(c["bytes"] for c in colls.values()) == 0, colls
    testing.assert_close(got, grad(logits, y), scale=lambda: testing.abs_scale(grad, logits, y),
                         what="take_along_axis gradient")


def test_gathered_updates_sliced_from_a_pinned_contraction_are_not_rematerialised(mesh24, capfd):
    """A recommender's embeddings, concatenated into a projection: the
    backward pass slices each table's updates out of the projection's
    gradient (a pinned contraction, the batch on `data`) and scatters them
    into a table whose rows are on `data`, the updates gathered over the
    batch. Left to propagation, the gathered layout flowed back through the
    slice into the contraction, which XLA could only reach by
    rematerialising it whole (the warning); from the slices' own layout,
    pinned first, it is one all-gather."""
    import jax.numpy as jnp

    ks = jax.random.split(jax.random.key(0), 5)
    params = {"tables": [jax.random.normal(k, (4096, 32)) * 0.05 for k in ks[:3]],
              "w": jax.random.normal(ks[3], (96, 64)) / 10}
    ids = jax.random.randint(ks[4], (256, 3), 0, 4096)

    def loss(params, ids):
        embs = [jnp.take(t, ids[:, i], axis=0) for i, t in enumerate(params["tables"])]
        return jnp.mean(jax.nn.relu(jnp.concatenate(embs, -1) @ params["w"]) ** 2)

    def step(params, ids):
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, jax.grad(loss)(params, ids))

    rules = {"args[0]['tables'][0]:0": "data", "args[0]['tables'][0]:1": "model",
             "args[1]:0": "data"}
    f = jb.jit(step, mesh=mesh24, rules=rules)
    got = f(params, ids)
    assert any(e.primitive.name == "scatter-add" and ins[2] is not None
               for e, (ins, _) in f.plan.contraction_specs().items()), "the updates are gathered"
    assert REMAT not in capfd.readouterr().err
    testing.assert_close(got, step(params, ids), scale=lambda: testing.abs_scale(step, params, ids),
                         what="embedding updates under the pinned routes")
