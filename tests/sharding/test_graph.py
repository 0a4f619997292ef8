"""Dim identities through the graph (no compiling): names, reshape->matmul
->reshape, tied layers, scan trip counts, divisibility."""

import math

import jax
import pytest

from jaxbackend import sharding
from jaxbackend.programs import llama
from jaxbackend.sharding import _plan


def _graph(step, args):
    return _plan.trace(step, *args)[1]


def _key_of(g, v, axis):
    return g.key_names[g.class_key[g.var_classes[v][axis]]]


def test_named_inputs_and_einsums_name_the_keys(block):
    g = _graph(block["step"], block["args"])
    names = set(g.key_names)
    assert {"batch", "time", "embd", "kv", "grp", "hd", "mlp", "vocab"} <= names
    # time and time_k are one identity (rename of the same values): one key.
    assert "time_k" not in names
    wq = g.invars[[i for i, s in enumerate(g.shapes[v] for v in g.invars) if s == (32, 4, 2, 8)][0]]
    assert [_key_of(g, wq, a) for a in range(4)] == ["embd", "kv", "grp", "hd"]


def test_reshape_matmul_reshape_keeps_the_batch_dim(block):
    g = _graph(block["jnp_step"], block["jnp_args"])
    cfg = block["cfg"]
    tokens = g.invars[-2]
    batch_key = _key_of(g, tokens, 0)
    flat = [v for v, s in enumerate(g.shapes) if s == (cfg.batch * cfg.time, cfg.embd)]
    assert flat, "the jnp twin flattens activations to (batch*time, embd)"
    assert all(_key_of(g, v, 0) == batch_key for v in flat)
    # The merged head axis of a flattened projection is sharded as kv.
    wq = g.invars[[i for i, v in enumerate(g.invars) if g.shapes[v] == (32, 4, 2, 8)][0]]
    merged = [v for v, s in enumerate(g.shapes) if s == (cfg.batch * cfg.time, 4 * 2 * 8)]
    assert merged and _key_of(g, merged[0], 1) == _key_of(g, wq, 1)


def test_unnamed_layers_share_keys():
    counts = []
    for n in (1, 3):
        cfg = llama.LlamaConfig(n_layers=n)
        p = llama.llama_shapes(cfg)
        t = llama.llama_batch(None, cfg, abstract=True)
        g = _graph(llama.sgd_step(llama.jnp_llama_loss), (p, *t))
        cm = sharding.CostModel(g, sharding.MeshSpec(("x",), (2,)))
        counts.append(len(sharding._search.search_space(cm)[0]))
    assert counts[0] == counts[1]


def _contract_flops(g):
    return sum(op.flops * op.mult for op in g.ops if op.kind == "contract")


def test_scan_body_is_walked_and_multiplied_by_trip_count():
    cfg = llama.LlamaConfig(n_layers=3)
    t = llama.name_llama_batch(*llama.llama_batch(None, cfg, abstract=True))
    step = llama.sgd_step(llama.named_llama_loss)
    unrolled = _graph(step, (llama.name_llama_params(llama.llama_shapes(cfg)), *t))
    scanned = _graph(step, (llama.name_llama_params(llama.llama_shapes(cfg, stacked=True)), *t))
    assert len(scanned.ops) < len(unrolled.ops)
    assert _contract_flops(scanned) == _contract_flops(unrolled)
    mesh = sharding.MeshSpec(("data",), (4,))
    costs = []
    for g in (unrolled, scanned):
        cm = sharding.CostModel(g, mesh)
        masks = [mesh.mask("data") if n == "batch" else 0 for n in g.key_names]
        costs.append(cm.evaluate(masks))
    # Data parallel: the gradient all-reduce bytes are the same either way.
    assert costs[1].all_reduce.bytes == pytest.approx(costs[0].all_reduce.bytes, rel=1e-6)
    # The scan also stacks residuals and slices weights (real copies) on top.
    assert costs[0].compute <= costs[1].compute <= 1.25 * costs[0].compute


