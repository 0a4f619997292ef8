"""Every numbered example runs with --tiny in a fresh process, exits 0, and
stays a single file under 200 lines."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# explain_target.py (another area's helper module) is not a numbered example.
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("[0-9][0-9]_*.py"))


def test_examples_are_numbered_and_short():
    assert len(EXAMPLES) >= 4
    for p in EXAMPLES:
        assert len(p.read_text().splitlines()) < 200, p.name
        assert "--tiny" in p.read_text(), p.name


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_runs_tiny(path, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("XLA_FLAGS", None)  # each example sets up its own devices
    # an example that writes a run writes it here (its default, a new temp
    # dir, would outlive the test)
    out = ["--out", str(tmp_path)] if "--out" in path.read_text() else []
    r = subprocess.run([sys.executable, str(path), "--tiny", *out], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{path.name} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    assert r.stdout.strip(), f"{path.name} printed nothing"
