"""Read back what `_repr_html_` rendered: its tables, notes and previews as
text, with the standard library's HTML parser (entities decoded), so tests
assert on cells and not on substrings of markup."""

from __future__ import annotations

import dataclasses
from html.parser import HTMLParser


@dataclasses.dataclass
class Table:
    caption: str
    header: list
    rows: list

    def column(self, name: str) -> dict:
        """{first cell of each row: its cell under `name`}."""
        i = self.header.index(name)
        return {r[0]: r[i] for r in self.rows}


@dataclasses.dataclass
class Page:
    title: str = ""
    tables: list = dataclasses.field(default_factory=list)
    notes: list = dataclasses.field(default_factory=list)   # text of <div>s holding text only
    pre: list = dataclasses.field(default_factory=list)
    tags: list = dataclasses.field(default_factory=list)    # every start tag, in order


class _Reader(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.page, self.stack, self.buf = Page(), [], []

    def handle_starttag(self, tag, attrs):
        self.page.tags.append(tag)
        if tag == "table":
            self.page.tables.append(Table("", [], []))
        elif tag == "tr":
            self.row = []
        self.stack.append(tag)
        self.buf = []

    def handle_data(self, data):
        self.buf.append(data)

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, f"unbalanced </{tag}> in {self.stack}"
        self.stack.pop()
        s, t = "".join(self.buf), self.page.tables[-1] if self.page.tables else None
        if tag in ("td", "th"):
            self.row.append(s)
        elif tag == "tr":
            if t.header:
                t.rows.append(self.row)
            else:
                t.header = self.row
        elif tag == "caption":
            t.caption = s
        elif tag == "b":
            self.page.title = s
        elif tag == "pre":
            self.page.pre.append(s)
        elif tag == "div" and s:
            self.page.notes.append(s)
        self.buf = []


def read(html: str) -> Page:
    """The page `html` renders; fails on unbalanced tags."""
    r = _Reader()
    r.feed(html)
    r.close()
    assert not r.stack, f"unclosed tags {r.stack}"
    return r.page