def test_indivisible_dims_are_never_sharded(block):
    g = _graph(block["step"], block["args"])
    mesh = sharding.MeshSpec(("a", "b"), (3, 2))
    cm = sharding.CostModel(g, mesh)
    keys, options = sharding._search.search_space(cm)
    for k, opts in zip(keys, options):
        for m in opts:
            assert g.key_size[k] % mesh.group_size[m] == 0
    assert all(mesh.group_size[m] != 3 for opts in options for m in opts)  # no size divisible by 3


def test_rules_that_do_not_divide_are_rejected(block, mesh24):
    with pytest.raises(ValueError, match="dim 'kv' has size 4, not divisible by mesh axes"):
        sharding.plan(block["step"], *block["args"], mesh=mesh24, rules=dict(kv=("data", "model")))


def test_mesh_links_and_profiles():
    spec = sharding.MeshSpec(("node", "gpu"), (4, 8), "h100")
    p = sharding.h100_profile()
    assert spec.axis_bandwidth == (p.inter_bandwidth, p.intra_bandwidth)
    assert spec.group_bandwidth[spec.mask(("node", "gpu"))] == p.inter_bandwidth
    assert spec.group_size[spec.mask(("node", "gpu"))] == 32
    assert sharding.h200_profile().memory > p.memory
    custom = sharding.MeshSpec(("x",), (2,), "cpu", axis_bandwidth={"x": 1e9})
    assert custom.axis_bandwidth == (1e9,)
    am = sharding.abstract_mesh((8, 32), ("data", "model"))
    assert sharding.MeshSpec.from_mesh(am).size == 256
    assert math.prod(sharding.MeshSpec.from_mesh(am).axis_sizes) == 256
    with pytest.raises(ValueError, match="has no axis 'z'"):
        spec.mask("z")


class _Device:
    """What `device_profile` reads of a jax.Device."""

    def __init__(self, platform, kind, limit=None):
        self.platform, self.device_kind, self._limit = platform, kind, limit

    def memory_stats(self):
        return None if self._limit is None else {"bytes_limit": self._limit, "bytes_in_use": 0}


def test_default_profile_is_the_mesh_devices_one(mesh24, monkeypatch):
    # a plan for a GPU mesh made with the CPU's numbers (5e10 flop/s, the
    # host's memory) would trade collectives for compute the GPU never
    # spends, and size memory to the wrong card
    h100 = sharding.device_profile(_Device("gpu", "NVIDIA H100 80GB HBM3", 60e9))
    assert (h100.name, h100.peak_flops, h100.memory) == ("h100", 989e12, 60e9)
    h200 = sharding.device_profile(_Device("gpu", "NVIDIA H200"))
    assert h200 == sharding.h200_profile()       # no allocator figure: the card's memory
    with pytest.warns(UserWarning, match="device kind 'NVIDIA A100-SXM4-80GB'.*profile="):
        other = sharding.device_profile(_Device("gpu", "NVIDIA A100-SXM4-80GB", 70e9))
    assert other.name == "h100-like (NVIDIA A100-SXM4-80GB)" and other.memory == 70e9
    # host devices share the host's memory: 8 simulated ones get 1/8 each
    monkeypatch.setattr(sharding._mesh, "_host_memory", lambda: 16 * 2.0 ** 30)
    cpu = sharding.device_profile(mesh24.devices.flat[0])
    assert cpu == sharding.cpu_profile(2 * 2.0 ** 30) and jax.local_device_count() == 8
    monkeypatch.setattr(sharding._mesh, "_host_memory", lambda: None)   # the OS does not say
    assert sharding.device_profile(mesh24.devices.flat[0]) == sharding.cpu_profile()
    seen = []
    monkeypatch.setattr(sharding._mesh, "device_profile",
                        lambda d=None: seen.append(d) or sharding.h100_profile())
    assert sharding.MeshSpec.from_mesh(mesh24).profile.name == "h100"
    assert sharding.MeshSpec.from_mesh(sharding.abstract_mesh((2, 4), ("data", "model"))
                                       ).profile.name == "h100"
    assert seen == [mesh24.devices.flat[0], None]   # a mesh's own device; else the default's
    assert sharding.MeshSpec.from_mesh(mesh24, "cpu").profile.name == "cpu"   # given: kept
    assert seen == [mesh24.devices.flat[0], None]


