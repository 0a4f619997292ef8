"""The modelled cost of one plan, as values: `Cost` (step time, compute,
communication, memory per device) with one `Collective` per kind the model
charges (`_ring.KINDS`). `CostModel.evaluate` makes them; `Plan.cost` holds
one.
"""

from __future__ import annotations

import dataclasses



@dataclasses.dataclass(frozen=True)
class Collective:
    """One kind of collective in a plan's step: seconds, bytes moved per
    device (the full, gathered or unreduced, buffer) and count."""
    time: float
    bytes: float
    count: float


@dataclasses.dataclass(frozen=True)
class Cost:
    """The modelled cost of one plan (per step, per device)."""
    time: float            # step time: compute + communication, seconds
    compute: float
    communication: float
    memory: float          # bytes per device: memory_fixed + memory_temp
    memory_fixed: float    # arguments and results
    memory_temp: float     # peak temporaries and gathered copies
    all_reduce: Collective
    all_gather: Collective
    reduce_scatter: Collective
    all_to_all: Collective

    def collective(self, kind: str) -> Collective:
        """The `Collective` of `kind`, one of `KINDS` ("all-gather", ...)."""
        return getattr(self, kind.replace("-", "_"))
