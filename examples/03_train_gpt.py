"""03 · Train the named GPT from Python (the API behind `python -m jaxbackend train`).

Run: python examples/03_train_gpt.py [--tiny] [--out DIR]
"""

import argparse
import tempfile

from jaxbackend.train import TrainConfig, train


def main(tiny: bool, out: str) -> None:
    if tiny:
        cfg = TrainConfig(steps=40, batch=4, seq=32, layers=1, embd=32, heads=2, ckpt_every=0,
                          eval_every=0, max_chars=200_000, eval_batches=2, sample_chars=0,
                          warmup=5, out=out, quiet=True)
    else:
        cfg = TrainConfig(out=out)
    result = train(cfg, log=print)
    print(f"{result['steps_run']} steps in {result['elapsed']:.1f} s "
          f"({result['tok_s']:.0f} tokens/s after compile, {result['jit']})")
    print(f"validation {result['val']:.3f} vs unigram baseline {result['baseline']:.3f} nats/char")
    if result["val"] >= result["baseline"]:
        raise SystemExit("the model did not beat the unigram baseline")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny model and run (tests)")
    ap.add_argument("--out", default=None, help="output folder (default: a temp dir)")
    a = ap.parse_args()
    main(a.tiny, a.out or tempfile.mkdtemp(prefix="jaxbackend-example-"))
