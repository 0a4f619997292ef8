"""The jaxpr as the cost model sees it: flat ops over dim identities.

Precondition: a ClosedJaxpr (named or plain jnp, any mix), with optional dim
names for its inputs and outputs. Result: a `Graph`, the jaxpr flattened
(sub-jaxprs of jit / custom_jvp / custom_vjp / remat / cond / while / scan
walked in place, never unrolled: a `scan` body appears once with its ops'
multiplicity `mult` multiplied by the trip count), where every array axis is
an instance of a *dim class*. It leaves the jaxpr alone (read only).

Dim classes come from a union-find over (variable, axis) positions:
elementwise ops unify equal-sized aligned axes, `transpose`, `broadcast_in_dim`,
reductions, `squeeze`, `concatenate` map axes, `dot_general` unifies each
contracting pair, batch triple and free dim with its output axis, the named
`einsum` unifies axes by name. A `reshape` that merges `(a, b) -> ab`
records `ab` as the product of the factors `[a, b]`; a later split of `ab`
with the same factor sizes unifies factor by factor, so `reshape -> matmul
-> reshape` keeps every dim. A merged dim is sharded as its major factor
(sharding `a` in blocks is sharding `ab` in blocks): its class takes the
major factor's key, and a merge whose minor factors are sharded costs a
gather (`REPLICATED` in the op's axis map). A class's shardable size is the
gcd of its (unmerged) members' sizes.

Names: axes of NamedArray inputs/outputs and einsum operands carry labels;
positions with the same label are unified too (a name is one identity), and
a class is called by its first label. Unnamed classes (plain jnp code) are
tied into one *key* by a fingerprint: their size and which input-argument
axes (by shape and position) they hold; so layer 7's head dim shares its key
with layer 1's, as a name would make it. The search chooses one mesh-axis
group per key.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxbackend import _jax

UNMAPPED = -1    # an operand axis with no requirement (size-1 broadcast)
REPLICATED = -2  # an operand axis that must be unsharded (minor factor of a merge)

_CALL_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


@dataclasses.dataclass
class Op:
    kind: str          # contract | reduce | gather | map
    mult: float        # times executed per step (scan trip counts)
    isizes: tuple      # iteration dims: sizes
    iclass: list       # iteration dims: class ids (final after `finish`)
    ins: tuple         # (var, axis map: iteration index per axis | UNMAPPED | REPLICATED)
    outs: tuple
    reduced: tuple     # iteration dims summed over
    flops: float       # unsharded


class Graph:
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
        self.invars: list = []
        self.outvars: list = []
        self.pinned: set = set()     # vars that are always materialised (scan results)

    # -- variables and union-find ---------------------------------------------
    def new_var(self, aval) -> int:
        v = len(self.shapes)
        shape = tuple(int(s) for s in aval.shape)
        self.shapes.append(shape)
        self.itemsize.append(np.dtype(aval.dtype).itemsize if hasattr(aval, "dtype") else 4)
        self.base.append(len(self.parent))
        self.parent.extend(range(len(self.parent), len(self.parent) + len(shape)))
        self.psizes.extend(shape)
        self.uses.append(-1)
        return v

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
        if [self.psize(p) for p in f1] == [self.psize(p) for p in f2]:
            for p, q in zip(f1, f2):
                self._union(p, q)
        else:
            self._union(f1[0], f2[0])

    def psize(self, p) -> int:
        return self.psizes[p]

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

    def nbytes(self, v) -> int:
        return math.prod(self.shapes[v]) * self.itemsize[v]

    # -- after the walk -------------------------------------------------------
    def finish(self) -> None:
        """Resolve classes, sizes, names and keys (the search's variables)."""
        roots = {}
        self.var_classes = []
        cls_sizes: dict = {}
        for v, shape in enumerate(self.shapes):
            cs = []
            for a, n in enumerate(shape):
                r = self.find(self.base[v] + a)
                c = roots.setdefault(r, len(roots))
                cs.append(c)
                if n != 1:
                    cls_sizes[c] = math.gcd(cls_sizes.get(c, 0), n)
            self.var_classes.append(tuple(cs))
        self.n_classes = len(roots)
        # A merged dim (reshape) is sharded as its major factor: its class
        # takes the factor's key, and its size does not bound the key's.
        self.major = list(range(self.n_classes))
        for r, parts in self.factors.items():
            if self.find(r) == r and r in roots:
                q, seen = self.find(parts[0]), set()
                while q in self.factors and q not in seen:
                    seen.add(q)
                    q = self.find(self.factors[q][0])
                self.major[roots[r]] = roots.setdefault(q, len(roots))
        self.n_classes = len(roots)
        self.major += list(range(len(self.major), self.n_classes))
        composite = {c for c in range(self.n_classes) if self.major[c] != c}
        for c in composite:
            cls_sizes.pop(c, None)
        self.class_size = [cls_sizes.get(c, 1) for c in range(self.n_classes)]
        names: dict = {}
        for p in sorted(self.labels):   # earliest-created position names the class
            names.setdefault(roots[self.find(p)], self.labels[p])
        self.class_names = names
        # Unnamed classes are tied by fingerprint (size + input-argument axes held).
        finger: dict = {c: set() for c in range(self.n_classes) if c not in names}
        for v in self.invars:
            for a, c in enumerate(self.var_classes[v]):
                if c in finger:
                    finger[c].add((self.shapes[v], a))
        key_of: dict = {}
        self.key_names: list = []
        self.class_key = [0] * self.n_classes
        for c in range(self.n_classes):
            if c in composite:
                continue
            k = ("name", names[c]) if c in names else ("anon", self.class_size[c], tuple(sorted(finger[c])))
            if k not in key_of:
                key_of[k] = len(self.key_names)
                self.key_names.append(names[c] if c in names else None)
            self.class_key[c] = key_of[k]
        counter: dict = {}
        for i, n in enumerate(self.key_names):   # deterministic names for unnamed keys
            if n is None:
                size = [self.class_size[c] for c in range(self.n_classes)
                        if self.class_key[c] == i and c not in composite][0]
                j = counter[size] = counter.get(size, -1) + 1
                self.key_names[i] = f"dim{size}" + (f"_{j}" if j else "")
        for c in composite:
            self.class_key[c] = self.class_key[self.major[c]]
        # A named merged dim (`head`, split by name into (kv_head, group)) has
        # no key of its own; its name is an alias of its major factor's key,
        # so rules may name either (`head -> model` shards kv_head in blocks).
        self.key_alias = {names[c]: self.class_key[c] for c in sorted(composite) if c in names}
        self.key_size = [0] * len(self.key_names)
        for c in range(self.n_classes):
            if c in composite:
                continue
            k = self.class_key[c]
            self.key_size[k] = math.gcd(self.key_size[k], self.class_size[c])
        for op in self.ops:
            op.iclass = [self.var_classes[v][a] for v, a in op.iclass]


def build(closed, in_names=None, out_names=None) -> Graph:
    """Flatten `closed` into a Graph. `in_names`/`out_names`: per flat
    input/output, a tuple of dim names or None."""
    g = Graph()
    env: dict = {}
    for var, c in zip(closed.jaxpr.constvars, closed.consts):
        env[var] = g.new_var(_jax.ShapedArray(np.shape(c), np.asarray(c).dtype if not hasattr(c, "dtype") else c.dtype))
    g.invars = [g.new_var(v.aval) for v in closed.jaxpr.invars]
    env.update(zip(closed.jaxpr.invars, g.invars))
    _walk(g, closed.jaxpr, env, 1.0)
    g.top_env = env   # top-level jaxpr Var -> graph var (for sharding constraints)
    g.outvars = [_read(g, env, v) for v in closed.jaxpr.outvars]
    for vs, names in ((g.invars, in_names), (g.outvars, out_names)):
        for v, dims in zip(vs, names or ()):
            if dims is not None and v is not None:
                for a, d in enumerate(dims):
                    g.label(v, a, d)
    for v in g.outvars:
        if v is not None:
            g.uses[v] = len(g.ops)
    g.finish()
    return g


def _read(g, env, x):
    if isinstance(x, _jax.Literal):
        return None
    return env[x]


def _sub_jaxpr(eqn):
    for k in _CALL_PARAMS:
        j = eqn.params.get(k)
        if j is not None:
            return j
    return None


def _inline(g, jaxpr, consts, ins, mult):
    """Walk a sub-jaxpr in place: its inputs are the caller's variables."""
    if isinstance(jaxpr, _jax.ClosedJaxpr):
        jaxpr, consts = jaxpr.jaxpr, jaxpr.consts
    env = {}
    for var in jaxpr.constvars:
        env[var] = g.new_var(var.aval)
    for var, v in zip(jaxpr.invars, ins):
        env[var] = v if v is not None else g.new_var(var.aval)
    _walk(g, jaxpr, env, mult)
    return [_read(g, env, x) for x in jaxpr.outvars]


def _walk(g, jaxpr, env, mult):
    for eqn in jaxpr.eqns:
        ins = [_read(g, env, x) for x in eqn.invars]
        name = eqn.primitive.name
        if name == "scan":
            outs = _scan(g, eqn, ins, mult)
        elif name == "while":
            nc, nb = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
            outs = _inline(g, eqn.params["body_jaxpr"], (), ins[nc:], mult)  # trip count unknown: 1
            for v, w in zip(ins[nc + nb:], outs):
                for a in range(len(g.shapes[w]) if v is not None and w is not None else 0):
                    g.union(v, a, w, a)
        elif name == "cond":
            branches = eqn.params["branches"]
            outs = None
            for br in branches:
                o = _inline(g, br, (), ins[1:], mult / len(branches))
                outs = o if outs is None else outs
        elif _sub_jaxpr(eqn) is not None and name not in ("custom_lin",):
            outs = _inline(g, _sub_jaxpr(eqn), (), ins, mult)
        else:
            outs = [g.new_var(x.aval) for x in eqn.outvars]
            _unify_and_record(g, eqn, ins, outs, mult)
            for v in ins:
                if v is not None:
                    g.uses[v] = len(g.ops) - 1
            env.update(zip(eqn.outvars, outs))
            continue
        # Call-like: alias the callee's outputs to the equation's outputs.
        for x, v in zip(eqn.outvars, outs):
            if v is None:
                v = g.new_var(x.aval)
            env[x] = v


def _scan(g, eqn, ins, mult):
    p = eqn.params
    body, length = p["jaxpr"], int(p["length"])
    nc, nk = p["num_consts"], p["num_carry"]
    inner_ins = []
    for i, v in enumerate(ins):
        if i < nc + nk or v is None:
            inner_ins.append(v)
        else:   # xs: the body sees one slice; axis a of the slice is axis a+1 outside
            w = g.new_var(_jax.ShapedArray(g.shapes[v][1:], np.float32))
            g.itemsize[w] = g.itemsize[v]
            for a in range(len(g.shapes[w])):
                g.union(v, a + 1, w, a)
            # Slicing iteration i needs the stacked axis whole on every
            # device: a layer axis sharded over devices costs an all-gather.
            n = len(g.shapes[w])
            g.ops.append(Op("map", mult, g.shapes[w], [(w, a) for a in range(n)],
                            ((v, (REPLICATED,) + tuple(range(n))),), ((w, tuple(range(n))),), (), 0.0))
            inner_ins.append(w)
            g.uses[v] = len(g.ops)
    outs = _inline(g, body, (), inner_ins, mult * length)
    result = []
    for i, (x, v) in enumerate(zip(eqn.outvars, outs)):
        if i < nk:
            result.append(v)
        else:   # ys: stacked along a new leading axis
            w = g.new_var(x.aval)
            n = len(g.shapes[w])
            ins_map = ()
            if v is not None:
                for a in range(len(g.shapes[v])):
                    g.union(w, a + 1, v, a)
                g.uses[v] = len(g.ops)
                ins_map = ((v, tuple(range(1, n))),)
            # The stacked result is a real buffer (e.g. residuals kept for
            # the backward scan): produced here, never fused away.
            g.ops.append(Op("map", mult, g.shapes[w], [(w, a) for a in range(n)], ins_map,
                            ((w, tuple(range(n))),), (), 0.0))
            g.pinned.add(w)
            result.append(w)
    for i in range(nk):   # carry in and out are the same dims
        if ins[nc + i] is not None and result[i] is not None:
            for a in range(len(g.shapes[result[i]])):
                g.union(ins[nc + i], a, result[i], a)
    return result


def _unify_and_record(g, eqn, ins, outs, mult):
    from jaxbackend.sharding import _rules
    _rules.record(g, eqn, ins, outs, mult)