def _same_plan(block, mesh, transform=None):
    named = sharding.plan(block["step"], *block["args"], mesh=mesh)
    plain = sharding.plan(block["jnp_step"], *block["jnp_args"], mesh=mesh, transform=transform)
    print(f"\nnamed {named.rules}\njnp   {plain.rules}")
    assert plain.in_specs() == named.in_specs()
    assert plain.cost.time == pytest.approx(named.cost.time, rel=0.1)


def test_jnp_twin_reaches_the_same_plan(block, mesh24):
    _same_plan(block, mesh24)


def test_jnp_twin_after_fuse_projections_reaches_the_same_plan(block, mesh24):
    from jaxbackend import passes
    fuse = lambda c: passes.dce(passes.fuse_projections(passes.inline_calls(c)))  # noqa: E731
    _same_plan(block, mesh24, transform=fuse)


def test_empty_arrays_are_planned_and_keep_jax_jits_values(mesh24):
    """Zero-size operands (a reshape of int32[0], an empty concatenate part,
    a contraction over 0 terms) have no element to place: each rule must map
    them without assuming sizes that multiply up (a reshape once raised
    IndexError), and the sharded step must equal jax.jit's."""
    import jax.numpy as jnp
    import numpy as np

    import jaxbackend as jb

    def f(x, e, z):
        w = jnp.concatenate([x, z], axis=0)                   # (16, 8) ++ (0, 8)
        empty_dot = jnp.einsum("bk,kd->bd", x[:, :0], z.T[:0, :]).sum()   # k = 0
        return (w * 2).sum(0) + e.reshape(4, 0).sum() + z.reshape(0, 2, 4).sum() + empty_dot

    args = (jnp.arange(128.0).reshape(16, 8), jnp.zeros((0,), jnp.int32), jnp.zeros((0, 8)))
    got = jb.jit(f, mesh=mesh24)(*args)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(f)(*args)))


def test_a_program_with_no_dim_to_shard_gets_the_replicated_plan(mesh24):
    """No dim divides the mesh (odd sizes, scalars, no array input): the
    search has no key to choose for; the one plan replicates everything (an
    empty grid once crashed the search)."""
    import jax.numpy as jnp
    import numpy as np

    import jaxbackend as jb

    def mlp(x, w):
        return jnp.tanh(x @ w)

    args = (jnp.ones((7, 3)), jnp.arange(15.0).reshape(3, 5))
    plan = sharding.plan(mlp, *args, mesh=mesh24)
    assert not any(plan.rules.values()) and plan.stats["optimal"], plan.rules
    f = jb.jit(mlp, mesh=mesh24)
    np.testing.assert_array_equal(np.asarray(f(*args)), np.asarray(jax.jit(mlp)(*args)))
    for fn, a in ((lambda s: jnp.arange(8.0) * s, (2.0,)), (lambda x: x * 2, (jnp.ones((1, 1)),))):
        np.testing.assert_array_equal(np.asarray(jb.jit(fn, mesh=mesh24)(*a)),
                                      np.asarray(jax.jit(fn)(*a)))
    with pytest.raises(sharding.NoPlanFits, match="no plan fits the memory budget"):
        sharding.plan(mlp, *args, mesh=mesh24, memory_budget=8)


def test_a_rule_on_a_name_given_to_axes_of_different_sizes_names_the_sizes(mesh24):
    """Two arguments call axes of sizes 8 and 6 'batch' (never combined, so
    the named ops allow it): the dim's shardable size is their gcd, 2, and a
    rule that does not divide it says where the 2 comes from."""
    import jax.numpy as jnp

    import jaxbackend as jb
    from jaxbackend import named as nx

    def f(a, b):
        return a.values.sum() + b.values.sum()

    args = (nx.as_named(jnp.ones((8, 4)), ("batch", "x")),
            nx.as_named(jnp.ones((6, 4)), ("batch", "x")))
    with pytest.raises(nx.DimError, match=r"dim 'batch' \(given to axes of sizes 6, 8: a sharding "
                                          r"must divide each\) has size 2, not divisible by mesh "
                                          r"axes 'model' of size 4"):
        jb.jit(f, mesh=mesh24, rules={"batch": "model"})(*args)
