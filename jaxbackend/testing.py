"""Equivalence helpers for users' own pytest suites, and the one numeric
comparison the project's own tests use.

* `assert_close(actual, expected, *, rtol, atol, scale, check_dtype, what)`:
  values (arrays or pytrees of them) agree within the error model below.
* `abs_scale(fn, *args)`: the `scale` of fn's outputs: the sum of |terms|
  of a sum or contraction, carried through any program.
* `assert_modules_match(named, reference, to_reference, inputs)`: a named
  module (NamedArrays in, NamedArray out) against a positional reference
  (say, written with `nnx.Linear`) on the SAME weights. `to_reference` maps
  the named module's parameters (a pure dict, as `nnx.to_pure_dict` gives)
  to the reference's; it must be differentiable (reshapes, transposes), so
  both modules become functions of the same parameters and their gradients
  are compared leaf by leaf, with the parameter path in any failure.
* `assert_pass_preserves(pass_fn, fn, *args)`: any `ClosedJaxpr ->
  ClosedJaxpr` callable (a `jaxbackend.passes` pass or pipeline, or your
  own) keeps fn's input/output types, still type-checks, computes the same
  values and the same gradients, and (optionally) is idempotent.

Failures raise `AssertionError` naming the leaf and the worst entry; success
returns the max abs error (or a small report dict).

Error model
-----------
The two compared values are one mathematical expression evaluated by two
float programs (`jb.jit` vs `jax.jit`, rolled vs unrolled layers, one CPU vs
another, sharded vs not). They may differ in association (a sum split over
vector lanes, scan steps or devices and added in another order), in fusion
(an FMA instead of a rounded multiply and add; an intermediate kept in
float32 instead of rounded to bfloat16) and in the code of transcendental
functions (vector and scalar paths of XLA's exp/tanh/log differ by an ulp or
two). Let eps be the dtype's machine epsilon (`EPS`: 2**-52 float64, 2**-23
float32, 2**-7 bfloat16, 2**-10 float16) and u = eps/2 the unit roundoff.

1. One op: a correctly rounded op is within u of its result, relative
   (XLA's exp/tanh/log: within a few ulps).
2. One sum: a sum of n terms t_i, in ANY order, is within (n-1) u sum|t_i|
   of the exact sum (Higham, "Accuracy and Stability of Numerical
   Algorithms", 2nd ed., eq. 4.4); a contraction sum_k a_k b_k likewise with
   sum_k |a_k b_k|. The bound is relative to sum|t_i|, NOT to |sum t_i|: a
   loss of 512 O(1) terms that comes to -0.47 differed by 7e-5 (1.6e-4 of
   itself) between two CPUs, which is 2 eps of sum|t_i|. So the comparison
   is `|actual - expected| <= atol + rtol * scale` entry by entry, with
   `scale` the sum of |terms| the entry came from.
3. The factor: the worst case (n-1) u is not the typical one. Round-to-
   nearest errors are zero-mean and nearly independent (Higham and Mary,
   SIAM J. Sci. Comput. 41(5), 2019), and XLA reduces with w >= 4 vector
   accumulators and then a tree, so one evaluation errs by about
   u sqrt(m/3) sum|t_i| (one standard deviation; m = n/w + log2 w additions
   per chain, partial sums at most sum|t_i|, their root mean square
   sum|t_i|/sqrt 3). For the sums tests do (n <= 4096: m <= 1026) that is
   <= 9.3 eps; two evaluations differ by <= 13 eps (sqrt 2 times), and by
   more than 4 standard deviations, 52 eps, essentially never. Hence
   `ROUNDINGS = 64` for float32 and float64 (float64 accumulates in float64:
   the same factor): rtol 7.6e-6 and 1.4e-14.
4. float16 and bfloat16 are not accumulated in their own precision: jnp's
   sums, means and dots upcast them to float32, and XLA CPU evaluates their
   elementwise ops in float32 and rounds each result. What differs between
   two programs is where results are rounded to the short mantissa (a fused
   chain may skip a rounding): at most one rounding per op. The factor is
   4 eps = 8 roundings of u, a chain of up to 8 ops (a layer norm or a
   softmax is about that): rtol 3.1e-2 (bfloat16), 3.9e-3 (float16); the
   float32 accumulation underneath is 2**16 (2**13) times finer.
5. Integers and bools are exact: compared with `==`. The non-finite pattern
   (positions of nan, +inf and -inf) is compared exactly too: a program that
   turns inf into nan, or a finite value into inf, is wrong, not inexact.
6. Programs: `abs_scale(fn, *args)` carries 2. through a whole program:
   each operation's own rounding (its sum|terms|, or |result| for an
   elementwise op) reaches the outputs times |derivative|, and the
   contributions add in quadrature as in 3. One sum gets exactly sum|terms|,
   so rtol means the same for a program as for one sum.

`TOLERANCES[dtype] = (ROUNDINGS[dtype] * EPS[dtype], 0)`; the loosest dtype
of the two compared arrays wins (a bfloat16 result against a float32
reference is compared at bfloat16's). `atol` is 0: an absolute floor would
hide errors in small tensors.

`scale` defaults to max|expected| over the tensor (its finite entries): the
right scale for entries made of terms no larger than the tensor's largest
entry (activations, logits, most weight gradients). It is the wrong one for
entries that cancel: a scalar loss summing signed terms, a gradient that is
~0 by symmetry, a matmul with tiny results from O(1) operands. Those pass
`scale=abs_scale(fn, *args)` (fn: the reference computation), or
`scale=lambda: abs_scale(fn, *args)`, which tries the default first and pays
for the scale's compile only where the default fails. A tolerance below this
model is a defect; one far above it hides bugs: tests pick a scale, not an
rtol.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from jaxbackend import _jax
from jaxbackend import named as nx

EPS = {"float64": 2.0 ** -52, "float32": 2.0 ** -23, "bfloat16": 2.0 ** -7, "float16": 2.0 ** -10}
# eps-multiples of its scale a float value may move between two evaluations
# (module docstring, 3. and 4.)
ROUNDINGS = {"float64": 64, "float32": 64, "bfloat16": 4, "float16": 4}
# (rtol, atol) per dtype; rtol multiplies `scale` (default max|expected|).
TOLERANCES = {name: (ROUNDINGS[name] * EPS[name], 0.0) for name in EPS}


def _dtype_name(d) -> str:
    return np.dtype(d).name


def tolerance(*dtypes) -> tuple:
    """(rtol, atol) for the loosest of `dtypes`: integers and bools (0, 0),
    other floats (float8s, ...) 4 eps of their own, unknown kinds float32's."""
    tols = []
    for d in dtypes:
        d = np.dtype(d)
        if d.name in TOLERANCES:
            tols.append(TOLERANCES[d.name])
        elif d.kind in "biu":
            tols.append((0.0, 0.0))
        elif d.kind == "f" or d.name.startswith("float"):
            tols.append((4 * float(ml_dtypes.finfo(d).eps), 0.0))
        else:
            tols.append(TOLERANCES["float32"])
    return max(t[0] for t in tols), max(t[1] for t in tols)


