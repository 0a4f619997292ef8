"""The jaxpr as the cost model sees it: flat ops over dim identities.

Precondition: a ClosedJaxpr (named or plain jnp, any mix), with optional dim
names for its inputs and outputs. Result: a frozen `Graph`, the jaxpr
flattened (sub-jaxprs of jit / custom_jvp / custom_vjp / remat / cond /
while / scan walked in place, never unrolled: a `scan` body appears once
with its ops' multiplicity `mult` multiplied by the trip count), where every
array axis is an instance of a *dim class*. It leaves the jaxpr alone (read
only).

Dim classes come from a union-find over (variable, axis) positions, kept by
a `Builder` while `_walk.build` walks the jaxpr (the walk, and how it
treats scans, whiles, conds and calls, is that module's). Which axes of an
equation are the same dim is the primitive's *dim rule*: this module owns the table
(`register`, JAX's registry pattern) and `_op_dims` fills it: elementwise
ops unify equal-sized aligned axes, `transpose`, `broadcast_in_dim`,
reductions, `squeeze`, `concatenate` map axes, `dot_general` unifies each
contracting pair, batch triple and free dim with its output axis, the named
`einsum` unifies axes by name. A `reshape` that merges `(a, b) -> ab`
records `ab` as the product of the factors `[a, b]`; a later split of `ab`
with the same factor sizes unifies factor by factor, so `reshape -> matmul
-> reshape` keeps every dim. A merged dim is sharded as its major factor
(sharding `a` in blocks is sharding `ab` in blocks): its class takes the
major factor's key, and a merge whose minor factors are sharded costs a
gather (`REPLICATED` in the op's axis map). A class's shardable size is the
gcd of its (unmerged) members' sizes, and 1 (never sharded) for the layer
axis of a scan's stacked inputs and outputs and of a stacked input split
into layers (`jb.stack_layers`): XLA gathers a sharded layer axis whole
before the loop, so sharding it saves no memory and moves every weight.

Names: axes of NamedArray inputs/outputs and einsum operands carry labels;
positions with the same label are unified too (a name is one identity), and
a class is called by its first label. Unnamed classes (plain jnp code) are
tied into one *key* by a fingerprint: their size and which input-argument
axes (by shape and position) they hold; so layer 7's head dim shares its key
with layer 1's, as a name would make it. The search chooses one mesh-axis
group per key. `Builder.finish` resolves all this once into the `Graph`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Mapping, NamedTuple

from jaxbackend import _jax
from jaxbackend.sharding import _names

UNMAPPED = -1    # an operand axis with no requirement (size-1 broadcast, a one-row read)
# an operand axis that must be unsharded (minor factor of a merge, a sliced,
# padded or concatenated axis, a conv's window): sharded, it is charged a gather
REPLICATED = -2


class Op(NamedTuple):
    """One equation over its iteration space. `ins`/`outs`: (var, axis map)
    per operand / result, the map giving per axis its iteration dim, or
    UNMAPPED / REPLICATED. `iclass`: the dim class of each iteration dim
    (while a `Builder` holds the op: a (var, axis) position of that dim)."""
    kind: str          # contract | reduce | gather | map
    mult: float        # times executed per step (scan trip counts)
    isizes: tuple      # iteration dims: sizes
    iclass: tuple      # iteration dims: class ids
    ins: tuple
    outs: tuple
    reduced: tuple     # iteration dims summed over
    flops: float       # unsharded
    bitcast: bool = False   # moves no data (reshape, squeeze: XLA emits a bitcast)


# -- the dim rules: `rule(builder, eqn, ins, outs, mult)` unifies the
# equation's positions and records its Op; `ins`/`outs` are graph vars (None
# for a literal operand). `_op_dims` registers them. ------------------------

DimRule = Callable[..., None]
_RULES: dict = {}
_DEFAULT_RULE: list = []   # the rule of every primitive without its own (one entry)


def register(*primitives: str):
    """Decorator: the dim rule of the primitives named."""
    def deco(rule: DimRule) -> DimRule:
        for name in primitives:
            _RULES[name] = rule
        return rule
    return deco


def register_default(rule: DimRule) -> DimRule:
    """Decorator: the dim rule of every primitive without its own."""
    _DEFAULT_RULE[:] = [rule]
    return rule


def dim_rule(primitive: str) -> DimRule:
    return _RULES.get(primitive, _DEFAULT_RULE[0])


@dataclasses.dataclass(frozen=True, eq=False)
class Graph:
    """A flattened program over dim classes and keys (see the module
    docstring); made by `build`, never changed after (contents included).
    A variant is `dataclasses.replace(graph, ops=...)`."""
    shapes: tuple          # var -> shape
    itemsize: tuple        # var -> bytes per element
    ops: tuple             # Op, in program order
    uses: tuple            # var -> index of the last op reading it (len(ops) for results)
    invars: tuple          # var per flat input
    outvars: tuple         # var per flat output (None: a literal)
    pinned: frozenset      # vars always materialised (stacked scan results)
    env: Mapping           # jaxpr Var -> var, sub-jaxprs included (sharding constraints)
    var_classes: tuple     # var -> class per axis
    class_size: tuple      # class -> shardable size (1 for a merged dim)
    class_names: Mapping   # class -> name, for named classes
    major: tuple           # class -> class of its major factor (itself unless merged)
    class_key: tuple       # class -> key
    key_names: tuple       # key -> name (a dim name, or dim<size>[_j] for unnamed)
    key_size: tuple        # key -> shardable size
    key_alias: Mapping     # name of a merged dim -> key of its major factor
    loop_state: frozenset = frozenset()   # vars a `while` carries in or out (held buffers)
    # stacked scan result -> index of the first op of its loop (written from the first trip)
    stacked_from: Mapping = dataclasses.field(default_factory=dict)
    # concatenates that are stacks (`_op_dims._unstack_split`): parts on a new axis
    stacks: frozenset = frozenset()
    # keys of the factors of merged dims the inputs hold (searched: `planned_keys`)
    factor_keys: frozenset = frozenset()
    # key -> the sizes of the axes it names (several where one name is given
    # to axes of different sizes; its shardable size is then their gcd)
    key_extents: tuple = ()
    # 16-bit float var -> "bfloat16" | "float16" (XLA:CPU holds them as
    # float32 between ops: `HardwareProfile.half_held_as_f32`)
    half: Mapping = dataclasses.field(default_factory=dict)
    # "path:axis" of each input axis -> its key, where the key has another
    # name (axes the program ties: `w1:1`, `b1:0` and `w2:0` are one dim,
    # named after the first): a rule may name the dim by any of them
    path_alias: Mapping = dataclasses.field(default_factory=dict)
    # "path:axis" of an input axis the program reshapes into several dims
    # (a batch split into micro-batches) -> the names of those dims
    path_factors: Mapping = dataclasses.field(default_factory=dict)
    # key of a dim never sharded (size > 1) -> why, for an error (`LOOP`, `WINDOW`)
    unshardable: Mapping = dataclasses.field(default_factory=dict)
    # (key, its PartitionSpec entry, the mesh's axis names) per axis the
    # user's own `with_sharding_constraint` lays out (unconstrained axes and
    # merged dims left out): layouts a searched plan keeps (`_search`)
    constraints: tuple = ()

    @property
    def n_classes(self) -> int:
        return len(self.class_size)

    def nbytes(self, v) -> int:
        return math.prod(self.shapes[v]) * self.itemsize[v]


# Why a dim is never sharded (`Builder.unshardable`), as an error says it.
LOOP = "the axis a loop runs over (a lax.scan's, or stacked layers'): its steps run in order"
WINDOW = ("a convolution kernel's window (its gradient is a convolution XLA's partitioner "
          "cannot split along it)")


class Builder:
    """The graph under construction: variables, the union-find over their
    (var, axis) positions, labels, and the ops recorded so far."""

    def __init__(self):
        self.shapes: list = []
        self.itemsize: list = []
        self.base: list = []
        self.parent: list = []
        self.psizes: list = []
        self.factors: dict = {}      # root position -> factor positions (a merged dim)
        self.labels: dict = {}       # position -> name
        self.first_label: dict = {}  # name -> position
        self.ops: list = []
        self.uses: list = []         # var -> index of last op reading it
        self.pinned: set = set()     # vars that are always materialised (scan results)
        self.loop_state: set = set()  # vars a `while` carries in or out
        self.stacked_from: dict = {}  # stacked scan result -> op index its loop starts at
        self.sub_env: dict = {}      # sub-jaxpr Var -> var, from its first walk
        self.origin: dict = {}       # var -> the equation that made it (names unnamed dims)
        self.unshardable: dict = {}    # position whose class is never sharded -> why (`LOOP`...)
        self.windows: set = set()      # conv window positions (`WINDOW` where a parameter's)
        self.stack_parts: dict = {}    # var -> (equal-shaped operands concatenated on axis 0, op)
        self.stacks: set = set()       # of those, the ones a reshape splits into a stack
        self.half: dict = {}           # 16-bit float var -> "bfloat16" | "float16"
        self.constraints: list = []    # (var, `_jax.constraint_axes`): the user's own layouts

    # -- variables and union-find ---------------------------------------------
    def add_var(self, shape, itemsize: int, half: str | None = None) -> int:
        v = len(self.shapes)
        if half:
            self.half[v] = half
        shape = tuple(int(s) for s in shape)
        self.shapes.append(shape)
        self.itemsize.append(itemsize)
        self.base.append(len(self.parent))
        self.parent.extend(range(len(self.parent), len(self.parent) + len(shape)))
        self.psizes.extend(shape)
        self.uses.append(-1)
        return v

    def var_of(self, aval) -> int:
        """A new variable of the aval's shape and dtype."""
        # `dtype.itemsize`, not np.dtype(...): a PRNG key's extended dtype has one too
        dtype = getattr(aval, "dtype", None)
        return self.add_var(aval.shape, 4 if dtype is None else dtype.itemsize,
                            _jax.half_float_name(dtype))

    def pos(self, v: int, axis: int) -> int:
        return self.base[v] + axis

    def find(self, p: int) -> int:
        parent = self.parent
        root = p
        while parent[root] != root:
            root = parent[root]
        while parent[p] != root:
            parent[p], p = root, parent[p]
        return root

    def union(self, v, a, w, b) -> None:
        if v is None or w is None:
            return
        if self.shapes[v][a] == 1 and self.shapes[w][b] != 1:
            return  # a size-1 broadcast axis is not the dim it broadcasts to
        self._union(self.pos(v, a), self.pos(w, b))

    def _union(self, p, q) -> None:
        ra, rb = self.find(p), self.find(q)
        if ra == rb:
            return
        lo, hi = min(ra, rb), max(ra, rb)
        self.parent[hi] = lo
        fl, fh = self.factors.pop(lo, None), self.factors.pop(hi, None)
        self.factors[lo] = fl or fh
        if fl and fh:
            self._unify_factors(fl, fh)
        if self.factors[lo] is None:
            del self.factors[lo]

    def _unify_factors(self, f1, f2) -> None:
        # Same factorisation: the factors are the same dims. Otherwise only
        # the major factors are known to coincide.
        if [self.psizes[p] for p in f1] == [self.psizes[p] for p in f2]:
            for p, q in zip(f1, f2):
                self._union(p, q)
        else:
            self._union(f1[0], f2[0])

    def set_factors(self, p, parts) -> None:
        """Position `p` is the merge of positions `parts` (major first)."""
        flat = []
        for q in parts:
            flat.extend(self.factors.get(self.find(q), [q]))
        r = self.find(p)
        if r in self.factors:
            self._unify_factors(self.factors[r], flat)
        else:
            self.factors[r] = flat

    def label(self, v, axis, name) -> None:
        if v is None:
            return
        p = self.pos(v, axis)
        self.labels.setdefault(p, name)
        q = self.first_label.setdefault(name, p)
        if q != p:
            ra, rb = self.find(p), self.find(q)
            if ra != rb:
                self.parent[max(ra, rb)] = min(ra, rb)

    # -- after the walk -------------------------------------------------------
    def finish(self, invars, outvars, env, in_paths=()) -> Graph:
        """Resolve classes, sizes, names and keys (the search's variables)."""
        roots: dict = {}
        var_classes = []
        cls_sizes: dict = {}
        extents: dict = {}    # class -> the sizes its members have (one, unless names clash)
        for v, shape in enumerate(self.shapes):
            cs = []
            for a, n in enumerate(shape):
                r = self.find(self.base[v] + a)
                c = roots.setdefault(r, len(roots))
                cs.append(c)
                if n != 1:
                    cls_sizes[c] = math.gcd(cls_sizes.get(c, 0), n)
                    extents.setdefault(c, set()).add(n)
            var_classes.append(tuple(cs))
        # A merged dim (reshape) is sharded as its major factor: its class
        # takes the factor's key, and its size does not bound the key's.
        major = list(range(len(roots)))
        for r, parts in self.factors.items():
            if self.find(r) == r and r in roots:
                q, seen = self.find(parts[0]), set()
                while q in self.factors and q not in seen:
                    seen.add(q)
                    q = self.find(self.factors[q][0])
                major[roots[r]] = roots.setdefault(q, len(roots))
        n_classes = len(roots)
        major += list(range(len(major), n_classes))
        composite = {c for c in range(n_classes) if major[c] != c}
        for c in composite:
            cls_sizes.pop(c, None)
        class_size = [cls_sizes.get(c, 1) for c in range(n_classes)]
        held = {c for v in invars for c in var_classes[v]}
        why_of = {roots[self.find(p)]: why for p, why in self.unshardable.items()}
        for p in self.windows:   # a kernel's window: the class holds a parameter's axis
            c = roots[self.find(p)]
            if c in held:
                why_of.setdefault(c, WINDOW)
        for c in why_of:
            class_size[c] = 1
        names: dict = {}
        for p in sorted(self.labels):   # earliest-created position names the class
            names.setdefault(roots[self.find(p)], self.labels[p])
        # Unnamed classes are tied by fingerprint (size + input-argument axes
        # held, whole or as a factor of a merged axis: the per-micro-batch
        # batch of a split input is no other dim of its size, such as a
        # patch grid's side, which tying made one key with it).
        finger: dict = {c: set() for c in range(n_classes) if c not in names}
        for v in invars:
            for a, c in enumerate(var_classes[v]):
                if c in finger:
                    finger[c].add((self.shapes[v], a))
                r = self.find(self.base[v] + a)
                for j, q in enumerate(self.factors.get(r, ())):
                    fc = roots.get(self.find(q))
                    if fc in finger:
                        finger[fc].add((self.shapes[v], a, j))
        key_of: dict = {}
        key_names: list = []
        class_key = [0] * n_classes
        for c in range(n_classes):
            if c in composite:
                continue
            k = ("name", names[c]) if c in names else ("anon", class_size[c], tuple(sorted(finger[c])))
            if k not in key_of:
                key_of[k] = len(key_names)
                key_names.append(names[c] if c in names else None)
            class_key[c] = key_of[k]
        _names.name_unnamed(key_names, class_key, composite, var_classes, invars, in_paths,
                            self.origin)
        for c in composite:
            class_key[c] = class_key[major[c]]
        path_alias, path_factors = {}, {}
        for path, v in zip(in_paths, invars):
            for a, c in enumerate(var_classes[v]):
                name = f"{path}:{a}"
                if c not in composite:
                    if key_names[class_key[c]] != name:
                        path_alias[name] = class_key[c]
                    continue
                r = self.find(self.base[v] + a)    # a merged axis: its factors' dims
                if r in self.factors:
                    path_factors[name] = tuple(key_names[class_key[roots[self.find(q)]]]
                                               for q in self.factors[r])
        # A named merged dim (`head`, split by name into (kv_head, group)) has
        # no key of its own; its name is an alias of its major factor's key,
        # so rules may name either (`head -> model` shards kv_head in blocks).
        key_alias = {names[c]: class_key[c] for c in sorted(composite) if c in names}
        # The factors of a merged dim an input holds (tokens (micro * batch,
        # time) split into (micro, batch) for gradient accumulation): dims the
        # plan may shard though no input holds one whole.
        factor_keys = frozenset(class_key[roots[self.find(q)]] for r, parts in self.factors.items()
                                if self.find(r) == r and roots.get(r) in held for q in parts)
        key_size = [0] * len(key_names)
        for c in range(n_classes):
            if c in composite:
                continue
            key_size[class_key[c]] = math.gcd(key_size[class_key[c]], class_size[c])
        key_extents: list = [set() for _ in key_names]
        for c, ns in extents.items():
            if c not in composite:
                key_extents[class_key[c]] |= ns
        ops = tuple(op._replace(iclass=tuple(var_classes[v][a] for v, a in op.iclass))
                    for op in self.ops)
        return Graph(
            shapes=tuple(self.shapes), itemsize=tuple(self.itemsize), ops=ops,
            uses=tuple(self.uses), invars=tuple(invars), outvars=tuple(outvars),
            pinned=frozenset(self.pinned), loop_state=frozenset(self.loop_state),
            stacked_from=dict(self.stacked_from), stacks=frozenset(self.stacks), env=env,
            var_classes=tuple(var_classes),
            class_size=tuple(class_size), class_names=names, major=tuple(major),
            class_key=tuple(class_key), key_names=tuple(key_names), key_size=tuple(key_size),
            key_alias=key_alias, factor_keys=factor_keys,
            key_extents=tuple(tuple(sorted(e)) for e in key_extents), half=dict(self.half),
            path_alias=path_alias, path_factors=path_factors,
            constraints=tuple((class_key[var_classes[v][a]], axes, names)
                              for v, (names, spec) in self.constraints
                              for a, axes in spec.items() if var_classes[v][a] not in composite),
            unshardable={class_key[c]: why for c, why in why_of.items() if c not in composite})
