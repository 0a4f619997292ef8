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

Flax NNX modules are not plain pytrees of arrays with static structure (they
carry mutable state and graph structure), so a call whose arguments hold one
splits them (`nnx.split` of the whole argument tree) into a static graph
definition, equal for layers of one structure (they share the cache entry),
and the arrays. State the layer updates (a dropout RNG counter, batch
statistics) comes back out of the call and is written into the caller's
modules; a call that updates nothing writes nothing, so a module closed over
by an outer `jax.jit` stays usable as it was without `layer`. (`nnx.jit`
would write every variable back, which fails for such a module.) Other calls
go through `jax.jit` directly.

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
    from flax import nnx

    changed_at: dict = {}   # (static, avals) -> positions of the state leaves fn updates

    @functools.partial(jax.jit, static_argnums=0)
    def pure(static, leaves):
        args, kwargs = nnx.merge(static.graphdef, *jax.tree.unflatten(static.treedef, leaves))
        out = fn(*args, **kwargs)
        new = jax.tree.leaves(nnx.split((args, kwargs), nnx.Variable, ...)[1:])
        # Traced once per cache entry: an untouched leaf is still its input tracer.
        changed = tuple(i for i, (a, b) in enumerate(zip(leaves, new)) if a is not b)
        changed_at[static, tuple(map(_aval, leaves))] = changed
        return out, [new[i] for i in changed]

    def call(args, kwargs):
        # (variables, everything else): only variables are written back
        graphdef, *states = nnx.split((args, kwargs), nnx.Variable, ...)
        leaves, treedef = jax.tree.flatten(states)
        static = _Static(graphdef, treedef)
        out, updates = pure(static, leaves)
        changed = changed_at[static, tuple(map(_aval, leaves))]
        if changed:
            for i, v in zip(changed, updates):
                leaves[i] = v
            nnx.update((args, kwargs), jax.tree.unflatten(treedef, leaves)[0])
        return out

    return call


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
