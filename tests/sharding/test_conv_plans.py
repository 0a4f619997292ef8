"""A residual ConvNet's training step on 8 simulated CPU devices: the cost
model sees convolutions as contractions over their input features (the
kernel gradient: over the batch), its plans' collectives are what XLA
emits, and the searched plan moves no more bytes than data parallel or
channel parallel. Reference: the single-device step."""

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import jaxbackend as jb
from jaxbackend import testing
from jaxbackend.sharding import _hlo
from jaxbackend.sharding._ring import KINDS

LAYERS, BATCH, SIDE, CHANNELS = 6, 16, 8, 16
BATCH_DIM = "args[1]:0"                          # x's leading axis
CHANNEL_DIM = "args[0]['blocks'][0][0]:2"        # the first block kernel's input features
RULES = {"searched": None, "data parallel": {BATCH_DIM: ("data", "model")},
         "channel parallel": {CHANNEL_DIM: "model", BATCH_DIM: "data"}}


def _conv(x, w):
    return lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                    dimension_numbers=("NHWC", "HWIO", "NHWC"))


def _norm(h):   # batch norm: the mean and the mean of squares are sibling sums
    m = h.mean((0, 1, 2))
    v = (h * h).mean((0, 1, 2)) - m * m
    return (h - m) * lax.rsqrt(v + 1e-5)


def _loss(p, x, y):
    h = _conv(x, p["stem"])
    for w1, w2 in p["blocks"]:
        h = h + _norm(_conv(jax.nn.relu(_norm(_conv(h, w1))), w2))
    logits = h.mean((1, 2)) @ p["head"]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))


def _step(p, x, y):
    loss, g = jax.value_and_grad(_loss)(p, x, y)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), loss


@pytest.fixture(scope="module")
def convnet(mesh24):
    k = jax.random.split(jax.random.key(0), 2 * LAYERS + 3)
    p = {"stem": 0.2 * jax.random.normal(k[0], (3, 3, 3, CHANNELS)),
         "head": 0.2 * jax.random.normal(k[1], (CHANNELS, 10)),
         "blocks": [tuple(0.1 * jax.random.normal(k[2 + 2 * i + j], (3, 3, CHANNELS, CHANNELS))
                          for j in range(2)) for i in range(LAYERS)]}
    args = (p, jax.random.normal(k[-1], (BATCH, SIDE, SIDE, 3)), jnp.arange(BATCH) % 10)
    rows = {}
    for name, rules in RULES.items():
        f = jb.jit(_step, mesh=mesh24, rules=rules)
        rows[name] = (f, f.lower(*args).compile())
    return args, rows


def test_sharded_convnet_step_equals_single_device(convnet):
    args, rows = convnet
    f, comp = rows["searched"]
    assert [s.matches for s in f.last_report.stats if s.name == "reroll"][0][
        "reroll.blocks_rolled"] == 2 * LAYERS          # forward and backward rolled
    testing.assert_close(comp(*args), jax.jit(_step)(*args), what="searched ConvNet step",
                         scale=lambda: testing.abs_scale(_step, *args))


@pytest.mark.parametrize("name", list(RULES))
def test_convnet_collectives_and_memory_match_compiled_hlo(convnet, name):
    f, comp = convnet[1][name]
    hlo = _hlo.collectives(comp.as_text())
    h = sum(v["bytes"] for v in hlo.values())
    cost = f.plan.cost
    p = sum(cost.collective(k).bytes for k in KINDS)
    print(f"\n{name}: HLO {hlo} predicted {cost}")
    assert h > 0 and p == pytest.approx(h, rel=0.25), (name, p, h)
    if not hlo["all-gather"]["count"]:
        # one all-reduce latency per group XLA combines (the norm's sibling
        # sums). (Where operands are resharded, XLA picks gather or reduce
        # per convolution on its own; the bytes agree, not the counts.)
        assert cost.all_reduce.count == pytest.approx(hlo["all-reduce"]["count"], rel=0.1)
    assert cost.memory == pytest.approx(_hlo.memory(comp)["total"], rel=0.25)


