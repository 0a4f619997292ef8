"""`jaxbackend.models`: the Flax NNX GPT built from `jaxbackend.nn` layers.

The functional twin programs the tests, benchmarks and notebooks share are
in `jaxbackend.programs`.
"""

from jaxbackend.models._gpt import GPT as GPT
from jaxbackend.models._gpt import GPTConfig as GPTConfig
from jaxbackend.models._gpt import generate as generate
from jaxbackend.models._gpt import lm_loss as lm_loss

__all__ = ["GPT", "GPTConfig", "generate", "lm_loss"]
