"""Names for the dims no dim name reaches (plain jnp code, unnamed inputs).

A plan a user reads names every sharded dim. A dim class that no NamedArray
and no named einsum labels is named after where it comes from: the first
program input holding it, by its argument path and axis
(`args[0]['tok']['embedding']:0`), else the first equation making it, by
primitive, user source line and axis (`gather@model.py:88:2`). Where the
inputs holding it are one path with numbers that vary (the same weight's
axis in every layer of a per-layer list, linen's `Block_0`, `Block_1`,
...), those numbers read `*` (`args[0]['layers'][*]['w1']:1`), provided
every input axis the pattern matches holds that dim: a plan names all the
layers' axis, not layer 0's. The argument's index and the axis stay
numbers. A dim one of jaxbackend's passes made has no user line: the layer
axis `reroll` stacks per-layer values on is `layers` (`layers_1`, ... for
further rolled loops), any other is named by primitive and axis. These
are ordinary rule names: `rules={"args[3]:1": "data"}` shards that dim, as
does a rule naming any other input axis of it (`Graph.path_alias`), such
as one layer's.
"""

from __future__ import annotations

import os
import re

from jaxbackend import _jax, passes
from jaxbackend.passes import _stacks


def name_unnamed(key_names, class_key, composite, var_classes, invars, in_paths, origin):
    """Name each key no dim name reached after where it comes from: the
    first input axis holding it ("params['wte']:1", an argument path
    and axis), else the first equation making it ("gather@model.py:88:0",
    primitive, source line, axis); repeats get "_1", "_2"."""
    where: dict = {}
    held: dict = {}          # unnamed key -> the input axes holding it, in order
    by_skeleton: dict = {}   # every input axis, by its text with each number blanked
    for i, v in enumerate(invars):
        for a, c in enumerate(var_classes[v]):
            name = f"{in_paths[i]}:{a}"
            by_skeleton.setdefault(_NUMBER.sub("#", name), []).append(name)
            if c not in composite and key_names[class_key[c]] is None:
                held.setdefault(class_key[c], []).append(name)
    for k, names in held.items():
        where[k] = _wildcard(names, by_skeleton)
    for v in sorted(origin):
        eqn = origin[v]
        for a, c in enumerate(var_classes[v]):
            if c not in composite and class_key[c] not in where:
                where[class_key[c]] = _origin_name(eqn, a)
    taken = {n for n in key_names if n is not None}
    for k, n in enumerate(key_names):
        if n is None:
            base = where.get(k, f"dim{k}")
            name, j = base, 0
            while name in taken:
                j += 1
                name = f"{base}_{j}"
            key_names[k] = name
            taken.add(name)


_NUMBER = re.compile(r"\d+")


def _wildcard(names: list, by_skeleton: dict) -> str:
    """The first of `names` (the input axes holding one key) with `*` for
    the numbers that vary among them (a layer index; not the `1` of `w1`,
    never the argument's index or the axis after the colon). Greedy: each
    number made `*` must cover more of `names`, and the pattern must match
    no input axis outside `names`. The first name as it is where no number
    qualifies."""
    first = names[0]
    skeleton, nums = _NUMBER.sub("#", first), _NUMBER.findall(first)
    rows = [_NUMBER.findall(n) for n in names[1:] if _NUMBER.sub("#", n) == skeleton]
    mine, others = set(names), by_skeleton[skeleton]

    def covered(vary) -> int:   # names agreeing with the first outside `vary`
        return sum(all(r[j] == nums[j] for j in range(len(nums)) if j not in vary) for r in rows)

    def safe(vary) -> bool:
        pattern = star_pattern(_spell(first, nums, vary))
        return not any(n not in mine and pattern.fullmatch(n) for n in others)

    vary: frozenset = frozenset()
    best = 0
    while rows:
        grown = [(covered(vary | {j}), j) for j in range(1, len(nums) - 1) if j not in vary]
        grown = [(c, j) for c, j in grown if c > best and safe(vary | {j})]
        if not grown:
            break
        best, j = max(grown, key=lambda cj: (cj[0], -cj[1]))   # a tie: the first number
        vary |= {j}
    return _spell(first, nums, vary) if vary else first


def _spell(text: str, nums: list, vary) -> str:
    """`text` (whose numbers are `nums`) with `*` for the numbers at the
    positions in `vary`."""
    parts = _NUMBER.split(text)
    return "".join(p + ("" if j == len(nums) else "*" if j in vary else nums[j])
                   for j, p in enumerate(parts))


def star_pattern(name: str):
    """The regex of the input-axis names `name` spells with `*` for a
    number (a plan's own name, or a rule's)."""
    return re.compile(re.escape(name).replace(r"\*", r"\d+"))


def _origin_name(eqn, axis: int) -> str:
    """The name of `eqn`'s output axis `axis`, after the equation. An
    equation a pass emitted has no user line to show: reroll's stacks of
    per-layer values lead with the layer axis (`layers`); any other is named
    by primitive and axis alone."""
    where = _jax.source_frame(eqn)
    if where is not None and not where[0].startswith(_PASSES_DIR):
        return f"{eqn.primitive.name}@{os.path.basename(where[0])}:{where[2]}:{axis}"
    if where is not None and where[0] == _stacks.__file__ and where[1] in _STACKING and axis == 0:
        return "layers"
    return f"{eqn.primitive.name}:{axis}"


_PASSES_DIR = os.path.dirname(passes.__file__) + os.sep
# the functions of `passes._stacks` whose results lead with the layer axis
_STACKING = frozenset({"stack", "stack_new_axis", "hold"})
