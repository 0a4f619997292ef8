"""Training options a user keeps: bfloat16 compute with float32 master
weights, gradient accumulation, the clip norm, and the metrics log."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax import nnx

from jaxbackend import nn
from jaxbackend.models import GPT
from jaxbackend.testing import assert_close
from jaxbackend.train import CheckpointError, TrainConfig, _cli, _data, train

SMALL = dict(batch=4, seq=32, layers=1, embd=32, heads=2, max_chars=200_000, eval_batches=2,
             sample_chars=0, warmup=5, quiet=True)


def _cfg(tmp_path, **kw):
    return TrainConfig(**{**SMALL, "steps": 4, "ckpt_every": 0, "eval_every": 0,
                          "out": str(tmp_path / "run"), **kw})


def test_bfloat16_compute_keeps_float32_weights_and_learns(tmp_path):
    r = train(_cfg(tmp_path, steps=60, dtype="bfloat16"), log=lambda s: None)
    assert {p.dtype for p in jax.tree.leaves(r["params"])} == {jnp.dtype(jnp.float32)}
    assert r["val"] < r["baseline"], (r["val"], r["baseline"])


def test_accumulation_averages_the_micro_batch_gradients(tmp_path):
    cfg = _cfg(tmp_path, steps=1, accum=3, clip=0)
    r = train(cfg, log=lambda s: None)
    # Step 1's loss: the mean over micro-batches 0, 1, 2 of the initial model.
    model = GPT(cfg.model_config(), rngs=nnx.Rngs(cfg.seed))
    params, loss_fn = nn.functional(model, "loss")
    data = jnp.asarray(_data.split(_data.load_corpus(cfg.max_chars))[0])
    losses = [loss_fn(params, *_data.get_batch(data, cfg.seed, i, cfg.batch, cfg.seq))
              for i in range(3)]
    expected = np.mean(losses)
    assert_close(r["history"][0], expected, scale=expected)
    one = train(_cfg(tmp_path, steps=1, clip=0, out=str(tmp_path / "one")), log=lambda s: None)
    assert_close(one["history"][0], losses[0], scale=losses[0])


def test_metrics_log_has_a_line_per_step_and_evaluation_and_resume_trims_it(tmp_path):
    cfg = _cfg(tmp_path, steps=6, ckpt_every=3, eval_every=3)
    train(cfg, log=lambda s: None)
    path = tmp_path / "run" / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    assert all(set(r) == {"step", "loss", "lr", "grad_norm", "tok_s"} for r in steps)
    assert [r["step"] for r in rows if "val_loss" in r] == [3, 6]
    # A run killed after step 8 but checkpointed at 6 left lines 7, 8 behind:
    # the resume keeps the lines up to its checkpoint and writes its own.
    with path.open("a") as f:
        f.write(json.dumps(dict(step=7, loss=9.0)) + "\n" + json.dumps(dict(step=8, loss=9.0)) + "\n")
    train(_cfg(tmp_path, steps=9, ckpt_every=3, eval_every=3, resume=True), log=lambda s: None)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 10))
    assert all(r["loss"] != 9.0 for r in rows if "loss" in r)


def test_a_resume_must_keep_dtype_accum_and_clip(tmp_path):
    train(_cfg(tmp_path, steps=2), log=lambda s: None)
    for change in (dict(dtype="bfloat16"), dict(accum=2), dict(clip=0.5)):
        with pytest.raises(CheckpointError, match=f"{next(iter(change))}="):
            train(_cfg(tmp_path, steps=3, resume=True, **change), log=lambda s: None)


def test_keep_below_one_is_one_clear_error(tmp_path):
    with pytest.raises(ValueError, match="keep=0 would delete every checkpoint; keep at least 1"):
        train(_cfg(tmp_path, keep=0), log=lambda s: None)


def test_unknown_dtype_is_one_clear_error(tmp_path):
    with pytest.raises(ValueError, match="dtype='float16' is not one of float32, bfloat16"):
        train(_cfg(tmp_path, dtype="float16"), log=lambda s: None)


@pytest.mark.parametrize("args, message", [
    (["--accum", "0"], "argument --accum: '0' must be > 0"),
    (["--clip", "-1"], "argument --clip: '-1' must be a finite number >= 0"),
    (["--dtype", "float16"], "argument --dtype: invalid choice: 'float16'"),
    (["--keep", "0"], "argument --keep: '0' must be > 0"),
])
def test_cli_option_errors(args, message, capsys, tmp_path):
    code = _cli.main(["--tiny", "--out", str(tmp_path), *args])
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and len(err.splitlines()) == 1, err


def test_dtype_is_refused_for_a_user_model(tmp_path):
    with pytest.raises(ValueError, match="dtype='bfloat16' sets the built-in GPT's compute dtype"):
        train(_cfg(tmp_path, dtype="bfloat16"), log=lambda s: None,
              model=nnx.Linear(4, 4, rngs=nnx.Rngs(0)))
