"""`jaxbackend.sharding`: sharding rules from an exact cost-model search.

Because named jaxprs keep dim names, a plan is a small set of rules
`dim name -> mesh axis | tuple of axes | None` (Flax logical-axis rules,
Haliax axis mappings), searched exactly against a cost model of flops,
alpha-beta collectives and per-device memory:

    mesh = sharding.auto_mesh((2, 4), ("data", "model"))
    plan = sharding.plan(step, params, tokens, targets, mesh=mesh)   # searched
    plan.rules; plan.cost; print(plan.table())
    f = jb.jit(step, mesh=mesh)                        # plan at trace time, compile
    f = jb.jit(step, mesh=mesh, rules={"batch": "data"})   # or given rules (or a plan)

Stages: `_mesh` (MeshSpec, HardwareProfile) -> `_graph` (a frozen graph of
ops over dim classes, union-find through unnamed code; `_walk` builds it from
the jaxpr, the per-primitive dim rules of `_op_dims` register into its
table) -> `_cost`
(CostModel; `_liveness` for memory, `_op_facts` for bytes moved and
combined all-reduces, `_ring` the collective formulas,
`_breakdown` the Cost value) -> `_search` (exact search; `_tables`,
`_bound`) -> `_plan` (Plan: data, no compiling); `_axis_rules` is what rules
mean (normalise, PartitionSpecs, divisibility, masks); `_hlo` reads back
what XLA did, with `_ring`'s formulas, to check the model.
Compiling is `jaxbackend.jit` (`jb.jit(fn, mesh=...)`).
"""

from jaxbackend.sharding._axis_rules import Rules as Rules
from jaxbackend.sharding._axis_rules import normalize as normalize_rules
from jaxbackend.sharding._axis_rules import spec_for_dims as spec_for_dims
from jaxbackend.sharding._cost import CostModel as CostModel
from jaxbackend.sharding._walk import build as build_graph
from jaxbackend.sharding._hlo import collectives as hlo_collectives
from jaxbackend.sharding._hlo import memory as hlo_memory
from jaxbackend.sharding._mesh import (
    HardwareProfile as HardwareProfile,
    MeshSpec as MeshSpec,
    abstract_mesh as abstract_mesh,
    auto_mesh as auto_mesh,
    cpu_profile as cpu_profile,
    device_profile as device_profile,
    h100_profile as h100_profile,
    h200_profile as h200_profile,
)
from jaxbackend.sharding._plan import Plan as Plan
from jaxbackend.sharding._plan import plan as plan
from jaxbackend.sharding._search import NoPlanFits as NoPlanFits
