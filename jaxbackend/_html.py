"""Small HTML tables for Jupyter's `_repr_html_` (NamedArray, Plan).

A value renders as a titled box of tables, notes and preformatted text,
built from the facts it already holds; nothing here knows what a NamedArray
or a Plan is. Escaping is this module's job alone: every string a caller
passes is plain text and goes through `html.escape` here, so a dim named
`<b>` or a parameter path with quotes shows as written and cannot inject
markup. The functions that make markup return `Html`, and `box` accepts
only `Html` parts, so mypy rejects an unescaped string where markup goes.

Styles are inline and few (monospace, left-aligned, thin row rules):
JupyterLab, VS Code and GitHub's notebook viewer drop or scope `<style>`
blocks differently, while inline styles read the same in all three.
"""

from __future__ import annotations

import html
from typing import Iterable, NewType, Sequence

# Markup made by this module (its text already escaped).
Html = NewType("Html", str)

_TABLE = ('style="border-collapse:collapse;font-family:monospace;font-size:12px;'
          'margin:2px 0 6px 0"')
_CAPTION = 'style="caption-side:top;text-align:left;font-style:italic;padding:2px 0"'
_TH = 'style="text-align:left;padding:1px 10px 1px 0;border-bottom:1px solid #999"'
_TD = 'style="text-align:left;padding:1px 10px 1px 0;border-bottom:1px solid #e4e4e4"'
_BOX = 'style="font-family:monospace;font-size:12px;line-height:1.35"'


def text(value: object) -> Html:
    """`value` as escaped text."""
    return Html(html.escape(str(value)))


def table(header: Sequence[object], rows: Iterable[Sequence[object]],
          caption: object = None) -> Html:
    """A table with one header row; every cell and the caption escaped."""
    head = "".join(f"<th {_TH}>{text(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td {_TD}>{text(c)}</td>" for c in row) + "</tr>"
                   for row in rows)
    cap = "" if caption is None else f"<caption {_CAPTION}>{text(caption)}</caption>"
    return Html(f"<table {_TABLE}>{cap}<thead><tr>{head}</tr></thead>"
                f"<tbody>{body}</tbody></table>")


def note(value: object) -> Html:
    """One line of escaped text."""
    return Html(f"<div>{text(value)}</div>")


def pre(value: object) -> Html:
    """Escaped preformatted text (an array preview keeps its alignment)."""
    return Html(f'<pre style="margin:2px 0;font-size:12px">{text(value)}</pre>')


def box(title: object, *parts: Html) -> Html:
    """A bold escaped title over `parts`, each made by this module."""
    return Html(f"<div {_BOX}><div><b>{text(title)}</b></div>{''.join(parts)}</div>")
