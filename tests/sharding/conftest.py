"""Shared fixtures: a 2-layer GPT block (named and jnp twins), its single-
device training step, and meshes over the 8 simulated CPU devices."""

import jax
import pytest

from jaxbackend import sharding
from jaxbackend.models import _block as blk


@pytest.fixture(scope="session")
def block():
    cfg = blk.BlockConfig(n_layers=2)
    params = blk.init_block_params(0, cfg)
    tokens, targets = blk.block_batch(1, cfg)
    named_args = (blk.name_block_params(params), *blk.name_block_batch(tokens, targets))
    step = blk.sgd_step(blk.named_block_loss)
    reference = jax.jit(step)(*named_args)   # single device
    return dict(cfg=cfg, params=params, jnp_args=(params, tokens, targets), args=named_args,
                step=step, jnp_step=blk.sgd_step(blk.jnp_block_loss), reference=reference)


@pytest.fixture(scope="session")
def mesh24():
    return sharding.auto_mesh((2, 4), ("data", "model"))
