"""Shared fixtures: a 2-layer GPT block (named and jnp twins), its single-
device training step, and meshes over the 8 simulated CPU devices."""

import jax
import pytest

from jaxbackend import sharding
from jaxbackend.programs import llama


@pytest.fixture(scope="session")
def block():
    cfg = llama.LlamaConfig(n_layers=2)
    params = llama.init_llama_params(0, cfg)
    tokens, targets = llama.llama_batch(1, cfg)
    named_args = (llama.name_llama_params(params), *llama.name_llama_batch(tokens, targets))
    step = llama.sgd_step(llama.named_llama_loss)
    reference = jax.jit(step)(*named_args)   # single device
    return dict(cfg=cfg, params=params, jnp_args=(params, tokens, targets), args=named_args,
                step=step, jnp_step=llama.sgd_step(llama.jnp_llama_loss), reference=reference)


@pytest.fixture(scope="session")
def mesh24():
    return sharding.auto_mesh((2, 4), ("data", "model"))


@pytest.fixture(scope="session")
def mesh42():
    return sharding.auto_mesh((4, 2), ("data", "model"))
