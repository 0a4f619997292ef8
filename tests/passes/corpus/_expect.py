"""What each pass of the default pipeline should do to a corpus program.

`Expect` declares, for one program (forward or value_and_grad), the whole
pipeline's behaviour: the passes that must fire (`fire`, or implied by
`matches` / `removes`); every other pass of `DEFAULT_PIPELINE` must not
fire, where "fires" is `jaxbackend._explain.fired` (it matched something or
changed some source line's equations). Then:

* `matches`: exact match counts a pass reports (`Report.stats[i].matches`);
* `removes`: the least number of equations a pass must remove;
* `checks`: named counters on the final jaxpr that must be 0 (a counter
  returns how many offending equations it found);
* `cost_le`: (reference function of the same arguments, {cost key: ratio}):
  XLA's cost analysis ("flops", "bytes accessed") of the compiled `jb.jit`
  program is at most ratio times the reference's under `jax.jit` ("work
  once per source element");
* `rounding`: the narrowest dtype the program computes in, when its outputs
  are wider (a float32 gradient of a bfloat16 computation): values are
  compared at that dtype's tolerance;
* `known_cost_issue`: why the pipeline's program costs more than
  `jax.jit`'s today (a strict xfail of the cost check: it fails once fixed,
  so the reason is removed with the fix).

These are what SHOULD happen; a program whose pass has not landed yet fails
its test, on purpose.
"""

from __future__ import annotations

import dataclasses
from jaxbackend import _jax
from jaxbackend.passes import _rewrite


@dataclasses.dataclass(frozen=True)
class Expect:
    fire: tuple = ()
    matches: dict = dataclasses.field(default_factory=dict)
    removes: dict = dataclasses.field(default_factory=dict)
    checks: tuple = ()
    cost_le: tuple | None = None
    rounding: object = None
    known_cost_issue: str = ""

    def firing(self) -> set:
        return set(self.fire) | set(self.matches) | set(self.removes)


# --- counters on a final jaxpr --------------------------------------------------

_SAME_DATA = {"reshape", "transpose", "convert_element_type", "copy"}


def _size(aval) -> int:
    n = 1
    for d in aval.shape:
        n *= int(d)
    return n


def _copies_data(eqn) -> bool:
    """A broadcast that makes copies (more elements out than in) or a tile."""
    if eqn.primitive.name == "tile":
        return True
    return (eqn.primitive.name == "broadcast_in_dim"
            and _size(eqn.outvars[0].aval) > _size(eqn.invars[0].aval) > 1)


def repeated_operands_of_dots(closed) -> int:
    """Operands of `dot_general` that are copies of a smaller array (a
    broadcast or tile, through reshapes, transposes and casts): a repeated
    K or V head contracted once per query head."""
    n = 0
    for jaxpr in _rewrite.iter_jaxprs(closed):
        made = {v: e for e in jaxpr.eqns for v in e.outvars}
        for e in jaxpr.eqns:
            if e.primitive.name != "dot_general":
                continue
            for x in e.invars:
                src = made.get(x) if _jax.is_var(x) else None
                while src is not None and src.primitive.name in _SAME_DATA:
                    y = src.invars[0]
                    src = made.get(y) if _jax.is_var(y) else None
                n += src is not None and _copies_data(src)
    return n


def einsums(closed) -> int:
    """`einsum` equations left (inline lowers every one)."""
    return _rewrite.count_eqns(closed, "einsum")


def calls(closed) -> int:
    """Nested `jit` / `closed_call` equations left (inline_calls flattens them)."""
    return _rewrite.count_eqns(closed, "jit") + _rewrite.count_eqns(closed, "closed_call")



def noncanonical_convs(closed) -> int:
    """Convolutions not in XLA's canonical layout (canonical_conv makes them so)."""
    from jaxbackend.passes.canonical_conv import remaining
    return remaining(closed)
