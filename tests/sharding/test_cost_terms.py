"""The cost model's terms that decide data parallel against sharded weights,
checked on small programs without compiling, and on the GPT AdamW step
compiled: memory traffic of fused elementwise chains, slices and
reshapes, and XLA's combined gradient all-reduce."""

import dataclasses

import jax.numpy as jnp
import pytest

import jaxbackend as jb
from jaxbackend import sharding
from jaxbackend.programs import llama
from jaxbackend.sharding import _plan
from jaxbackend.sharding._ring import ring_time

# Flops free: compute is the memory-traffic term alone.
TRAFFIC_ONLY = dataclasses.replace(sharding.cpu_profile(), peak_flops=1e30)


def _unsharded_cost(fn, *args, profile=TRAFFIC_ONLY):
    _, g, _, _ = _plan.trace(fn, *args)
    cm = sharding.CostModel(g, sharding.MeshSpec(("x",), (1,), profile))
    return cm.evaluate([0] * cm.n_keys)


def test_an_elementwise_chain_reads_and_writes_once():
    """Four elementwise ops are one XLA fusion: one read of x, one write of
    the result (charging every op its operands counted 4 reads, 4 writes)."""
    x = jnp.ones((64, 64), jnp.float32)
    cost = _unsharded_cost(lambda x: jnp.tanh(x * 2.0 + 1.0) * 3.0, x)
    assert cost.compute == pytest.approx(2 * x.nbytes / TRAFFIC_ONLY.mem_bandwidth, rel=1e-12)


def test_a_slice_reads_what_it_keeps_and_a_reshape_is_a_bitcast():
    """x[:8] reads 8 rows (not all 64) and the reshape of the slice moves no
    data of its own: the fused slice writes its result once."""
    x = jnp.ones((64, 64), jnp.float32)
    cost = _unsharded_cost(lambda x: x[:8].reshape(-1), x)
    kept = x.nbytes // 8
    assert cost.compute == pytest.approx(2 * kept / TRAFFIC_ONLY.mem_bandwidth, rel=1e-12)


def test_a_stack_of_sharded_parts_is_copied_per_device():
    """reroll stacks per-layer values as concatenate + reshape
    (`passes._stacks.stack`). Where the parts' leading dim is sharded (the
    batch of activations saved for a rolled backward pass whose forward is
    not rolled), each device copies its own rows and gathers nothing: the
    copy costs 1/8 of itself on 8 devices (it was charged whole, and data
    parallelism looked slower than it is)."""
    from jaxbackend.passes import _stacks

    x = jnp.ones((64, 32), jnp.float32)
    _, g, _, _ = _plan.trace(lambda x: _stacks.stack([x, x * 2.0, x * 3.0]), x)
    cm = sharding.CostModel(g, sharding.MeshSpec(("x",), (8,), TRAFFIC_ONLY))
    (i,) = [k for k, op in enumerate(g.ops) if op.outs[0][0] in g.stacks]
    sig = cm.sigs[cm.op_sig[i]][0]
    masks = [0] * cm.n_keys
    masks[cm.var_keys[g.invars[0]][0]] = 1     # x's rows on the 8 devices
    whole = cm.op_cost(sig, [0] * cm.n_keys)[3]
    _, _, gathers, compute = cm.op_cost(sig, masks)
    assert whole > 0 and compute == pytest.approx(whole / 8, rel=1e-12)
    assert not any(gathers)


@pytest.fixture(scope="module")
def small_dp():
    cfg = llama.LlamaConfig(n_layers=1, batch=4, time=8, embd=16, kv=2, grp=2, hd=4, mlp=32, vocab=32)
    args = (llama.name_llama_params(llama.llama_shapes(cfg)),
            *llama.name_llama_batch(*llama.llama_batch(None, cfg, abstract=True)))
    step = llama.sgd_step(llama.named_llama_loss)
    mesh = sharding.MeshSpec(("data",), (4,), "cpu")
    plan = sharding.plan(step, *args, mesh=mesh, rules={"batch": "data"})
    return plan, len(plan.model.g.invars) - 2   # weight leaves (not tokens, targets)


