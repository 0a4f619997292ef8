"""`train` with the user's own model, loss and data: what it trains is what
was given (an instance or a factory, a loss written against the module, a
text, a file or token ids), a resume checks it is the same, and the CLI's
`--model`/`--data` reach the same code with one-line errors."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxbackend import named as nx
from jaxbackend.models import GPT, lm_loss
from jaxbackend.testing import assert_close
from jaxbackend.train import CheckpointError, TrainConfig, _data, train
from jaxbackend.train import _cli as _cli_module

ROOT = pathlib.Path(__file__).resolve().parents[2]
TEXT = (ROOT / "README.md").read_text() * 4

FACTORY = '''
import jax.numpy as jnp
from flax import nnx


class Bigram(nnx.Module):
    """Plain Flax layers, plain arrays: logits (batch, time, vocab), no loss method."""

    def __init__(self, vocab_size, rngs):
        self.emb = nnx.Embed(vocab_size, 16, rngs=rngs)
        self.out = nnx.Linear(16, vocab_size, rngs=rngs)

    def __call__(self, tokens):
        return self.out(jnp.tanh(self.emb(tokens)))


def build(vocab_size, seq_len, rngs):
    return Bigram(vocab_size, rngs)
'''


def _cfg(tmp_path, **kw):
    base = dict(steps=6, batch=4, seq=16, ckpt_every=0, eval_every=0, eval_batches=1,
                sample_chars=5, warmup=2, out=str(tmp_path / "run"), quiet=True)
    return TrainConfig(**{**base, **kw})


@pytest.fixture
def factory_file(tmp_path):
    path = tmp_path / "bigram.py"
    path.write_text(FACTORY)
    return path


class Plain(nnx.Module):
    def __init__(self, vocab_size, rngs):
        self.emb = nnx.Embed(vocab_size, 8, rngs=rngs)
        self.out = nnx.Linear(8, vocab_size, rngs=rngs)

    def __call__(self, tokens):
        return self.out(self.emb(tokens))


def test_the_given_loss_is_what_trains(tmp_path):
    offset = 100.0   # a loss no language model reaches: proves which function ran

    def loss(model, x, y):
        return lm_loss(model(x), y) + offset

    r = train(_cfg(tmp_path), log=lambda s: None, model=Plain(128, nnx.Rngs(0)), loss=loss,
              data=TEXT)
    assert len(r["history"]) == 6 and all(h > offset for h in r["history"])
    assert r["val"] > offset


def test_a_model_without_a_loss_method_trains_on_its_logits(tmp_path):
    model = Plain(128, nnx.Rngs(1))
    ids = _data.as_ids(TEXT)
    train_ids = jnp.asarray(_data.split(ids)[0])
    x, y = _data.get_batch(train_ids, 0, 0, 4, 16)
    expected = optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()
    r = train(_cfg(tmp_path, steps=2, sample_chars=0), log=lambda s: None, model=model, data=TEXT)
    # Step 1's loss is the loss of the initial parameters on batch 0.
    assert_close(r["history"][0], expected, scale=expected)


def test_factory_and_data_file_resume_and_extend(tmp_path, factory_file):
    data = tmp_path / "corpus.txt"
    data.write_text(TEXT)
    cfg = _cfg(tmp_path, model=f"{factory_file}:build", data=str(data))
    lines = []
    first = train(cfg, log=lines.append)
    assert any("tokens of " + str(data) in s and f"{factory_file}:build" in s for s in lines)
    more = train(_cfg(tmp_path, model=cfg.model, data=cfg.data, steps=9, resume=True),
                 log=lines.append)
    assert more["steps_run"] == 3 and more["history"][:6] == first["history"]
    data.write_text(TEXT + "changed")
    with pytest.raises(CheckpointError, match="the data differs"):
        train(_cfg(tmp_path, model=cfg.model, data=cfg.data, steps=12, resume=True),
              log=lambda s: None)


def test_a_resume_refuses_another_model(tmp_path, factory_file):
    train(_cfg(tmp_path, model=f"{factory_file}:build"), log=lambda s: None)
    with pytest.raises(CheckpointError, match=r"model='.*bigram.py:build' \(checkpoint\) vs 'GPT'"):
        train(_cfg(tmp_path, resume=True, steps=8), log=lambda s: None)


def test_token_ids_beyond_the_chars_widen_the_vocabulary(tmp_path):
    ids = np.random.default_rng(0).integers(0, 300, 4000)
    r = train(_cfg(tmp_path, steps=2, sample_chars=0, layers=1, embd=16, heads=2),
              log=lambda s: None, data=ids)
    assert r["params"]["tok"]["embedding"].shape[0] == 300


@pytest.mark.parametrize("bad, match", [
    (np.zeros((4, 4), np.int32), "1-d array of integer token ids"),
    (np.array([1, -2, 3]), "negative token id -2"),
])
def test_bad_data_is_one_clear_error(tmp_path, bad, match):
    with pytest.raises(ValueError, match=match):
        train(_cfg(tmp_path), log=lambda s: None, data=bad)


def test_a_factory_must_return_a_module(tmp_path):
    with pytest.raises(TypeError, match="returned dict; it must return an nnx.Module"):
        train(_cfg(tmp_path), log=lambda s: None, model=lambda **kw: {})


def test_lm_loss_matches_optax_for_named_plain_and_bf16_logits():
    k1, k2 = jax.random.split(jax.random.key(0))
    logits = jax.random.normal(k1, (2, 5, 11)) * 3
    y = jax.random.randint(k2, (2, 5), 0, 11)
    ref = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    named = nx.as_named(logits, ("batch", "time", "vocab")).transpose("vocab", "batch", "time")
    for got in (lm_loss(logits, y), lm_loss(named, y),
                lm_loss(named, nx.as_named(y, ("batch", "time")))):
        assert_close(got, ref, scale=ref)
    half = lm_loss(logits.astype(jnp.bfloat16), y)
    assert half.dtype == jnp.float32
    ref_half = optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.bfloat16).astype(jnp.float32), y).mean()
    assert_close(half, ref_half, scale=ref_half)


def test_gpt_loss_is_lm_loss_of_its_logits():
    from jaxbackend.models import GPTConfig

    model = GPT(GPTConfig(n_layers=1, embd=16, heads=2, seq_len=8), rngs=nnx.Rngs(0))
    x = jax.random.randint(jax.random.key(1), (2, 8), 0, 128)
    ref = optax.softmax_cross_entropy_with_integer_labels(
        model(x).transpose("batch", "time", "vocab").values, x).mean()
    assert_close(model.loss(x, x), ref, scale=ref)


def _cli(args, capsys, monkeypatch, cwd):
    """`python -m jaxbackend train --tiny --quiet ARGS` in this process, run
    from `cwd`: (exit code, stdout, stderr)."""
    monkeypatch.chdir(cwd)
    code = _cli_module.main(["--tiny", "--quiet", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_trains_a_model_script_on_a_data_file(tmp_path, factory_file, capsys, monkeypatch):
    (tmp_path / "corpus.txt").write_text(TEXT)
    code, out, err = _cli(["--model", "bigram.py:build", "--data", "corpus.txt", "--steps", "20",
                           "--sample-chars", "0"], capsys, monkeypatch, tmp_path)
    assert code == 0, err[-2000:]
    assert "tokens of corpus.txt" in out and "model: bigram.py:build" in out


@pytest.mark.parametrize("args, message", [
    (["--model", "bigram.py:build", "--layers", "3"],
     "--layers configure the built-in GPT, and --model builds its own model; drop --layers"),
    (["--model", "missing.py:build"], "--model missing.py:build: 'missing.py' is not a .py file"),
    (["--model", "bigram.py:nope"], "bigram.py has no model factory 'nope'; callables there: "),
    (["--data", "missing.txt"], "--data missing.txt: no such file"),
])
def test_cli_model_and_data_errors_are_one_line(tmp_path, factory_file, args, message, capsys,
                                                monkeypatch):
    code, _, err = _cli(args, capsys, monkeypatch, tmp_path)
    assert code == 2 and "Traceback" not in err
    assert message in err and len(err.strip().splitlines()) == 1, err
