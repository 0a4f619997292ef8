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
        new, after = form.flatten((args, kwargs))
        if after != form.structure(static):
            raise TypeError(f"jb.layer: {getattr(fn, '__name__', 'fn')} changed the structure "
                            f"of the NNX modules it was passed (added, removed or replaced a "
                            f"module or Variable); a layer may update Variable values only.")
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
    sharing, so used only where nothing is shared (`unshared_leaves`)."""

    @staticmethod
    def split(tree):
        """`unshared_leaves(tree)` where its structure is hashable (the
        `jax.jit` static argument), else None."""
        got = unshared_leaves(tree)
        if got is not None:
            try:
                hash(got[1])
            except TypeError:
                return None
        return got

    @staticmethod
    def flatten(tree):
        return jax.tree.flatten(tree)

    @staticmethod
    def structure(treedef):
        return treedef

    @staticmethod
    def rebuild(treedef, leaves):
        return jax.tree.unflatten(treedef, leaves)

    @staticmethod
    def write_back(tree, treedef, leaves, updates: dict) -> None:
        """Leaf i's new value into the caller's Variable holding leaf i
        (`unshared_leaves`); other leaves are not state."""
        from flax import nnx

        found = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))
        for i, x in enumerate(found):
            if i in updates and isinstance(x, nnx.Variable):
                x.set_value(updates[i])


def unshared_leaves(tree):
    """`jax.tree.flatten(tree)` where it loses nothing of an NNX graph: None
    unless every NNX object in `tree` is a pytree node (none left as a
    leaf), no `Variable` is reached twice (a module or RNG stream on two
    paths), and each `Variable` holds one array or scalar (so entry i of a
    walk that stops at Variables is leaf i)."""
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
    return (leaves, treedef) if len(leaves) == len(found) else None


def _one_leaf(value) -> bool:
    return hasattr(value, "shape") or isinstance(value, (bool, int, float, complex))


class _SplitForm:
    """The arguments through `nnx.split(tree, Variable, ...)`: keeps shared
    Variables and modules shared."""

    @staticmethod
    def split(tree):
        from flax import nnx

        graphdef, *states = nnx.split(tree, nnx.Variable, ...)
        leaves, treedef = jax.tree.flatten(tuple(states))   # the structure `flatten` gives
        return leaves, _Static(graphdef, treedef)

    @staticmethod
    def flatten(tree):
        from flax import nnx

        return jax.tree.flatten(nnx.split(tree, nnx.Variable, ...)[1:])

    @staticmethod
    def structure(static):
        return static.treedef

    @staticmethod
    def rebuild(static, leaves):
        from flax import nnx

        return nnx.merge(static.graphdef, *jax.tree.unflatten(static.treedef, leaves))

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