def test_gradient_all_reduces_are_combined_into_one(small_dp):
    """Data parallel: every weight gradient is all-reduced over `data`, and
    XLA's combiner merges them: one latency for the summed bytes, not one
    per gradient."""
    plan, n_leaves = small_dp
    ar = plan.cost.all_reduce
    bw, lat = plan.mesh.axis_bandwidth[0], plan.mesh.axis_latency[0]
    rdv = plan.mesh.profile.rendezvous
    one = ring_time("all-reduce", 4, ar.bytes, bw, lat, rdv)          # summed bytes, one latency
    per_leaf = ring_time("all-reduce", 4, ar.bytes, bw, n_leaves * lat, rdv)   # a latency per leaf
    assert n_leaves > 5 and ar.bytes > 0
    assert ar.count <= 1 + 1e-9
    assert ar.time <= one * (1 + 1e-9)
    assert ar.time < 0.5 * per_leaf


def test_searched_gpt_adamw_step_moves_no_more_bytes_than_data_parallel():
    """The GPT AdamW step (2 layers, small) on a (2, 4) mesh: the searched
    plan's compiled collectives move no more bytes than data parallel's
    (the model used to shard weights to save replicated optimizer work it
    overcharged, and paid all-gathers for it)."""
    from benchmarks.sharded_scaling import _setup

    _, params, tx, step, x, y = _setup(2, embd=32, heads=4, seq=16, batch=8)
    opt_state = tx.init(params)
    mesh = sharding.auto_mesh((2, 4), ("data", "model"))
    moved = {}
    for name, rules in (("searched", None), ("dp", {"batch": ("data", "model")})):
        f = jb.jit(step, mesh=mesh, rules=rules)
        text = f.lower(params, opt_state, x, y).compile().as_text()
        moved[name] = sum(v["bytes"] for v in sharding.hlo_collectives(text).values())
    assert moved["searched"] <= moved["dp"], moved


def test_keeping_a_minor_mesh_axis_without_its_major_one_gathers_the_group():
    """A dim sharded on (data, model) that an op needs on `model` alone: its
    tiles are no slices of the joint ones (device (d, m) holds block 2d + m;
    model-only wants blocks 4m .. 4m + 3), so XLA permutes devices and
    gathers; the model charges a gather of the whole group. Dropping the
    minor axis (keeping data) is a plain gather over model."""
    from jaxbackend.sharding._cost import _reorders

    t = _reorders(4)            # masks over (data = 1, model = 2)
    assert t[3, 2] and not t[3, 1] and not t[3, 3] and not t[3, 0] and not t[2, 2]
    t3 = _reorders(8)           # three axes
    assert t3[7, 2] and t3[7, 6] and t3[7, 4] and t3[5, 4] and not t3[7, 3] and not t3[7, 1]


def test_a_reordered_group_is_predicted_as_xla_gathers_it(mesh42):
    import jax

    from jaxbackend import named as nx
    from jaxbackend.sharding import _hlo

    def loss(p, x):
        h = nx.gelu(nx.dot(x, p["w1"], dim="embd"))
        y = nx.dot(h, p["w2"], dim="mlp")
        return (y * y).values.mean()

    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    p = {"w1": nx.as_named(jax.random.normal(k1, (64, 256)), ("embd", "mlp")),
         "w2": nx.as_named(jax.random.normal(k2, (256, 64)), ("mlp", "embd"))}
    x = nx.as_named(jax.random.normal(k3, (32, 64)), ("batch", "embd"))
    # batch takes data first, so h = x @ w1 keeps mlp on model alone
    f = jb.jit(jax.value_and_grad(loss), mesh=mesh42,
               rules={"batch": "data", "mlp": ("data", "model")})
    hlo = _hlo.collectives(f.lower(p, x).compile().as_text())
    moved = hlo["all-gather"]["bytes"] + hlo["collective-permute"]["bytes"]
    assert f.plan.cost.collective("all-gather").bytes == pytest.approx(moved, rel=0.25)


def test_slicing_a_sharded_dim_is_charged_and_the_search_avoids_it():
    """An LSTM cell splits one projection into its four gates (`jnp.split`
    on the gate dim). Sharding that dim puts shard bounds off the gates':
    XLA reshuffles it (all-to-alls, collective-permutes). The model once
    called the slice free, and the search sharded the gates for a plan
    that moved more than data parallel and ran 2-3x slower; now the sliced
    axis must be whole, and the searched plan moves no more than data
    parallel, as compiled."""
    import jax

    from jaxbackend.sharding import _hlo

    x = jax.random.normal(jax.random.key(0), (256, 64))
    w = jax.random.normal(jax.random.key(1), (64, 256)) / 8

    def f(x, w):
        def cell(h, _):
            i, fg, g, o = jnp.split(h @ w, 4, -1)
            return jax.nn.sigmoid(i) * jnp.tanh(g) + jax.nn.sigmoid(fg) * jax.nn.sigmoid(o), None
        return jnp.sum(jax.lax.scan(cell, x, None, length=8)[0])

    grad = jax.grad(f, argnums=1)
    mesh = sharding.auto_mesh((2, 4), ("data", "model"))
    gates = jb.jit(grad, mesh=mesh, rules={"args[1]:1": "data", "args[0]:0": "model"})
    gates.lower(x, w)
    assert gates.plan.cost.collective("all-gather").bytes > 0
    moved = {}
    for name, rules in (("searched", None), ("dp", {"args[0]:0": ("data", "model")})):
        text = jb.jit(grad, mesh=mesh, rules=rules).lower(x, w).compile().as_text()
        moved[name] = sum(c["bytes"] for c in _hlo.collectives(text).values())
    assert moved["searched"] <= moved["dp"], moved


