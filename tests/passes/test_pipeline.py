"""The pipeline: registry, order, dump, report; random programs stay equal."""

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxbackend import _jax, passes
from jaxbackend import named as nx
from jaxbackend.passes import pipeline
from jaxbackend.passes.fuse_projections import remaining as chains_left
from jaxbackend.passes.inline import remaining as calls_left
from jaxbackend.programs import small as P
from jaxbackend.testing import assert_same_values


def test_registry_order_and_one_line_extension(monkeypatch):
    assert pipeline.DEFAULT_PIPELINE[-1] == "inline"
    assert pipeline.DEFAULT_PIPELINE[:2] == ("reroll", "inline_calls")
    assert set(pipeline.DEFAULT_PIPELINE) <= set(pipeline.PASSES)
    seen = []
    monkeypatch.setitem(pipeline.PASSES, "spy", lambda c: seen.append(len(c.eqns)) or c)
    closed = jax.make_jaxpr(P.hand_mlp)(*P.mlp_args())
    out, report = passes.run_pipeline(closed, ("spy", "fuse_projections", "dce", "spy"))
    assert seen[0] == len(closed.eqns) and seen[1] == len(out.eqns) < seen[0]
    assert [s.name for s in report.stats] == ["spy", "fuse_projections", "dce", "spy"]
    fused = report.stats[1]
    assert fused.matches == {"forward chain fused": 2}
    assert fused.eqns_before == len(closed.eqns)
    assert "fuse_projections" in str(report) and "forward chain fused: 2" in str(report)


def test_unknown_pass_name_is_a_clear_error():
    closed = jax.make_jaxpr(jnp.sin)(1.0)
    with pytest.raises(ValueError, match="unknown pass 'fusee'.*inline"):
        passes.run_pipeline(closed, ("fusee",))


def test_dump_writes_the_jaxpr_after_each_pass(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXBACKEND_DUMP", str(tmp_path))
    closed = jax.make_jaxpr(P.named_mlp)(*P.mlp_args())
    out, _ = passes.run_pipeline(closed, label="mlp")
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files[0] == "mlp.0.input.txt" and len(files) == 1 + len(pipeline.DEFAULT_PIPELINE)
    assert "einsum" in (tmp_path / "mlp.0.input.txt").read_text()
    last = tmp_path / f"mlp.{len(pipeline.DEFAULT_PIPELINE)}.inline.txt"
    assert last.read_text() == str(out) and "einsum" not in last.read_text()


# --- random programs from a grammar ----------------------------------------

def _jnp_op(k, x, w):
    b, t, e = x.shape
    if k == 0:
        return jnp.tanh((x.reshape(-1, e) @ w).reshape(b, t, e))       # flatten chain
    if k == 1:
        return x / (jnp.linalg.norm(x, axis=-1, keepdims=True) + 1.0)  # nested jit
    if k == 2:
        g = jnp.broadcast_to(x[:, :, None, :], (b, t, 2, e))           # expand + work
        return jnp.mean(jnp.exp(-g * g) * g, axis=2)
    if k == 3:
        return jax.nn.softmax(jnp.einsum("bte,ef->btf", x, w), axis=-1)
    if k == 4:
        return jax.jit(lambda a: jnp.sin(a) * 2.0 - a)(x)
    if k == 5:
        return jax.lax.scan(lambda c, a: (jnp.tanh(c + a), c), x[:, 0], jnp.swapaxes(x, 0, 1))[1] \
            .swapaxes(0, 1)
    if k == 6:
        return jax.lax.cond(jnp.sum(x) > 0, lambda a: a * 0.5, jnp.cos, x)
    if k == 7:
        return jnp.exp(-x * x) + jnp.exp(-x * x)                       # duplicate work
    if k == 8:
        return jax.checkpoint(lambda a: jnp.sin(a) * a)(x) + jax.nn.relu(x)
    return jnp.sort(x, axis=-1) + jnp.cumsum(x, axis=1) * 0.1          # no rules


def _named_op(k, x, w):
    if k == 0:
        return nx.tanh(nx.dot(x, w, dim="embd").rename(out="embd"))
    if k == 1:
        return nx.softmax(x, dim="time")
    if k == 2:
        return x - x.mean(dim="embd")
    if k == 3:
        return nx.where(x > 0, x, 0.1 * x) * nx.exp(-x * x)
    if k == 4:
        return x.transpose("embd", "batch", "time") * 0.5 + 1.0
    return nx.dot(x, x.rename(time="time_k"), dim="embd").max(dim="time_k") * 0.1 + x


def _check_pipeline(prog, args):
    closed = jax.make_jaxpr(prog)(*args)
    out, _ = passes.run_pipeline(closed)
    _jax.check_closed_jaxpr(out)
    assert calls_left(out) == {"einsum": 0, "call": 0}
    assert chains_left(out) == 0
    assert_same_values(closed, out, args, what="pipeline output")


@settings(max_examples=8, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=4))
def test_random_jnp_programs_keep_values_and_grads(ops):
    def loss(x, w):
        for k in ops:
            x = _jnp_op(k, x, w)
        return jnp.sum(x * x)

    _check_pipeline(jax.value_and_grad(loss, argnums=(0, 1)), (P.rand(0, 2, 3, 4), P.rand(1, 4, 4) * 0.5))


@settings(max_examples=8, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=4))
def test_random_named_programs_keep_values_and_grads(ops):
    def loss(x, w):
        x = nx.as_named(x, ("batch", "time", "embd"))
        w = nx.as_named(w, ("embd", "out"))
        for k in ops:
            x = _named_op(k, x, w)
        return (x * x).sum().values

    _check_pipeline(jax.value_and_grad(loss, argnums=(0, 1)), (P.rand(0, 2, 3, 4), P.rand(1, 4, 4) * 0.5))
