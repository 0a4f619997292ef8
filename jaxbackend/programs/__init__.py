"""`jaxbackend.programs`: example programs, most written twice (with named
dims and in plain jnp, on the same weights), that the demo, the tests, the
benchmarks and the notebooks share. They are fixtures, not the product: the
product's model is `jaxbackend.models.GPT`.

* `attention_stack`: a multi-layer causal self-attention, named and jnp.
* `transformer`: a pre-LayerNorm transformer in plain jnp, as a Python loop
  over layers and as a hand-written `lax.scan` (what `reroll` produces).
* `gqa`: grouped-query attention with repeated KV heads (`jnp.repeat`,
  broadcast + reshape, `tile`, heads-first) and the hand-written grouped
  form, for `group_heads`.
* `llama`: a whole LLaMA-style decoder, named and jnp, with abstract
  parameter shapes for the LLaMA-8B-shaped sharding benchmark.
* `small`: small programs that each target one pass (the flatten MLP, the
  two XSA forms, a scan over every sub-jaxpr kind) and their arguments.

Import the module you need: `from jaxbackend.programs import llama`.
"""

from jaxbackend.programs import attention_stack as attention_stack
from jaxbackend.programs import gqa as gqa
from jaxbackend.programs import llama as llama
from jaxbackend.programs import small as small
from jaxbackend.programs import transformer as transformer

__all__ = ["attention_stack", "gqa", "llama", "small", "transformer"]
