"""`abs_scale`: the rounding error a program's outputs carry, as the sum of
|terms| each output entry comes from (the package docstring, 2., 3. and 6.).

`abs_scale` evaluates a jaxpr and, next to every float value, the variance
of its rounding error in units of float32's u**2 (None: exact). Each
operation adds its own rounding, (sum|terms|)**2 for a sum or contraction
and result**2 for an elementwise op, times (u/u_float32)**2 for its result's
dtype (a bfloat16 op rounds 2**16 times coarser), to the variances it
inherits from its operands,
weighted by the squared derivative (Higham and Mary's probabilistic
rounding error analysis: independent zero-mean roundings add in quadrature),
plus, for a product of two erring values or a power of one, the product of
the errors (second order: the whole error of squared rounding noise).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxbackend import _jax

# Data movement: each output entry is an input entry, and so is its variance.
_MOVE = frozenset("""broadcast_in_dim reshape squeeze expand_dims transpose slice dynamic_slice
dynamic_update_slice gather concatenate pad rev copy copy_p select_n stop_gradient
optimization_barrier""".split())
# Linear in all float operands together, coefficients +-1: variances add.
_SUM = frozenset("add add_any sub neg reduce_sum cumsum reduce_window_sum scatter-add "
                 "scatter_add".split())
# Linear in each float operand: var = sum_i op(others**2, var_i).
_PRODUCT = frozenset("mul dot_general einsum conv_general_dilated".split())
# Elementwise: var = sum_i (d out / d operand_i)**2 var_i.
_ELEMENTWISE = frozenset("""
exp exp2 log log1p expm1 sqrt rsqrt cbrt tanh logistic sin cos tan asin acos atan sinh cosh
asinh acosh atanh abs sign floor ceil round integer_pow square convert_element_type erf erfc
erf_inv lgamma digamma reduce_precision div max min pow atan2 rem clamp
""".split())


def _is_float(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


# Variances are float64 (the variance program runs with x64 enabled,
# `abs_scale`): a variance is a square, and in float32 it would underflow to 0
# for any value below ~1e-19 (a softmax's small probabilities, a second moment
# of small gradients: XLA flushes the subnormals) and overflow above ~1e19.
_VDTYPE = jnp.float64


def _filled(vals, vs):
    """Variances with exact floats as zeros (scan/cond/while need one structure)."""
    return [(jnp.zeros(jnp.shape(x), _VDTYPE) if v is None else v) if _is_float(x) else None
            for x, v in zip(vals, vs)]


def _unit(x) -> float:
    """u = eps / 2, the unit roundoff of x's dtype (its own: under x64, where
    the variance program runs, jnp.result_type makes a weak float32 float64)."""
    dtype = getattr(x, "dtype", None)
    return float(jnp.finfo(jnp.result_type(x) if dtype is None else dtype).eps) / 2


# The variances are in units of float32's u**2, whatever the dtypes: an op's
# own rounding is result**2 * _weight(result), so a float32 result computed
# through bfloat16 ops (mixed precision) carries their roundings at their
# size; `abs_scale` converts each output's scale to its own dtype's units.
# Two errors of variances U**2 w0 and U**2 w1 (U = _REF_UNIT) have a product
# of variance U**4 w0 w1: (U w0) (U w1) in these units.
_REF_UNIT = float(jnp.finfo(jnp.float32).eps) / 2


def _weight(x) -> float:
    """(u / u_float32)**2 for x's dtype: its own roundings in these units."""
    return (_unit(x) / _REF_UNIT) ** 2


def _select(pred, a, b):
    """jnp.where(pred, a, b) for a Python scalar b, as one `select_n`:
    jnp.where is a nested `jit` per call, and the variance program of a deep
    training step makes thousands of them."""
    shape = jnp.broadcast_shapes(jnp.shape(pred), jnp.shape(a))
    a = jnp.broadcast_to(a, shape)
    return lax.select(jnp.broadcast_to(pred, shape), a, lax.full_like(a, b))


def _finite(x):
    """lax.is_finite, for complex values too (both parts finite)."""
    if jnp.iscomplexobj(x):
        return lax.is_finite(jnp.real(x)) & lax.is_finite(jnp.imag(x))
    return lax.is_finite(x)