# -- scale: the rounding error a program's outputs carry -------------------------
# `abs_scale` evaluates a jaxpr and, next to every float value, the variance
# of its rounding error in units of u**2 (None: exact). Each operation adds
# its own rounding, (sum|terms|)**2 for a sum or contraction and result**2
# for an elementwise op, to the variances it inherits from its operands,
# weighted by the squared derivative (Higham and Mary's probabilistic
# rounding error analysis: independent zero-mean roundings add in quadrature).

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


def _vdtype(x):
    """Variances are float32 (float64 for float64 values): no float16 overflow."""
    return jnp.float64 if jnp.result_type(x) == jnp.float64 else jnp.float32


def _filled(vals, vs):
    """Variances with exact floats as zeros (scan/cond/while need one structure)."""
    return [(jnp.zeros(jnp.shape(x), _vdtype(x)) if v is None else v) if _is_float(x) else None
            for x, v in zip(vals, vs)]


def _clean(out, var):
    """0 on non-finite values (compared by pattern); an overflowed or undefined
    variance on a finite value becomes the largest float (no information)."""
    big = jnp.finfo(var.dtype).max
    return jnp.where(jnp.isfinite(out), jnp.where(jnp.isfinite(var), var, big), 0).astype(var.dtype)


def _var_eval(closed, args, vs) -> tuple:
    """(outputs, their variances) of `closed` on args with variances vs."""
    env, var = {}, {}

    def read(v):
        return (v.val, None) if isinstance(v, _jax.Literal) else (env[v], var.get(v))

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
        return outs, [_clean(o, w) for o, w in zip(outs, moved)]
    dt = _vdtype(outs[0])
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
            return _jax.bind_eqn_as(eqn, ops, dt)[0].astype(dt)
        absv = [jnp.abs(x).astype(dt) if _is_float(x) else x for x in vals]
        var = 0 if name == "neg" else jnp.square(op(absv))      # this op's own rounding
        if name in _SUM:
            var = var + op([w.astype(dt) if _is_float(x) else x for x, w in zip(vals, zero)])
        else:
            sq = [jnp.square(a) if _is_float(x) else a for a, x in zip(absv, vals)]
            for i, w in enumerate(vs):
                if w is not None:
                    var = var + op(sq[:i] + [w.astype(dt)] + sq[i + 1:])
        return outs, [_clean(outs[0], var)]
    if name in _ELEMENTWISE:
        var = jnp.square(outs[0].astype(dt))
        for i, w in enumerate(vs):
            if w is not None:
                def f(xi, i=i):
                    return _jax.bind_eqn(eqn, vals[:i] + [xi] + vals[i + 1:])[0]
                _, d = jax.jvp(f, (vals[i],), (jnp.ones_like(vals[i]),))
                var = var + jnp.where(w > 0, jnp.square(d.astype(dt)) * w.astype(dt), 0)
        return outs, [_clean(outs[0], var)]
    # Anything else (sort, cumprod, callbacks, ...): its own rounding plus the
    # largest variance of an operand (assumes it does not amplify errors).
    carried = sum((jnp.max(w) for w in vs if w is not None), jnp.float32(0))
    return outs, [_clean(o, jnp.square(o.astype(_vdtype(o))) + carried.astype(_vdtype(o)))
                  if f else None for o, f in zip(outs, floats)]


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
    Inputs are exact. Calls, custom_jvp/vjp (their primal), checkpoint,
    scan, cond and while are followed; data movement and max/min move the
    scale; operations it does not know (sort, callbacks, ...) add their own
    rounding to their operands' largest. Non-finite outputs get 0 (their
    pattern is compared exactly). A gradient that cancels (a bias whose
    gradient is zero by symmetry is rounding noise of size eps * sum|terms|)
    is compared at the scale of the program that computes it:

        abs_scale(jax.grad(loss), params, batch)

    Returns numpy float64 arrays in fn's output structure.
    """
    leaves, tree = jax.tree.flatten(args)
    closed, shape = jax.make_jaxpr(lambda *xs: fn(*jax.tree.unflatten(tree, xs)),
                                   return_shape=True)(*leaves)
    scales = jax.jit(lambda *xs: [None if v is None else jnp.sqrt(v) for v in
                                  _var_eval(closed, xs, [None] * len(xs))[1]])(*leaves)
    return jax.tree.unflatten(jax.tree.structure(shape),
                              [np.zeros(o.shape) if s is None else np.asarray(s, np.float64)
                               for o, s in zip(jax.tree.leaves(shape), scales)])


def _array(x):
    if isinstance(x, nx.NamedArray):
        x = x.values
    return x if isinstance(x, (np.ndarray, jax.Array)) else np.asarray(x)


def _where(mask) -> str:
    idx = np.argwhere(np.asarray(mask))
    return f"{len(idx)} entries, first at {tuple(int(i) for i in idx[0])}" if len(idx) else "none"


def _pattern(x):
    """0 where finite, 1 / -1 / 2 where +inf / -inf / nan."""
    return np.where(np.isfinite(x), 0.0, np.nan_to_num(x, nan=2.0, posinf=1.0, neginf=-1.0))


def _compare(actual, expected, rtol, atol, scale, check_dtype, what) -> float:
    a_raw, e_raw = _array(actual), _array(expected)
    a, e = np.asarray(a_raw), np.asarray(e_raw)
    if a.shape != e.shape:
        raise AssertionError(f"{what}: shape {a.shape} != reference shape {e.shape}")
    if check_dtype:
        if a.dtype != e.dtype:
            raise AssertionError(f"{what}: dtype {a.dtype} != reference dtype {e.dtype}")
        wa, we = getattr(a_raw, "weak_type", None), getattr(e_raw, "weak_type", None)
        if wa is not None and we is not None and wa != we:
            raise AssertionError(f"{what}: weak_type {wa} != reference weak_type {we}")
    if a.dtype.kind in "biu" and e.dtype.kind in "biu":
        if not np.array_equal(a, e):
            bad = a != e
            i = tuple(np.argwhere(bad)[0])
            raise AssertionError(f"{what}: integer/bool values differ at {_where(bad)}: "
                                 f"{a[i]!r} != reference {e[i]!r}")
        return 0.0
    r0, a0 = tolerance(a.dtype, e.dtype)
    rtol, atol = (r0 if rtol is None else rtol), (a0 if atol is None else atol)
    a, e = a.astype(np.float64), e.astype(np.float64)
    if not a.size:
        return 0.0
    fin_a, fin_e = np.isfinite(a), np.isfinite(e)
    if not (fin_a.all() and fin_e.all()):
        bad = _pattern(a) != _pattern(e)
        if bad.any():
            i = tuple(np.argwhere(bad)[0])
            raise AssertionError(f"{what}: non-finite pattern (nan/+inf/-inf positions) differs "
                                 f"from the reference at {_where(bad)}: {a[i]!r} vs {e[i]!r}")
    fin = fin_a & fin_e
    if scale is None:
        s = np.float64(np.max(np.abs(e[fin]), initial=0.0))
    else:
        s = np.abs(np.asarray(scale, np.float64))
        try:
            s = np.broadcast_to(s, e.shape)
        except ValueError:
            raise ValueError(f"assert_close({what}): scale of shape {s.shape} does not broadcast "
                             f"to the result's shape {e.shape}; give one sum|terms| per entry "
                             f"or a scalar.") from None
        if not np.isfinite(s[fin]).all():
            raise ValueError(f"assert_close({what}): scale has non-finite entries where the "
                             f"values are finite; compute it in a wider dtype (abs_scale "
                             f"works in float32 or float64).")
    err = np.zeros(e.shape)
    err[fin] = np.abs(a[fin] - e[fin])
    bound = atol + rtol * s
    bad = err > bound
    if bad.any():
        ratio = np.where(bad, err / np.maximum(bound, np.finfo(np.float64).tiny), 0.0)
        i = np.unravel_index(np.argmax(ratio), e.shape)
        si = float(np.broadcast_to(s, e.shape)[i])
        name = max((a_raw.dtype, e_raw.dtype), key=lambda d: tolerance(d)[0])
        eps = EPS.get(_dtype_name(name))
        units = f" = {err[i] / (eps * si):.3g} eps of scale" if eps and si else ""
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {e.size} entries differ by more than atol={atol:.3g} + "
            f"rtol={rtol:.3g} * scale; worst at {tuple(int(j) for j in i)}: {a[i]!r} vs reference "
            f"{e[i]!r}, abs error {err[i]:.3g}{units} (scale {si:.3g}, "
            f"{'max|reference|' if scale is None else 'given'}); max abs error {err.max():.3g}")
    return float(err.max())


def _at_least_max_abs(scale, expected):
    e = np.abs(np.asarray(_array(expected), np.float64))
    return np.maximum(np.abs(np.asarray(scale, np.float64)),
                      np.max(e, where=np.isfinite(e), initial=0.0))


def assert_close(actual, expected, *, rtol=None, atol=None, scale=None, check_dtype=False,
                 what="value") -> float:
    """|actual - expected| <= atol + rtol * scale entry by entry, by the error
    model of this module's docstring; returns the max abs error.

    actual, expected: arrays (NamedArrays: their values) or pytrees of them
    with the same number of leaves, compared leaf by leaf.
    rtol, atol: default per dtype (`tolerance`: the loosest of the two).
    scale: the sum of |terms| each compared entry came from: an array that
    broadcasts to the result, a scalar, or (for pytrees) a pytree of those;
    default max|expected| over each tensor. `abs_scale` computes it. A
    callable returning one is lazy: called only if the comparison at the
    default fails, and then each entry is compared at the larger of the two
    (`scale=lambda: abs_scale(f, x)` skips that compile when all is well).
    check_dtype: also require equal dtypes (and weak types, where both are
    jax arrays). Shapes must always be equal. Integer and bool values are
    compared exactly; nan/+inf/-inf positions exactly.
    """
    a_leaves, e_leaves = jax.tree.leaves(actual), jax.tree.leaves(expected)
    if len(a_leaves) != len(e_leaves):
        raise AssertionError(f"{what}: {len(a_leaves)} arrays != reference's {len(e_leaves)}")
    lazy = scale if callable(scale) else None
    if lazy is not None:
        try:
            return assert_close(actual, expected, rtol=rtol, atol=atol, check_dtype=check_dtype,
                                what=what)
        except AssertionError:
            scale = lazy()
    scales = jax.tree.leaves(scale) if scale is not None else [None] * len(a_leaves)
    if len(scales) == 1:
        scales = scales * len(a_leaves)
    if len(scales) != len(a_leaves):
        raise ValueError(f"assert_close({what}): scale has {len(scales)} leaves for "
                         f"{len(a_leaves)} compared arrays; give one per array or one scalar.")
    if lazy is not None:
        scales = [_at_least_max_abs(s, e) for s, e in zip(scales, e_leaves)]
    if len(a_leaves) == 1:
        return _compare(a_leaves[0], e_leaves[0], rtol, atol, scales[0], check_dtype, what)
    return max((_compare(a, e, rtol, atol, s, check_dtype, f"{what}[{k}]")
                for k, (a, e, s) in enumerate(zip(a_leaves, e_leaves, scales))), default=0.0)


def _values(x, out_dims=None):
    if isinstance(x, nx.NamedArray):
        return (x.transpose(*out_dims) if out_dims else x).values
    return x


def assert_modules_match(named: nnx.Module, reference: nnx.Module, to_reference, inputs, *,
                         reference_inputs=None, out_dims=None, grads: bool = True, seed: int = 0,
                         rtol=None, atol=None) -> dict:
    """Outputs (and parameter gradients) of `named(*inputs)` and
    `reference(*reference_inputs)` agree when the reference's weights are
    `to_reference(named params)`.

    `out_dims`: the dim order the named output is brought to before comparing
    with the positional output (default: its own order). Gradients are those
    of sum(output * fixed random cotangent), so every output entry matters.
    Returns {"out_err": ..., "grad_err": {path: err}}.
    """
    reference_inputs = inputs if reference_inputs is None else reference_inputs
    gd_n, p_n, rest_n = nnx.split(named, nnx.Param, ...)
    gd_r, p_r, rest_r = nnx.split(reference, nnx.Param, ...)
    pure = nnx.to_pure_dict(p_n)

    def run_named(params):
        st = jax.tree.map(lambda x: x, p_n)
        nnx.replace_by_pure_dict(st, params)
        return _values(nnx.merge(gd_n, st, rest_n)(*inputs), out_dims)

    def run_reference(params):
        st = jax.tree.map(lambda x: x, p_r)
        nnx.replace_by_pure_dict(st, to_reference(params))
        return _values(nnx.merge(gd_r, st, rest_r)(*reference_inputs))

    # One compiled program per module (outputs and their VJP together): a
    # compile per program, not one per eager op, and half the compiles.
    out_shape = jax.eval_shape(run_reference, pure)
    ct = jax.random.normal(jax.random.key(seed), out_shape.shape, jnp.float32)

    def value_and_grads(run):
        def f(p):
            out, vjp = jax.vjp(lambda q: run(q).astype(jnp.float32), p)
            return out, vjp(ct)[0]
        return f

    out_n, g_n = jax.jit(value_and_grads(run_named))(pure)
    out_r, g_r = jax.jit(value_and_grads(run_reference))(pure)
    # entries that cancel (a gradient zero by symmetry) are judged by the
    # rounding of their terms: the reference program's own abs_scale
    scale_for = _lazy_scales(value_and_grads(run_reference), pure)
    r0, a0 = tolerance(jax.eval_shape(run_named, pure).dtype, out_shape.dtype)
    report = {"out_err": assert_close(out_n, out_r, rtol=r0 if rtol is None else rtol,
                                      atol=a0 if atol is None else atol, scale=scale_for(0),
                                      what="module output")}
    if not grads:
        return report
    report["grad_err"] = {}
    for k, ((path, a), (_, b)) in enumerate(zip(jax.tree_util.tree_leaves_with_path(g_n),
                                                jax.tree_util.tree_leaves_with_path(g_r))):
        name = jax.tree_util.keystr(path)
        report["grad_err"][name] = assert_close(a, b, rtol=rtol, atol=atol, scale=scale_for(1 + k),
                                                what=f"gradient of parameter {name}")
    return report


def _lazy_scales(fn, *args):
    """scale_for(k): a lazy `scale` (see assert_close) for output leaf k of fn,
    abs_scale computed once, on first need (it costs a compile)."""
    scales = functools.cache(lambda: jax.tree.leaves(abs_scale(fn, *args)))
    return lambda k: lambda: scales()[k]


# -- passes -----------------------------------------------------------------------

def _flat(fn, args):
    leaves, tree = jax.tree.flatten(args)

    def flat_fn(*xs):
        return jax.tree.leaves(fn(*jax.tree.unflatten(tree, xs)))
    return flat_fn, leaves


def _types(closed) -> tuple:
    return (tuple((tuple(a.shape), a.dtype) for a in closed.in_avals),
            tuple((tuple(a.shape), a.dtype) for a in closed.out_avals))


def default_pipeline():
    """jaxbackend's default pass pipeline (`jaxbackend.passes.run_pipeline`)
    as a plain ClosedJaxpr -> ClosedJaxpr callable."""
    try:
        from jaxbackend.passes import run_pipeline
    except ImportError as e:
        raise ValueError("assert_pass_preserves: no pass given and jaxbackend.passes has no "
                         "run_pipeline; pass pass_fn=your ClosedJaxpr -> ClosedJaxpr callable.") from e
    return run_pipeline


def _apply(pass_fn, closed):
    # Pipelines may return (closed_jaxpr, report); plain passes the jaxpr.
    out = pass_fn(closed)
    return out[0] if isinstance(out, tuple) else out


def assert_pass_preserves(pass_fn, fn, *args, grads: bool = True, idempotent: bool = True,
                          seed: int = 0, rtol=None, atol=None) -> dict:
    """`pass_fn` (ClosedJaxpr -> ClosedJaxpr, or -> (ClosedJaxpr, report);
    None = jaxbackend's default pipeline)
    preserves `fn`'s types and numerics, forward and gradient, on `args`
    (pytrees, NamedArrays included). Returns equation counts and errors."""
    pass_fn = default_pipeline() if pass_fn is None else pass_fn
    flat_fn, leaves = _flat(fn, args)
    report = {}
    programs = [("forward", flat_fn)]
    if grads:
        outs = jax.eval_shape(flat_fn, *leaves)
        key = jax.random.key(seed)
        cts = [jax.random.normal(jax.random.fold_in(key, i), o.shape, jnp.float32)
               for i, o in enumerate(outs)]
        diff = [i for i, x in enumerate(leaves) if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)]

        def scalar(*xs):
            return sum(jnp.sum(o.astype(jnp.float32) * c) for o, c in zip(flat_fn(*xs), cts)
                       if jnp.issubdtype(o.dtype, jnp.floating))
        programs.append(("gradient", jax.grad(scalar, argnums=tuple(diff))))
    for label, f in programs:
        before = jax.make_jaxpr(f)(*leaves)
        after = _apply(pass_fn, before)
        _jax.check_jaxpr(after.jaxpr)
        if _types(after) != _types(before):
            raise AssertionError(f"{label}: the pass changed the program's types from "
                                 f"{_types(before)} to {_types(after)}")
        expect = jax.jit(_jax.jaxpr_as_fun(before))(*leaves)
        got = jax.jit(_jax.jaxpr_as_fun(after))(*leaves)
        scale_for = _lazy_scales(_jax.jaxpr_as_fun(before), *leaves)
        errs = [assert_close(g, e, rtol=rtol, atol=atol, scale=scale_for(i),
                             what=f"{label} output {i}")
                for i, (g, e) in enumerate(zip(got, expect))]
        if idempotent:
            again = _apply(pass_fn, after)
            if str(again.jaxpr) != str(after.jaxpr):
                raise AssertionError(f"{label}: running the pass twice differs from running it once")
        report[label] = {"eqns_before": len(before.jaxpr.eqns), "eqns_after": len(after.jaxpr.eqns),
                         "max_abs_err": max(errs, default=0.0)}
    return report
