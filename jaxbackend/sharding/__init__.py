"""`jaxbackend.sharding`: sharding rules from an exact cost-model search.

Because named jaxprs keep dim names, a plan is a small set of rules
`dim name -> mesh axis | tuple of axes | None` (Flax logical-axis rules,
Haliax axis mappings), searched exactly against a cost model of flops,
alpha-beta collectives and per-device memory:

    mesh = sharding.auto_mesh((2, 4), ("data", "model"))
    plan = sharding.search(step, params, tokens, targets, mesh=mesh)
    plan.rules; plan.cost; print(plan.table())
    f = sharding.sharded_jit(step, mesh=mesh)          # search, then compile
    f = sharding.sharded_jit(step, mesh=mesh, rules={"batch": "data"})

Stages: `_mesh` (MeshSpec, HardwareProfile) -> `_graph` + `_rules` (jaxpr
-> ops over dim classes, union-find through unnamed code) -> `_cost`
(CostModel) -> `_search` (exact search) -> `_plan` (Plan, compile);
`_hlo` reads back what XLA did, to check the model.
"""

from jaxbackend.sharding._cost import CostModel as CostModel
from jaxbackend.sharding._graph import build as build_graph
from jaxbackend.sharding._hlo import collectives as hlo_collectives
from jaxbackend.sharding._hlo import memory as hlo_memory
from jaxbackend.sharding._mesh import (
    HardwareProfile as HardwareProfile,
    MeshSpec as MeshSpec,
    abstract_mesh as abstract_mesh,
    auto_mesh as auto_mesh,
    cpu_profile as cpu_profile,
    h100_profile as h100_profile,
    h200_profile as h200_profile,
)
from jaxbackend.sharding._plan import (
    Plan as Plan,
    plan_for as plan_for,
    search as search,
    sharded_jit as sharded_jit,
    trace as trace,
)
from jaxbackend.sharding._search import NoPlanFits as NoPlanFits
