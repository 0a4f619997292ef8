"""`Plan._repr_html_`: every rule with its mesh axes, the modelled cost per
collective kind and memory per device (the facts of `Plan.table()`), the
search's verdict and the exceptions, all names escaped."""

import jax
import jax.numpy as jnp
import pytest

from jaxbackend import named as nx
from jaxbackend import sharding
from jaxbackend.sharding._cost import KINDS
from tests._html_tables import read

MLP = "<mlp>"   # a dim name that is also markup: must show as written


def _mlp_args(batch=16):
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    x = nx.as_named(jax.random.normal(k1, (batch, 8)), ("batch", "embd"))
    w1 = nx.as_named(jax.random.normal(k2, (8, 32)), ("embd", MLP))
    w2 = nx.as_named(jax.random.normal(k3, (32, 8)), (MLP, "embd"))
    return w1, w2, x


def _loss(w1, w2, x):
    h = nx.dot(x, w1, dim="embd")
    return nx.dot(h * h, w2, dim=MLP).sum().values


@pytest.fixture(scope="module")
def searched(mesh24):
    # a batch large enough that sharding it beats the collectives' latency
    return sharding.plan(jax.grad(_loss, argnums=(0, 1)), *_mlp_args(4096), mesh=mesh24)


def _tables(plan):
    page = read(plan._repr_html_())
    return page, {t.caption: t for t in page.tables}


def test_rules_table_lists_every_rule_with_its_mesh_axes(searched, mesh24):
    page, t = _tables(searched)
    rules = t["rules: dim name → mesh axes"]
    assert rules.header == ["dim", "mesh axes", "pieces"]
    assert [r[0] for r in rules.rows] == list(searched.rules)
    for d, a in searched.rules.items():
        axes = () if a is None else (a,) if isinstance(a, str) else a
        assert rules.column("mesh axes")[d] == (" × ".join(axes) or "replicated")
        n = 1
        for ax in axes:
            n *= mesh24.shape[ax]
        assert rules.column("pieces")[d] == str(n)
    assert page.title == f"Plan on {searched.mesh!r}"


def test_cost_table_gives_bytes_count_and_time_per_collective_kind(searched):
    _, t = _tables(searched)
    cost = t["modelled cost per step, per device"]
    c = searched.cost
    assert [r[0] for r in cost.rows] == ["compute", *KINDS, "step (modelled)", "memory/device"]
    for k in KINDS:
        assert int(cost.column("bytes/device")[k].replace(",", "")) == round(c.collective(k).bytes)
        assert float(cost.column("count")[k]) == c.collective(k).count
        ms = float(cost.column("time (ms)")[k])
        assert ms == pytest.approx(c.collective(k).time * 1e3, rel=1e-3)   # printed to 4 digits
    assert int(cost.column("bytes/device")["memory/device"].replace(",", "")) == round(c.memory)
    step = float(cost.column("time (ms)")["step (modelled)"])
    assert step == pytest.approx(c.time * 1e3, rel=1e-3)
    assert any(c.collective(k).bytes > 0 for k in KINDS)   # the sharded step does communicate


def test_search_verdict_is_stated(searched):
    page, _ = _tables(searched)
    verdict = [s for s in page.notes if s.startswith("search: ")]
    assert len(verdict) == 1 and searched.stats["method"] in verdict[0]
    assert ("proven optimal" in verdict[0]) == bool(searched.stats["optimal"])


def test_given_rules_and_their_exceptions_are_listed(mesh24):
    # w1 (embd, <mlp>) cannot put both dims on `model`: the second is an exception.
    rules = {"batch": "data", "embd": "model", MLP: "model"}
    plan = sharding.plan(_loss, *_mlp_args(), mesh=mesh24, rules=rules)
    page, t = _tables(plan)
    assert t["rules: dim name → mesh axes"].column("mesh axes") == {
        "batch": "data", "embd": "model", MLP: "model"}
    assert "rules given, not searched" in page.notes
    exc = t["exceptions: mesh axis already used by an earlier dim"]
    assert exc.rows == [[where, d, "model"] for where, d, _ in plan.exceptions] and exc.rows


def test_names_are_escaped(searched):
    html = searched._repr_html_()
    assert "<mlp>" not in html and "&lt;mlp&gt;" in html
    assert "mlp" not in read(html).tags


def test_a_rule_over_two_mesh_axes_names_both(mesh24):
    plan = sharding.plan(_loss, *_mlp_args(), mesh=mesh24, rules={"batch": ("data", "model")})
    _, t = _tables(plan)
    rules = t["rules: dim name → mesh axes"]
    assert rules.column("mesh axes")["batch"] == "data × model"
    assert rules.column("pieces")["batch"] == "8"


def test_jnp_program_renders(mesh24):
    # A plain-array program: its dims are named by argument path and axis.
    def f(x, w):
        return jnp.sum(jnp.tanh(x @ w))
    plan = sharding.plan(f, jnp.ones((16, 8)), jnp.ones((8, 4)), mesh=mesh24)
    _, t = _tables(plan)
    assert [r[0] for r in t["rules: dim name → mesh axes"].rows] == list(plan.rules)
