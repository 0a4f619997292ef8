"""`python -m jaxbackend train`: learns, resumes exactly after SIGKILL, and
fails with one-line errors (exit 2, no traceback)."""

import os
import pathlib
import re
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxbackend.train import _checkpoint, _cli

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = ["--tiny", "--quiet"]


def _cmd(*args):
    return [sys.executable, "-m", "jaxbackend", "train", *args]


@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory):
    # One persistent compilation cache for this module's subprocesses: the
    # killed and the resumed run reuse the uninterrupted run's executables
    # (same programs), which keeps the test's CPU time down. Numerics are
    # unaffected: a cached executable is the same compiled program.
    return str(tmp_path_factory.mktemp("jax-cache"))


def _env(cache=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("XLA_FLAGS", None)  # the CLI's own --devices decides
    if cache:
        env.update(JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    return env


def _params(folder):
    arrays, _ = _checkpoint.load(folder)  # path -> array, on one device
    return [np.asarray(arrays[k]) for k in sorted(arrays)]


def test_kill_mid_run_then_resume_matches_an_uninterrupted_run(tmp_path, jax_cache):
    steps = ["--steps", "60", "--ckpt-every", "10", "--eval-every", "0"]
    full = tmp_path / "full"
    done = subprocess.run(_cmd(*TINY, *steps, "--out", str(full)), env=_env(jax_cache), cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    # The uninterrupted run is also the "visibly learns" check of the tiny job.
    assert "vs unigram baseline" in done.stdout and "(below by" in done.stdout
    assert "sample (prompt from the validation text" in done.stdout
    assert (full / "loss.png").stat().st_size > 1000
    steps += ["--sample-chars", "0"]

    part = tmp_path / "part"
    proc = subprocess.Popen(_cmd(*TINY, *steps, "--out", str(part)), env=_env(jax_cache), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in proc.stdout:
        if line.startswith("checkpoint step 20"):
            # A hard kill while step 20 is being written in the background:
            # step 20 if its save finished, else step 10, never a torn one.
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    killed_at = _checkpoint.read_meta(part / "checkpoints")["step"]
    assert killed_at in (10, 20)

    resumed = subprocess.run(_cmd(*TINY, *steps, "--out", str(part), "--resume"), env=_env(jax_cache),
                             cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resumed from {part / 'checkpoints' / str(killed_at)} at step {killed_at}" in \
        resumed.stdout
    a, b = _params(full / "checkpoints"), _params(part / "checkpoints")
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert _checkpoint.read_meta(part / "checkpoints")["history"] == \
        _checkpoint.read_meta(full / "checkpoints")["history"]
    # The default --keep 3: the newest three of the six saves.
    assert _checkpoint.steps(full / "checkpoints") == [40, 50, 60]


@pytest.fixture(autouse=True)
def _keep_xla_flags(monkeypatch):
    # `main(--devices N)` rewrites XLA_FLAGS for its own process; in-process
    # calls must not leak that into later tests' subprocesses.
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))


def _run_main(args, capsys):
    code = _cli.main(args)
    err = capsys.readouterr().err.strip()
    return code, err


@pytest.mark.parametrize("args,needle", [
    (["--steps", "0"], "--steps: '0' must be > 0"),
    (["--lr", "abc"], "--lr: 'abc' is not a valid float"),
    (["--embd", "30", "--heads", "4"], "--embd 30 does not divide by --heads 4"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_arguments_one_line_exit_2(args, needle, capsys):
    code, err = _run_main(TINY + args, capsys)
    assert code == 2 and needle in err and len(err.splitlines()) == 1 and err.startswith("error:")


def test_missing_and_corrupt_checkpoint_one_line_exit_2(tmp_path, capsys):
    code, err = _run_main(TINY + ["--out", str(tmp_path), "--resume"], capsys)
    assert code == 2 and "no checkpoint in" in err and len(err.splitlines()) == 1
    meta = tmp_path / "checkpoints" / "3" / "meta"
    meta.mkdir(parents=True)
    (meta / "metadata").write_text('{"step": 3, "conf')  # a torn metadata file
    code, err = _run_main(TINY + ["--out", str(tmp_path), "--resume"], capsys)
    assert code == 2 and "is corrupt (meta: JSONDecodeError)" in err and len(err.splitlines()) == 1


def test_corrupt_arrays_one_line_exit_2(tmp_path, capsys):
    small = TINY + ["--eval-every", "0", "--sample-chars", "0", "--out", str(tmp_path)]
    assert _cli.main(small + ["--steps", "2"]) == 0
    step = tmp_path / "checkpoints" / "2"
    files = [f for f in (step / "state").rglob("*") if f.is_file() and f.parent.name == "d"]
    for f in files:  # every data file cut short
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    capsys.readouterr()
    code, err = _run_main(small + ["--steps", "3", "--resume"], capsys)
    assert code == 2 and err.startswith(f"error: checkpoint {step} is corrupt (")
    assert len(err.splitlines()) == 1, err


def test_dims_not_dividing_the_mesh_one_line_exit_2(tmp_path, capsys):
    assert jax.device_count() >= 3  # conftest fakes 8 CPU devices
    code, err = _run_main(TINY + ["--devices", "3", "--batch", "4", "--out", str(tmp_path)], capsys)
    assert code == 2 and "'batch' has size 4" in err and len(err.splitlines()) == 1


def test_error_in_a_fresh_process_has_no_traceback(tmp_path):
    r = subprocess.run(_cmd(*TINY, "--out", str(tmp_path), "--resume"), env=_env(), cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().startswith("error: no checkpoint in")


def test_devices_8_prints_the_searched_plan_and_trains(tmp_path, capsys):
    assert jax.device_count() >= 8  # conftest fakes 8 CPU devices
    code = _cli.main(TINY + ["--devices", "8", "--batch", "8", "--steps", "3", "--ckpt-every", "0",
                             "--eval-every", "0", "--sample-chars", "0", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    # the plan of the whole step: `batch`, drawn inside it, is one of its dims
    assert "| dim | mesh axes |" in out and re.search(r"^\| batch \| \S+ \|$", out, re.M)
    assert "checkpoint step 3" in out and (tmp_path / "loss.png").exists()
