"""Multi-device training (`--devices N`, N > 1): the mesh, the searched
rules, where the parameters live.

A 1-d mesh `data` of N devices; the rules dim -> mesh axis are the searched
plan of `jaxbackend.sharding.plan` on the loss (its table is printed), and
each parameter is placed by the dims it records (`nn.partition_specs`). With
`--stack-layers` the parameters of the L blocks are stacked arrays
(`jb.stack_layers`): each is placed as its layer's parameter is, with its
leading layer axis unsharded (XLA would gather a layer-sharded stack whole
before the loop; see `sharding._graph`). The optimizer state is made from
the placed parameters (`tx.init`), so each moment lives where its parameter
does, and every batch is constrained to the plan's `batch` axis; XLA
propagates those layouts through the step. (`jb.jit(mesh=, rules=)` would
pin them on every contraction, but it refuses the plan's rules for dims
this step does not have: the plan is searched on the loss alone, whose
auto-named dims differ from the step's.)
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from jaxbackend import _stacked, nn, sharding
from jaxbackend import named as nx
from jaxbackend.train import _data


def mesh_and_rules(cfg, loss_fn, params, x, y, log):
    """The `data` mesh and the searched rules (as a dict) for this loss."""
    if jax.device_count() < cfg.devices:
        raise ValueError(f"--devices {cfg.devices} asked for, but JAX sees {jax.device_count()} "
                         f"devices; set --devices before anything imports jax.")
    if cfg.batch % cfg.devices:
        raise nx.DimError(f"dim 'batch' has size {cfg.batch}, which the {cfg.devices}-device "
                          f"mesh axis 'data' does not divide; use --batch a multiple of {cfg.devices}.")
    mesh = jax.make_mesh((cfg.devices,), ("data",), axis_types=(AxisType.Auto,))
    plan = sharding.plan(loss_fn, params, x, y, mesh=mesh)
    log(plan.table())
    return mesh, nn._params.normalize_rules(plan)


def shard(run) -> None:
    """Searches rules on the mesh (printing the plan), places `run.params`
    by the dims they record and sets `run.constrain` for every batch."""
    cfg = run.cfg
    x0, y0 = _data.get_batch(run.data, cfg.seed, 0, cfg.batch, cfg.seq)
    mesh, rules = mesh_and_rules(cfg, run.loss_fn, run.params, x0, y0, run.say)
    nn.check_divisible(run.pstate, rules, mesh)
    specs = nn.partition_specs(run.pstate, rules)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, PartitionSpec))
    per_layer = nnx.to_pure_dict(run.pstate)   # the params' per-layer tree
    shardings = jax.tree.unflatten(jax.tree.structure(per_layer),
                                   [NamedSharding(mesh, s) for s in spec_leaves])
    if cfg.stack_layers:
        shardings = _stacked.stack_like(
            run.params, shardings, lambda s: NamedSharding(mesh, PartitionSpec(None, *s.spec)))
    run.params = jax.device_put(run.params, shardings)
    batch_spec = NamedSharding(mesh, PartitionSpec(rules.get("batch")))
    run.constrain = lambda a: jax.lax.with_sharding_constraint(a, batch_spec)
