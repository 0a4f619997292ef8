"""Axis rules: what a sharding plan is, `dim name -> mesh axes`.

A rule maps a dim name to one mesh axis, a tuple of mesh axes (the dim is
split over their product), or None (replicated); `Rules` is that mapping.
The same rules lay out parameters (`jaxbackend.nn.partition_specs`), the
arguments and contractions of a planned program (`Plan`), and export as
Flax logical axis rules. This module is the one place that reads them:

* `normalize`: a dict, a sequence of (dim, axes) pairs, or an object with a
  `.rules` attribute (a `Plan`) -> a dict whose values are a name, a tuple
  of two or more names, or None;
* `spec_for_dims`: a tensor's PartitionSpec from its dim names. A mesh axis
  shards at most one dim of a tensor: a later dim keeps only the axes an
  earlier dim left unused (a plan's per-tensor exception);
* `check_divisible`: every dim's size divides by the size of its axes, or
  one `DimError` (a ValueError) worded the same for parameters and programs;
* `split_unused`: the rules naming a dim of a program, and the names of
  the others (a rule set written for a family of models; a misspelling of
  one of the program's dims is an error instead);
* `to_masks`: rules -> one mesh-axis bit mask per key of a sharding graph
  (the search's representation), merged dims taking their major factor's,
  and the names `split_unused` left unused. A rule may name a dim by any
  input axis of it, with `*` for a layer index (`aliases`).

Rules are read, never changed: every function returns a new value.
"""

from __future__ import annotations

import difflib
import math
import re
from typing import Mapping, Union

from jax.sharding import PartitionSpec

from jaxbackend.named import DimError
from jaxbackend.sharding import _names

Axes = Union[str, tuple[str, ...], None]
Rules = Mapping[str, Axes]


def normalize(rules) -> dict[str, Axes]:
    """dict dim -> mesh axis (str), tuple of two or more axes, or None.

    In a sequence of pairs (Flax's and MaxText's logical axis rules) a dim
    may appear more than once; Flax reads such a list in order and gives
    the dim its first rule whose axes the tensor's earlier dims left free,
    so the first rule is the dim's (where an earlier dim took those axes,
    `spec_for_dims` leaves it unsharded instead of trying the next one)."""
    if hasattr(rules, "rules"):
        rules = rules.rules
    if rules is None:
        return {}
    if isinstance(rules, (str, bytes, set, frozenset)):
        raise TypeError(f"sharding rules {rules!r}: give a dict of dim name -> mesh axis (e.g. "
                        f"{{'batch': 'data'}}) or a sequence of (dim, mesh axis) pairs.")
    if isinstance(rules, Mapping):
        items = list(rules.items())
    else:
        try:
            items = [tuple(r) for r in rules]
        except TypeError:
            raise ValueError(f"sharding rules {rules!r} must be a dict of dim -> mesh axis or a "
                             f"sequence of (dim, mesh axis) pairs.") from None
    out: dict[str, Axes] = {}
    for item in items:
        if len(item) != 2 or not isinstance(item[0], str):
            raise ValueError(f"sharding rule {item!r} must be a (dim name, mesh axis) pair.")
        dim, axis = item
        if isinstance(axis, list):
            axis = tuple(axis)
        if not (axis is None or isinstance(axis, str)
                or isinstance(axis, tuple) and all(isinstance(a, str) for a in axis)):
            raise TypeError(f"sharding rule {dim!r}: {axis!r} is not a mesh axis name, a tuple "
                            f"of names or None; e.g. {{{dim!r}: 'data'}}.")
        if isinstance(axis, tuple) and len(axis) <= 1:  # () = replicated, ("x",) = "x"
            axis = axis[0] if axis else None
        out.setdefault(dim, axis)   # the first rule for a dim is its own (see above)
    return out


def axes_tuple(axes: Axes) -> tuple[str, ...]:
    """None -> (), "x" -> ("x",), a tuple as it is."""
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def axes_text(axes: Axes) -> str:
    """A rule value as plan tables print it: "data × model", or "replicated"."""
    return " × ".join(axes_tuple(axes)) or "replicated"


