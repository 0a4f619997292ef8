"""einops on NamedArrays: `rearrange`, `reduce`, `repeat` by dim name.

A pattern's axis names ARE dim names. The left side is matched against the
array by name, not by position (so it reads the same whatever order the
array's axes are in): a bare name must be one of the array's dims; a group
`(head hd)` stands for the one dim of the array it splits, which is either
named in the group, `(embd: head hd)`, or the dim left over once the bare
names are matched (several unnamed groups take the left-over dims in the
array's order); its size must be the product of the group's sizes (all but
one given by keyword); an ellipsis `...` takes every dim not otherwise
matched. The left side may be empty (`"-> batch head time hd"`): the array
already knows its dims, so it reads as its own dims.

The right side names the result's dims: a bare name is that dim; a group
merges dims into one, named `(embd: head hd)` or, unnamed, by joining its
parts with "_" (`(head hd)` -> `head_hd`, `(...)` joins the ellipsis' dims);
`...` puts back the dims the left ellipsis took, under their own names (with
an empty left side: every dim the right side does not name). A new axis
needs a name: `(new: 1)`, or a bare name sized by keyword in `repeat`.

The work is einops' own: its parser reads both sides
(`einops.parsing.ParsedExpression`; only the `name:` group prefix is ours and
is stripped first), and the array's values go through `einops.rearrange` /
`reduce` / `repeat` with a positional pattern whose left side lists the
array's axes in their own order and spells `...` out as the dims it took, so
a rearrange is one reshape-transpose-reshape and never a transpose back and
forth. The positional pattern uses placeholder identifiers, fresh per call
(einops' messages are translated back to dim names). Names and sizes are
checked first, so a mistake is a `DimError` naming the dim, both sizes and
the fix. None of these ops contracts: every contraction of a program still
binds the named `einsum`.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable

import einops
from einops.parsing import AnonymousAxis, ParsedExpression

from jaxbackend.named import _errors
from jaxbackend.named._array import NamedArray
from jaxbackend.named._errors import DimError

_ELLIPSIS = "…"  # einops' marker for "..." in a parsed composition
_REDUCTIONS = ("sum", "mean", "max", "min", "prod", "any", "all")  # the names einops accepts
_TOKEN = re.compile(r"\(\s*([A-Za-z_]\w*)\s*:|\(|\)|\s+|[^\s()]+")


def rearrange(x: NamedArray, pattern: str, **sizes: int) -> NamedArray:
    """`einops.rearrange` by dim name: transpose, split and merge dims, e.g.
    `rearrange(x, "batch time (head hd) -> batch head time hd", head=4)`."""
    return _apply("rearrange", x, pattern, sizes, einops.rearrange)


def reduce(x: NamedArray, pattern: str, reduction: str | Callable = "sum",
           **sizes: int) -> NamedArray:
    """`einops.reduce` by dim name: dims of the left side missing on the right
    are reduced with `reduction` ("sum", "mean", "max", "min", "prod", "any",
    "all", or a callable `(array, axes) -> array` as einops takes), e.g.
    `reduce(x, "batch time embd -> batch embd", "mean")`."""
    if not callable(reduction) and reduction not in _REDUCTIONS:
        raise DimError(f"reduce: reduction={reduction!r} is not one of {_REDUCTIONS}; pass one of "
                       f"those names or a callable (array, axes) -> array.")
    return _apply("reduce", x, pattern, sizes,
                  lambda v, p, **k: einops.reduce(v, p, reduction, **k))


def repeat(x: NamedArray, pattern: str, **sizes: int) -> NamedArray:
    """`einops.repeat` by dim name: right-side names absent on the left are new
    dims sized by keyword, e.g. `repeat(x, "batch embd -> batch copy embd", copy=3)`."""
    return _apply("repeat", x, pattern, sizes, einops.repeat)


class _Ids:
    """Placeholder identifiers for one call: einops' positional pattern gets
    `n0`, `n1`, ... and its messages get the dim names back."""

    def __init__(self) -> None:
        self.of: dict[str, str] = {}

    def __call__(self, name: Any) -> str:
        if isinstance(name, AnonymousAxis):
            return str(name.value)
        return self.of.setdefault(name, f"n{len(self.of)}")

    def group(self, parts: list) -> str:
        return "(" + " ".join(self(p) for p in parts) + ")"

    def back(self, message: str) -> str:
        names = {v: k for k, v in self.of.items()}
        return re.sub(r"\bn\d+\b", lambda m: names.get(m.group(0), m.group(0)), message)


def _parse(op: str, text: str, where: str):
    """(einops composition, {item index: group name}) of one side."""
    names, plain, depth, items = {}, [], 0, 0
    for m in _TOKEN.finditer(text):
        tok = m.group(0)
        if tok.startswith("("):
            if m.group(1):
                if depth:
                    raise DimError(f"{op}: the group name {m.group(1)!r} in {text!r} is inside "
                                   f"another group; name only top-level groups, e.g. "
                                   f"(embd: head hd).")
                names[items] = m.group(1)
            depth += 1
            plain.append("(")
        elif tok == ")":
            depth -= 1
            plain.append(")")
            items += depth == 0
        else:
            plain.append(tok)
            items += depth == 0 and not tok.isspace()
    try:
        parsed = ParsedExpression("".join(plain))
    except einops.EinopsError as e:
        raise DimError(f"{op}: the {where} of the pattern, {text.strip()!r}, does not parse ({e}); "
                       f"write dim names separated by spaces, groups in parentheses.") from None
    return parsed.composition, names


def _is_group(item, i: int, names: dict) -> bool:
    # `(a)` parses as bare `a`; `()`, `(a b)`, `(2)`, `(...)` and named groups are groups.
    return i in names or item == [] or len(item) != 1 or not isinstance(item[0], str) \
        or item[0] == _ELLIPSIS


def _named(parts) -> set:
    return {p for p in parts if isinstance(p, str)}


def _apply(op: str, x: NamedArray, pattern: str, sizes: dict, run: Callable) -> NamedArray:
    if not isinstance(x, NamedArray):
        raise TypeError(f"{op}: expected a NamedArray, got {type(x).__name__}; wrap it with "
                        f"nx.as_named(array, dims=...) first, or use einops.{op} on plain arrays.")
    if not isinstance(pattern, str) or pattern.count("->") != 1:
        raise DimError(f"{op}: pattern={pattern!r} needs exactly one '->', e.g. "
                       f"'batch time (head hd) -> batch head time hd'.")
    x.check_rank(op)
    ids = _Ids()
    left_text, right_text = pattern.split("->")
    right, rnames = _parse(op, right_text, "right side")
    if left_text.strip():
        left, lnames = _parse(op, left_text, "left side")
        split, ell = _match_left(op, x, left, lnames, sizes, pattern)
    else:                                   # shorthand: the array's own dims
        mentioned = {p for item in right if item != _ELLIPSIS for p in item}
        has_ell = any(item == _ELLIPSIS or _ELLIPSIS in item for item in right)
        ell = [d for d in x.dims if d not in mentioned] if has_ell else []
        split = {d: [d] for d in x.dims}
    for name, n in sizes.items():
        if name in split and x.sizes[name] != n:
            raise _errors.size_conflict(op, name, n, x.sizes[name], "the keyword arguments",
                                        "the array")
    # The array's axes in their own order: a bare dim, or the group that splits it.
    left_pos = [ids(d) if split[d] == [d] else ids.group(split[d]) for d in x.dims]
    out_dims, right_pos, right_names = [], [], set()
    for i, item in enumerate(right):
        if item == _ELLIPSIS:
            out_dims += ell
            right_pos += [ids(d) for d in ell]
            right_names |= set(ell)
            continue
        parts = [p for q in item for p in (ell if q == _ELLIPSIS else [q])]
        right_names |= _named(parts)
        if _is_group(item, i, rnames):
            if i not in rnames and not parts:
                raise DimError(f"{op}: the right side of {pattern!r} makes a new size-1 axis "
                               f"without a name; name it as a group, e.g. (new: 1).")
            out_dims.append(rnames.get(i) or "_".join(str(getattr(p, "value", p)) for p in parts))
            right_pos.append(ids.group(parts))
        else:
            out_dims.append(item[0])
            right_pos.append(ids(item[0]))
    out_dims = list(_errors.check_dims_tuple(op, out_dims, arg="the pattern's right side"))
    left_names = set().union(*(_named(p) for p in split.values()))
    _check_sides(op, pattern, left_names, right_names, sizes)
    positional = " ".join(left_pos) + " -> " + " ".join(right_pos)
    try:
        out = run(x.values, positional, **{ids(k): v for k, v in sizes.items()})
    except einops.EinopsError as e:
        raise DimError(f"{op}: einops rejected {pattern!r} for dims {_errors.fmt_dims(x.dims)} "
                       f"with sizes {x.sizes}: {ids.back(str(e)).strip()}") from None
    return NamedArray(out, tuple(out_dims))


def _match_left(op, x, left, names, sizes, pattern):
    """{array dim: the parts the left side splits it into ([dim] when bare)}
    for every dim of the array, and the dims the ellipsis takes."""
    bound, groups, has_ell = {}, [], False    # item index -> dim; unnamed group indices
    for i, item in enumerate(left):
        if item == _ELLIPSIS:
            has_ell = True
        elif _ELLIPSIS in item:
            raise DimError(f"{op}: the left side of {pattern!r} puts '...' inside a group; a group "
                           f"splits one dim, so write the dim's parts, e.g. (embd: head hd).")
        elif _is_group(item, i, names) and i not in names:
            groups.append(i)
        else:
            dim = names.get(i, item[0])
            if dim not in x.sizes:
                raise DimError(f"{op}: the pattern {pattern!r} names {dim!r}, which is not a dim "
                               f"of the array, whose dims are {_errors.fmt_dims(x.dims)}; use "
                               f"those names (or rename first).")
            if dim in bound.values():
                raise DimError(f"{op}: the left side of {pattern!r} names dim {dim!r} twice; "
                               f"name each of the array's dims once.")
            bound[i] = dim
    rest = [d for d in x.dims if d not in bound.values()]
    if groups and has_ell:
        raise DimError(f"{op}: in {pattern!r} an unnamed group and '...' both stand for unnamed "
                       f"dims {_errors.fmt_dims(rest)}; name the group's dim, e.g. "
                       f"(embd: head hd).")
    if not has_ell and len(groups) != len(rest):
        raise DimError(f"{op}: the left side of {pattern!r} leaves dims {_errors.fmt_dims(rest)} "
                       f"of the array {_errors.fmt_dims(x.dims)} for {len(groups)} unnamed "
                       f"group(s); mention every dim once (add '...' for the others, or name "
                       f"groups as (dim: a b)).")
    bound.update(zip(groups, rest))
    ell = rest if has_ell else []
    split = {d: [d] for d in ell}
    for i, dim in bound.items():
        if _is_group(left[i], i, names):
            _check_group(op, x, dim, left[i], sizes, pattern)
            split[dim] = left[i]
        else:
            split[dim] = [dim]
    return split, ell


def _check_group(op, x, dim, parts, sizes, pattern):
    """A group's known part sizes must fit the dim it splits."""
    known = [(p, p.value if isinstance(p, AnonymousAxis) else sizes[p]) for p in parts
             if isinstance(p, AnonymousAxis) or p in sizes]
    prod = math.prod(n for _, n in known)
    n = x.sizes[dim]
    unknown = len(parts) - len(known)
    if unknown > 1:
        raise DimError(f"{op}: group {tuple(str(p) for p in parts)} of {pattern!r} splits dim "
                       f"{dim!r} (size {n}) with {unknown} sizes unknown; give all but one by "
                       f"keyword, e.g. {op}(x, pattern, {parts[0]}=...).")
    if (unknown == 0 and prod != n) or (unknown == 1 and (prod == 0 or n % prod)):
        given = ", ".join(f"{p}={s}" for p, s in known)
        raise DimError(f"{op}: dim {dim!r} has size {n} but the group "
                       f"{tuple(str(p) for p in parts)} of {pattern!r} has sizes {given} "
                       f"(product {prod}){' that does not divide it' if unknown else ''}; "
                       f"choose sizes whose product is {n}.")


