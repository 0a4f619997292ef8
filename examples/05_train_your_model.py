"""05 · Train your own NNX model on your own text, with the loop behind `python -m jaxbackend train`.

A LLaMA-style model (RMSNorm, rotary positions, grouped-query attention 4/2,
SwiGLU) written with `jaxbackend.nn`, its own loss (cross entropy plus
PaLM's z-loss), and a text file: the loop gives it evaluation against the unigram baseline,
checkpoints with resume, a sample and the loss curve. The same model from
the command line (a factory `build(vocab_size=, seq_len=, rngs=)`):

    python -m jaxbackend train --model examples/05_train_your_model.py:build --data FILE.txt

Run: python examples/05_train_your_model.py [--tiny] [--data FILE] [--out DIR]
(without --data: this repository's own source, written to OUT/corpus.txt)
"""

import argparse
import pathlib
import tempfile

import jax.numpy as jnp
from flax import nnx

from jaxbackend import named as nx
from jaxbackend import nn
from jaxbackend.train import TrainConfig, train


class TinyLlama(nnx.Module):
    def __init__(self, vocab_size: int, seq_len: int, *, embd: int = 64, heads: int = 4,
                 kv_heads: int = 2, layers: int = 2, rngs: nnx.Rngs):
        self.tok = nn.Embedding(vocab_size, embd, rngs=rngs)
        self.blocks = nnx.List([
            nn.TransformerBlock(embd, heads, kv_heads=kv_heads, activation="swiglu",
                                norm="rmsnorm", rotary=True, use_bias=False, rngs=rngs)
            for _ in range(layers)])
        self.norm = nn.RMSNorm({"embd": embd}, rngs=rngs)
        self.seq_len = seq_len

    def __call__(self, tokens) -> nx.NamedArray:
        x = self.tok(nx.as_named(tokens, ("batch", "time")))
        for block in self.blocks:
            x = block(x)
        return self.tok.attend(self.norm(x))      # logits: batch time vocab


def build(vocab_size: int, seq_len: int, rngs: nnx.Rngs) -> TinyLlama:
    """The factory `--model` calls."""
    return TinyLlama(vocab_size, seq_len, rngs=rngs)


def z_loss(model: TinyLlama, tokens, targets, weight: float = 1e-4):
    """Cross entropy plus weight * log(Z)^2, which keeps the logits' scale in
    check (PaLM), by name: no `.values` until the scalar, no axis numbers."""
    logits = model(tokens).astype(jnp.float32)
    nll = nx.cross_entropy(logits, nx.as_named(targets, ("batch", "time")), dim="vocab")
    log_z = nx.logsumexp(logits, dim="vocab")
    return (nll + weight * log_z * log_z).mean().values


def main(tiny: bool, data: str, out: str) -> None:
    if tiny:
        cfg = TrainConfig(steps=20, batch=4, seq=32, ckpt_every=10, eval_every=0, eval_batches=2,
                          sample_chars=20, warmup=5, out=out, quiet=True)
        model = TinyLlama(128, cfg.seq, embd=32, layers=1, rngs=nnx.Rngs(0))
    else:
        cfg = TrainConfig(steps=300, out=out)
        model = build(128, cfg.seq, nnx.Rngs(0))
    if data is None:  # stands in for your text: this package's source, as one file
        root = pathlib.Path(__file__).resolve().parents[1] / "jaxbackend"
        data = pathlib.Path(out) / "corpus.txt"
        data.write_text("".join(p.read_text() for p in sorted(root.rglob("*.py"))))
    text = pathlib.Path(data).read_text(encoding="utf-8", errors="replace")
    result = train(cfg, log=print, model=model, loss=z_loss, data=text)
    print(f"{result['steps_run']} steps in {result['elapsed']:.1f} s; validation "
          f"{result['val']:.3f} vs unigram baseline {result['baseline']:.3f} nats/char "
          f"(cross entropy + z-loss)")
    # Resume and extend: same model, loss and data; 5 more steps.
    more = train(TrainConfig(**{**cfg.__dict__, "steps": cfg.steps + 5, "resume": True}),
                 log=print, model=model, loss=z_loss, data=text)
    print(f"resumed at step {cfg.steps} and ran {more['steps_run']} more steps")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny model and run (tests)")
    ap.add_argument("--data", default=None,
                    help="a text file to train on (default: this repository's source)")
    ap.add_argument("--out", default=None, help="output folder (default: a temp dir)")
    a = ap.parse_args()
    main(a.tiny, a.data, a.out or tempfile.mkdtemp(prefix="jaxbackend-example-"))
