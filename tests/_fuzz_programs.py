"""Seeded random programs for the differential fuzzer (`tests/test_fuzz.py`).

`make(seed)` draws one small program from a grammar and returns a `Program`:
its Python source (the readable description a failure prints, `exec`'d to
get the function, so what is printed is exactly what ran), its inputs (drawn
from the same seed) and the transforms that apply to it. The family is
`CYCLE[seed % len(CYCLE)]`, so any six consecutive seeds cover every family
(`broadcast`, the cheapest to compile, three times); everything else (sizes,
dtypes, variants, literals) comes from `np.random.default_rng(seed)`.

Families and what they aim at:

* `layers`: a Python loop of 5-7 layers (>= `REROLL_MIN_REPEATS`, so
  `reroll` fires) with a per-layer variant: identical layers; the same code
  with a different literal in one layer; code that branches on the layer
  index; a different custom_vjp / custom_jvp rule per layer; a pure_callback
  per layer; jax.checkpoint on some layers; lax.cond / while_loop / scan /
  fori_loop inside each layer. Widths may be 0 (zero-size arrays) or the
  state a 0-d scalar; dtypes float32/float16/bfloat16/int32, float64 under x64.
* `broadcast`: broadcasts (broadcast_to, expand + reshape, jnp.repeat,
  jnp.tile) followed by elementwise chains and sums over created or real
  axes (`hoist_broadcast` and its sum sinking): multiplication/division by
  literals including 0, inf and values that overflow float16, integer floor
  division and remainder; int32/uint32/float16/bfloat16/float32 (+ 64-bit
  under x64); inputs with inf/nan entries.
* `projection`: reshape -> matmul -> reshape chains (`fuse_projections`),
  possibly with a zero-size batch.
* `named`: `jaxbackend.named` programs (as_named, dot, softmax, sums), also
  as a layer loop, so the named einsum meets reroll, vmap and jacfwd.
"""

from __future__ import annotations

import contextlib
import dataclasses
import textwrap

import jax
import ml_dtypes
import numpy as np

FAMILIES = ("layers", "broadcast", "projection", "named")
CYCLE = ("layers", "broadcast", "named", "broadcast", "projection", "broadcast")

# Every program's source runs after this prelude (the failure message names
# it rather than printing it).
PRELUDE = '''
import functools
import math
import jax
import jax.numpy as jnp
import numpy as np
from jaxbackend import named as nx

def make_custom_vjp(c):
    """sin whose backward rule is scaled by c (a per-layer rule)."""
    @jax.custom_vjp
    def g(a):
        return jnp.sin(a)
    g.defvjp(lambda a: (jnp.sin(a), a), lambda r, ct: (ct * jnp.cos(r) * c,))
    return g

def make_custom_jvp(c):
    """tanh whose forward rule is scaled by c (a per-layer rule)."""
    @jax.custom_jvp
    def g(a):
        return jnp.tanh(a)
    g.defjvp(lambda p, t: (jnp.tanh(p[0]), t[0] * c * (1 - jnp.tanh(p[0]) ** 2)))
    return g

@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def clip_gradient(c, a):
    """identity whose gradient is clipped to [-c, c] (c: a per-layer static)."""
    return a
clip_gradient.defvjp(lambda c, a: (a, None), lambda c, _, g: (jnp.clip(g, -c, c),))

def apply_static(f, a):
    return f(a)
apply_static = jax.jit(apply_static, static_argnums=0)

def np_scaled_tanh(c, a):
    return (np.tanh(np.asarray(a, np.float32)) * c).astype(np.asarray(a).dtype)
'''


@dataclasses.dataclass
class Program:
    seed: int
    family: str
    source: str            # the function `f`, after PRELUDE
    args: tuple            # numpy inputs
    transforms: tuple      # names from test_fuzz.TRANSFORMS that apply
    x64: bool = False

    @property
    def fn(self):
        env: dict = {}
        exec(compile(PRELUDE + self.source, f"<fuzz program {self.seed}>", "exec"), env)
        return env["f"]

    def describe(self) -> str:
        inputs = "\n".join(f"  arg {i}: {_spec(a)}" for i, a in enumerate(self.args))
        return (f"seed {self.seed}, family {self.family}, x64={self.x64}, transforms "
                f"{', '.join(self.transforms)}\n{self.source.strip()}\ninputs (numpy, "
                f"from the seed):\n{inputs}\nreproduce: from tests._fuzz_programs import make; "
                f"p = make({self.seed}); f, args = p.fn, p.args  (prelude: "
                f"tests._fuzz_programs.PRELUDE)")


