"""The README's main-job command runs and reports agreement with jnp."""

import subprocess
import sys


def test_demo_runs_and_matches_jnp():
    r = subprocess.run([sys.executable, "-m", "jaxbackend", "demo", "--layers", "1"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "named == jnp: OK" in r.stdout
    assert "einsum  [batch time embd] x [embd head hd] -> [batch time head hd]" in r.stdout
