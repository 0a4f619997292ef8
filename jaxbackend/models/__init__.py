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
from jaxbackend.models._block import (
    LLAMA_8B as LLAMA_8B,
    BlockConfig as BlockConfig,
    block_batch as block_batch,
    block_shapes as block_shapes,
    init_block_params as init_block_params,
    jnp_block_loss as jnp_block_loss,
    name_block_batch as name_block_batch,
    name_block_params as name_block_params,
    named_block_loss as named_block_loss,
    sgd_step as sgd_step,
    stack_block_layers as stack_block_layers,
)
