"""`jb.layer`: trace a layer once, call it L times.

A model written as a Python for-loop over L layers is traced L times: every
iteration runs the layer's Python again, and `jax.grad` then differentiates
L copies of its equations. A layer function wrapped in `jax.jit` is traced
once per distinct (function, argument structure, avals): every later call
binds the same `jit` equation with the *same* jaxpr object. JAX's own
caches key on that object (checked in JAX 0.10's source, all
`weakref_lru_cache`s in `jax._src`), so one layer's worth of work is done
once, not L times, by

* tracing: `pjit._infer_params_cached`;
* JVP: `pjit._pjit_jvp` -> `ad.jvp_jaxpr` -> `ad._jvp_jaxpr`;
* partial evaluation for `grad`: `pjit._pjit_partial_eval` ->
  `pe.partial_eval_jaxpr_nounits_fwd` -> `pe._partial_eval_jaxpr_nounits`;
* transposition: `pjit._pjit_transpose_fancy` -> `pjit._transpose_jaxpr_fancy`.

Measured on this machine (make_jaxpr of value_and_grad of the library GPT,
embd 64): 4 layers 0.29 s -> 0.21 s, 32 layers 1.24 s -> 0.26 s.

`reroll` then sees a run of identical `jit` equations (same jaxpr object,
equal params) forward and, after AD, backward, and rolls them into `scan`
like any other run; `inline_calls` flattens what is left.

Flax NNX modules carry mutable state, so a call whose arguments hold one
is split into a static structure, equal for layers of one structure (they
share the cache entry), and the arrays. Flax >= 0.12 modules are JAX
pytrees: `jax.tree.flatten` does that split in ~0.1 ms per block where
`nnx.split` takes ~2 ms (64 blocks: 0.15 s of a 1 s trace). A pytree keeps
no sharing, so the flatten is used only when no `Variable` occurs twice in
the arguments (a module or RNG stream reached by two paths); otherwise
`nnx.split`, which keeps the sharing. State the layer updates (a dropout RNG
counter, batch statistics) comes back out of the call and is written into
the caller's modules; a call that updates nothing writes nothing, so a
module closed over by an outer `jax.jit` stays usable as it was without
`layer`. (`nnx.jit` would write every variable back, which fails for such a
module.) Other calls go through `jax.jit` directly.

When it keeps `jax.jit`'s results: always. A `jit` boundary inside a traced
program is inlined by XLA; the equations inside are the ones the layer's
Python would have produced.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import jax


def layer(fn: Callable) -> Callable:
    """`fn` traced once per distinct argument structure and avals, reused by
    every call with the same (see the module docstring). Use it on the body
    of a for-loop over layers: `h = block(h, w)` with `block = jb.layer(f)`.
    `jaxbackend.nn.TransformerBlock` calls itself this way."""
    if not callable(fn):
        raise TypeError(f"jb.layer: {fn!r} is not callable; decorate a function, e.g. "
                        f"@jb.layer over `def block(h, w): ...`.")
    plain = jax.jit(fn)
    with_modules: list = []   # the NNX path, made on the first call that needs it

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not _holds_nnx((args, kwargs)):
            return plain(*args, **kwargs)
        if not with_modules:
            with_modules.append(_nnx_call(fn))
        return with_modules[0](args, kwargs)

    return call


def _nnx_call(fn: Callable) -> Callable:
    changed_at: dict = {}   # (static, avals) -> positions of the state leaves fn updates

    def run(form, static, leaves):
        # Traced once per cache entry: an untouched leaf is still its input tracer.
        args, kwargs = form.rebuild(static, leaves)
        out = fn(*args, **kwargs)
        new = form.leaves_after(static, (args, kwargs))
        if new is None:
            raise TypeError(f"jb.layer: {getattr(fn, '__name__', 'fn')} changed the structure "
                            f"of the NNX modules it was passed (added, removed or replaced a "
                            f"module or Variable, or set a plain attribute); a layer may update "
                            f"Variable values only.")
        changed = tuple(i for i, (a, b) in enumerate(zip(leaves, new)) if a is not b)
        changed_at[static, tuple(map(_aval, leaves))] = changed
        return out, [new[i] for i in changed]

    # one jitted function per form; the static argument is its structure
    jitted = {form: jax.jit(functools.partial(run, form), static_argnums=0)
              for form in (_TreeForm, _SplitForm)}

    def call(args, kwargs):
        tree = (args, kwargs)
        form, got = _TreeForm, _TreeForm.split(tree)
        if got is None:
            form, got = _SplitForm, _SplitForm.split(tree)
        leaves, static = got
        out, updates = jitted[form](static, leaves)
        changed = changed_at[static, tuple(map(_aval, leaves))]
        if changed:
            form.write_back(tree, static, leaves, dict(zip(changed, updates)))
        return out

    return call


class _TreeForm:
    """The arguments as a JAX pytree (`jax.tree.flatten`): Flax >= 0.12
    modules and Variables are pytree nodes. Fast, but a pytree keeps no
    sharing, so used only where nothing is shared (`unshared_leaves`). As
    under `nnx.split`, Variables' values and arrays are the call's inputs,
    other leaves (Python scalars, strings) are static: part of the cache
    key, so Python may branch on them."""

    class Static(NamedTuple):
        treedef: Any
        inputs: tuple      # positions of the leaves passed in (Variables, arrays)
        consts: tuple      # (position, value) of every other leaf

    @classmethod
    def split(cls, tree):
        """(input leaves, Static), or None where `unshared_leaves` refuses
        the tree or a const is not hashable."""
        got = _unshared(tree)
        if got is None:
            return None
        found, leaves, treedef = got
        inputs = tuple(i for i, x in enumerate(found) if _is_input(x))
        taken = set(inputs)
        static = cls.Static(treedef, inputs,
                            tuple((i, x) for i, x in enumerate(leaves) if i not in taken))
        try:
            hash(static)
        except TypeError:
            return None
        return [leaves[i] for i in inputs], static

    @staticmethod
    def rebuild(static, inputs):
        leaves = [None] * static.treedef.num_leaves
        for i, x in zip(static.inputs, inputs):
            leaves[i] = x
        for i, x in static.consts:
            leaves[i] = x
        return jax.tree.unflatten(static.treedef, leaves)

    @classmethod
    def leaves_after(cls, static, tree):
        """The input leaves of `tree` after the call, or None if its
        structure or consts changed."""
        got = cls.split(tree)
        return None if got is None or got[1] != static else got[0]

    @staticmethod
    def write_back(tree, static, leaves, updates: dict) -> None:
        """Input k's new value into the caller's Variable holding it
        (`unshared_leaves`: walk entry i is leaf i); other inputs (arrays
        passed in) are not state."""
        from flax import nnx

        found = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))
        for k, v in updates.items():
            x = found[static.inputs[k]]
            if isinstance(x, nnx.Variable):
                x.set_value(v)


def unshared_leaves(tree):
    """`jax.tree.flatten(tree)` where it loses nothing of an NNX graph: None
    unless every NNX object in `tree` is a pytree node (none left as a
    leaf), no `Variable` is reached twice (a module or RNG stream on two
    paths), and each `Variable` holds one array or scalar (so entry i of a
    walk that stops at Variables is leaf i)."""
    got = _unshared(tree)
    return None if got is None else got[1:]


def _unshared(tree):
    """(walk entries stopping at Variables, leaves, treedef) or None: see
    `unshared_leaves`."""
    from flax import nnx

    found = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))
    seen = set()
    for x in found:
        if isinstance(x, nnx.Variable):
            if id(x) in seen or not _one_leaf(x.get_raw_value()):
                return None
            seen.add(id(x))
        elif isinstance(x, nnx.Pytree):   # a module that is not a pytree (pytree=False)
            return None
    leaves, treedef = jax.tree.flatten(tree)
    return (found, leaves, treedef) if len(leaves) == len(found) else None


def _is_input(x) -> bool:
    from flax import nnx

    return isinstance(x, nnx.Variable) or hasattr(x, "shape")


def _one_leaf(value) -> bool:
    return hasattr(value, "shape") or isinstance(value, (bool, int, float, complex))


class _SplitForm:
    """The arguments through `nnx.split(tree, Variable, ...)`: keeps shared
    Variables and modules shared."""

    @staticmethod
    def split(tree):
        from flax import nnx

        graphdef, *states = nnx.split(tree, nnx.Variable, ...)
        leaves, treedef = jax.tree.flatten(tuple(states))
        return leaves, _Static(graphdef, treedef)

    @staticmethod
    def rebuild(static, leaves):
        from flax import nnx

        return nnx.merge(static.graphdef, *jax.tree.unflatten(static.treedef, leaves))

    @staticmethod
    def leaves_after(static, tree):
        from flax import nnx

        leaves, treedef = jax.tree.flatten(tuple(nnx.split(tree, nnx.Variable, ...)[1:]))
        return leaves if treedef == static.treedef else None

    @staticmethod
    def write_back(tree, static, leaves, updates: dict) -> None:
        """Only Variables (the first state) are written back."""
        from flax import nnx

        leaves = [updates.get(i, x) for i, x in enumerate(leaves)]
        nnx.update(tree, jax.tree.unflatten(static.treedef, leaves)[0])


def _aval(x) -> tuple:
    t = jax.typeof(x)
    return t.shape, t.dtype, t.weak_type


class _Static:
    """A graph definition and state treedef as one hashable `jax.jit` static
    argument: a GraphDef compares equal across splits of one structure but
    is not hashable (layers keep dicts); its treedef is, and equal graph
    definitions have equal treedefs."""

    __slots__ = ("graphdef", "treedef")

    def __init__(self, graphdef, treedef):
        self.graphdef, self.treedef = graphdef, treedef

    def __eq__(self, other) -> bool:
        return (isinstance(other, _Static) and self.treedef == other.treedef
                and self.graphdef == other.graphdef)

    def __hash__(self) -> int:
        return hash(self.treedef)

    def merge(self, leaves):
        """The object back from the state's leaves (`nnx.merge`)."""
        from flax import nnx

        return nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, leaves))


def _holds_nnx(tree) -> bool:
    """Does the argument tree hold a Flax NNX object (module, variable)?"""
    nnx = sys.modules.get("flax.nnx")   # Flax not loaded: nothing can be NNX
    if nnx is None:
        return False
    kinds = (nnx.Pytree, nnx.Variable)
    found = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, kinds))
    return any(isinstance(x, kinds) for x in found)
