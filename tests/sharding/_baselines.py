"""Hand-written rule sets on a (data, model) mesh, as people write them."""

MEGATRON = dict(batch="data", kv="model", mlp="model", vocab="model")   # heads + MLP on model
FSDP = dict(batch=("data", "model"), embd=("data", "model"))           # weights sharded, gathered
DATA_PARALLEL = dict(batch=("data", "model"))
