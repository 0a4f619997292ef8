"""What the compiler actually did: collectives and memory of a compiled step.

Reads `compiled.as_text()` (the optimised, partitioned HLO of one device)
for collective instructions and sums the bytes of their results, by kind;
reads `compiled.memory_analysis()` for per-device memory. The cost model's
predictions are checked against these. Async pairs (`all-reduce-start` /
`-done`) count once, at the start. A collective inside a `while` body with
a known trip count counts once per trip (scan over layers).
"""

from __future__ import annotations

import math
import re

from jaxbackend.sharding._ring import KINDS, ring_time

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_KINDS = KINDS + ("collective-permute",)   # the model charges none; XLA may emit some
_LINE = re.compile(r"=\s*(\(.*?\)|\S+)\s+(" + "|".join(_KINDS) + r")(-start)?\(")
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")


def _bytes(shape_text: str) -> int:
    total = 0
    for dtype, dims in _SHAPE.findall(shape_text):
        if dtype in _DTYPE_BYTES:
            total += _DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


_COMP = re.compile(r"^(?:ENTRY\s+)?(%[\w.\-]+)\s*\(")
_WHILE = re.compile(r"while\(.*?body=(%[\w.\-]+).*?\"known_trip_count\":\{\"n\":\"(\d+)\"")


def instructions(hlo_text: str) -> list:
    """[(kind, result bytes per device, group size, executions)] for each
    collective; `executions` multiplies through `while` loops with a known
    trip count (a scan over layers runs its body's collectives n times)."""
    found, loops, comp, entry = [], [], None, None
    for line in hlo_text.splitlines():
        if line and not line[0].isspace():
            m = _COMP.match(line)
            if m:
                comp = m.group(1)
                if line.startswith("ENTRY"):
                    entry = comp
            continue
        w = _WHILE.search(line)
        if w:
            loops.append((comp, w.group(1), int(w.group(2))))
        m = _LINE.search(line)
        if m:
            shape, kind, start = m.groups()
            if start:   # async start returns (operand, result, ...): count the result only
                parts = _SHAPE.findall(shape)
                shape = "%s[%s]" % parts[-1] if parts else ""
            found.append((comp, kind, _bytes(shape), _group_size(line)))
    runs = {entry: 1}
    for _ in range(len(loops)):   # nested loops: propagate until stable
        for parent, body, n in loops:
            if parent in runs:
                runs[body] = runs[parent] * n
    return [(kind, nbytes, size, runs.get(c, 1)) for c, kind, nbytes, size in found]


def _group_size(line: str) -> int:
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if m:   # mesh['a'=2,'b'=4] {'a'}: the product of the named axes
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(1)))
        return math.prod(int(sizes[a]) for a in re.findall(r"'(\w+)'", m.group(2)))
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)
    if m:   # iota form [groups, size]<=[...]
        return int(m.group(2))
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if m:
        return len(m.group(1).split(","))
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
    return 2 if m else 1


def collectives(hlo_text: str) -> dict:
    """{kind: {'count': n, 'bytes': result bytes per device}} for each kind."""
    out = {k: {"count": 0, "bytes": 0} for k in _KINDS}
    for kind, nbytes, _, runs in instructions(hlo_text):
        out[kind]["count"] += runs
        out[kind]["bytes"] += nbytes * runs
    return out


def comm_time(hlo_text: str, mesh) -> float:
    """Seconds the compiled collectives take under `mesh`'s alpha-beta model
    (`_ring`, the cost model's formulas, applied to what XLA emitted). A
    group is given the slowest link of the mesh-axis groups of its size."""
    total = 0.0
    for kind, nbytes, n, runs in instructions(hlo_text):
        if n <= 1:
            continue
        cands = [m for m in range(len(mesh.group_size)) if mesh.group_size[m] == n]
        bw = min((mesh.group_bandwidth[m] for m in cands), default=min(mesh.axis_bandwidth))
        lat = max((mesh.group_latency[m] for m in cands), default=max(mesh.axis_latency))
        full = nbytes * (n if kind == "reduce-scatter" else 1)   # the unreduced buffer
        total += runs * ring_time(kind, n, full, bw, lat, mesh.profile.rendezvous)
    return total


def memory(compiled) -> dict:
    """Per-device bytes from `memory_analysis()`: arguments, outputs, temporaries."""
    m = compiled.memory_analysis()
    d = dict(arguments=m.argument_size_in_bytes, outputs=m.output_size_in_bytes,
             temp=m.temp_size_in_bytes, alias=m.alias_size_in_bytes)
    d["total"] = d["arguments"] + d["outputs"] + d["temp"] - d["alias"]
    return d
