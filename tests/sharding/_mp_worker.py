"""One process of the 2-process test (not collected by pytest): 4 CPU
devices here, 8 in the cluster; runs the searched plan's training step on a
(2, 4) mesh spanning both processes and (process 0) saves the results."""

import os
import sys

from jaxbackend._devices import cpu_device_flags  # noqa: E402

os.environ["XLA_FLAGS"] = cpu_device_flags(4)
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")


def main(pid: int, port: int, out: str) -> None:
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=pid, initialization_timeout=60)
    from jax.experimental import multihost_utils

    import jaxbackend as jb
    from jaxbackend import sharding
    from jaxbackend.programs import llama

    assert jax.device_count() == 8 and jax.local_device_count() == 4
    cfg = llama.LlamaConfig(n_layers=2)
    params = llama.init_llama_params(0, cfg)
    tokens, targets = llama.llama_batch(1, cfg)
    args = (llama.name_llama_params(params), *llama.name_llama_batch(tokens, targets))
    step = llama.sgd_step(llama.named_llama_loss)
    mesh = sharding.auto_mesh((2, 4), ("data", "model"), devices=jax.devices())
    plan = sharding.plan(step, *args, mesh=mesh)
    shardings = plan.shardings(args)
    global_args = jax.tree.map(
        lambda x, s: jax.make_array_from_callback(x.shape, s, lambda idx, x=np.asarray(x): x[idx]),
        args, shardings)
    loss, new_params = jb.jit(step, mesh=mesh, rules=plan, passes=())(*global_args)
    gathered = multihost_utils.process_allgather(new_params, tiled=True)
    leaves = [np.asarray(loss.addressable_data(0))] + [np.asarray(x) for x in jax.tree.leaves(gathered)]
    if pid == 0:
        np.savez(out, *leaves, rules=repr(plan.rules))
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
