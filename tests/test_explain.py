"""`python -m jaxbackend explain`: the source lines each pass changed, and
`--corpus DIR`: per pass, the corpus programs it fired on."""

import pathlib
import textwrap

import pytest

from jaxbackend import _explain

SCRIPT = '''\
import jax
import jax.numpy as jnp
from jaxbackend import named as nx


def project(x, w):
    return (x.reshape(-1, x.shape[-1]) @ w).reshape(*x.shape[:-1], w.shape[-1])


def model(x, w, v):
    h = jnp.tanh(project(x, w))
    a = jnp.sin(h) + jnp.sin(h)
    s = nx.dot(nx.as_named(a, ("b", "t", "f")), nx.as_named(v, ("f", "g")), dim="f")
    return s.values


def example_inputs():
    return (jnp.ones((2, 3, 4)), jnp.ones((4, 5)), jnp.ones((5, 6)))
'''

PASSES = "fuse_projections,cse,dce,inline"


def _line(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


def _rows(out: str) -> dict:
    """pass -> [row text] of the 'source lines' section."""
    rows, current = {}, None
    for line in out.split("source lines each pass changed")[1].splitlines()[1:]:
        if line[2:3].strip():
            current = line.split()[0]
        rows.setdefault(current, []).append(line)
    return rows


def test_each_pass_names_the_source_lines_it_changed(tmp_path, capsys):
    script = tmp_path / "model.py"
    script.write_text(SCRIPT)
    assert _explain.main([f"{script}:model", "--passes", PASSES]) == 0
    rows = _rows(capsys.readouterr().out)
    proj = f"model.py:{_line(SCRIPT, '@ w')} (project)"
    dup = f"model.py:{_line(SCRIPT, 'jnp.sin(h) + jnp.sin(h)')} (model)"
    dot = f"model.py:{_line(SCRIPT, 'nx.dot(')} (model)"
    # fuse_projections replaces the flattened dot_general of `project` (the
    # innermost user frame, not its caller); dce drops the two reshapes.
    assert any(proj in r and "-1 " in r for r in rows["fuse_projections"]), rows
    assert any(proj in r and "-2 " in r and "+0 " in r for r in rows["dce"]), rows
    # cse: one of the two `sin`s on the line that computes it twice.
    assert any(dup in r and "-1 " in r and "+0 " in r for r in rows["cse"]), rows
    # inline: the named einsum, made inside jaxbackend.named, belongs to the
    # user's line that called nx.dot.
    assert any(dot in r and "-1 " in r for r in rows["inline"]), rows
    # Equations a pass traces carry the pass's stack (and, under pytest, this
    # test's frame): never attributed to a line of this file.
    assert not any(x in r for rs in rows.values() for r in rs
                   for x in ("jaxbackend", "_ops.py", "test_explain.py"))


def test_line_changes_count_removed_and_added_per_line(tmp_path):
    import jaxbackend as jb
    from jaxbackend._scripts import load_callable

    script = tmp_path / "model.py"
    script.write_text(SCRIPT)
    module, fn = load_callable(f"{script}:model", "function")
    report = jb.jit(fn, passes=PASSES.split(",")).trace_passes(*module.example_inputs())
    changes = dict(_explain.line_changes(report))
    assert list(changes) == PASSES.split(",")
    dup = f"model.py:{_line(SCRIPT, 'jnp.sin(h) + jnp.sin(h)')} (model)"
    assert changes["cse"] == [(dup, 1, 0)]
    # dce removes what fusion left dead, and nothing else changed lines.
    assert all(added == 0 for _, _, added in changes["dce"])
    # Every equation is counted once before and once after each pass.
    total = sum(r - a for rows in changes.values() for _, r, a in rows)
    stats = report.stats
    assert total == stats[0].eqns_before - stats[-1].eqns_after


CORPUS_FILE = '''\
import jax.numpy as jnp
from jaxbackend._corpus import Program


def flat(x, w):
    return (x.reshape(-1, 4) @ w).reshape(2, 3, 5)


def plain(x, w):
    return jnp.tanh(x) @ w


def args():
    return jnp.ones((2, 3, 4)), jnp.ones((4, 5))


CORPUS = [("flat", flat, args), Program("plain", plain, args)]
'''


def test_corpus_report_counts_programs_per_pass_and_flags_silent_ones(tmp_path, capsys):
    (tmp_path / "blocks.py").write_text(CORPUS_FILE)
    (tmp_path / "_helper.py").write_text("raise RuntimeError('helpers are not corpus files')\n")
    (tmp_path / "test_blocks.py").write_text("raise RuntimeError('tests are not corpus files')\n")
    assert _explain.main(["--corpus", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "2 programs" in out
    rows = {line.split()[0]: line for line in out.splitlines()[3:]}
    assert "1 / 2" in rows["fuse_projections"] and "flat" in rows["fuse_projections"]
    assert "plain" not in rows["fuse_projections"]
    for silent in ("reroll", "hoist_broadcast", "group_heads", "cse", "inline"):
        assert "0 / 2" in rows[silent] and "FIRES ON NOTHING" in rows[silent], rows[silent]


@pytest.mark.parametrize("argv, needle", [
    (["--corpus", "/nonexistent/corpus"], "does not exist"),
    (["x.py:f", "--corpus", "."], "not both"),
    ([], "not both and not neither"),
])
def test_corpus_errors_are_one_line(argv, needle, capsys):
    assert _explain.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_corpus_file_without_corpus_list_is_named(tmp_path, capsys):
    (tmp_path / "empty.py").write_text("X = 1\n")
    assert _explain.main(["--corpus", str(tmp_path)]) == 2
    assert "empty.py defines no CORPUS" in capsys.readouterr().err
