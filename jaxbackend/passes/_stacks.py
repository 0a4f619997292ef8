"""How `reroll` stores per-block values and reads them back.

A stack is one array whose entry i is block i's value: made by one
`concatenate` plus a bitcast reshape (`stack`), read by one `dynamic_slice`
at an index XLA cannot see (`unstack_one`, `opaque_indices`), so every read of
one shape is the same XLA kernel whatever the layer. A short stack of the
program's own inputs is made through a `hold_one` loop when the program is
evaluated (`HeldInputStacks`), so XLA:CPU compiles no kernel for it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxbackend import _jax
from jaxbackend.passes import _rewrite


# XLA:CPU fuses a concatenate of at most this many operands into its readers
# (`kMaxConcatenateArguments` in xla/service/cpu/cpu_instruction_fusion.cc,
# JAX 0.10 / jaxlib 0.10): a stack that short is `hold`-ed by `reroll`, and
# made through a `hold_one` by `HeldInputStacks` where its parts are inputs.
CONCAT_FUSES_UP_TO = 8


def stack(xs):
    """jnp.stack(xs), as one concatenate along the existing leading axis and a
    reshape (a bitcast): one XLA op per stack instead of one reshape per
    element (measured: the 12 weight stacks of 64 layers compile in 0.55 s
    this way, 0.85 s as jnp.stack)."""
    shape = xs[0].shape
    if not shape:
        return jnp.stack(xs)
    return lax.concatenate(list(xs), 0).reshape((len(xs),) + shape)


def stack_new_axis(xs):
    """jnp.stack(xs) as one concatenate of the parts on a new leading axis:
    each part keeps its layout under a mesh (`stack` merges its rows with the
    layer axis, which XLA must reshard where the parts' leading dim is
    sharded); one more op per part to compile, so only where that matters
    (`sharding.Plan.stack_eqns`)."""
    return lax.concatenate([lax.expand_dims(x, (0,)) for x in xs], 0)


def unstack_one(arr, i):
    """arr[i] for a runtime scalar i: one dynamic_slice and a reshape (which
    XLA makes a bitcast; lax.dynamic_index_in_dim would add a nested jit).
    The other offsets are zeros of i's own dtype: a Python 0 would be int64
    under jax_enable_x64, and dynamic_slice wants one index dtype."""
    zero = np.zeros((), i.dtype)
    row = lax.dynamic_slice(arr, (i,) + (zero,) * (arr.ndim - 1), (1,) + arr.shape[1:],
                            allow_negative_indices=False)
    return row.reshape(arr.shape[1:])


def opaque_indices(n: int, like):
    """Scalars 0..n-1 whose values XLA cannot see at compile time.

    Unstacking a scan's output into per-layer results (the weight gradients
    the caller expects) takes one slice per layer. With constant offsets each
    slice is a different XLA:CPU kernel, compiled separately: ~10-40 ms each,
    hundreds per deep model, which alone would cost more than compiling the
    scan (measured: 64 slices of one array, 2.9 s; this way, 0.29 s). With the
    offset a runtime scalar, all slices of one shape are one kernel, which
    XLA compiles once. The scalars come out of a `while` loop that runs zero
    times (its trip count is a value XLA cannot know: whether `like`'s first
    element is NaN) and whose body would leave them unchanged anyway (it adds
    the counter, 0, on its only possible iteration), so the values are always
    0..n-1; the loop costs a few microseconds per call. (For an integer or
    boolean `like`, the trip count is its first element's lowest bit: 0 or 1,
    unknown to XLA.)
    """
    first = corner(like, 0)
    if jnp.issubdtype(first.dtype, jnp.inexact):
        trips = (first != first).astype(jnp.int32)
    else:
        # x != x is known false for integers and booleans (XLA folds it, and
        # every index with it); any run-time value in {0, 1} does, since one
        # iteration leaves the indices as they are
        trips = first.astype(jnp.int32) & 1
    init = (jnp.int32(0), tuple(jnp.int32(i) for i in range(n)))
    _, idx = lax.while_loop(lambda c: c[0] < trips,
                            lambda c: (c[0] + 1, tuple(x + c[0] for x in c[1])), init)
    return idx


class HeldInputStacks:
    """The top-level stacks of a jaxpr's own inputs, each made through a
    `hold_one` loop when an evaluator reaches it: `get(eqn)` gives the value
    of such a `concatenate` equation ([value]; None for any other), to bind
    in its place (`jit`, `run_planned`).

    A stack is a `concatenate` along axis 0 of 2 to `CONCAT_FUSES_UP_TO`
    parts of one type (rank >= 1, not empty), every part an input, read by
    one reshape (`stack`'s bitcast into layers); not of PRNG keys (the
    loop selects). XLA:CPU fuses a concatenate that short into that reshape: one
    kernel per stack shape, about 200 kB of optimised LLVM IR for 8 parts;
    a concatenate whose one reader is a loop is copied part by part, with no
    kernel at all (measured, 24 stacks of 8 parts of distinct shapes: 3.1 s
    to compile as `stack`, 1.1 s held; an 8-layer per-layer GPT AdamW step
    stacks 48 weights and moments, of 8 shapes). The values are the
    concatenates', bit for bit (the loop runs zero times).

    One loop per group of stacks the jaxpr makes one after another (their
    reshapes aside), made where the group's first stack was: XLA:CPU
    compiles each loop's counter as kernels of its own, and a stack made
    any earlier than the jaxpr makes it would hold its buffer longer (all
    of them at the first: the optimizer moments' stacks through the forward
    and backward pass, 9 MiB more per device on an 8-layer GPT step).
    Equations in `skip` (stacks built on a new axis under a mesh,
    `Plan.stack_eqns`) are left to the evaluator. Linear in the equations."""

    def __init__(self, jaxpr, args, skip=frozenset()):
        uses = _rewrite.own_uses(jaxpr)
        self.value = dict(zip(jaxpr.invars, args))
        joined = {e.outvars[0]: e for e in jaxpr.eqns   # read once: by its reshape, if a stack
                  if e.primitive.name == "concatenate" and e not in skip
                  and _of_inputs(e, self.value) and uses[e.outvars[0]] == 1}
        reshapes = {}   # the reshape into layers -> its stack
        for e in jaxpr.eqns:
            c = (joined.get(e.invars[0])
                 if e.primitive.name == "reshape" and _jax.is_var(e.invars[0]) else None)
            if c is not None and \
                    e.outvars[0].aval.shape == (len(c.invars),) + c.invars[0].aval.shape:
                reshapes[e] = c
        stacks = set(reshapes.values())
        self.groups: list = []    # lists of consecutive stack equations
        self.group_of: dict = {}
        after_stack = False
        for e in jaxpr.eqns:
            if e in stacks:
                if not after_stack:
                    self.groups.append([])
                self.groups[-1].append(e)
                self.group_of[e] = len(self.groups) - 1
                after_stack = True
            elif e not in reshapes:
                after_stack = False
        self.made: dict = {}
        self.zero = None

    def __bool__(self) -> bool:
        return bool(self.groups)

    def get(self, eqn):
        g = self.group_of.get(eqn)
        if g is None:
            return None
        if eqn not in self.made:
            group = self.groups[g]
            if self.zero is None:
                sizes = [x for x in self.value.values() if getattr(x, "size", 0)
                         and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended)]
                self.zero = opaque_indices(1, min(sizes, key=lambda x: x.size))[0]
            flats = tuple(lax.concatenate([self.value[v] for v in e.invars], 0) for e in group)
            self.made.update((e, [h]) for e, h in zip(group, hold_one(flats, self.zero)))
        return self.made[eqn]


def _of_inputs(e, value) -> bool:
    """Is concatenate `e` along axis 0 of 2 to `CONCAT_FUSES_UP_TO` inputs
    (keys of `value`) of one non-empty numeric type of rank >= 1?"""
    a = e.invars[0].aval
    return (not _jax.concatenate_dimension(e) and 2 <= len(e.invars) <= CONCAT_FUSES_UP_TO
            and bool(a.shape) and bool(a.size)
            and not jax.dtypes.issubdtype(a.dtype, jax.dtypes.extended)
            and all(_jax.is_var(v) and v in value and _jax.same_aval(v.aval, a)
                    for v in e.invars))


@jax.custom_jvp
def hold(xs: tuple, zero) -> tuple:
    """xs, each materialised once before its entries are read (`unstack_one`).

    Without it XLA fuses the element-wise chain that computed a stack (the
    vectorised optimizer update) into every entry's slice: one larger kernel
    per layer and weight to compile (3 x 1024 at 64 layers, most of the
    compile time). `lax.optimization_barrier` does not stop that on XLA:CPU
    (JAX 0.10: the barrier is expanded away before fusion); a `while` loop
    does. The xs go through one loop that runs `zero` times (an int32 scalar
    that is 0 at run time but unknown to XLA: `opaque_indices(...)[0]`; a
    replicated scalar, so no collective under a mesh) and whose body selects
    each x when its counter is 0, so it would return xs had it run once. A
    select moves bits without arithmetic (nothing rounds, no subnormal is
    flushed, any dtype), so each result is its x, bit for bit. One loop for
    all the stacks held at one point, because XLA:CPU compiles each loop's
    compare and counter add as kernels of their own: a loop per stack (96 in
    an 8-layer per-layer AdamW step) was ~290 kernels. Differentiated, it is
    the identity (`_identity_jvp`): reverse mode cannot go through a `while`
    loop, and a rolled program is differentiated again when `jax.grad` is
    applied outside `jb.jit`.
    """
    return _zero_trips(xs, zero, _kept)


def _zero_trips(xs, zero, keep):
    """xs through a loop that runs `zero` times, whose body maps each x to
    `keep(x, first)` (first: the counter is 0; keep(x, True) is x)."""
    def body(c):
        first = c[0] == 0
        return (c[0] + 1,) + tuple(keep(x, first) for x in c[1:])

    return lax.while_loop(lambda c: c[0] < zero, body, (jnp.int32(0),) + tuple(xs))[1:]


def _kept(x, first):
    return lax.select(jnp.broadcast_to(first, x.shape), x, jnp.zeros_like(x))


def _identity_jvp(f):
    """The JVP rule of a hold `f`: reverse mode cannot go through its loop,
    and it is the identity."""
    def jvp(primals, tangents):
        xs, zero = primals
        return f(xs, zero), tangents[0]
    return jvp


hold.defjvp(_identity_jvp(hold))


@jax.custom_jvp
def hold_one(xs: tuple, zero) -> tuple:
    """`hold(xs, zero)` for non-empty arrays, whose loop body moves one
    element of each x, not all of them: `x` with its first element replaced
    by itself (selected while the counter is 0), so it would return xs had
    it run once, bit for bit. The loop runs zero times either way, but XLA's
    cost analysis counts a loop body once whatever its trip count: with
    `hold`'s whole-array select, a held stack of weights was counted as
    read and written twice more than it is (a 6-layer MLP's rolled forward,
    +15% bytes over jax.jit by `compiled.cost_analysis()`)."""
    return _zero_trips(xs, zero, _first_kept)


def _first_kept(x, first):
    at = (jnp.int32(0),) * x.ndim
    return lax.dynamic_update_slice(x, _kept(lax.dynamic_slice(x, at, (1,) * x.ndim), first), at)


hold_one.defjvp(_identity_jvp(hold_one))


def corner(x, at: int):
    """The scalar at x[at, at, ...] (at 0 or -1) by one static slice: under a
    mesh, flattening x first (`x.reshape(-1)[0]`) would make XLA gather the
    whole of a sharded stack to read one element."""
    start = tuple(0 if at == 0 else d - 1 for d in x.shape)
    return lax.slice(x, start, tuple(i + 1 for i in start)).reshape(())


_BITS = {jnp.dtype(jnp.bfloat16): jnp.dtype(jnp.uint16),
         jnp.dtype(jnp.float16): jnp.dtype(jnp.uint16)}


def as_bits(aval):
    """The unsigned integer type a per-block result of `aval` is stacked as
    by a scan, or None (stacked as it is). 16-bit floats: XLA:CPU has no
    bfloat16/float16 dynamic-update-slice, so the loop carries the whole
    stack converted to float32 (twice its bytes, on top of the result; one
    conversion per trip): a backward scan's bfloat16 residuals took 3x
    their bytes, 24 MiB for 8 (measured, one CPU, JAX 0.10). The same bits
    as uint16 are updated in place, and the scans that read them bitcast
    each entry back: bit for bit the same values."""
    dtype = getattr(aval, "dtype", None)
    # a PRNG key's extended dtype is no np.dtype (np.dtype() of it raises): stacked as it is
    return _BITS.get(dtype) if isinstance(dtype, np.dtype) else None


def bits_aval(aval):
    """`aval` with the type `as_bits` gives it."""
    return aval.update(dtype=as_bits(aval))


def bitcast_eqn(src, dst):
    """The equation `dst = bitcast_convert_type(src)` (types of one width)."""
    shape, a, b = src.aval.shape, src.aval.dtype, dst.aval.dtype
    if (shape, a, b) not in _BITCASTS:   # traced once per type: the one equation, re-wired
        _BITCASTS[shape, a, b] = jax.make_jaxpr(lambda x: lax.bitcast_convert_type(x, b))(
            jax.ShapeDtypeStruct(shape, a)).jaxpr.eqns[0]
    return _BITCASTS[shape, a, b].replace(invars=[src], outvars=[dst])


_BITCASTS: dict = {}