def test_searched_convnet_plan_moves_no_more_bytes_than_hand_sets(convnet):
    rows = convnet[1]
    moved = {name: sum(v["bytes"] for v in _hlo.collectives(comp.as_text()).values())
             for name, (_, comp) in rows.items()}
    print(f"\n{moved} searched rules {rows['searched'][0].plan.rules}")
    assert moved["searched"] <= min(moved["data parallel"], moved["channel parallel"])


@pytest.mark.parametrize("rules", [{"args[1]:0": "data"}, {"args[1]:0": "model"},
                                   {"args[1]:1": "data"}, None],
                         ids=["batch-data", "batch-model", "time-data", "searched"])
def test_depthwise_conv_kernel_gradient_under_a_partial_layout_is_exact(mesh24, rules):
    """A depthwise conv1d's kernel gradient is a `batch_group_count` conv,
    which XLA's partitioner multiplies by the size of the mesh axes its
    operands leave replicated (x4 with the batch on `data` alone, as in a
    Mamba block's step planned data parallel on `data`); the plan computes
    it from whole operands there, and the gradient is jax.jit's."""
    b, t, e, k = 8, 16, 64, 4

    def loss(w, x):
        y = lax.conv_general_dilated(x, w, (1,), [(k - 1, 0)], feature_group_count=e,
                                     dimension_numbers=("NWC", "WIO", "NWC"))
        return jnp.sum(jnp.tanh(y))

    args = (jax.random.normal(jax.random.key(0), (k, 1, e)),
            jax.random.normal(jax.random.key(1), (b, t, e)))
    g = jax.grad(loss)
    testing.assert_close(jb.jit(g, mesh=mesh24, rules=rules)(*args), jax.jit(g)(*args),
                         scale=lambda: testing.abs_scale(g, *args), what=f"kernel gradient {rules}")


@pytest.mark.parametrize("side, patch", [(32, 4), (64, 8), (16, 8)],
                         ids=["grid-8-window-4", "grid-equals-window", "grid-below-window"])
def test_a_kernel_window_is_never_sharded(mesh24, side, patch):
    """A kernel's window axis: its gradient is a convolution whose result
    spatial axis is that window, which XLA's partitioner cannot split (a
    searched MLP-Mixer plan sharded its patch embedding's window, for the
    model's halving of that conv's work; XLA replicated and re-sharded it,
    an involuntary rematerialisation). The window's dim is never sharded,
    and a rule that tries says why; the patch grid (the activations' dim)
    stays shardable, whatever its size next to the window's."""
    from jaxbackend.named import DimError

    def loss(w, v, x):   # a patch embedding, then a dense layer over the patches
        h = lax.conv_general_dilated(x, w, (patch, patch), "VALID",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jnp.mean(jnp.tanh(h.reshape(h.shape[0], -1) @ v))

    def step(w, v, x):   # SGD: the kernel and its gradient are one dim per axis
        gw, gv = jax.grad(loss, (0, 1))(w, v, x)
        return w - 0.1 * gw, v - 0.1 * gv

    grid = side // patch
    k = jax.random.split(jax.random.key(0), 3)
    args = (jax.random.normal(k[0], (patch, patch, 3, 16)) / patch,
            jax.random.normal(k[1], (grid * grid * 16, 8)) / (4 * grid),
            jax.random.normal(k[2], (8, side, side, 3)))
    f = jb.jit(step, mesh=mesh24)
    f.lower(*args)
    g = f.plan.model.g
    for a in (0, 1):
        k = g.key_names.index(f"args[0]:{a}")
        assert k in g.unshardable and g.key_size[k] == 1, (a, g.key_size[k])
    grids = [k for k, n in enumerate(g.key_names) if n.startswith("conv_general_dilated@")]
    assert grids and not any(k in g.unshardable for k in grids), [g.key_names[k] for k in grids]
    testing.assert_close(f(*args), jax.jit(step)(*args),
                         scale=lambda: testing.abs_scale(step, *args), what="patch embedding step")
    with pytest.raises(DimError, match=rf"dim 'args\[0\]:1' \(size {patch}\) is a convolution "
                                       r"kernel's window.*map 'args\[0\]:1' to None"):
        jb.jit(step, mesh=mesh24, rules={"args[0]:1": "data"}).lower(*args)