def _sq(x):
    """|x|**2 in the variance dtype: a complex value's error is a distance in
    the plane, |e|, so its size is its modulus (for a real value, x**2)."""
    return jnp.square(jnp.abs(x).astype(_VDTYPE))


def _clean(out, var):
    """0 on non-finite values (compared by pattern); an overflowed or undefined
    variance on a finite value becomes the largest float (no information)."""
    var = jnp.broadcast_to(var, jnp.shape(out))
    var = _select(lax.is_finite(var), var, jnp.finfo(var.dtype).max)
    return _select(_finite(out), var, 0)


def _var_eval(closed, args, vs) -> tuple:
    """(outputs, their variances) of `closed` on args with variances vs."""
    env: dict = {}
    var: dict = {}

    def read(v):
        # a literal as an array of its own dtype: JAX 0.10 keeps a float
        # literal as a Python float subclass, which under x64 (the variance
        # program) becomes float64 where a rule computes with it (the
        # derivative of `pow` by a literal exponent: an optax schedule's)
        if isinstance(v, _jax.Literal):
            return np.asarray(v.val, v.aval.dtype), None
        return env[v], var.get(v)

    env.update(zip(closed.jaxpr.constvars, closed.consts))
    env.update(zip(closed.jaxpr.invars, args))
    var.update(zip(closed.jaxpr.invars, vs))
    for eqn in closed.jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        outs, out_vs = _var_rule(eqn, [x for x, _ in ins], [v for _, v in ins])
        env.update(zip(eqn.outvars, outs))
        var.update(zip(eqn.outvars, out_vs))
    outs = [read(v) for v in closed.jaxpr.outvars]
    return [x for x, _ in outs], [v for _, v in outs]


def _var_rule(eqn, vals, vs):
    name, body = eqn.primitive.name, _jax.call_body(eqn)
    if body is not None:
        return _var_eval(body, vals, vs)
    if name in ("scan", "cond", "while"):
        return {"scan": _var_scan, "cond": _var_cond, "while": _var_while}[name](eqn, vals, vs)
    outs = _jax.bind_eqn(eqn, vals)
    floats = [_is_float(o) for o in outs]
    if not any(floats) or (name in _MOVE and all(v is None for v in vs)):
        return outs, [None] * len(outs)
    if name in _MOVE:
        filled = _filled(vals, vs)
        moved = _jax.bind_eqn(eqn, [w if _is_float(x) else x for x, w in zip(vals, filled)])
        # (an integer moved with floats, by one optimization_barrier, is exact)
        return outs, [_clean(o, w) if f else None for o, w, f in zip(outs, moved, floats)]
    dt = _VDTYPE
    zero = [jnp.zeros(jnp.shape(x), dt) if w is None and _is_float(x) else w
            for x, w in zip(vals, vs)]
    if name in ("reduce_max", "reduce_min"):    # the extreme entry's own (ties: the largest)
        axes = _jax.reduce_axes(eqn)
        hit = vals[0] == jnp.expand_dims(outs[0], axes)
        return outs, [_clean(outs[0], jnp.max(jnp.where(hit, zero[0].astype(dt), 0), axis=axes))]
    if name == "convert_element_type" and _is_float(vals[0]) and (
            jnp.finfo(outs[0].dtype).nmant >= jnp.finfo(jnp.result_type(vals[0])).nmant):
        return outs, [None if vs[0] is None else vs[0].astype(dt)]   # widening: exact
    if name in _SUM or name in _PRODUCT:
        def op(ops):
            if name in ("sub", "neg"):
                return ops[0] + ops[1] if name == "sub" else ops[0]
            if name in ("scatter-add", "scatter_add"):
                # its params hold an update jaxpr typed for the values' dtype
                prm = eqn.params
                return lax.scatter_add(*ops, prm["dimension_numbers"],
                                       indices_are_sorted=prm["indices_are_sorted"],
                                       unique_indices=prm["unique_indices"], mode=prm["mode"])
            return _jax.bind_eqn_as(eqn, ops, dt)[0].astype(dt)
        absv = [jnp.abs(x).astype(dt) if _is_float(x) else x for x in vals]
        var = 0 if name == "neg" else jnp.square(op(absv)) * _weight(outs[0])   # its own rounding
        if name in _SUM:
            var = var + op([w.astype(dt) if _is_float(x) else x for x, w in zip(vals, zero)])
        else:
            sq = [jnp.square(a) if _is_float(x) else a for a, x in zip(absv, vals)]
            for i, w in enumerate(vs):
                if w is not None:
                    var = var + op(sq[:i] + [w.astype(dt)] + sq[i + 1:])
            if len(vs) == 2 and all(w is not None for w in vs):
                # both factors carry errors: their product e0 * e1 too
                # (second order; the whole error where the factors are
                # themselves rounding noise, as a gradient that cancels by
                # symmetry, squared). u on each factor: w0 * w1 may overflow
                var = var + op([w.astype(dt) * _REF_UNIT for w in vs])
        return outs, [_clean(outs[0], var)]
    if name == "fft":
        return outs, [_clean(outs[0], _var_fft(eqn, vals[0], zero[0], outs[0]))]
    if name in _ELEMENTWISE:
        var = _sq(outs[0]) * _weight(outs[0])
        for i, w in enumerate(vs):
            if w is not None:
                def f(xi, i=i):
                    return _jax.bind_eqn(eqn, vals[:i] + [xi] + vals[i + 1:])[0]
                _, d = jax.jvp(f, (vals[i],), (jnp.ones_like(vals[i]),))
                var = var + _select(w > 0, _sq(d) * w.astype(dt), 0)
        power = 2 if name == "square" else eqn.params.get("y", 0) if name == "integer_pow" else 0
        if power >= 2 and vs[0] is not None:
            # x**p moves by p x**(p-1) e + p (p-1) x**(p-2) e**2 / 2: the
            # second term, variance (p (p-1) x**(p-2))**2 / 2 * var**2 * u**2,
            # is the whole error where x is itself rounding noise
            w = vs[0].astype(dt)
            curve = power * (power - 1) * jnp.abs(vals[0]).astype(dt) ** (power - 2)
            var = var + 0.5 * jnp.square(curve * w * _REF_UNIT)
        return outs, [_clean(outs[0], var)]
    # Anything else (sort, cumprod, callbacks, ...): its own rounding plus the
    # largest variance of an operand (assumes it does not amplify errors).
    carried = sum((jnp.max(w) for w in vs if w is not None), jnp.float32(0))
    return outs, [_clean(o, _sq(o) * _weight(o) + carried.astype(_VDTYPE))
                  if f else None for o, f in zip(outs, floats)]


