"""What the compiler actually did: collectives and memory of a compiled step.

Reads `compiled.as_text()` (the optimised, partitioned HLO of one device)
for collective instructions and sums the bytes of their results, by kind;
reads `compiled.memory_analysis()` for per-device memory. The cost model's
predictions are checked against these. Async pairs (`all-reduce-start` /
`-done`) count once, at the start. A collective inside a `while` body counts
once per occurrence in the text, not per trip.
"""

from __future__ import annotations

import math
import re

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_LINE = re.compile(r"=\s*(\(.*?\)|\S+)\s+(" + "|".join(_KINDS) + r")(-start)?\(")
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")


def _bytes(shape_text: str) -> int:
    total = 0
    for dtype, dims in _SHAPE.findall(shape_text):
        if dtype in _DTYPE_BYTES:
            total += _DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def collectives(hlo_text: str) -> dict:
    """{kind: {'count': n, 'bytes': result bytes per device}} for each kind."""
    out = {k: {"count": 0, "bytes": 0} for k in _KINDS}
    for line in hlo_text.splitlines():
        m = _LINE.search(line)
        if m:
            shape, kind, start = m.groups()
            if start:   # async start returns (operand, result, ...): count the result only
                parts = _SHAPE.findall(shape)
                shape = "%s[%s]" % parts[-1] if parts else ""
            out[kind]["count"] += 1
            out[kind]["bytes"] += _bytes(shape)
    return out


def memory(compiled) -> dict:
    """Per-device bytes from `memory_analysis()`: arguments, outputs, temporaries."""
    m = compiled.memory_analysis()
    d = dict(arguments=m.argument_size_in_bytes, outputs=m.output_size_in_bytes,
             temp=m.temp_size_in_bytes, alias=m.alias_size_in_bytes)
    d["total"] = d["arguments"] + d["outputs"] + d["temp"] - d["alias"]
    return d
