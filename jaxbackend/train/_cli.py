"""`python -m jaxbackend train`: train a char-level GPT on the stdlib source.

Flags map one-to-one onto `TrainConfig`; `--tiny` picks small defaults for
tests (any flag given explicitly still wins). `--devices N` (N > 1) must act
before JAX creates its CPU client, so `main` sets
`XLA_FLAGS=--xla_force_host_platform_device_count=N` before anything asks
JAX for devices (importing jax is fine; the client is created lazily).

Every expected failure (bad flag, missing or corrupt checkpoint, dims that
do not divide the mesh, loss blow-up) prints ONE line `error: ...` to stderr
and exits with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import os
import sys

DEFAULTS = dict(steps=250, batch=32, seq=64, layers=2, embd=128, heads=4, lr=3e-3,
                ckpt_every=100, eval_every=100, max_chars=2_000_000, eval_batches=8,
                sample_chars=300, warmup=30)
TINY = dict(steps=40, batch=4, seq=32, layers=1, embd=32, heads=2, lr=3e-3, ckpt_every=10,
            eval_every=20, max_chars=200_000, eval_batches=2, sample_chars=40, warmup=5)


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


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m jaxbackend train",
                description="Train a char-level GPT on the Python standard library's source "
                            "(no download), with checkpoints, a loss curve and a sample.")
    pi, pf = _positive(int), _positive(float)
    p.add_argument("--steps", type=pi, help=f"training steps (default {DEFAULTS['steps']})")
    p.add_argument("--batch", type=pi, help=f"sequences per step (default {DEFAULTS['batch']})")
    p.add_argument("--seq", type=pi, help=f"context length in chars (default {DEFAULTS['seq']})")
    p.add_argument("--layers", type=pi, help=f"transformer blocks (default {DEFAULTS['layers']})")
    p.add_argument("--embd", type=pi, help=f"model width (default {DEFAULTS['embd']})")
    p.add_argument("--heads", type=pi, help=f"attention heads (default {DEFAULTS['heads']})")
    p.add_argument("--lr", type=pf, help=f"peak AdamW learning rate (default {DEFAULTS['lr']})")
    p.add_argument("--seed", type=_nonneg_int, default=0, help="init and data-order seed")
    p.add_argument("--out", default="runs/train", help="folder for checkpoint and loss.png")
    p.add_argument("--ckpt-every", type=_nonneg_int,
                   help=f"checkpoint every N steps, 0 = only at the end (default {DEFAULTS['ckpt_every']})")
    p.add_argument("--eval-every", type=_nonneg_int, help="validation every N steps")
    p.add_argument("--sample-chars", type=_nonneg_int,
                   help=f"chars to generate at the end, 0 = none (default {DEFAULTS['sample_chars']})")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.ckpt")
    p.add_argument("--devices", type=pi, default=1,
                   help="simulated CPU devices (N > 1: data mesh + sharding plan)")
    p.add_argument("--tiny", action="store_true", help="tiny model and run (for tests)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def parse(argv):
    args = parser().parse_args(argv)
    base = TINY if args.tiny else DEFAULTS
    for k, v in base.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    if args.embd % args.heads:
        raise _UsageError(f"--embd {args.embd} does not divide by --heads {args.heads}; "
                          f"pick --embd a multiple of --heads")
    if args.seq < 2:
        raise _UsageError(f"--seq {args.seq} must be at least 2")
    return args


def _set_devices(n: int) -> None:
    if n > 1:
        flag = f"--xla_force_host_platform_device_count={n}"
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
                 if not f.startswith("--xla_force_host_platform_device_count")]
        os.environ["XLA_FLAGS"] = " ".join(flags + [flag])


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse(argv)
    except _UsageError as e:
        print(f"error: {e} (see python -m jaxbackend train --help)", file=sys.stderr)
        return 2
    _set_devices(args.devices)
    from jaxbackend.train import _checkpoint, _loop

    cfg = _loop.TrainConfig(**{f: getattr(args, f) for f in _loop.TrainConfig.__dataclass_fields__
                               if hasattr(args, f)})
    try:
        _loop.train(cfg, log=lambda s: print(s, flush=True))
    except (_checkpoint.CheckpointError, ValueError, FloatingPointError, OSError) as e:
        msg = " ".join(str(e).split())
        print(f"error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted; rerun with --resume to continue from the last checkpoint",
              file=sys.stderr)
        return 130
    return 0
