"""`assert_close` and the tolerances of the error model (the package
docstring): per-dtype rtol, comparison at a given or default `scale`, exact
integers and non-finite patterns."""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np

from jaxbackend import named as nx

EPS = {"float64": 2.0 ** -52, "float32": 2.0 ** -23, "bfloat16": 2.0 ** -7, "float16": 2.0 ** -10}
# eps-multiples of its scale a float value may move between two evaluations
# (package docstring, 3. and 4.)
ROUNDINGS = {"float64": 64, "float32": 64, "bfloat16": 4, "float16": 4}
# (rtol, atol) per dtype; rtol multiplies `scale` (default max|expected|).
TOLERANCES = {name: (ROUNDINGS[name] * EPS[name], 0.0) for name in EPS}


def _dtype_name(d) -> str:
    return _real(d).name


def _real(d) -> np.dtype:
    """d, or for a complex dtype the float dtype of its parts: a complex
    value rounds part by part, at that dtype's eps."""
    d = np.dtype(d)
    return np.dtype(f"float{d.itemsize * 4}") if d.kind == "c" else d


def tolerance(*dtypes) -> tuple:
    """(rtol, atol) for the loosest of `dtypes`: integers and bools (0, 0),
    complex ones their parts' float dtype's, other floats (float8s, ...) 4
    eps of their own, unknown kinds float32's."""
    tols = []
    for d in dtypes:
        d = _real(d)
        if d.name in TOLERANCES:
            tols.append(TOLERANCES[d.name])
        elif d.kind in "biu":
            tols.append((0.0, 0.0))
        elif d.kind == "f" or d.name.startswith("float"):
            tols.append((4 * float(ml_dtypes.finfo(d).eps), 0.0))
        else:
            tols.append(TOLERANCES["float32"])
    return max(t[0] for t in tols), max(t[1] for t in tols)


def _values(x):
    return x.values if isinstance(x, nx.NamedArray) else x


def _array(x):
    x = _values(x)
    if _is_key(x):
        # a typed PRNG key (an NNX step's RngState): its bits, compared exactly
        # (`_compare` first requires both sides to be keys of one implementation)
        return jax.random.key_data(x)
    return x if isinstance(x, (np.ndarray, jax.Array)) else np.asarray(x)


def _where(mask) -> str:
    idx = np.argwhere(np.asarray(mask))
    return f"{len(idx)} entries, first at {tuple(int(i) for i in idx[0])}" if len(idx) else "none"


def _pattern(x):
    """0 where finite, 1 / -1 / 2 where +inf / -inf / nan."""
    return np.where(np.isfinite(x), 0.0, np.nan_to_num(x, nan=2.0, posinf=1.0, neginf=-1.0))


def _is_key(x) -> bool:
    return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)


def _compare(actual, expected, rtol, atol, scale, check_dtype, what) -> float:
    pair = [_values(x) for x in (actual, expected)]
    keys = [_is_key(x) for x in pair]
    if any(keys) and (not all(keys)
                      or jax.random.key_impl(pair[0]) != jax.random.key_impl(pair[1])):
        kinds = [str(jax.random.key_impl(x)) if k else f"{getattr(x, 'dtype', type(x))} data"
                 for x, k in zip(pair, keys)]
        raise AssertionError(f"{what}: a PRNG key compared with another kind ({kinds[0]} vs "
                             f"reference {kinds[1]}); compare keys of one implementation, or "
                             f"jax.random.key_data of both.")
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
    # complex values are compared as points of the plane: |actual - expected|
    # against the scale (the error model holds for each part)
    wide = np.complex128 if "c" in (a.dtype.kind, e.dtype.kind) else np.float64
    a, e = a.astype(wide), e.astype(wide)
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
    s: np.ndarray | np.float64
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