@pytest.mark.parametrize("op", ["cumsum", "sort", "top_k", "flip", "fft"])
def test_an_op_along_a_sharded_axis_is_charged_no_less_than_xla_moves(op):
    """cumsum, sort, top_k, rev and fft read the whole axis they work along: XLA
    moves data when it is sharded (all-gathers for cumsum and top_k, as
    modelled; an all-to-all for sort and a collective-permute for rev,
    less than the gather modelled). The model once called them elementwise,
    free on any layout."""
    import jax

    from jaxbackend.sharding import _hlo

    along = {"cumsum": lambda h: jnp.cumsum(h, 1), "sort": lambda h: jnp.sort(h, 1),
             "top_k": lambda h: jax.lax.top_k(h, h.shape[1])[0], "flip": lambda h: h[:, ::-1],
             "fft": lambda h: jnp.abs(jnp.fft.fft(h, axis=1))}[op]

    def f(x, w):     # rows of x: independent; its columns: the axis `op` works along
        return jnp.tanh(along(jnp.tanh(x @ w)) @ w.T)

    x = jax.random.normal(jax.random.key(0), (64, 512))
    w = jax.random.normal(jax.random.key(1), (512, 512)) / 16
    mesh = sharding.auto_mesh((8,), ("data",))
    cols = jb.jit(f, mesh=mesh, rules={"args[1]:1": "data"})
    text = cols.lower(x, w).compile().as_text()
    modelled = sum(c.bytes for c in (cols.plan.cost.all_gather, cols.plan.cost.all_to_all))
    moved = sum(c["bytes"] for k, c in _hlo.collectives(text).items() if k != "all-reduce")
    assert modelled >= moved > 0


DP, MEGATRON = {"batch": ("data", "model")}, {"batch": "data", "head": "model", "mlp": "model"}


@pytest.mark.parametrize("dtype, rules, layers", [("bfloat16", DP, 5), ("bfloat16", MEGATRON, 5),
                                                 ("float16", DP, 2)],
                         ids=["bfloat16-dp-rolled", "bfloat16-megatron-rolled", "float16-dp"])
def test_half_temporaries_and_collectives_are_costed_as_xla_cpu_holds_them(dtype, rules, layers):
    """XLA:CPU holds bfloat16 and float16 temporaries as float32, and runs
    bfloat16 collectives in float32 (float16's stay float16): the CPU
    profile counts so (arguments, results and loop state keep their own
    dtype); the H100 profile counts 16-bit bytes. The model used to predict
    half a bfloat16 step's collective bytes, and 0.62 of the memory."""
    from benchmarks.sharded_scaling import _setup

    # 5 layers are rolled: stacked residuals and loop state keep their dtype
    _, params, tx, step, x, y = _setup(layers, embd=64, heads=4, seq=32, batch=16, dtype=dtype)
    args = (params, tx.init(params), x, y)
    mesh = sharding.auto_mesh((2, 4), ("data", "model"))
    f = jb.jit(step, mesh=mesh, rules=rules)
    compiled = f.lower(*args).compile()
    cost = f.plan.cost
    modelled = sum(c.bytes for c in (cost.all_reduce, cost.all_gather, cost.reduce_scatter,
                                     cost.all_to_all))
    measured = sum(v["bytes"] for v in sharding.hlo_collectives(compiled.as_text()).values())
    assert modelled == pytest.approx(measured, rel=0.02)
    assert cost.memory == pytest.approx(sharding.hlo_memory(compiled)["total"], rel=0.2)
    h100 = sharding.plan(step, *args, mesh=mesh, rules=rules, profile="h100").cost
    # (all but the float32 loss)
    widened = 2 if dtype == "bfloat16" else 1
    assert h100.all_reduce.bytes == pytest.approx(cost.all_reduce.bytes / widened, rel=1e-3)
