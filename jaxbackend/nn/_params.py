"""Named parameters: NNX variables that carry their dim names.

Every parameter of a `jaxbackend.nn` layer is an `nnx.Param` whose metadata
holds `dims`, a tuple of dim names, one per axis (`nnx.Param(w, dims=("embd",
"head", "hd"))`). The value stays a plain `jax.Array`, so `nnx.split/merge`,
`nnx.jit`, `nnx.grad`, optax and `jaxbackend.jit` see ordinary leaves; layers
wrap the value as a `NamedArray` only inside `__call__` (`named(p)`).

Because names live on the parameters, a sharding plan stated as rules
"dim name -> mesh axis" turns into parameter shardings mechanically
(`partition_specs`, `shardings`), and exports as Flax logical axis rules
(`flax_logical_axis_rules` + `annotate_logical_axes`, after which
`with nnx.logical_axis_rules(rules): nnx.get_partition_spec(state)` gives the
same specs). Rules may be a dict, a sequence of pairs, or any object with a
`.rules` attribute holding either (such as a sharding search's plan); what
rules mean is `jaxbackend.sharding._axis_rules`, shared with the planner.

Leaves alone: variables without `dims` metadata (RNG state, Dropout's
counters) map to replicated specs.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import meta
from jax.sharding import NamedSharding, PartitionSpec

from jaxbackend import named as nx
from jaxbackend._layer import unshared_leaves
from jaxbackend._stacked import stack_layers, unstack_layers
from jaxbackend.sharding import _axis_rules
from jaxbackend.sharding._axis_rules import spec_for_dims


def param(init, key, sizes: dict, dtype=jnp.float32) -> nnx.Param:
    """An `nnx.Param` of shape `sizes.values()` with `dims=tuple(sizes)`."""
    dims = tuple(sizes)
    shape = tuple(int(sizes[d]) for d in dims)
    return nnx.Param(init(key, shape, dtype), dims=dims)


def fan_in_normal(in_size: int):
    """Normal(0, 1/fan_in) init (what `nnx.Linear`'s lecun_normal does, minus truncation)."""
    std = 1.0 / math.sqrt(max(in_size, 1))

    def init(key, shape, dtype):
        return jax.random.normal(key, shape, dtype) * jnp.asarray(std, dtype)
    return init


def zeros_init(key, shape, dtype):
    return jnp.zeros(shape, dtype)


def ones_init(key, shape, dtype):
    return jnp.ones(shape, dtype)


def named(p: nnx.Variable) -> nx.NamedArray:
    """The parameter's value as a NamedArray with its recorded dims."""
    return nx.NamedArray(p[...], p.get_metadata("dims"))


# -- rules -> shardings --------------------------------------------------------

def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def _is_box(x) -> bool:
    """A Flax linen parameter boxed with its axis names
    (`nn.with_logical_partitioning` or `nn.with_partitioning`: its `init`
    returns `flax.core.meta.Partitioned` leaves, which `apply` and optax
    take as they are)."""
    return isinstance(x, meta.Partitioned)


def holds_names(x) -> bool:
    """Whether x is one parameter whose metadata may name its axes (an NNX
    variable or a linen box): a leaf when a tree's dims are read."""
    return _is_var(x) or _is_box(x)


def _state(tree):
    return nnx.state(tree) if isinstance(tree, nnx.Module) else tree


def _value(v):
    """The array a variable or linen box holds."""
    return v.value if _is_box(v) else v[...]


def _ndim(v) -> int:
    # by the leaf's shape: under a trace (jb.jit plans on abstract values)
    # the value may be a ShapeDtypeStruct, which v[...] cannot index
    leaves = jax.tree.leaves(v)
    return len(leaves[0].shape) if len(leaves) == 1 and hasattr(leaves[0], "shape") else \
        jnp.ndim(_value(v))


def dims_of(v, leading: bool = False) -> tuple | None:
    """A variable's dim names: our `dims` metadata, else Flax's logical axis
    names (`out_sharding`, set by `nnx.with_partitioning`; a linen box's
    `names`; None entries are unnamed axes), else None. `leading`: the value
    may carry more axes in front than the names name (a `jb.stack_layers`
    state: the layer axis); those are unnamed (None)."""
    if _is_box(v):
        dims = v.names      # a linen `nn.scan` adds its axis' name (Flax requires one)
    elif _is_var(v):
        dims = v.get_metadata("dims", None)
        if dims is not None and not leading:
            return tuple(dims)
        if dims is None:
            dims = v.get_metadata("out_sharding", None)
    else:
        return None
    if not isinstance(dims, (tuple, list)) or not all(d is None or isinstance(d, str)
                                                      for d in dims):
        return None     # (a mesh-axis tuple for one axis, say: not a name)
    ndim = _ndim(v)
    if len(dims) == ndim or leading and len(dims) < ndim:
        return with_leading(dims, ndim)
    return None


def with_leading(dims, ndim: int) -> tuple:
    """The names of the trailing axes of an `ndim`-axis value, with None for
    the leading axes they do not name (a stacked layer axis)."""
    return (None,) * (ndim - len(dims)) + tuple(dims)


def param_dims(tree):
    """A tree like `nnx.state(module)` whose leaves are each variable's dims
    (None for variables without names)."""
    return jax.tree.map(dims_of, _state(tree), is_leaf=holds_names)


def partition_specs(tree, rules):
    """PartitionSpec per variable of a module (or its state) under `rules`.
    A variable with neither `dims` nor Flax logical-axis metadata stays
    replicated, with a warning naming the first such parameter."""
    r = _axis_rules.normalize(rules)
    unnamed = [jax.tree_util.keystr(p) for p, v in
               jax.tree_util.tree_leaves_with_path(_state(tree), is_leaf=holds_names)
               if holds_names(v) and _ndim(v) > 0 and dims_of(v) is None]
    if unnamed and r:
        warnings.warn(
            f"partition_specs: {len(unnamed)} variables carry no dim names (e.g. {unnamed[0]}) "
            f"and stay replicated whatever the rules say; build them with jaxbackend.nn layers "
            f"or name their axes with nnx.with_partitioning(init, names).", stacklevel=2)

    def one(v):
        dims = dims_of(v)
        return PartitionSpec() if dims is None else spec_for_dims(dims, r)
    return jax.tree.map(one, _state(tree), is_leaf=holds_names)


def shardings(tree, rules, mesh):
    """NamedSharding per variable, for `jax.device_put(state, shardings(...))`."""
    check_divisible(tree, rules, mesh)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), partition_specs(tree, rules),
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def check_divisible(tree, rules, mesh) -> None:
    """Raise `nx.DimError` naming the first parameter dim whose size does not
    divide by the mesh axes the rules put it on."""
    leaves = jax.tree_util.tree_leaves_with_path(_state(tree), is_leaf=holds_names)
    named = [(f" of parameter {jax.tree_util.keystr(path)}", dims_of(v), _value(v).shape)
             for path, v in leaves if dims_of(v) is not None]
    _axis_rules.check_divisible(named, _axis_rules.normalize(rules), dict(mesh.shape))