def spec_for_dims(dims, rules: Rules) -> PartitionSpec:
    """PartitionSpec of a tensor with these dim names under `rules`."""
    used: set = set()
    out = []
    for d in dims:
        keep = tuple(a for a in axes_tuple(rules.get(d)) if a not in used)
        used.update(keep)
        out.append(None if not keep else keep[0] if len(keep) == 1 else keep)
    return PartitionSpec(*out)


def check_size(dim: str, size: int, axes: Axes, axis_sizes: Mapping[str, int],
               where: str = "") -> None:
    """Raise `DimError` unless mesh axes `axes` (sizes from `axis_sizes`)
    divide `size`; `where` ("of parameter ['w']") says whose dim it is."""
    unknown = [a for a in axes_tuple(axes) if a not in axis_sizes]
    if unknown:
        raise ValueError(f"dim {dim!r}{where} is mapped to {axes!r}, but the mesh has no axis "
                         f"{unknown[0]!r}; its axes are {tuple(axis_sizes)}.")
    k = math.prod(axis_sizes[a] for a in axes_tuple(axes))
    if size % k:
        raise DimError(f"dim {dim!r}{where} has size {size}, not divisible by mesh axes {axes!r} "
                       f"of size {k}; map {dim!r} to mesh axes whose size divides {size}, or to "
                       f"None.")


def check_divisible(named_shapes, rules: Rules, axis_sizes: Mapping[str, int]) -> None:
    """`named_shapes`: (where, dims, shape) triples; checks each dim's size
    against the axes `spec_for_dims` gives it."""
    for where, dims, shape in named_shapes:
        for d, n, axes in zip(dims, shape, spec_for_dims(dims, rules)):
            check_size(d, n, axes, axis_sizes, where)


def split_unused(rules: Rules, graph, alias_of: Mapping) -> tuple[dict, list]:
    """(the rules that name a dim of `graph`, a sharding graph, by a name of
    it or an input axis in `alias_of` (`aliases`); the names of the others,
    sorted).

    Rules are a table, as Flax's logical axis rules and Levanter's axis
    mapping are: a set written once for a family of models names dims a
    given program lacks (`vocab` in a ViT, `kv_head` without grouped
    heads), and those rules go unused, as there. A name that is not a dim
    of the program but close to one of its dim names (`layer` for
    `layers`, `bacth` for `batch`; an input path nearly one of the
    program's, of the same argument) is taken for a misspelling: ValueError
    naming both. A name split by a reshape stays in the rules (`to_masks`
    says which factor to name)."""
    g, dims = graph, dim_names(graph)
    unknown = sorted(set(rules) - set(dims) - set(alias_of) - set(g.path_factors))
    plain = [n for n in dims if _plain(n)]
    paths = [n for n in (*dims, *g.path_alias) if not _plain(n)] if unknown else []
    for n in unknown:
        near = difflib.get_close_matches(n, plain if _plain(n) else _same_argument(n, paths),
                                         n=1, cutoff=0.8 if _plain(n) else 0.85)
        if near:
            raise ValueError(f"rules: {n!r} names no dim of this program; did you mean "
                             f"{near[0]!r}? Its dims are {dims}; fix the spelling (a rule "
                             f"for a dim the program lacks is unused).")
    return {d: a for d, a in rules.items() if d not in unknown}, unknown


def aliases(rules, graph) -> Mapping:
    """`graph.path_alias` (input axes, by path, that are a key of another
    name) plus each rule name with `*` for a number (a layer index:
    `args[0]['layers'][*]['w2']:0`, as the plan spells its own names) whose
    matches among the input axes are all one key; ValueError where they are
    several dims."""
    g = graph
    star = [n for n in rules if "*" in n and n not in g.key_names and n not in g.path_alias]
    if not star:
        return g.path_alias
    found = dict(g.path_alias)
    named = {n: k for k, n in enumerate(g.key_names)}
    for n in star:
        pattern = _names.star_pattern(n)
        keys = {k for spelled in (found, named) for m, k in spelled.items()
                if pattern.fullmatch(m)}
        if len(keys) > 1:
            raise ValueError(f"rules: {n!r} matches input axes of {len(keys)} dims of the plan "
                             f"({', '.join(sorted(repr(g.key_names[k]) for k in keys))}); "
                             f"name one of them.")
        if keys:
            found[n] = keys.pop()
    return found


