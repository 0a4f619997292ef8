"""`python -m jaxbackend train` at its edges: run folders, --resume reusing
the checkpoint's flags, SIGTERM, stale temp files, the progress bar on a
terminal, argument checks and --help."""

import io
import os
import pathlib
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

from jaxbackend.train import _checkpoint, _cli, _loop, _progress

ROOT = pathlib.Path(__file__).resolve().parents[2]
SMALL = ["--tiny", "--steps", "3", "--batch", "2", "--seq", "16", "--embd", "16", "--heads", "2",
         "--eval-every", "0", "--sample-chars", "0"]


@pytest.fixture(autouse=True)
def _keep_xla_flags(monkeypatch):
    # `main(--devices N)` rewrites XLA_FLAGS for its own process.
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))


def _main(args, capsys):
    code = _cli.main(args)
    return code, capsys.readouterr().err.strip()


def _one_line_error(code, err, *needles):
    assert code == 2 and err.startswith("error:") and len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, err


def test_help_shows_every_default():
    text = " ".join(_cli.parser().format_help().split())
    for words in ("training steps (with --resume: the new total) (default: 250)",
                  "validation every N steps, 0 = at the end (default: 100)",
                  "folder for checkpoint and loss.png (default: runs/train)",
                  "simulated CPU devices (N > 1: data mesh + sharding plan) (default: 1)",
                  "small defaults for tests: steps 40, batch 4"):
        assert words in text


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_lr_must_be_finite(value, capsys):
    _one_line_error(*_main(["--tiny", f"--lr={value}"], capsys), f"--lr: '{value}' is not finite")


def test_a_fresh_run_refuses_a_folder_that_holds_a_run(tmp_path, capsys):
    earlier = tmp_path / "checkpoints" / "7"
    earlier.mkdir(parents=True)
    (earlier / "note").write_bytes(b"an earlier run")
    _one_line_error(*_main(SMALL + ["--out", str(tmp_path)], capsys),
                    f"--out {tmp_path} already holds a run (checkpoints)", "--overwrite",
                    "--resume")
    _one_line_error(*_main(SMALL + ["--out", str(tmp_path), "--resume", "--overwrite"], capsys),
                    "give only one of them")
    assert (earlier / "note").read_bytes() == b"an earlier run"


def test_overwrite_replaces_the_earlier_run(tmp_path, capsys):
    earlier = tmp_path / "checkpoints" / "7"
    earlier.mkdir(parents=True)
    assert _cli.main(SMALL + ["--quiet", "--out", str(tmp_path), "--overwrite"]) == 0
    assert _checkpoint.steps(tmp_path / "checkpoints") == [3]


def _fake_checkpoint(folder, **config):
    cfg = _loop.TrainConfig(**{**dict(steps=3, batch=2, seq=16, layers=1, embd=16, heads=2,
                                      max_chars=1000), **config})
    meta = dict(step=3, config=cfg.model_key(), settings=cfg.settings(), history=[], val_history=[])
    _checkpoint.save(folder / "checkpoints", {"x": np.zeros(2, np.float32)}, meta)
    return folder / "checkpoints"


def test_resume_errors_name_flags_that_exist(tmp_path, capsys):
    # the CLI's copies of _loop's names (it avoids importing flax before parsing)
    assert set(_cli.FIXED_ON_RESUME) == set(_loop.TrainConfig().model_key()) - {"steps"}
    assert _cli.CKPT_NAME == _loop.CKPT_NAME
    ckpt = _fake_checkpoint(tmp_path)
    out = ["--resume", "--out", str(tmp_path)]
    _one_line_error(*_main(out + ["--embd", "32"], capsys),
                    "--embd 32 differs from the checkpoint's 16", "drop --embd")
    _one_line_error(*_main(out + ["--steps", "2"], capsys),
                    "--steps 2 is below the checkpoint's step 3")
    # max_chars is no flag (only --tiny sets it): the API error names the field
    with pytest.raises(_checkpoint.CheckpointError, match="max_chars=1000 .checkpoint.") as e:
        _checkpoint.check_resumable(ckpt, _loop.TrainConfig(steps=3, batch=2, seq=16, layers=1,
                                                             embd=16, heads=2,
                                                             max_chars=200_000).model_key())
    assert "--max-chars" not in str(e.value)


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def _screen_lines(text: str) -> list:
    """The lines a terminal shows: ANSI control sequences dropped, a
    carriage return starts the line again."""
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)
    return [part for line in text.split("\n") for part in line.split("\r") if part.strip()]


