"""`jb.stack_layers`: per-layer state kept stacked, the for-loop kept as written.

`reroll` rolls a for-loop over L layers into one `scan`, but the program's
inputs and outputs are still what the caller passes and gets back: one array
per layer and weight (and per optimizer moment). A 64-layer GPT training
step takes and returns 3089 arrays; XLA:CPU compiles one kernel per output
and one concatenate operand per input, and those, not the layers, are most
of its compile time (measured, XLA compile of that rolled step: 11.1 s as
it is, 4.1 s with the same program's inputs and outputs stacked). Optax,
too, traces its update once per leaf.

`stack_layers(tree)` replaces each sequence of L >= 2 structurally identical
sub-trees (a list or tuple, or a dict keyed 0..L-1 as `nnx.to_pure_dict`
writes an `nnx.List`) by a `Stacked`: one sub-tree whose arrays have a
leading axis of L. A `Stacked` is a pytree node (optax, `jax.grad`,
checkpoints and `jax.tree` see L-times-larger leaves, not L copies) and a
sequence: `len`, indexing and iteration give layer i's sub-tree, so the
user's `for w in weights: x = layer(w, x)` runs unchanged, traced or not.
`unstack_layers` undoes it (the original containers, keys and order).

Iterating splits every leaf at once with `split_layers`, a `custom_vjp`
whose primal is one `split` into L unit pieces along axis 0, each squeezed,
and whose backward rule concatenates the L cotangents back into one array.
`reroll` recognises both (`passes._reroll_walk.Walk.keep`): the per-layer
weights fed to its scans are then the stacked input itself, and the
per-layer gradients a backward scan returns are its stacked output, so the
program neither copies the weights into a stack nor splits the gradients
out of one.

What it keeps: the split and its gradient are exact (slices, and a
concatenate of the cotangents the per-layer form would return), so a
program over a `Stacked` computes what it computes over the list, bitwise
under `jax.jit`; rolled by `reroll`, the two agree as `reroll` promises
(the same values up to float reassociation). Integer and boolean leaves
are sliced plainly: they have no cotangent.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jaxbackend import _jax


def _slices(a) -> tuple:
    """(a[0], ..., a[L-1]): one `split` into L unit pieces along axis 0, each
    squeezed (the body `splits_entries` checks). L + 1 equations: half the
    binds of L `index_in_dim`s, which is tracing time at 64 layers."""
    return tuple(lax.squeeze(p, (0,)) for p in lax.split(a, (1,) * a.shape[0]))


@jax.custom_vjp
def split_layers(a):
    """`_slices(a)` for an inexact array a of shape (L, ...); its gradient
    is one concatenate."""
    return _slices(a)


def _split_fwd(a):
    return split_layers(a), None


def _split_bwd(_, cts):
    shape = cts[0].shape
    if not shape:
        return (jnp.stack(cts),)
    # one concatenate along the entries' own axis 0, then a bitcast reshape
    # (the form `reroll` recognises and `_stacks.stack` emits)
    return (lax.concatenate(list(cts), 0).reshape((len(cts),) + shape),)


split_layers.defvjp(_split_fwd, _split_bwd)


def _split_leaf(a):
    return split_layers(a) if jnp.issubdtype(a.dtype, jnp.inexact) else _slices(a)


@jax.tree_util.register_pytree_with_keys_class
class Stacked(Sequence):
    """L layers' sub-trees kept as one sub-tree of stacked arrays.

    `tree`: the layer sub-tree with a leading axis of length L on every
    leaf; `kind`: the container it came from ("list", "tuple" or "dict"),
    restored by `unstack_layers`.
    """

    def __init__(self, tree, length: int, kind: str = "list"):
        self.tree, self.length, self.kind = tree, length, kind

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i):
        if isinstance(i, slice):
            return Stacked(jax.tree.map(lambda a: a[i], self.tree),
                           len(range(*i.indices(self.length))), self.kind)
        if not -self.length <= i < self.length:
            raise IndexError(f"Stacked: layer {i} of {self.length}")
        i %= self.length
        return jax.tree.map(lambda a: lax.index_in_dim(a, i, keepdims=False), self.tree)

    def __iter__(self):
        return iter(self.unstack())

    def unstack(self) -> list:
        """The L layers' sub-trees, split in one `split_layers` per leaf."""
        leaves, treedef = jax.tree.flatten(self.tree)
        per_leaf = [_split_leaf(a) for a in leaves]
        return [jax.tree.unflatten(treedef, [p[i] for p in per_leaf]) for i in range(self.length)]

    def tree_flatten_with_keys(self):
        return ((jax.tree_util.GetAttrKey("stacked"), self.tree),), (self.length, self.kind)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)

    def __repr__(self) -> str:
        shapes = jax.tree.map(lambda a: getattr(a, "shape", a), self.tree)
        return f"Stacked({self.length} layers, {shapes})"