def dim_names(graph) -> list:
    """The names of `graph`'s dims (a sharding graph's keys, and the merged
    dims laid out by one of them), sorted: what messages list."""
    return sorted(set(graph.key_names) | set(graph.key_alias))


def _same_argument(name: str, paths: list) -> list:
    """The names in `paths` a misspelling of `name` (not a plain name) may
    be: those of the same argument (`args[0]['layers'][*]['wl']:1` for
    `args[0]['layers'][*]['w1']:1`), or any where `name` names no argument
    (`arg[1]:0`); none for an argument the program lacks (`args[5]:0`, a
    rule for a family of models)."""
    m = _ARGUMENT.match(name)
    if m is None:
        return paths
    return [p for p in paths if p.startswith(m.group(0))]


_ARGUMENT = re.compile(r"(args|kwargs)\[[^\]]*\]")


def _plain(name: str) -> bool:
    """A dim name a user writes (`batch`), not one made from an argument
    path or an equation (`args[0]['w']:1`, `gather@model.py:88:0`)."""
    return name.isidentifier()


def _fold(rules: dict, alias: str, into: str, clash) -> None:
    """rules[alias] becomes rules[into] (another spelling of one dim);
    ValueError(clash()) where both are given, differently."""
    if into in rules and rules[into] != rules[alias]:
        raise ValueError(clash())
    rules[into] = rules.pop(alias)


def to_masks(rules: Rules, graph, mesh) -> tuple[list[int], list[str]]:
    """(one mesh-axis mask per key of `graph` (a sharding graph) under
    `rules` on `mesh` (a MeshSpec); the rules' names that no dim of `graph`
    has, `split_unused`'s). A rule for a merged dim (a reshape of several
    dims) applies to its major factor, the key it is laid out by."""
    g = graph
    alias_of = aliases(rules, g)
    rules, unused = split_unused(rules, g, alias_of)   # an absent dim's is unused; a typo raises
    merged = [n for n in rules if n in g.path_factors and n not in g.path_alias
              and n not in g.key_names and n not in g.key_alias]
    if merged:
        n, parts = merged[0], g.path_factors[merged[0]]
        raise ValueError(
            f"rules: {n!r} is split by a reshape in the program into the dims {list(parts)} "
            f"(a batch into micro-batches, say): a plan shards those, not it; name the one to "
            f"shard (rules={{{parts[-1]!r}: ...}} shards the last).")
    given_as: dict = {}   # the plan's name of a dim -> the spelling a rule used
    for alias in [a for a in rules if a in alias_of]:   # another input axis of one dim
        name = g.key_names[alias_of[alias]]
        other = given_as.get(name, name)
        _fold(rules, alias, name, lambda: (
            f"rules: {alias!r} and {other!r} are one dim of the plan (called {name!r}), "
            f"but the rules give {alias!r} -> {rules[alias]!r} and {other!r} -> "
            f"{rules[name]!r}; give one of them, or both the same axes."))
        given_as.setdefault(name, alias)
    for alias, k in g.key_alias.items():   # a merged dim: laid out as its major factor
        if alias in rules:
            major = g.key_names[k]
            _fold(rules, alias, major, lambda: (
                f"rules: dim {alias!r} is a reshape of dims whose major factor is {major!r}, "
                f"so it is sharded as {major!r}, but the rules give {alias!r} -> "
                f"{rules[alias]!r} and {major!r} -> {rules[major]!r}; give one of them, or "
                f"both the same axes."))
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    masks = [0] * len(g.key_names)
    for k, name in enumerate(g.key_names):
        if name in rules:
            ext = g.key_extents[k]
            if k in g.unshardable and axes_tuple(rules[name]):
                given = given_as.get(name, name)
                called = f", called {name!r} in the plan" if given != name else ""
                raise DimError(f"dim {given!r} (size {max(ext, default=1)}{called}) is "
                               f"{g.unshardable[k]}: it cannot be sharded; map {given!r} to "
                               f"None.")
            where = (f" (given to axes of sizes {', '.join(map(str, ext))}: a sharding must "
                     f"divide each)" if len(ext) > 1 else "")
            check_size(name, g.key_size[k], rules[name], sizes, where)   # names an unknown axis
            masks[k] = mesh.mask(rules[name])
    return masks, unused
