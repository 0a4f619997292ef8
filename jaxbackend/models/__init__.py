"""Reference models: functional twins (named and plain jnp) used by the demo,
benchmarks and tests, and the Flax NNX GPT."""

from jaxbackend.models._attention_stack import (
    init_attention_stack as init_attention_stack,
    jnp_attention_stack as jnp_attention_stack,
    named_attention_stack as named_attention_stack,
)
from jaxbackend.models._gpt import GPT as GPT
from jaxbackend.models._gpt import GPTConfig as GPTConfig
from jaxbackend.models._gpt import generate as generate
from jaxbackend.models._transformer import (
    init_transformer as init_transformer,
    loop_transformer as loop_transformer,
    scan_transformer as scan_transformer,
    stack_layers as stack_layers,
)