# -- Flax logical axis rules ------------------------------------------------------

def flax_logical_axis_rules(rules, module=None) -> tuple:
    """Rules as Flax logical axis rules: a tuple of (logical name, mesh axis)
    pairs for `nnx.logical_axis_rules(...)` / `flax.linen.logical_axis_rules`.

    Flax leaves a logical name without a rule in the spec verbatim (it is
    then taken for a mesh axis), so pass `module` to add `(dim, None)` for
    every parameter dim the rules do not mention.
    """
    r = _axis_rules.normalize(rules)
    if module is not None:
        for dims in jax.tree.leaves(param_dims(module), is_leaf=lambda x: isinstance(x, tuple)):
            for d in dims or ():
                r.setdefault(d, None)
    return tuple(r.items())


def annotate_logical_axes(module: nnx.Module) -> nnx.Module:
    """Copy every parameter's `dims` into Flax's `out_sharding` metadata (the
    logical axis names Flax resolves with `nnx.logical_axis_rules`). In place;
    returns the module. Values are not moved."""
    for _, v in nnx.iter_graph(module):
        if _is_var(v) and v.get_metadata("dims", None) is not None:
            v.set_metadata(out_sharding=tuple(v.get_metadata("dims")))
    return module


def functional(model: nnx.Module, method: str | Callable = "loss", *, stacked: bool = False):
    """`(params, fn)`: the model's parameters as a pure dict of arrays and
    `fn(params, *args, key=None, **kwargs)` calling `model.<method>(*args,
    **kwargs)` with those params; `method` may also be a function, called
    as `method(model, *args, **kwargs)` (a loss written against the module).

    For `jax.value_and_grad`, optax and `jb.jit`, which want functions of
    plain pytrees. `fn` is pure, so any jit or grad may trace it: it reads
    the model's other state (RNG streams included) as it was when
    `functional` was called and never writes back. Randomness (dropout)
    therefore comes from `key`, a JAX PRNG key: each RNG stream of the model
    is re-seeded from `fold_in(key, i)` (i: the stream's place in the state),
    so a fresh key per call (`jax.random.fold_in(key, step)`) gives fresh
    masks and the same key the same masks. Without `key` every call draws
    the masks of the model's RNG state at `functional` time. The model's
    mode is fixed then too: call `model.eval()` before `functional` for a
    deterministic `fn`.

    stacked: return the params with each list of identical layers (an
    `nnx.List` of blocks) kept as one `jb.Stacked` of stacked arrays
    (`jb.stack_layers`): the model's for-loop over its blocks runs as
    written, and a rolled training step takes and returns a few stacked
    arrays instead of one per layer (the 64-layer GPT AdamW step: 4.9 s
    from trace to XLA, 15.7 s per-layer; BENCHMARKS.md). `fn` takes either
    form.
    """
    graphdef, pstate, *others = nnx.split(model, nnx.Param, ...)
    rest = others[0]   # every variable that is not a Param
    params = nnx.to_pure_dict(pstate)
    rebuild = _Rebuild.of(model, params, rest)

    def fn(params, *args, key=None, **kwargs):
        params = unstack_layers(params)
        module = rebuild(params, key) if rebuild is not None else None
        if module is None:
            state = jax.tree.map(lambda v: v, pstate)  # a fresh copy to fill in
            nnx.replace_by_pure_dict(state, params)
            module = nnx.merge(graphdef, state, _fresh_rest(rest, key))
        if callable(method):
            return method(module, *args, **kwargs)
        return getattr(module, method)(*args, **kwargs)

    return (stack_layers(params) if stacked else params), fn