def splits_entries(eqn) -> bool:
    """Is output i of `eqn` entry i of its one operand, exactly (L outputs
    for an operand of shape (L, ...)), with the derivative of slices? True
    for `split_layers` (a `custom_vjp_call` whose backward rule is
    `_split_bwd`, by identity) or a plain call (`jit`), when the body is
    `_slices`' own: one `split` of the operand along axis 0 into L pieces of
    size 1, piece i squeezed on axis 0 as output i, and nothing else: the
    body is the proof of the values, and the rule's identity of the
    gradient (`reroll` bypasses the call, so a program differentiated after
    it must not lose another rule)."""
    name = eqn.primitive.name
    if not (name in _jax.CALL_PRIMITIVES or _jax.custom_vjp_bwd_function(eqn) is _split_bwd):
        return False
    return _unit_split(eqn, every=True)


def splits_layers(eqn) -> bool:
    """Does call `eqn` split its one operand into layers along axis 0 (the
    body of `splits_entries`, some outputs possibly dropped), whatever its
    derivative rule? What the sharding walk needs to keep that layer axis
    unsharded: JAX's dead-code elimination rewrites a `custom_vjp_call`
    with a new backward rule (`dce_bwd`), so `splits_entries` no longer
    holds after the pipeline's `dce`, though the split is the same."""
    name = eqn.primitive.name
    return (name in _jax.CALL_PRIMITIVES or name == "custom_vjp_call") and _unit_split(eqn, False)


def _unit_split(eqn, every: bool) -> bool:
    """The body is one `split` of the call's one (variable) operand along
    axis 0 into L pieces of size 1, each output one piece squeezed on axis
    0: piece i as output i, all L (`every`), or any of them."""
    body = _jax.call_body(eqn)
    if body is None or len(eqn.invars) != 1 or not _jax.is_var(eqn.invars[0]):
        return False
    n = eqn.invars[0].aval.shape[:1]
    j = body.jaxpr
    if (not n or not j.eqns or len(j.eqns) != len(j.outvars) + 1
            or (every and n[0] != len(j.outvars))):
        return False
    split, squeezes = j.eqns[0], j.eqns[1:]
    if (split.primitive.name != "split" or split.invars[0] is not j.invars[0]
            or _jax.split_parts(split) != ((1,) * n[0], 0)):
        return False
    pieces = split.outvars if every else [sq.invars[0] for sq in squeezes]
    return set(map(id, pieces)) <= set(map(id, split.outvars)) and all(
        sq.primitive.name == "squeeze" and _jax.squeeze_dimensions(sq) == (0,)
        and sq.invars[0] is piece and out is sq.outvars[0]
        for sq, piece, out in zip(squeezes, pieces, j.outvars))


def _is_stacked(x) -> bool:
    return isinstance(x, Stacked)


def _layers(node):
    """(kind, entries) when `node` is a list, tuple (not a NamedTuple) or
    dict keyed 0..n-1 of n >= 2 entries, else None."""
    if isinstance(node, (list, tuple)) and not hasattr(node, "_fields") and len(node) >= 2:
        return ("list" if isinstance(node, list) else "tuple"), list(node)
    if isinstance(node, dict) and len(node) >= 2 and set(node) == set(range(len(node))):
        return "dict", [node[i] for i in range(len(node))]
    return None


def _signature(tree):
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves or not all(hasattr(a, "shape") and hasattr(a, "dtype") for a in leaves):
        return None
    return treedef, tuple((tuple(a.shape), a.dtype) for a in leaves)


def _rebuild(kind: str, entries: list):
    if kind == "dict":
        return dict(enumerate(entries))
    return entries if kind == "list" else tuple(entries)


def _difference(a, b) -> str:
    if b is None:
        return "no arrays, or leaves that are not arrays"
    if a[0] != b[0]:
        return "another tree structure"
    k = next(k for k, (x, y) in enumerate(zip(a[1], b[1])) if x != y)
    return f"leaf {k}: shape {b[1][k][0]} {b[1][k][1]}, not {a[1][k][0]} {a[1][k][1]}"


