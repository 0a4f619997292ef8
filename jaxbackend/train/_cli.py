"""`python -m jaxbackend train`: train a char-level GPT on the stdlib source,
or your own model (`--model script.py:build`) on your own text (`--data FILE`).

Flags map one-to-one onto `TrainConfig`. Where a setting comes from, first
match wins: a flag given on the command line; with `--resume`, the value the
checkpoint recorded (so `--resume` alone continues the run as it was; of the
given flags, those that decide the numbers must agree with the checkpoint,
and `--steps` may grow to extend the run); `--tiny`'s small defaults (for
tests); the defaults `--help` shows. `--devices N` (N > 1) must act before
JAX creates its CPU client, so `main` sets `XLA_FLAGS`
(`jaxbackend._devices.cpu_device_flags`: N devices, and the scheduler setting
multi-device runs need) before anything asks JAX for devices (importing jax
is fine; the client is created lazily; reading a checkpoint's metadata
creates none).

Checkpoints go to `OUT/checkpoints/<step>` (orbax; see `_checkpoint`):
every `--ckpt-every` steps and at the end, written in the background while
training goes on; `--keep N` keeps the newest N steps.

A fresh run refuses a `--out` that already holds a run (a checkpoint or a
loss plot) unless `--overwrite`. SIGTERM, or a first Ctrl-C (SIGINT), ends
the run after the current step with a checkpoint, one line on stderr and
status 128 + the signal (143, 130); a second Ctrl-C interrupts at once
(mid-compile, say) without saving.

Every expected failure (bad flag, missing or corrupt checkpoint, dims that
do not divide the mesh, loss blow-up) prints ONE line `error: ...` to stderr
and exits with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import shutil
import signal
import sys

from jaxbackend._devices import cpu_device_flags

DEFAULTS = dict(steps=250, batch=32, seq=64, layers=2, embd=128, heads=4, lr=3e-3,
                ckpt_every=100, eval_every=100, max_chars=2_000_000, eval_batches=8,
                sample_chars=300, warmup=30)
TINY = dict(steps=40, batch=4, seq=32, layers=1, embd=32, heads=2, lr=3e-3, ckpt_every=10,
            eval_every=20, max_chars=200_000, eval_batches=2, sample_chars=40, warmup=5)
OTHER_DEFAULTS = dict(seed=0, out="runs/train", devices=1, data=None, model=None,
                      dtype="float32", accum=1, clip=1.0, keep=3, stack_layers=None)
GPT_FLAGS = ("layers", "embd", "heads", "dtype")   # set the built-in GPT only
CKPT_NAME = "checkpoints"   # = _loop.CKPT_NAME (not imported: _loop imports flax)
RUN_FILES = (CKPT_NAME, "loss.png", "metrics.jsonl")   # what a run leaves in --out
# Settings a resume must keep: they decide the numbers (see `TrainConfig.model_key`).
FIXED_ON_RESUME = ("batch", "seq", "layers", "embd", "heads", "lr", "seed", "max_chars",
                   "warmup", "weight_decay", "dtype", "accum", "clip", "stack_layers")


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse prints usage + message)
        raise _UsageError(message)


def _positive(kind):
    def parse(s):
        try:
            v = kind(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not a valid {kind.__name__}") from None
        if not math.isfinite(v):  # nan would pass `v <= 0` and surface as a nan loss
            raise argparse.ArgumentTypeError(f"{s!r} is not finite; give a number > 0")
        if v <= 0:
            raise argparse.ArgumentTypeError(f"{s!r} must be > 0")
        return v
    return parse


def _nonneg_int(s):
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a valid int") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"{s!r} must be >= 0")
    return v


def _nonneg_float(s):
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a valid float") from None
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"{s!r} must be a finite number >= 0")
    return v


def parser(*, given_only: bool = False) -> argparse.ArgumentParser:
    """The train command's parser. `given_only=True`: no defaults at all, so
    the parsed namespace holds exactly the flags on the command line."""
    from jaxbackend.passes.pipeline import REROLL_MIN_REPEATS  # imports jax: no client yet

    tiny = ", ".join(f"{k} {v}" for k, v in TINY.items())
    p = _Parser(prog="python -m jaxbackend train",
                description="Train a char-level GPT on the Python standard library's source "
                            "(no download), with checkpoints, a loss curve and a sample.",
                formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                argument_default=argparse.SUPPRESS if given_only else None)
    pi, pf = _positive(int), _positive(float)
    p.add_argument("--steps", type=pi, help="training steps (with --resume: the new total)")
    p.add_argument("--batch", type=pi, help="sequences per step")
    p.add_argument("--seq", type=pi, help="context length in chars")
    p.add_argument("--layers", type=pi, help="transformer blocks")
    p.add_argument("--embd", type=pi, help="model width")
    p.add_argument("--heads", type=pi, help="attention heads")
    p.add_argument("--lr", type=pf, help="peak AdamW learning rate")
    p.add_argument("--warmup", type=_nonneg_int,
                   help="linear learning-rate warmup steps, then cosine decay to lr/10")
    p.add_argument("--dtype", choices=("float32", "bfloat16"),
                   help="the GPT's compute dtype (parameters and optimizer stay float32)")
    p.add_argument("--accum", type=pi,
                   help="gradient accumulation: micro-batches of --batch per optimizer step")
    p.add_argument("--clip", type=_nonneg_float, help="gradient global-norm clip, 0 = none")
    p.add_argument("--data", metavar="FILE",
                   help="a text file to train on (chars; default: the stdlib source)")
    p.add_argument("--model", metavar="SCRIPT.py:NAME",
                   help="your model: NAME(vocab_size=, seq_len=, rngs=) returns an nnx.Module whose "
                        "loss(tokens, targets) method, or else whose logits, are trained "
                        "(default: the built-in GPT)")
    p.add_argument("--seed", type=_nonneg_int, help="init and data-order seed")
    p.add_argument("--out", help="folder for checkpoint and loss.png")
    p.add_argument("--ckpt-every", type=_nonneg_int,
                   help="checkpoint every N steps, 0 = only at the end")
    p.add_argument("--keep", type=pi, help="checkpoints kept (the newest; older are deleted)")
    p.add_argument("--eval-every", type=_nonneg_int,
                   help="validation every N steps, 0 = at the end")
    p.add_argument("--sample-chars", type=_nonneg_int,
                   help="chars to generate at the end, 0 = none")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in OUT/checkpoints with the flags it "
                        "was written with")
    p.add_argument("--overwrite", action="store_true",
                   help="start a fresh run even if OUT already holds one (deletes it)")
    p.add_argument("--devices", type=pi,
                   help="simulated CPU devices (N > 1: data mesh + sharding plan)")
    p.add_argument("--stack-layers", action=argparse.BooleanOptionalAction,
                   help="keep the blocks' weights (and optimizer state, checkpoint) as stacked "
                        "arrays: compile time flat in --layers; a resume keeps it. Default: "
                        f"stacked from {REROLL_MIN_REPEATS} identical layers (the step is rolled)")
    p.add_argument("--tiny", action="store_true", help=f"small defaults for tests: {tiny}")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    if not given_only:
        p.set_defaults(**DEFAULTS, **OTHER_DEFAULTS)
    return p


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def parse(argv):
    args = parser().parse_args(argv)
    given = set(vars(parser(given_only=True).parse_args(argv)))
    if args.tiny:
        for k, v in TINY.items():
            if k not in given:
                setattr(args, k, v)
    run = pathlib.Path(args.out)
    if args.resume:
        if args.overwrite:
            raise _UsageError("--overwrite starts a new run and --resume continues one; "
                              "give only one of them")
        _take_checkpoint_settings(args, given, run / CKPT_NAME)
    if args.model is not None:
        shaped = [_flag(k) for k in GPT_FLAGS if k in given]
        if shaped:
            raise _UsageError(f"{', '.join(shaped)} configure the built-in GPT, and --model builds "
                              f"its own model; drop {', '.join(shaped)} (set them in your factory)")
        # Only the path is checked here: running the script would create JAX's
        # client before --devices is set (the loop loads it).
        script = args.model.rpartition(":")[0]
        if not script or not pathlib.Path(script).is_file():
            raise _UsageError(f"--model {args.model}: {script or args.model!r} is not a .py file; "
                              f"give path/to/script.py:<factory name>")
    if args.data is not None and not pathlib.Path(args.data).is_file():
        raise _UsageError(f"--data {args.data}: no such file; give a path to a text file")
    if args.embd % args.heads:
        raise _UsageError(f"--embd {args.embd} does not divide by --heads {args.heads}; "
                          f"pick --embd a multiple of --heads")
    if args.seq < 2:
        raise _UsageError(f"--seq {args.seq} must be at least 2")
    # After the flag checks: a bad flag is reported as such even where --out
    # already holds a run (the README's main job leaves one in runs/train).
    from jaxbackend.train import _checkpoint  # numpy, jax, orbax imports only; no JAX client

    # A checkpoint folder holding only a killed first save's temp folder is no run.
    held = [n for n in RUN_FILES
            if (_checkpoint.steps(run / n) if n == CKPT_NAME else (run / n).exists())]
    if not args.resume and held and not args.overwrite:
        raise _UsageError(f"--out {run} already holds a run ({', '.join(held)}); pass --resume "
                          f"to continue it, --overwrite to replace it, or another --out")
    return args


def _take_checkpoint_settings(args, given: set, ckpt: pathlib.Path) -> None:
    """Fill every setting not given on the command line from the checkpoint;
    a given flag that decides the numbers must equal the recorded value."""
    from jaxbackend.train import _checkpoint  # numpy, jax, orbax imports only; no JAX client

    meta = _checkpoint.read_meta(ckpt)
    saved = {**_checkpoint.RECORDED_SINCE, **meta.get("config", {}), **meta.get("settings", {})}
    for k, v in saved.items():
        if k not in given:
            setattr(args, k, v)
        elif k in FIXED_ON_RESUME and getattr(args, k) != v:
            raise _UsageError(f"{_flag(k)} {getattr(args, k)} differs from the checkpoint's {v}, "
                              f"and a resumed run keeps it; drop {_flag(k)} or start a new run "
                              f"in another --out")
    if args.steps < meta["step"]:
        raise _UsageError(f"--steps {args.steps} is below the checkpoint's step {meta['step']}; "
                          f"pass --steps {meta['step']} or more (more extends the run)")


def _set_devices(n: int) -> None:
    if n > 1:
        os.environ["XLA_FLAGS"] = cpu_device_flags(n, os.environ.get("XLA_FLAGS", ""))


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse(argv)
    except _UsageError as e:
        print(f"error: {e} (see python -m jaxbackend train --help)", file=sys.stderr)
        return 2
    except ValueError as e:  # CheckpointError: --resume found no readable checkpoint
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    _set_devices(args.devices)
    from jaxbackend.train import _loop
    from jaxbackend.train._checkpoint import CheckpointError

    if args.overwrite:
        for name in RUN_FILES:
            path = pathlib.Path(args.out) / name
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    cfg = _loop.TrainConfig(**{f: getattr(args, f) for f in _loop.TrainConfig.__dataclass_fields__
                               if hasattr(args, f)})
    # SIGTERM (kill, a scheduler's preemption) and a first Ctrl-C only raise
    # a flag: the loop saves after the step in flight and raises `Stopped`.
    signals: list = []

    def on_signal(signum, frame):
        if signum == signal.SIGINT and signals:
            raise KeyboardInterrupt   # a second Ctrl-C: stop now
        signals.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        _loop.train(cfg, log=lambda s: print(s, flush=True), stop=lambda: bool(signals))
    except _loop.Stopped as e:
        name = signal.Signals(signals[0]).name
        print(f"stopped by {name} after step {e.step}; checkpoint saved to {e.ckpt}; rerun with "
              f"--resume to continue", file=sys.stderr)
        return 128 + signals[0]
    except (CheckpointError, ValueError, FloatingPointError, OSError) as e:
        msg = " ".join(str(e).split())
        print(f"error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted; rerun with --resume to continue from the last checkpoint",
              file=sys.stderr)
        return 130
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 0