def _spec(a) -> str:
    if isinstance(a, (list, tuple)):
        return f"{len(a)} x {_spec(a[0])}" if a else "[]"
    a = np.asarray(a)
    special = ""
    if a.dtype.kind == "f" and a.size and not np.isfinite(a.astype(np.float64)).all():
        f = a.astype(np.float64)
        special = (f" with {int(np.isnan(f).sum())} nan, {int(np.isposinf(f).sum())} +inf, "
                   f"{int(np.isneginf(f).sum())} -inf")
    return f"{a.dtype.name}{list(a.shape)}{special}"


@contextlib.contextmanager
def x64_enabled(on: bool):
    """jax_enable_x64 set for the block, restored after."""
    before = jax.config.read("jax_enable_x64")
    jax.config.update("jax_enable_x64", on)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", before)


def make(seed: int) -> Program:
    rng = np.random.default_rng(seed)
    family = CYCLE[seed % len(CYCLE)]
    x64 = bool(rng.random() < 0.2) and family != "named"
    prog = {"layers": _layers, "broadcast": _broadcast, "projection": _projection,
            "named": _named}[family](rng, x64)
    return Program(seed, family, textwrap.dedent(prog[0]), prog[1], prog[2], x64)


# -- values ------------------------------------------------------------------------

def _values(rng, shape, dtype, scale=1.0, nonfinite=False, positive=False):
    """Random values; floats get exact zeros now and then (x * inf is nan only
    there), and inf/nan entries when `nonfinite`."""
    dtype = np.dtype(dtype)
    if dtype.kind in "iu":
        lo = 0 if dtype.kind == "u" or positive else -7
        return rng.integers(lo, 8, size=shape).astype(dtype)
    v = rng.standard_normal(shape) * scale
    if positive:
        v = np.abs(v) + 0.5
    elif v.size and rng.random() < 0.4:
        v.reshape(-1)[rng.integers(v.size, size=max(1, v.size // 5))] = 0.0
    if dtype.kind == "f" or dtype.name == "bfloat16":   # large scales: stay finite (0.9 max)
        big = 0.9 * float(ml_dtypes.finfo(dtype).max)
        v = np.clip(v, -big, big)
    if nonfinite and v.size:
        flat = v.reshape(-1)
        for special in (np.inf, -np.inf, np.nan):
            if rng.random() < 0.6:
                flat[rng.integers(flat.size)] = special
    return v.astype(dtype)


def _float_dtype(rng, x64, low_precision=0.3):
    if x64 and rng.random() < 0.7:
        return "float64"
    if rng.random() < low_precision:
        return str(rng.choice(["float16", "bfloat16"]))
    return "float32"


def _dtype(name):
    return ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)


def _lit(v) -> str:
    return {np.inf: "math.inf", -np.inf: "-math.inf"}.get(v, repr(float(v)))


# -- layers ------------------------------------------------------------------------

LAYER_VARIANTS = ("same", "literal", "branch", "custom_vjp", "custom_jvp", "clip_gradient",
                  "callback", "checkpoint", "cond", "while", "scan", "fori")


def _layers(rng, x64):
    n = int(rng.integers(5, 8))
    variant = str(rng.choice(LAYER_VARIANTS))
    integer = variant in ("same", "literal", "branch") and rng.random() < 0.15
    dname = ("int64" if x64 else "int32") if integer else _float_dtype(rng, x64, 0.2)
    scalar = rng.random() < 0.15                    # 0-d state and weights
    width = 0 if rng.random() < 0.12 else int(rng.integers(1, 5))
    batch = 0 if (not scalar and rng.random() < 0.12) else int(rng.integers(1, 3))
    odd = int(rng.integers(n))                      # the layer that differs, where one does
    c = [0.5] * n
    if variant == "literal":
        c[odd] = 0.75
    mix = "h * w" if scalar else "h @ w"
    if integer:
        act = f"a = ({mix} + b) % 7 - 3"
    else:
        act = f"a = jnp.tanh({mix} + b)"
    body, pre = [act], []
    if variant == "branch":
        body.append(f"if i == {odd}:\n    a = jnp.sin(a)" if not integer
                    else f"if i == {odd}:\n    a = a * 2")
    elif variant in ("custom_vjp", "custom_jvp", "clip_gradient", "callback"):
        scales = [1.0] * n
        scales[odd] = 2.0 if rng.random() < 0.7 else 1.0   # else: distinct objects, same rule
        if variant == "callback":
            pre.append(f"RULE = [functools.partial(jax.pure_callback, functools.partial("
                       f"np_scaled_tanh, c), vmap_method='sequential') for c in {scales}]")
            call = "RULE[i](jax.ShapeDtypeStruct(a.shape, a.dtype), {q})"
        elif variant == "clip_gradient":
            pre.append(f"CLIP = {[0.1 * s for s in scales]}")
            call = "clip_gradient(CLIP[i], {q})"
        else:
            pre.append(f"RULE = [make_{variant}(c) for c in {scales}]")
            call = "RULE[i]({q})"
        # inside a sub-jaxpr the rule's function prints as a bare name
        wrap = str(rng.choice(["plain", "checkpoint", "cond", "static_jit"]))
        body.append({"plain": "a = " + call.format(q="a"),
                     "checkpoint": "a = jax.checkpoint(lambda q: " + call.format(q="q") + ")(a)",
                     "cond": "a = jax.lax.cond(jnp.sum(a) > -1e9, lambda q: " + call.format(q="q")
                             + ", lambda q: q, a)",
                     "static_jit": "a = apply_static(functools.partial(lambda i, q: "
                                   + call.format(q="q") + ", i), a)"}[wrap])
    elif variant == "checkpoint":
        which = sorted(set(rng.integers(n, size=int(rng.integers(1, n + 1))).tolist()))
        body.append(f"if i in {which}:\n    a = jax.checkpoint(lambda q: jnp.sin(q) * q)(a)\n"
                    f"else:\n    a = jnp.sin(a) * a")
    elif variant == "cond":
        hi = [0.9] * n
        hi[odd] = float(rng.choice([0.9, 0.8]))
        body.append(f"a = jax.lax.cond(jnp.sum(a) > 0, lambda q: q * {hi}[i], "
                    f"lambda q: q * 1.1, a)")
    elif variant == "while":
        trips = [2] * n
        trips[odd] = int(rng.choice([2, 3]))
        body.append(f"a = jax.lax.while_loop(lambda s: s[0] < {trips}[i], "
                    f"lambda s: (s[0] + 1, s[1] * 0.9), (0, a))[1]")
    elif variant == "scan":
        steps = [[0.5, 1.5]] * n
        steps[odd] = [0.5, float(rng.choice([1.5, 2.5]))]
        body.append(f"a = jax.lax.scan(lambda s, k: (jnp.tanh(s * k), None), a, "
                    f"jnp.asarray({steps}[i], a.dtype))[0]")
    elif variant == "fori":
        trips = [2] * n
        trips[odd] = int(rng.choice([2, 3]))
        body.append(f"a = jax.lax.fori_loop(0, {trips}[i], lambda j, q: q * 0.9 + 0.1, a)")
    body.append(f"h = h + a * {c}[i]" if not integer
                else f"h = (h + a * {[int(v * 2) for v in c]}[i]) % 11")
    src = "\n".join(pre) + "\n\ndef f(x, ws, bs):\n    h = x\n"
    src += "    for i, (w, b) in enumerate(zip(ws, bs)):\n"
    src += textwrap.indent("\n".join(body), " " * 8)
    src += ("\n    return jnp.sum(h * h), h\n" if not integer else "\n    return jnp.sum(h), h\n")
    dt = _dtype(dname)
    xs = () if scalar else (batch, width)
    wshape, bshape = ((), ()) if scalar else ((width, width), (width,))
    wscale = 1.0 if scalar else 1.0 / max(width, 1) ** 0.5
    args = (_values(rng, xs, dt), [_values(rng, wshape, dt, wscale) for _ in range(n)],
            [_values(rng, bshape, dt, 0.1) for _ in range(n)])
    transforms = ["forward", "vmap", "vmap_of_jb"]
    if not integer and variant != "callback":
        if variant not in ("while",):               # no reverse mode through while_loop
            transforms += ["vjp", "vjp_of_jb"]
        if variant not in ("custom_vjp", "clip_gradient"):   # no forward mode through custom_vjp
            transforms += ["jvp", "jvp_of_jb"]
    return src, args, tuple(transforms)


# -- broadcast ---------------------------------------------------------------------

_BCAST = {
    "broadcast_to": "jnp.broadcast_to(x[:, None, :], (A, G, D))",
    "expand+reshape": "jnp.broadcast_to(x.reshape(A, 1, D), (A, G, D))",
    "repeat": "jnp.repeat(x[:, None, :], G, axis=1)",
    "tile": "jnp.tile(x[:, None, :], (1, G, 1))",
    "expand+flatten": "jnp.broadcast_to(x[:, None, :], (A, G, D)).reshape(A * G, D)"
                      ".reshape(A, G, D)",
}
_FLOAT_LITS = (2.0, 0.5, 0.25, -3.0, 0.0, np.inf, -np.inf, 7e4, 1e5, 1e-3)


def _broadcast(rng, x64):
    kind = rng.choice(["float", "float", "float", "int", "uint", "uint"])
    if kind == "float":
        dname = _float_dtype(rng, x64, 0.45)
    else:
        dname = ({"int": "int64", "uint": "uint64"} if x64 and rng.random() < 0.5
                 else {"int": "int32", "uint": "uint32"})[kind]
    is_float = kind == "float"
    # low precision near its overflow now and then (same sign: the sum of
    # finite terms overflows, a scaled sum of them need not)
    big = {"float16": 3e4, "bfloat16": 1e37}.get(dname, 1.0) if rng.random() < 0.3 else 1.0
    a_, g_, d_ = (int(rng.integers(0 if rng.random() < 0.1 else 1, 4)), int(rng.integers(2, 4)),
                  int(rng.integers(1, 4)))
    lines = [f"A, G, D = {a_}, {g_}, {d_}", f"bc = {_BCAST[str(rng.choice(list(_BCAST)))]}",
             "z = bc"]
    for _ in range(int(rng.integers(1, 4))):
        if is_float:
            lit = _lit(rng.choice(_FLOAT_LITS))
            op = rng.choice(["z * {l}", "z / {l}", "z + {l}", "jnp.exp(z)", "jnp.tanh(z)", "z * z",
                             "jnp.sqrt(jnp.abs(z))", "jnp.maximum(z, {l})", "z * y", "y * z * {l}",
                             "z + y"])
        else:
            lit = str(int(rng.choice([2, 3, 5, 7] if kind == "uint" else [2, 3, -3, 5, 7])))
            op = rng.choice(["z * {l}", "z + {l}", "z // {l}", "z % {l}", "jnp.maximum(z, {l})",
                             "z * y", "z // (y % 3 + 1)" if kind == "uint" else "z // (y * y + 1)",
                             "z + y"])
        lines.append(f"z = {str(op).format(l=lit)}")
    # Sums over the created axis 1 (or all axes) of data times something
    # constant along it: what hoist_broadcast's sum sinking rewrites; drawn
    # first, more often than the rest, with special literals half the time.
    sink = (["jnp.sum(y * bc, axis=1)", "jnp.sum(y / bc, axis=1)", "jnp.sum(y * bc * {l}, axis=1)",
             "jnp.sum(y * {l}, axis=1)", "jnp.sum(y / {l})", "jax.lax.reduce_sum(y * {l}, (1,))",
             "jnp.sum(z * y, axis=1)"] if is_float else
            ["jnp.sum(y // (bc % 5 + 1), axis=1)", "jnp.sum(y // {l}, axis=1)",
             "jnp.sum(y * (bc // 2), axis=1)", "jnp.sum(y * {l})"])
    other = ["jnp.sum(z, axis=1)", "jnp.sum(z, axis=(0, 2))", "jnp.sum(z)", "jnp.max(z, axis=1)",
             "jnp.sum(z * bc, axis=1)"] + (["jnp.mean(z, axis=1)"] if is_float else [])
    reds = []
    for k in range(int(rng.integers(1, 3))):
        r = str(rng.choice(sink if k == 0 and rng.random() < 0.7 else other + sink))
        if k == 0 and big > 1:      # a sum in the low precision itself (jnp.sum upcasts)
            r, lit = "jax.lax.reduce_sum(y * {l}, (1,))", _lit(rng.choice([0.25, 0.5]))
        elif is_float:
            special = rng.random() < 0.5
            lit = _lit(rng.choice([0.0, np.inf, -np.inf, 1e5] if special else _FLOAT_LITS))
        else:
            lit = str(int(rng.choice([2, 3, 5] if kind == "uint" else [2, -3, 5])))
        reds.append(r.format(l=lit))
    if rng.random() < 0.3:
        reds.append("z")
    src = "def f(x, y):\n" + textwrap.indent("\n".join(lines), "    ") + \
        f"\n    return ({', '.join(reds)},)\n"
    dt = _dtype(dname)
    nonfinite = is_float and rng.random() < 0.35
    args = (_values(rng, (a_, d_), dt, 1.0, nonfinite),
            _values(rng, (a_, g_, d_), dt, big, nonfinite and rng.random() < 0.5, big > 1))
    transforms = ["forward", "vmap", "vmap_of_jb"]
    if is_float:
        transforms += ["vjp", "jvp", "vjp_of_jb", "jvp_of_jb"]
    return src, args, tuple(transforms)


# -- projection --------------------------------------------------------------------

def _projection(rng, x64):
    dname = _float_dtype(rng, x64, 0.3)
    b, t = int(rng.integers(0 if rng.random() < 0.15 else 1, 3)), int(rng.integers(1, 4))
    e, h, o = (int(rng.integers(1, 5)) for _ in range(3))
    act = rng.choice(["jnp.tanh(h)", "jax.nn.relu(h)", "h * 0.5"])
    first = rng.choice(["(x.reshape(-1, E) @ w1).reshape(B, T, H)",
                        "(x.reshape(B * T, E) @ w1).reshape(B, T, H)",
                        "jnp.einsum('bte,eh->bth', x, w1)",
                        "(jnp.swapaxes(x, 0, 1).reshape(-1, E) @ w1).reshape(T, B, H)"
                        ".swapaxes(0, 1)"])
    src = (f"def f(x, w1, w2, bias):\n    B, T, E, H, O = {b}, {t}, {e}, {h}, {o}\n"
           f"    h = {first} + bias\n    h = {act}\n"
           f"    y = (h.reshape(-1, H) @ w2).reshape(B, T, O)\n"
           f"    return jnp.sum(y * y), y\n")
    dt = _dtype(dname)
    args = (_values(rng, (b, t, e), dt), _values(rng, (e, h), dt, 0.5),
            _values(rng, (h, o), dt, 0.5), _values(rng, (h,), dt, 0.1))
    return src, args, ("forward", "vjp", "jvp", "vmap", "vjp_of_jb", "jvp_of_jb", "vmap_of_jb",
                       "jacfwd")


# -- named -------------------------------------------------------------------------

def _named(rng, x64):
    dname = "bfloat16" if rng.random() < 0.2 else "float32"
    n = int(rng.integers(5, 7)) if rng.random() < 0.6 else 1
    b, t, e, hh = (int(rng.integers(1, 4)) for _ in range(4))
    red = rng.choice(['xn.sum(("batch", "time")).values', '(xn * xn).sum().values',
                      'nx.logsumexp(xn, "embd").values', 'xn.max("time").values'])
    src = (f"def f(x, ws, vs):\n"
           f"    xn = nx.as_named(x, ('batch', 'time', 'embd'))\n"
           f"    for w, v in zip(ws, vs):\n"
           f"        s = nx.dot(xn, nx.as_named(w, ('embd', 'head')), dim='embd')\n"
           f"        p = nx.softmax(s, dim='head')\n"
           f"        xn = xn + nx.dot(p, nx.as_named(v, ('head', 'embd')), dim='head') * 0.5\n"
           f"    return {red}, xn.values\n")
    dt = _dtype(dname)
    args = (_values(rng, (b, t, e), dt), [_values(rng, (e, hh), dt, 0.7) for _ in range(n)],
            [_values(rng, (hh, e), dt, 0.7) for _ in range(n)])
    return src, args, ("forward", "vjp", "jvp", "vmap", "vjp_of_jb", "jvp_of_jb", "vmap_of_jb",
                       "jacfwd")
