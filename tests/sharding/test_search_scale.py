"""The search past the exhaustive grid: the branch and bound returns the
exhaustive search's plan wherever both run (several programs, meshes and
memory budgets) and brute force's optimum on tiny meshes; the heuristics say
they are not proven optimal; a grid over the old GRID_LIMIT is searched
instead of refused."""

import dataclasses
import itertools
import pathlib
import re
import sys

import numpy as np
import pytest

from jaxbackend import sharding
from jaxbackend.programs import llama
from jaxbackend.sharding import _bound, _plan, _search, _tables

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SMALL = llama.LlamaConfig(n_layers=1, batch=4, time=8, embd=16, kv=2, grp=2, hd=4, mlp=32, vocab=32)


def _named(cfg, stacked=False):
    return llama.sgd_step(llama.named_llama_loss), (
        llama.name_llama_params(llama.llama_shapes(cfg, stacked=stacked)),
        *llama.name_llama_batch(*llama.llama_batch(None, cfg, abstract=True)))


def _jnp(cfg):
    return llama.sgd_step(llama.jnp_llama_loss), (llama.llama_shapes(cfg),
                                              *llama.llama_batch(None, cfg, abstract=True))


def _llama_tiny(devices=8, seq=64):
    """The benchmark's LLaMA step (AdamW, remat, scan), tiny sizes."""
    from benchmarks import search_scale as ss
    return ss.train_step, ss.abstract_args(ss.TINY, devices, seq, stacked=True)


PROGRAMS = {
    "named": lambda: _named(SMALL),
    "jnp": lambda: _jnp(SMALL),
    "scan": lambda: _named(dataclasses.replace(SMALL, n_layers=2), stacked=True),
    "llama+adam+remat": _llama_tiny,
}


@pytest.fixture(scope="module")
def graphs():
    cache = {}

    def get(name):
        if name not in cache:
            step, args = PROGRAMS[name]()
            cache[name] = _plan.trace(step, *args)[1]
        return cache[name]
    return get


def _model(graph, shape, names, profile="cpu"):
    return sharding.CostModel(graph, sharding.MeshSpec(names, shape, profile))


def _tight(cm, frac):
    """A budget `frac` of the way from the least memory any plan needs to
    the memory of the unconstrained optimum (which then does not fit)."""
    keys, options = _search.search_space(cm)
    tab = _tables.Tables(cm, keys, options)
    least = tab.memory_at(np.indices(tab.shape).reshape(len(keys), -1)).min()
    free = sum(cm.memory(_search.search(cm, np.inf)[0]))
    assert least < free
    return least + frac * (free - least)


@pytest.mark.parametrize("program,shape,profile,frac", [
    ("named", (4,), "cpu", None), ("named", (2, 2), "h100", None), ("named", (2, 2), "cpu", 0.6),
    ("named", (2, 4), "h100", 0.5), ("jnp", (2, 4), "cpu", None), ("jnp", (2, 4), "h100", 0.7),
    ("scan", (2, 4), "cpu", 0.6), ("scan", (2, 2), "h100", None),
    ("llama+adam+remat", (2, 4), "h100", None), ("llama+adam+remat", (2, 4), "cpu", 0.5),
])
def test_branch_and_bound_returns_the_exhaustive_plan(graphs, program, shape, profile, frac):
    cm = _model(graphs(program), shape, ("x", "y")[:len(shape)], profile)
    budget = None if frac is None else _tight(cm, frac)
    exact, es = _search.search(cm, budget, method="exhaustive")
    found, bs = _search.search(cm, budget, method="branch_and_bound")
    assert bs["method"] == "branch_and_bound" and bs["optimal"] is True
    assert found == exact
    assert bs["time"] == es["time"]   # the same sum, in the same order
    heur, hs = _search.search(cm, budget, method="heuristic")
    assert hs["optimal"] is False and hs["why"] == "forced"
    # the exhaustive pick is within TOLERANCE of the least time (the least
    # communication among tied plans), so a heuristic may undercut it by that
    assert hs["time"] >= es["time"] / (1 + _search.TOLERANCE) * (1 - 1e-12)
    assert sum(cm.memory(heur)) <= (cm.mesh.profile.memory if budget is None else budget) * (1 + 1e-9)


def test_tables_reproduce_the_cost_model(graphs):
    cm = _model(graphs("scan"), (2, 4), ("x", "y"), "h100")
    keys, options = _search.search_space(cm)
    tab = _tables.Tables(cm, keys, options)
    rng = np.random.default_rng(0)
    idx = np.array([rng.integers(0, len(o), 20) for o in options])
    for i in range(idx.shape[1]):
        masks = tab.masks(idx[:, i])
        t, extras = cm.step_time(masks)
        assert tab.time_at(idx[:, i:i + 1])[0] == pytest.approx(t, rel=1e-12)
        assert tab.memory_at(idx[:, i:i + 1])[0] == pytest.approx(sum(cm.memory(masks, extras)), rel=1e-12)


def _brute_force(cm, budget):
    """Every plan through the scalar path: the least time within the budget."""
    keys, options = _search.search_space(cm)
    best = np.inf
    for combo in itertools.product(*[list(o) for o in options]):
        masks = [0] * cm.n_keys
        for k, m in zip(keys, combo):
            masks[k] = int(m)
        t, extras = cm.step_time(masks)
        if t < best and sum(cm.memory(masks, extras)) <= budget:
            best = t
    return best