class _Rebuild:
    """`fn`'s module made by one `jax.tree.unflatten` of the model's pytree
    (Flax >= 0.12 modules are pytrees), the params and re-seeded RNG keys
    put at their leaves: what `replace_by_pure_dict` + `nnx.merge` +
    `_fresh_rest` build, in a third of the time (64-layer GPT: 30 ms, not
    95 ms, per trace). Used where the model's pytree keeps its whole graph
    (`_layer.unshared_leaves`) and every param and RNG key is a leaf of its
    own; `fn` takes the merge path for params of another structure (whose
    errors name the path)."""

    def __init__(self, treedef, leaves, params_def, at, keys_at):
        self.treedef, self.leaves = treedef, leaves
        self.params_def, self.at, self.keys_at = params_def, at, keys_at

    @classmethod
    def of(cls, model, params, rest):
        got = unshared_leaves(model)
        if got is None:
            return None
        leaves, treedef = got
        where = {id(x): i for i, x in enumerate(leaves)}
        flat, params_def = jax.tree.flatten(params)
        keys = [v.get_raw_value() for v in jax.tree.leaves(rest, is_leaf=_is_var)
                if isinstance(v, nnx.RngKey)]   # in `_fresh_rest`'s order: stream i
        at = [where.get(id(x)) for x in flat]
        keys_at = [where.get(id(x)) for x in keys]
        if len(where) != len(leaves) or None in at or None in keys_at:
            return None   # an array on two leaves, or one the model does not hold
        for i in at:
            leaves[i] = None   # the closure holds no copy of the params
        return cls(treedef, leaves, params_def, at, keys_at)

    def __call__(self, params, key):
        flat, params_def = jax.tree.flatten(params)
        if params_def != self.params_def:
            return None
        leaves = list(self.leaves)
        for i, x in zip(self.at, flat):
            leaves[i] = x
        if key is not None:
            key = _as_key(key)
            for n, i in enumerate(self.keys_at):
                leaves[i] = jax.random.fold_in(key, n)
        return jax.tree.unflatten(self.treedef, leaves)


def _fresh_rest(rest, key):
    # New Variables, made in the current trace: Flax lets a Variable (an RNG
    # stream's counter) be advanced only in the trace that created it, and
    # copies also keep the closed-over state free of this trace's values.
    if key is not None:
        key = _as_key(key)
    streams = itertools.count()

    def copy(v):
        if key is not None and isinstance(v, nnx.RngKey):
            return v.copy(jax.random.fold_in(key, next(streams)))
        return v.copy()
    return jax.tree.map(copy, rest, is_leaf=_is_var)


def _as_key(key):
    shape = getattr(key, "shape", None)
    if shape is not None and jnp.issubdtype(key.dtype, jax.dtypes.prng_key) and shape == ():
        return key
    if shape == (2,) and key.dtype == jnp.uint32:  # a raw jax.random.PRNGKey
        return jax.random.wrap_key_data(key)
    what = type(key).__name__ if shape is None else f"an array of shape {shape} dtype {key.dtype}"
    raise TypeError(f"functional: key is {what}, not a single JAX PRNG key; pass "
                    f"key=jax.random.key(seed) (per step: jax.random.fold_in(key, step)).")