def test_progress_off_a_terminal_is_plain_lines():
    log = io.StringIO()
    with _progress.Progress(40, start=10, stream=log) as bar:
        for step in range(11, 41):
            bar.update(step, 2.5, 12_345.0)
    lines = log.getvalue().splitlines()
    assert lines[0] == "step    12/40  loss 2.5000  12.3k tok/s"
    assert [int(line.split()[1].split("/")[0]) for line in lines] == list(range(12, 41, 2))
    assert "\x1b" not in log.getvalue() and "\r" not in log.getvalue()


def test_resume_reuses_the_checkpoints_flags_and_more_steps_extend(tmp_path, monkeypatch):
    # A save killed before its rename leaves a temp folder; the next run removes it.
    stale = tmp_path / "checkpoints" / "2.orbax-checkpoint-tmp-1795423820"
    stale.mkdir(parents=True)
    (stale / "partial").write_bytes(b"partial")
    screen = _Terminal()  # stdout and stderr on one terminal, as in a shell
    monkeypatch.setattr(sys, "stdout", screen)
    monkeypatch.setattr(sys, "stderr", screen)
    assert _cli.main(SMALL + ["--ckpt-every", "1", "--keep", "2", "--lr", "0.002", "--out",
                              str(tmp_path)]) == 0
    text = screen.getvalue()
    assert not stale.exists() and f"removed {stale}" in text
    lines = _screen_lines(text)
    # rich's bar was drawn, and each message got a line of its own above it
    assert any(re.match(r"step 3/3 .*loss \d\.\d{4} .*tok/s", line) for line in lines), lines
    assert sum(line.startswith("checkpoint step") for line in lines) == 3
    assert not [line for line in lines if "tok/s" in line and "checkpoint" in line]
    assert _checkpoint.steps(tmp_path / "checkpoints") == [2, 3]  # --keep 2

    screen.seek(0), screen.truncate()
    # No flags but --steps: model, data, schedule and --ckpt-every come from the checkpoint.
    assert _cli.main(["--resume", "--steps", "5", "--quiet", "--out", str(tmp_path)]) == 0, \
        screen.getvalue()
    assert f"resumed from {tmp_path / 'checkpoints' / '3'} at step 3" in screen.getvalue()
    assert "checkpoint step 4" in screen.getvalue()
    assert _checkpoint.steps(tmp_path / "checkpoints") == [4, 5]  # --keep 2 is kept too
    meta = _checkpoint.read_meta(tmp_path / "checkpoints")
    assert meta["step"] == 5 and len(meta["history"]) == 5
    assert {k: meta["settings"][k] for k in ("embd", "seq", "batch", "lr", "max_chars")} == \
        dict(embd=16, seq=16, batch=2, lr=0.002, max_chars=_cli.TINY["max_chars"])


@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory):
    # One persistent compilation cache for the signalled runs: the second
    # run (the same program) reuses the first one's executables instead of
    # compiling them again. A cached executable is the same compiled program.
    return str(tmp_path_factory.mktemp("jax-cache"))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_sigterm_saves_a_checkpoint_and_exits_with_a_message(tmp_path, sig, jax_cache):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               JAX_COMPILATION_CACHE_DIR=jax_cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, "-m", "jaxbackend", "train", *SMALL, "--steps", "5000", "--quiet",
           "--ckpt-every", "0", "--out", str(tmp_path)]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    for line in proc.stdout:
        if line.startswith("unigram baseline"):  # the last line before the first step
            proc.send_signal(sig)
            break
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, err[-2000:]
    step = _checkpoint.read_meta(tmp_path / "checkpoints")["step"]
    assert 1 <= step < 5000
    assert err.strip() == (f"stopped by {sig.name} after step {step}; checkpoint saved to "
                           f"{tmp_path / 'checkpoints' / str(step)}; rerun with --resume to "
                           f"continue")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "metrics.jsonl"]
    assert _checkpoint.steps(tmp_path / "checkpoints") == [step]  # finished before the exit


def test_explain_unknown_pass_is_one_line(capsys):
    from jaxbackend import _explain

    target = str(ROOT / "examples" / "explain_target.py") + ":train_step"
    code = _explain.main([target, "--passes", "cse,bogus"])
    _one_line_error(code, capsys.readouterr().err.strip(), "'bogus'")