@pytest.mark.parametrize("shape,frac", [((2,), None), ((4,), 0.7)])
def test_branch_and_bound_matches_brute_force(graphs, shape, frac):
    cm = _model(graphs("named"), shape, ("x",), "h100")
    budget = cm.mesh.profile.memory if frac is None else _tight(cm, frac)
    masks, stats = _search.search(cm, budget, method="branch_and_bound")
    assert stats["optimal"]
    assert sum(cm.memory(masks)) <= budget
    assert cm.step_time(masks)[0] == pytest.approx(_brute_force(cm, budget), rel=1e-9)


@pytest.fixture(scope="module")
def low_grid_limit():
    """GRID_LIMIT lowered to 2**22, under the tiny LLaMA's grid. Its (2, 2, 2)
    grid was ~3e7 plans; scan layer axes are no search keys any more
    (`_walk._scan`: never sharded), which leaves 7.3e6, under the real
    limit. What these tests check, a grid over the limit searched exactly by
    the branch and bound, does not depend on the limit's value."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_search, "GRID_LIMIT", 1 << 22)
        yield


@pytest.fixture(scope="module")
def over_limit(low_grid_limit):
    """The tiny LLaMA step on a (2, 2, 2) mesh: 7.3e6 plans, over GRID_LIMIT
    (`low_grid_limit`; the search used to refuse such a grid)."""
    step, args = _llama_tiny()
    cm = _model(_plan.trace(step, *args)[1], (2, 2, 2), ("a", "b", "c"), "h100")
    keys, options = _search.search_space(cm)
    assert np.prod([len(o) for o in options], dtype=float) > _search.GRID_LIMIT
    return cm


def test_grid_over_the_old_limit_is_searched_exactly(over_limit):
    cm = over_limit
    budget = 0.5 * sum(cm.memory([0] * cm.n_keys))   # replicating everything does not fit
    masks, stats = _search.search(cm, budget)
    assert stats["method"] == "branch_and_bound" and stats["optimal"] is True
    assert stats["candidates"] > _search.GRID_LIMIT
    t = cm.step_time(masks)[0]
    assert sum(cm.memory(masks)) <= budget
    # No heuristic and no sampled plan within the budget is cheaper.
    other, s = _search.search(cm, budget, method="heuristic")
    least = t / (1 + _search.TOLERANCE) * (1 - 1e-12)    # t: within TOLERANCE of the least
    assert s["optimal"] is False and cm.step_time(other)[0] >= least
    keys, options = _search.search_space(cm)
    rng = np.random.default_rng(0)
    for _ in range(100):
        sample = [0] * cm.n_keys
        for k, o in zip(keys, options):
            sample[k] = int(rng.choice(o))
        ts, extras = cm.step_time(sample)
        assert ts >= least or sum(cm.memory(sample, extras)) > budget


def test_public_search_over_the_old_limit_says_how_it_searched(low_grid_limit):
    step, args = _llama_tiny()
    plan = sharding.plan(step, *args, mesh=sharding.abstract_mesh((2, 2, 2), ("a", "b", "c")),
                           profile="h100")
    assert plan.stats["candidates"] > _search.GRID_LIMIT
    assert plan.stats["method"] == "branch_and_bound" and plan.stats["optimal"] is True


def test_stopped_or_untabulated_search_says_not_proven(over_limit, monkeypatch):
    cm = over_limit
    exact = _search.search(cm)[1]["time"]
    for limits in (dict(time_limit=0.0), {}):
        if not limits:
            monkeypatch.setattr(_bound, "FRONTIER_LIMIT", 0)
        masks, stats = _search.search(cm, **limits)
        assert stats["method"] == "heuristic" and stats["optimal"] is False
        assert "branch and bound stopped" in stats["why"]
        assert stats["time"] >= exact / (1 + _search.TOLERANCE) * (1 - 1e-12)
    monkeypatch.setattr(_search, "TABLE_LIMIT", 1000)
    masks, stats = _search.search(cm)
    assert stats["method"] == "descent" and stats["optimal"] is False and "cost tables" in stats["why"]
    assert cm.step_time(masks)[0] >= exact / (1 + _search.TOLERANCE) * (1 - 1e-12)


def test_no_plan_fits_under_branch_and_bound():
    cfg = llama.LlamaConfig(n_layers=1, batch=8, time=128, embd=512, kv=4, grp=2, hd=64, mlp=2048, vocab=4096)
    step, args = _named(cfg)
    cm = _model(_plan.trace(step, *args)[1], (2, 2), ("x", "y"), "h100")
    budget = 0.01 * 2**30
    with pytest.raises(sharding.NoPlanFits) as exhaustive:
        _search.search(cm, budget, method="exhaustive")
    with pytest.raises(sharding.NoPlanFits, match=r"needs at least [\d.]+ [KMG]iB per dev") as bnb:
        _search.search(cm, budget, method="branch_and_bound")
    unit = {"KiB": 2**-20, "MiB": 2**-10, "GiB": 1.0}
    found = (re.search(r"needs (?:at least )?([\d.]+) ([KMG]iB)", str(e.value))
             for e in (bnb, exhaustive))
    needs = [float(m.group(1)) * unit[m.group(2)] for m in found]
    # a lower bound on the least memory (GiB), above the budget (3 significant digits)
    assert 0.01 < needs[0] <= needs[1] * 1.001


def test_unknown_method_is_named(graphs):
    cm = _model(graphs("named"), (2,), ("x",))
    with pytest.raises(ValueError, match="method 'bnb' is not one of"):
        _search.search(cm, method="bnb")


def test_benchmark_quick_runs_and_writes_nothing(capsys, monkeypatch):
    from benchmarks import _report, search_scale

    monkeypatch.setattr(_report, "write_section", lambda *a, **k: pytest.fail("quick wrote BENCHMARKS.md"))
    assert search_scale.main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert "branch and bound, proven" in out and "| tiny | unrolled |" in out
