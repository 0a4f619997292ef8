"""The model a training run trains: built (the GPT of the config, or the
user's module or factory), its loss, and its parameters as the optimizer
sees them (per layer, or with the blocks stacked: `TrainConfig.stack_layers`).
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import TYPE_CHECKING

import jax
from flax import nnx

from jaxbackend import _scripts
from jaxbackend._stacked import NothingToStack, Stacked, stack_layers
from jaxbackend.models import GPT, lm_loss
from jaxbackend.passes import REROLL_MIN_REPEATS
from jaxbackend.train import _checkpoint

if TYPE_CHECKING:
    from jaxbackend.train._loop import TrainConfig


def arrange(cfg: TrainConfig, params, model_name: str, ckpt: pathlib.Path) -> tuple:
    """(params, stacked): `params` per layer or stacked, as
    `cfg.stack_layers` asks (the `_loop` docstring says when None stacks; on
    a resume None is what the checkpoint recorded)."""
    want = cfg.stack_layers
    if want is None and cfg.resume:
        want = _checkpoint.recorded(ckpt, "stack_layers")
    if want is False:
        return params, False
    try:
        out = stack_layers(params)
    except NothingToStack as e:
        if want is None:
            return params, False
        # name the flag that asked for it
        raise ValueError(f"stack_layers: {model_name} has no list of >= 2 identical layers "
                         f"to keep stacked ({e.what}); drop --stack-layers.") from None
    lists = jax.tree.leaves(out, is_leaf=lambda n: isinstance(n, Stacked))
    if want is None and max(len(x) for x in lists if isinstance(x, Stacked)) < REROLL_MIN_REPEATS:
        return params, False
    return out, True


def build(cfg: TrainConfig, model, vocab: int) -> tuple:
    """(the module, the name a checkpoint records for it)."""
    if model is None and cfg.model is not None:
        model = _scripts.load_callable(cfg.model, "model factory")[1]
    if model is None:
        return GPT(dataclasses.replace(cfg.model_config(), vocab_size=vocab),
                   dtype=None if cfg.dtype == "float32" else cfg.compute_dtype(),
                   rngs=nnx.Rngs(cfg.seed)), "GPT"
    if cfg.dtype != "float32":
        raise ValueError(f"dtype={cfg.dtype!r} sets the built-in GPT's compute dtype; your model "
                         f"sets its own (e.g. jaxbackend.nn layers' dtype=), so leave dtype unset.")
    if not isinstance(model, nnx.Module):
        factory, model = model, model(vocab_size=vocab, seq_len=cfg.seq, rngs=nnx.Rngs(cfg.seed))
        if not isinstance(model, nnx.Module):
            raise TypeError(f"the model factory {getattr(factory, '__name__', factory)} returned "
                            f"{type(model).__name__}; it must return an nnx.Module.")
    return model, cfg.model or type(model).__qualname__


def loss_of(model: nnx.Module, loss):
    """`loss(model, tokens, targets)`: the given one, the model's method, or
    cross entropy of the model's logits."""
    if loss is not None:
        return loss
    if callable(getattr(model, "loss", None)):
        return lambda m, x, y: m.loss(x, y)
    return lambda m, x, y: lm_loss(m(x), y)