def _var_fft(eqn, x, var, out):
    """An FFT's output entry is a sum of the n = prod(fft_lengths) input
    entries of its transformed axes times unit roots (divided by n for an
    inverse; an inverse real FFT reads each stored entry twice, as itself and
    as its mirror): sum|terms| is c * sum|x| over those axes, c = 1, 1/n or
    2/n, and each input's variance reaches it times c**2, as for a sum."""
    lengths = tuple(eqn.params["fft_lengths"])
    kind = lax.FftType(eqn.params["fft_type"]).name   # an int in a JAX 0.10 jaxpr
    n = float(np.prod(lengths))
    c = {"FFT": 1.0, "RFFT": 1.0, "IFFT": 1.0 / n, "IRFFT": 2.0 / n}[kind]
    axes = tuple(range(np.ndim(x) - len(lengths), np.ndim(x)))
    terms = c * jnp.sum(jnp.abs(x).astype(_VDTYPE), axis=axes, keepdims=True)
    carried = c * c * jnp.sum(var.astype(_VDTYPE), axis=axes, keepdims=True)
    return jnp.broadcast_to(jnp.square(terms) * _weight(out) + carried, jnp.shape(out))


def _var_scan(eqn, vals, vs):
    body, nc, ncarry, length, reverse = _jax.scan_parts(eqn)

    def step(carry, x):
        outs, out_vs = _var_eval(body, [*vals[:nc], *carry[0], *x[0]], [*vs[:nc], *carry[1], *x[1]])
        out_vs = _filled(outs, out_vs)
        return (outs[:ncarry], out_vs[:ncarry]), (outs[ncarry:], out_vs[ncarry:])

    carry = vals[nc:nc + ncarry]
    (c, cv), (ys, yv) = jax.lax.scan(step, (carry, _filled(carry, vs[nc:nc + ncarry])),
                                     (vals[nc + ncarry:], vs[nc + ncarry:]),
                                     length=length, reverse=reverse)
    return [*c, *ys], [*cv, *yv]


