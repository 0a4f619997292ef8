"""What `reroll` works with: the record of a run, the tags that say how a
block reads each operand, and the dependence graph the checks of
`_reroll_find` read (definition and use sites of every variable).

A block is `period` consecutive equations; a run is `repeats` blocks in a
row (`Run`). Equation r of a block reads its operand k as one of:

* `Lit`: a literal, the same in every block;
* `Inner(r, o)`: output o of equation r of the same block;
* `Prev(r, o)`: output o of equation r of the previous block (a carry);
* `Out(v)`: a value from before the run (v: the variable this block reads);
* `Bad`: a value from two or more blocks back (not a simple chain).

A verified run's template numbers carries and outside values instead:
`Carry(c)` for a `Prev`, `Outside(s)` for an `Out` (`Lit` and `Inner` stay).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

from jaxbackend import _jax

# -- operand tags: how equation r of a block reads its operand k ---------------
# Small dataclasses (equal only to a tag of the same class with equal fields;
# never mutated). Not frozen: a frozen init costs 4x, and tags are made per
# operand per block.

@dataclasses.dataclass(slots=True)
class Lit:
    """A literal (the same in every block)."""


@dataclasses.dataclass(slots=True)
class Inner:
    """Output o of equation r of the same block."""
    r: int
    o: int

    @property
    def slot(self) -> tuple:
        return (self.r, self.o)


@dataclasses.dataclass(slots=True)
class Prev:
    """Output o of equation r of the previous block (a loop carry)."""
    r: int
    o: int

    @property
    def slot(self) -> tuple:
        return (self.r, self.o)


@dataclasses.dataclass(slots=True)
class Out:
    """A value from before the run (`v` as read by the block described)."""
    v: Any


@dataclasses.dataclass(slots=True)
class Bad:
    """A value from two or more blocks back: not a simple chain."""


@dataclasses.dataclass(slots=True)
class Carry:
    """In a Run's template: carry c (a `Prev`, numbered)."""
    c: int


@dataclasses.dataclass(slots=True)
class Outside:
    """In a Run's template: outside slot s (an `Out`, numbered)."""
    s: int


LIT, BAD = Lit(), Bad()


@dataclasses.dataclass
class Run:
    start: int                      # index of the first equation of block 0
    period: int                     # equations per block
    repeats: int                    # number of blocks
    template: list                  # [r][k] -> Lit | Inner | Carry | Outside
    carry_slots: list               # [c] -> (r, o): block output carried to the next block
    carry_init: list                # [c] -> outside var read by block 0 for that carry
    outside: list                   # [s] -> tuple of vars, one per block (same var: invariant)
    ys_slots: list                  # [(r, o)] block outputs used after the run, stacked
    carry_ys: list                  # [c] carries whose per-block values are used after the run

    @property
    def stop(self) -> int:
        return self.start + self.period * self.repeats

    def block_eqn_index(self, j: int, r: int) -> int:
        return self.start + j * self.period + r


class DepGraph:
    """Definition sites and use sites of every variable of one jaxpr (built
    once): the data dependences the run checks read."""

    def __init__(self, jaxpr):
        self.eqns = jaxpr.eqns
        self.n = len(self.eqns)
        self.defs: dict = {}                           # var -> (eqn index, output index)
        self.uses = collections.defaultdict(list)      # var -> sorted eqn indices
        for i, e in enumerate(self.eqns):
            for v in e.invars:
                if not isinstance(v, _jax.Literal):
                    self.uses[v].append(i)
            for o, v in enumerate(e.outvars):
                self.defs[v] = (i, o)
        for v in jaxpr.outvars:
            if not isinstance(v, _jax.Literal):
                self.uses[v].append(self.n)            # "used after every equation"

    def last_use(self, v) -> int:
        u = self.uses.get(v)
        return u[-1] if u else -1
