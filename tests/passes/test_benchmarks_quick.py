"""The pass benchmarks' --quick smoke runs (no BENCHMARKS.md writes), and the
`explain` command on the shipped example."""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


@pytest.mark.parametrize("name", ["pass_scaling", "dispatch"])  # xsa: below
def test_benchmark_quick_mode_runs_and_reports(name, capsys, monkeypatch):
    import importlib

    from benchmarks import _report

    monkeypatch.setattr(_report, "write_section", lambda *a, **k: pytest.fail("quick wrote BENCHMARKS.md"))
    mod = importlib.import_module(f"benchmarks.{name}")
    assert mod.main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert "| " in out and ("MET" in out or "MISSED" in out)


def test_xsa_quick_meets_both_targets(capsys, monkeypatch):
    """At quick sizes the pass makes the expand forward as cheap as unsqueeze;
    with grad it only lowers flops (runtime factors are not sunk: _sink_sum)."""
    from benchmarks import _report, xsa

    monkeypatch.setattr(_report, "write_section", lambda *a, **k: pytest.fail("quick wrote BENCHMARKS.md"))
    results = xsa.run((1, 8, 2, 2, 8), repeat=1)
    for mode in ("forward", "forward+grad"):
        after = results[(mode, "expand", "jb.jit")]
        ref = results[(mode, "unsqueeze", "jax.jit")]
        before = results[(mode, "expand", "jax.jit")]
        if mode == "forward":
            assert after["flops"] <= 1.05 * ref["flops"] < before["flops"], mode
        else:
            assert after["flops"] < before["flops"], mode
        assert after["fusions"] <= ref["fusions"], mode
    assert xsa.render(results, (1, 8, 2, 2, 8)).count("MET (target") == 1


def test_explain_cli_prints_the_report_for_the_example():
    r = subprocess.run([sys.executable, "-m", "jaxbackend", "explain",
                        "examples/explain_target.py:train_step", "--passes", "inline_calls,fuse_projections,dce"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "fuse_projections" in r.stdout and "forward chain fused: 4" in r.stdout
    assert "weight-grad chain fused: 2" in r.stdout


def test_explain_errors_name_the_fix(capsys):
    from jaxbackend import _explain

    target = str(ROOT / "examples" / "explain_target.py")
    assert _explain.main([target]) == 2
    assert "path/to/script.py:function" in capsys.readouterr().err
    assert _explain.main([target + ":nope"]) == 2
    err = capsys.readouterr().err
    assert "no function 'nope'" in err and "train_step" in err
    assert _explain.main([str(ROOT / "benchmarks" / "_report.py") + ":table"]) == 2
    assert "example_inputs_table()" in capsys.readouterr().err
