"""`jaxbackend.passes`: pure `ClosedJaxpr -> ClosedJaxpr` rewrites.

One pass per module, all driven by the shared traversal in `_rewrite`
(rule tables per primitive, recursion into sub-jaxprs, linear time);
`pipeline` lists the default passes in order and runs them with a report.
"""

from jaxbackend.passes._rewrite import (
    EqnBuilder as EqnBuilder,
    Rewriter as Rewriter,
    RewriteDeclined as RewriteDeclined,
    collect_stats as collect_stats,
    count_eqns as count_eqns,
    iter_eqns as iter_eqns,
    iter_jaxprs as iter_jaxprs,
    record_stats as record_stats,
    rewrite as rewrite,
)
from jaxbackend.passes.canonical_conv import canonical_conv as canonical_conv
from jaxbackend.passes.cse import cse as cse
from jaxbackend.passes.dce import dce as dce
from jaxbackend.passes.fuse_projections import fuse_projections as fuse_projections
from jaxbackend.passes.group_heads import group_heads as group_heads
from jaxbackend.passes.hoist_broadcast import hoist_broadcast as hoist_broadcast
from jaxbackend.passes.inline import inline as inline
from jaxbackend.passes.inline import inline_calls as inline_calls
from jaxbackend.passes.pipeline import (
    DEFAULT_PIPELINE as DEFAULT_PIPELINE,
    PASSES as PASSES,
    REROLL_MIN_REPEATS as REROLL_MIN_REPEATS,
    Report as Report,
    configure as configure,
    run_pipeline as run_pipeline,
)
from jaxbackend.passes.remat_residuals import remat_residuals as remat_residuals
from jaxbackend.passes.reroll import RerollStats as RerollStats
from jaxbackend.passes.reroll import reroll as reroll
from jaxbackend.passes.reroll import reroll_with_stats as reroll_with_stats