def _stack(tree, prefix: tuple, misses: list, found: list):
    def visit(path, node):
        got = _layers(node)
        if got is None:
            return node
        where = prefix + path
        kind, entries = got
        sigs = [_signature(e) for e in entries]
        bad = next((j for j, s in enumerate(sigs) if s != sigs[0]), None)
        if sigs[0] is not None and bad is None:
            found.append(where)
            return Stacked(jax.tree.map(lambda *xs: jnp.stack(xs), *entries), len(entries), kind)
        if sigs[0] is not None:
            misses.append(f"at {jax.tree_util.keystr(where) or 'the top'}, layer {bad} differs "
                          f"from layer 0 ({_difference(sigs[0], sigs[bad])})")
        return _rebuild(kind, [_stack(e, where + (jax.tree_util.SequenceKey(j),), misses, found)
                               for j, e in enumerate(entries)])

    return jax.tree_util.tree_map_with_path(visit, tree, is_leaf=lambda n: _layers(n) is not None)


def stack_layers(tree):
    """`tree` with each list, tuple or dict keyed 0..L-1 of L >= 2 layers
    (sub-trees of arrays with one structure, shapes and dtypes) replaced by
    a `Stacked` (module docstring). Sequences whose entries differ are
    walked into and kept as they are; a tree where nothing stacks is an
    error that says where layers differ."""
    misses: list = []
    found: list = []
    out = _stack(tree, (), misses, found)
    if not found:
        named = _named_layers(tree)
        raise NothingToStack(
            "no list, tuple or dict keyed 0..n-1 of >= 2 layers with one structure, shapes "
            "and dtypes in this tree" + "".join("; " + m for m in misses[:1]) +
            (f"; the layers {named} are dict entries named by number (Flax linen's naming): a "
             f"model looks them up by those names, so they cannot be replaced by one stack; "
             f"flax.linen.scan (nn.scan) over the layer keeps them stacked" if named else ""))
    return out


def _named_layers(tree) -> str | None:
    """'h0'..'h5' for the shallowest mapping (a dict, a Flax FrozenDict)
    holding >= 2 sub-trees of one signature keyed <prefix><i> (or
    <prefix>_<i>) for i = 0..n-1, else None."""
    todo = collections.deque([tree])
    while todo:
        node = todo.popleft()
        if not isinstance(node, Mapping):
            if isinstance(node, (list, tuple)):
                todo.extend(node)
            continue
        groups: dict = {}
        for key in node:
            m = re.fullmatch(r"(.*?)(\d+)", str(key))
            if m:
                groups.setdefault(m.group(1), {})[int(m.group(2))] = key
        for keys in groups.values():
            if len(keys) >= 2 and set(keys) == set(range(len(keys))):
                sigs = {_signature(node[keys[i]]) for i in range(len(keys))}
                if len(sigs) == 1 and None not in sigs:
                    return f"{keys[0]!r}..{keys[len(keys) - 1]!r}"
        todo.extend(node.values())
    return None


class NothingToStack(ValueError):
    """`stack_layers` found no layers; `what` says what it looked for and
    where layers differ, for callers that give their own advice."""

    def __init__(self, what: str):
        super().__init__(f"stack_layers: {what}; pass the tree that holds the layers (the "
                         f"params of nn.functional, or a list of per-layer weight trees).")
        self.what = what


def unstack_layers(tree):
    """`tree` with every `Stacked` replaced by the container it was made
    from, holding the per-layer sub-trees (traced: via `split_layers`)."""
    def undo(x):
        if not _is_stacked(x):
            return x
        return _rebuild(x.kind, [unstack_layers(e) for e in x.unstack()])
    return jax.tree.map(undo, tree, is_leaf=_is_stacked)


def stack_like(stacked, per_layer, fn):
    """`per_layer`, a tree shaped like `unstack_layers(stacked)` (its
    shardings, say), in `stacked`'s structure: at each `Stacked`, layer 0's
    sub-tree with every leaf mapped by `fn` (a layer's leaf to the stacked
    leaf's: a sharding gains an unsharded layer axis); other leaves as
    they are."""
    def at(node, layers):
        if not _is_stacked(node):
            return layers
        return Stacked(jax.tree.map(fn, layers[0]), node.length, node.kind)
    return jax.tree.map(at, stacked, per_layer, is_leaf=_is_stacked)