def _var_cond(eqn, vals, vs):
    def branch(b):
        def f(ops, op_vs):
            outs, out_vs = _var_eval(b, ops, op_vs)
            return outs, _filled(outs, out_vs)
        return f
    return jax.lax.switch(vals[0], [branch(b) for b in _jax.cond_branches(eqn)], vals[1:], vs[1:])


def _var_while(eqn, vals, vs):
    cond, cn, body, bn = _jax.while_parts(eqn)

    def step(carry):
        outs, out_vs = _var_eval(body, [*vals[cn:cn + bn], *carry[0]], [*vs[cn:cn + bn], *carry[1]])
        return outs, _filled(outs, out_vs)

    carry = vals[cn + bn:]
    c, cv = jax.lax.while_loop(lambda c: _jax.eval_jaxpr(cond, *vals[:cn], *c[0])[0], step,
                               (carry, _filled(carry, vs[cn + bn:])))
    return list(c), list(cv)


def _compile_fast(lowered):
    """The variance program compiled for compile time, not run time: it runs
    once, on a test's small arrays, and its ops (several per op of the
    program, each variance kept finite) took XLA:CPU seconds to optimise
    (LLVM at its lowest level: 35% less for a scanned transformer's gradient).
    The scales it gives move by rounding only (1e-6 relative, measured: the
    program's own float32 values vectorised or not), far below what a scale
    is good for. A backend without the option compiles as usual."""
    try:
        return lowered.compile({"xla_backend_optimization_level": 0})
    except jax.errors.JaxRuntimeError:
        return lowered.compile()


def abs_scale(fn, *args):
    """The `scale` for comparing `fn(*args)` with another evaluation of it.

    For a sum or contraction it is the sum of |terms| of every output entry:

        abs_scale(jnp.matmul, a, b)              # sum_k |a_ik b_kj|
        abs_scale(lambda t: t.sum(0), terms)     # sum_i |t_ij|

    For any program it is the same quantity carried through: each operation
    contributes its own sum|terms| (|result| for an elementwise op), carried
    to the outputs by |derivative| and added in quadrature (independent
    zero-mean roundings; Higham and Mary, SIAM J. Sci. Comput. 41(5), 2019),
    so one sum gets exactly sum|terms| and `rtol` means the same for both.
    An op's rounding counts at its own dtype's size, in the output's units:
    a float32 loss computed through bfloat16 matmuls (mixed precision) gets
    their bfloat16 roundings, 2**16 float32 ones each; float32 work under a
    bfloat16 result counts at its own, finer size. Inputs are exact. Calls,
    custom_jvp/vjp (their primal), checkpoint, scan, cond and while are
    followed; data movement and max/min move the scale; operations it does
    not know (sort, callbacks, ...) add their own rounding to their
    operands' largest. Non-finite outputs get 0 (their
    pattern is compared exactly). A gradient that cancels (a bias whose
    gradient is zero by symmetry is rounding noise of size eps * sum|terms|)
    is compared at the scale of the program that computes it:

        abs_scale(jax.grad(loss), params, batch)

    Returns numpy float64 arrays in fn's output structure.
    """
    leaves, tree = jax.tree.flatten(args)
    closed, shape = jax.make_jaxpr(lambda *xs: fn(*jax.tree.unflatten(tree, xs)),
                                   return_shape=True)(*leaves)
    # the program's own values keep their dtypes (its jaxpr is traced above,
    # without x64); only the variances are float64
    with jax.enable_x64(True):
        lowered = jax.jit(lambda *xs: [None if v is None else jnp.sqrt(v) for v in
                                       _var_eval(closed, xs, [None] * len(xs))[1]]).lower(*leaves)
        scales = _compile_fast(lowered)(*leaves)
    # each output's scale in its own dtype's units (what its rtol multiplies)
    return jax.tree.unflatten(jax.tree.structure(shape),
                              [np.zeros(o.shape) if s is None
                               else np.asarray(s, np.float64) * (_REF_UNIT / _unit(o.dtype))
                               for o, s in zip(jax.tree.leaves(shape), scales)])


def lazy_scales(fn, *args):
    """scale_for(k): a lazy `scale` (see assert_close) for output leaf k of fn,
    abs_scale computed once, on first need (it costs a compile)."""
    scales = functools.cache(lambda: jax.tree.leaves(abs_scale(fn, *args)))
    return lambda k: lambda: scales()[k]

