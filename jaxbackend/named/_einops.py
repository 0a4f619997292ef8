"""einops on NamedArrays: `rearrange`, `reduce`, `repeat` by dim name.

A pattern's axis names ARE dim names. The left side is matched against the
array by name, not by position: a bare name must be one of the array's dims;
a group `(head hd)` stands for the one dim of the array it splits, which is
either named in the group, `(embd: head hd)`, or the dim left over once the
bare names are matched (several unnamed groups take the left-over dims in
the array's order); an ellipsis `...` takes every dim not otherwise matched.
The left side may be empty (`"-> batch head time hd"`): the array already
knows its dims, so it reads as its own dims.

The right side names the result's dims: a bare name is that dim; a group
merges dims into one, named `(embd: head hd)` or, unnamed, by joining its
parts with "_" (`(head hd)` -> `head_hd`); `...` puts back the dims the left
ellipsis took (with an empty left side: every dim the right side does not
name). A new axis needs a name: `(new: 1)`, or a bare name sized by keyword
in `repeat`.

The work is einops' own: its parser reads both sides
(`einops.parsing.ParsedExpression`), and the array, brought to the left
side's order, goes through `einops.rearrange`/`reduce`/`repeat` with a
positional pattern over placeholder names (so dim names need not be Python
identifiers). Names and sizes are checked first, so a mistake is a
`DimError` naming the dim, both sizes and the fix. None of these ops
contracts: every contraction of a program still binds the named `einsum`.
"""

from __future__ import annotations

import math
import re

import einops
from einops.parsing import AnonymousAxis, ParsedExpression

from jaxbackend.named import _errors
from jaxbackend.named._array import NamedArray
from jaxbackend.named._errors import DimError

_ELLIPSIS = "…"  # einops' marker for "..." in a parsed composition
_TOKEN = re.compile(r"\(\s*([A-Za-z_]\w*)\s*:|\(|\)|\s+|[^\s()]+")


def rearrange(x: NamedArray, pattern: str, **sizes) -> NamedArray:
    """`einops.rearrange` by dim name: transpose, split and merge dims, e.g.
    `rearrange(x, "batch time (head hd) -> batch head time hd", head=4)`."""
    return _apply("rearrange", x, pattern, sizes, lambda v, p: einops.rearrange(v, p, **_ids(sizes)))


def reduce(x: NamedArray, pattern: str, reduction="sum", **sizes) -> NamedArray:
    """`einops.reduce` by dim name: dims of the left side missing on the right
    are reduced with `reduction` ("sum", "mean", "max", "min", "prod", or a
    callable as einops takes), e.g. `reduce(x, "-> batch embd", "mean")`."""
    return _apply("reduce", x, pattern, sizes,
                  lambda v, p: einops.reduce(v, p, reduction, **_ids(sizes)))


def repeat(x: NamedArray, pattern: str, **sizes) -> NamedArray:
    """`einops.repeat` by dim name: right-side names absent on the left are new
    dims sized by keyword, e.g. `repeat(x, "-> batch time embd", time=8)`."""
    return _apply("repeat", x, pattern, sizes, lambda v, p: einops.repeat(v, p, **_ids(sizes)))


# Placeholders: einops wants Python identifiers; dim names need not be.
_id_of: dict = {}


def _id(name) -> str:
    if isinstance(name, AnonymousAxis):
        return str(name.value)
    return _id_of.setdefault(name, f"n{len(_id_of)}")


def _ids(sizes: dict) -> dict:
    return {_id(k): v for k, v in sizes.items()}


def _parse(op: str, text: str, where: str):
    """(einops composition, {item index: group name}) of one side."""
    names, plain, depth, items = {}, [], 0, 0
    for m in _TOKEN.finditer(text):
        tok = m.group(0)
        if tok.startswith("("):
            if m.group(1):
                if depth:
                    raise DimError(f"{op}: the group name {m.group(1)!r} in {text!r} is inside "
                                   f"another group; name only top-level groups, e.g. (embd: head hd).")
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


def _is_group(item, i, names) -> bool:
    return i in names or len(item) != 1 or isinstance(item[0], AnonymousAxis)