def _check_sides(op, pattern, left: set, right: set, sizes: dict):
    """What einops would reject, said with dim names: rearrange keeps every
    name, reduce only drops, repeat only adds (sized by keyword), and every
    size keyword names an axis of the pattern."""
    dropped, added = sorted(left - right), sorted(right - left)
    if dropped and op != "reduce":
        raise DimError(f"{op}: {pattern!r} drops dims {tuple(dropped)}, which only nx.reduce does; "
                       f"keep them on the right side or use nx.reduce(x, pattern, 'sum').")
    if added and op != "repeat":
        raise DimError(f"{op}: {pattern!r} has {tuple(added)} on the right side only, which only "
                       f"nx.repeat creates; use nx.repeat(x, pattern, {added[0]}=size) for a "
                       f"new dim.")
    unsized = [d for d in added if d not in sizes]
    if unsized:
        raise DimError(f"repeat: new dims {tuple(unsized)} of {pattern!r} have no size; give "
                       f"each by keyword, e.g. nx.repeat(x, pattern, {unsized[0]}=4).")
    unused = {k: n for k, n in sizes.items() if k not in left | right}
    if unused:
        given = ", ".join(f"{k}={n}" for k, n in unused.items())
        raise DimError(f"{op}: the size keyword(s) {given} name no axis of {pattern!r}; drop them "
                       f"or use the names in the pattern.")
