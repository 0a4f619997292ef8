"""Multi-device training (`--devices N`, N > 1): the mesh, the searched
plan of the training step, where the parameters and the data live.

A 1-d mesh `data` of N devices. The step is `jb.jit(train_step, mesh=,
donate_argnums=(0, 1))`: the sharding search runs on the whole step
(forward, backward, AdamW; rolled into scans where layers repeat, so its
cost stays flat in depth), and every input, output and named contraction
is pinned to the plan's layout. The plan is made once before the first
step, by lowering the step on the abstract state (`place`), and its table
is printed. The parameters, the token array and (in `_resume`) the
optimizer state are then placed where the plan wants them, so the donated
buffers are reused in place and no step copies its inputs; the step's
outputs come back in the same layouts. (JAX traces the step again for the
placed inputs; `jb.jit` answers that trace from its plan cache, without
re-running the trace, the passes or the search.)

With `--stack-layers` the blocks' parameters are stacked arrays
(`jb.stack_layers`) and the search plans the step over them, the stacked
`layers` dim unsharded (`sharding._walk`).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
from jax.sharding import AxisType

from jaxbackend import named as nx


def make_mesh(cfg) -> jax.sharding.Mesh:
    """The `data` mesh of `cfg.devices` devices; clear errors where it cannot be."""
    if jax.device_count() < cfg.devices:
        raise ValueError(f"--devices {cfg.devices} asked for, but JAX sees {jax.device_count()} "
                         f"devices; set --devices before anything imports jax.")
    if cfg.batch % cfg.devices:
        raise nx.DimError(f"dim 'batch' has size {cfg.batch}, which the {cfg.devices}-device "
                          f"mesh axis 'data' does not divide; use --batch a multiple of {cfg.devices}.")
    return jax.make_mesh((cfg.devices,), ("data",), axis_types=(AxisType.Auto,))


def place(run, step_fn) -> None:
    """Plans `step_fn` (a `jb.jit(mesh=)` step) on its mesh, printing the
    plan; places `run.params` and `run.data` by it and records the
    optimizer state's layout (`run.opt_shardings`) and the seconds planning
    took (`run.plan_s`)."""
    t0 = time.perf_counter()
    args = (run.params, jax.eval_shape(run.tx.init, run.params), run.data,
            jax.ShapeDtypeStruct((), jnp.int32))
    step_fn.lower(*args)              # trace, passes and the search: sets .plan
    plan = step_fn.plan
    run.say(plan.table())
    params, run.opt_shardings, data, _ = plan.shardings(args)
    run.params = jax.device_put(run.params, params)
    run.data = jax.device_put(run.data, data)
    run.plan_s = time.perf_counter() - t0
