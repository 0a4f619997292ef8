"""The package type-checks: `mypy jaxbackend` (settings in pyproject.toml's
[tool.mypy]: basic mode, third-party stubs not required) reports nothing.

Part of the README's test command through pytest, so a change that breaks
go-to-definition or a type checker's view of the public API fails CI."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_mypy_is_clean():
    out = subprocess.run([sys.executable, "-m", "mypy", "jaxbackend"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
