"""Names for the dims no dim name reaches (plain jnp code, unnamed inputs).

A plan a user reads names every sharded dim. A dim class that no NamedArray
and no named einsum labels is named after where it comes from: the first
program input holding it, by its argument path and axis
(`args[0]['tok']['embedding']:0`), else the first equation making it, by
primitive, user source line and axis (`gather@model.py:88:2`). A dim one of
jaxbackend's passes made has no user line: the layer axis `reroll` stacks
per-layer values on is `layers` (`layers_1`, ... for further rolled loops),
any other is named by primitive and axis. These are ordinary rule names:
`rules={"args[3]:1": "data"}` shards that dim, as does a rule naming any
other input axis of it (`Graph.path_alias`).
"""

from __future__ import annotations

import os

from jaxbackend import _jax, passes
from jaxbackend.passes import _stacks


def name_unnamed(key_names, class_key, composite, var_classes, invars, in_paths, origin):
    """Name each key no dim name reached after where it comes from: the
    first input axis holding it ("params['wte']:1", an argument path
    and axis), else the first equation making it ("gather@model.py:88:0",
    primitive, source line, axis); repeats get "_1", "_2"."""
    where: dict = {}
    for i, v in enumerate(invars):
        for a, c in enumerate(var_classes[v]):
            if c not in composite:
                where.setdefault(class_key[c], f"{in_paths[i]}:{a}")
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