def _apply(op, x, pattern, sizes, run):
    if not isinstance(x, NamedArray):
        raise TypeError(f"{op}: expected a NamedArray, got {type(x).__name__}; wrap it with "
                        f"nx.as_named(array, dims=...) first, or use einops.{op} on plain arrays.")
    if not isinstance(pattern, str) or pattern.count("->") != 1:
        raise DimError(f"{op}: pattern={pattern!r} needs exactly one '->', e.g. "
                       f"'batch time (head hd) -> batch head time hd'.")
    x.check_rank(op)
    left_text, right_text = pattern.split("->")
    right, rnames = _parse(op, right_text, "right side")
    if left_text.strip():
        left, lnames = _parse(op, left_text, "left side")
        order, left_pos, ell = _match_left(op, x, left, lnames, sizes, pattern)
    else:                                   # shorthand: the array's own dims
        mentioned = {n for item in right if item != _ELLIPSIS for n in item}
        ell = [d for d in x.dims if d not in mentioned] if _ELLIPSIS in right else []
        order = [d for d in x.dims if d not in ell] + ell
        left_pos = [_id(d) for d in order[:len(order) - len(ell)]] + (["..."] if ell else [])
    for name, n in sizes.items():
        if name in x.sizes and x.sizes[name] != n and name in order:
            raise _errors.size_conflict(op, name, n, x.sizes[name], "the keyword arguments", "the array")
    out_dims, right_pos = [], []
    for i, item in enumerate(right):
        if item == _ELLIPSIS:
            out_dims += ell
            right_pos.append("...")
        elif _is_group(item, i, rnames):
            if i not in rnames and not item:
                raise DimError(f"{op}: the right side of {pattern!r} makes a new size-1 axis without "
                               f"a name; name it as a group, e.g. (new: 1).")
            out_dims.append(rnames.get(i) or "_".join(str(getattr(p, "value", p)) for p in item))
            right_pos.append("(" + " ".join(_id(p) for p in item) + ")")
        else:
            out_dims.append(item[0])
            right_pos.append(_id(item[0]))
    out_dims = _errors.check_dims_tuple(op, out_dims, arg="the pattern's right side")
    _check_sides(op, pattern, _parts(left_pos, order), _parts(right_pos, out_dims), sizes)
    values = x.transpose(*order).values if tuple(order) != x.dims else x.values
    positional = " ".join(left_pos) + " -> " + " ".join(right_pos)
    try:
        out = run(values, positional)
    except einops.EinopsError as e:
        raise DimError(f"{op}: einops rejected {pattern!r} for dims {_errors.fmt_dims(x.dims)} "
                       f"with sizes {x.sizes}: {_names_back(str(e))}") from None
    return NamedArray(out, out_dims)


def _match_left(op, x, left, names, sizes, pattern):
    """The array's dims in the left side's order, the positional left
    pattern, and the dims the ellipsis takes."""
    bound, groups, has_ell = {}, [], False    # item index -> dim; unnamed group indices
    for i, item in enumerate(left):
        if item == _ELLIPSIS:
            has_ell = True
        elif _is_group(item, i, names) and i not in names:
            groups.append(i)
        else:
            dim = names.get(i, item[0])
            if dim not in x.sizes:
                raise DimError(f"{op}: the pattern {pattern!r} names {dim!r}, which is not a dim of "
                               f"the array, whose dims are {_errors.fmt_dims(x.dims)}; use those "
                               f"names (or rename first).")
            if dim in bound.values():
                raise DimError(f"{op}: the left side of {pattern!r} names dim {dim!r} twice; "
                               f"name each of the array's dims once.")
            bound[i] = dim
    rest = [d for d in x.dims if d not in bound.values()]
    if groups and has_ell:
        raise DimError(f"{op}: in {pattern!r} an unnamed group and '...' both stand for unnamed dims "
                       f"{_errors.fmt_dims(rest)}; name the group's dim, e.g. (embd: head hd).")
    if not has_ell and len(groups) != len(rest):
        raise DimError(f"{op}: the left side of {pattern!r} leaves dims {_errors.fmt_dims(rest)} of the "
                       f"array {_errors.fmt_dims(x.dims)} for {len(groups)} unnamed group(s); mention "
                       f"every dim once (add '...' for the others, or name groups as (dim: a b)).")
    bound.update(zip(groups, rest))
    order, pos, ell = [], [], rest if has_ell else []
    for i, item in enumerate(left):
        if item == _ELLIPSIS:
            order += ell
            pos.append("...")
            continue
        dim = bound[i]
        order.append(dim)
        if _is_group(item, i, names):
            _check_group(op, x, dim, item, sizes, pattern)
            pos.append("(" + " ".join(_id(p) for p in item) + ")")
        else:
            pos.append(_id(item[0]))
    return order, pos, ell


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


def _parts(positional, dims) -> set:
    """Names an einops side mentions (the ellipsis standing for `dims`' own)."""
    back = {v: k for k, v in _id_of.items()}
    names = {back[t] for item in positional for t in re.findall(r"\bn\d+\b", item)}
    return names | (set(dims) if "..." in positional else set())


def _check_sides(op, pattern, left: set, right: set, sizes: dict):
    """What einops would reject, said with dim names: rearrange keeps every
    name, reduce only drops, repeat only adds (sized by keyword)."""
    dropped, added = sorted(left - right), sorted(right - left)
    if dropped and op != "reduce":
        raise DimError(f"{op}: {pattern!r} drops dims {tuple(dropped)}, which only nx.reduce does; "
                       f"keep them on the right side or use nx.reduce(x, pattern, 'sum').")
    if added and op != "repeat":
        raise DimError(f"{op}: {pattern!r} has {tuple(added)} on the right side only, which only "
                       f"nx.repeat creates; use nx.repeat(x, pattern, {added[0]}=size) for a new dim.")
    unsized = [d for d in added if d not in sizes]
    if unsized:
        raise DimError(f"repeat: new dims {tuple(unsized)} of {pattern!r} have no size; give each by "
                       f"keyword, e.g. nx.repeat(x, pattern, {unsized[0]}=4).")


def _names_back(message: str) -> str:
    back = {v: k for k, v in _id_of.items()}
    return re.sub(r"\bn\d+\b", lambda m: back.get(m.group(0), m.group(0)), message)
