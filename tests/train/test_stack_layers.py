"""`--stack-layers` (`TrainConfig.stack_layers`): the training run keeps the
blocks' weights, optimizer state and checkpoint stacked (`jb.stack_layers`)
and computes what the per-layer run computes; by default from
`REROLL_MIN_REPEATS` layers; a resume keeps the recorded choice."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jaxbackend as jb
from jaxbackend import nn
from jaxbackend.models import GPT
from jaxbackend.passes import REROLL_MIN_REPEATS
from jaxbackend.testing import abs_scale, assert_close
from jaxbackend.train import CheckpointError, TrainConfig, _checkpoint, _cli, _data, train

SMALL = dict(batch=4, seq=32, layers=2, embd=32, heads=2, max_chars=200_000, eval_batches=2,
             sample_chars=0, warmup=5, quiet=True, clip=0)


def _cfg(tmp_path, name="run", **kw):
    return TrainConfig(**{**SMALL, "steps": 2, "ckpt_every": 0, "eval_every": 0,
                          "out": str(tmp_path / name), **kw})


def _first_loss_scales(cfg):
    """The error scale (`abs_scale`) of the first two steps' losses: the
    warm-up schedule starts at lr 0, so steps 0 and 1 both see the initial
    parameters (on batches 0 and 1)."""
    model = GPT(cfg.model_config(), rngs=nnx.Rngs(cfg.seed))
    params, loss_fn = nn.functional(model, "loss")
    data = jnp.asarray(_data.split(_data.load_corpus(cfg.max_chars))[0])
    batches = [_data.get_batch(data, cfg.seed, i, cfg.batch, cfg.seq) for i in range(2)]
    return [abs_scale(loss_fn, params, *b) for b in batches]


@pytest.fixture(scope="module")
def per_layer_run(tmp_path_factory):
    """The per-layer run both stacked runs are compared with, and the error
    scales of its first two losses (one of each for the module)."""
    tmp = tmp_path_factory.mktemp("per_layer")
    return train(_cfg(tmp, "a"), log=lambda s: None), _first_loss_scales(_cfg(tmp))


@pytest.mark.parametrize("devices", [1, 2])
def test_stacked_training_computes_the_per_layer_runs_losses(tmp_path, devices, per_layer_run):
    per_layer, scales = per_layer_run
    stacked = train(_cfg(tmp_path, "b", stack_layers=True, devices=devices), log=lambda s: None)
    params = stacked["params"]["blocks"]
    assert isinstance(params, jb.Stacked) and len(params) == 2
    assert all(a.shape[0] == 2 for a in jax.tree.leaves(params))
    first = [jnp.float32(r["history"][i]) for r in (stacked, per_layer) for i in (0, 1)]
    assert_close(first[:2], first[2:], scale=scales,   # float32 losses, as the step computed
                 what="the first two losses (initial parameters)")
    assert jax.tree.structure(jb.unstack_layers(stacked["params"])) == \
        jax.tree.structure(per_layer["params"])


def test_a_resume_must_keep_stack_layers(tmp_path):
    train(_cfg(tmp_path, stack_layers=True), log=lambda s: None)
    with pytest.raises(CheckpointError, match="stack_layers=True \\(checkpoint\\) vs False"):
        train(_cfg(tmp_path, steps=3, resume=True, stack_layers=False), log=lambda s: None)
    r = train(_cfg(tmp_path, steps=3, resume=True), log=lambda s: None)   # None: as recorded
    assert len(r["history"]) == 3 and isinstance(r["params"]["blocks"], jb.Stacked)


@pytest.mark.parametrize("layers", [2, REROLL_MIN_REPEATS])
def test_by_default_layers_are_stacked_where_the_step_rolls(tmp_path, layers):
    r = train(_cfg(tmp_path, steps=1, layers=layers), log=lambda s: None)
    deep = layers >= REROLL_MIN_REPEATS
    assert isinstance(r["params"]["blocks"], jb.Stacked) == deep
    assert _checkpoint.recorded(tmp_path / "run" / "checkpoints", "stack_layers") is deep


def test_a_checkpoint_from_before_the_setting_resumes_per_layer(tmp_path, monkeypatch):
    """Checkpoints written before `stack_layers` was recorded were per-layer:
    a deep model's resume (CLI or `train`) keeps them per-layer."""
    cfg = _cfg(tmp_path, layers=REROLL_MIN_REPEATS, stack_layers=False)
    train(cfg, log=lambda s: None)
    ckpt = tmp_path / "run" / "checkpoints"
    read = _checkpoint.read_meta

    def old_meta(*a, **kw):   # the checkpoint as an older version wrote it
        meta = read(*a, **kw)
        meta["config"].pop("stack_layers")
        meta["settings"].pop("stack_layers")
        return meta
    monkeypatch.setattr(_checkpoint, "read_meta", old_meta)
    assert _checkpoint.recorded(ckpt, "stack_layers") is False
    args = _cli.parse(["--resume", "--out", str(tmp_path / "run")])
    assert args.stack_layers is False
    r = train(_cfg(tmp_path, layers=REROLL_MIN_REPEATS, steps=3, resume=True), log=lambda s: None)
    assert len(r["history"]) == 3 and not isinstance(r["params"]["blocks"], jb.Stacked)


def test_stack_layers_on_a_one_layer_model_is_one_clear_error(tmp_path, capsys):
    code = _cli.main(["--tiny", "--layers", "1", "--stack-layers", "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "stack_layers: GPT has no list of >= 2 identical layers" in err
    assert "drop --stack-layers" in err
