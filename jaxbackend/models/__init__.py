"""Reference models: functional twins (named and plain jnp) used by the demo,
benchmarks and tests, and the Flax NNX GPT."""

from jaxbackend.models._attention_stack import (
    init_attention_stack as init_attention_stack,
    jnp_attention_stack as jnp_attention_stack,
    named_attention_stack as named_attention_stack,
)
