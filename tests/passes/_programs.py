"""Small programs the pass tests share, and the four checks every pass gets.

`check_pass(pass_fn, fn, args)` asserts, for a scalar-valued `fn`:
1. the output type-checks (`_jax.check_closed_jaxpr`);
2. before == after numerically (`jaxbackend.testing.assert_close`), on the
   forward jaxpr and on the jaxpr of `jax.value_and_grad(fn)` (the pass runs
   on AD-produced code too), and `jax.grad` of the rewritten forward jaxpr
   equals `jax.grad(fn)`;
3. running the pass twice prints the same jaxpr as running it once.
It returns the rewritten forward and grad jaxprs for invariant counting.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxbackend import _jax
from jaxbackend import named as nx
from jaxbackend.testing import abs_scale, assert_close


def _run(closed, leaves):
    # one XLA compile is much faster than op-by-op eager evaluation
    return jax.jit(_jax.jaxpr_as_fun(closed))(*leaves)


def assert_same_values(before, after, leaves, what="rewritten jaxpr"):
    """`after` computes what `before` does on `leaves`, by the error model of
    `jaxbackend.testing` (entries that cancel: at `before`'s own abs_scale)."""
    assert_close(_run(after, leaves), _run(before, leaves), what=what,
                 scale=lambda: abs_scale(_jax.jaxpr_as_fun(before), *leaves))


def check_pass(pass_fn, fn, args, *, argnums=0):
    leaves, tree = jax.tree.flatten(args)

    def flat_fn(*xs):
        return fn(*jax.tree.unflatten(tree, xs))

    results = []
    for prog in (flat_fn, jax.value_and_grad(flat_fn, argnums=argnums)):
        before = jax.make_jaxpr(prog)(*leaves)
        after = pass_fn(before)
        _jax.check_closed_jaxpr(after)
        assert_same_values(before, after, leaves)
        again = pass_fn(after)
        assert str(again) == str(after), "pass is not idempotent"
        results.append(after)
    fwd = results[0]
    g_after = jax.jit(jax.grad(lambda *xs: _jax.eval_jaxpr(fwd, *xs)[0], argnums=argnums))(*leaves)
    g_before = jax.jit(jax.grad(flat_fn, argnums=argnums))(*leaves)
    assert_close(g_after, g_before, what="grad of the rewritten jaxpr",
                 scale=lambda: abs_scale(jax.grad(flat_fn, argnums=argnums), *leaves))
    return results


def rand(key, *shape):
    return jax.random.normal(jax.random.key(key), shape, jnp.float32)


# --- programs -------------------------------------------------------------

def hand_mlp(x, w1, w2):
    """The hand-written flatten pattern: x.reshape(-1, d) @ w."""
    h = jnp.tanh((x.reshape(-1, x.shape[-1]) @ w1).reshape(*x.shape[:-1], w1.shape[1]))
    y = (h.reshape(-1, h.shape[-1]) @ w2).reshape(*x.shape[:-1], w2.shape[1])
    return jnp.sum(y ** 2)


def mlp_args():
    return (rand(0, 2, 3, 4), rand(1, 4, 5) * 0.5, rand(2, 5, 6) * 0.5)


def named_mlp(x, w1, w2):
    """Named twin: contractions are einsum equations with dim names."""
    x = nx.as_named(x, ("batch", "time", "embd"))
    h = nx.tanh(nx.dot(x, nx.as_named(w1, ("embd", "hidden")), dim="embd"))
    y = nx.dot(h, nx.as_named(w2, ("hidden", "out")), dim="hidden")
    # jnp.linalg.norm is a nested `jit` equation: a call for `inline` to remove
    return nx.softmax(y, dim="out").max(dim="out").sum().values + jnp.linalg.norm(w1)


def xsa_expand(v, y):
    """GQA XSA, "expand" form: broadcast KV heads to every query head, then
    normalise (v: batch time kv hd; y: batch time kv group hd)."""
    vb = jnp.broadcast_to(v[:, :, :, None, :], y.shape)
    vn = vb / jnp.linalg.norm(vb, axis=-1, keepdims=True)
    return y - jnp.sum(y * vn, -1, keepdims=True) * vn


def xsa_unsqueeze(v, y):
    """Same projection, "unsqueeze" form: normalise once per KV head."""
    vn = (v / jnp.linalg.norm(v, axis=-1, keepdims=True))[:, :, :, None, :]
    return y - jnp.sum(y * vn, -1, keepdims=True) * vn


def xsa_args():
    return (rand(3, 2, 4, 2, 8), rand(4, 2, 4, 2, 3, 8))


def xsa_loss(v, y):
    return jnp.sum(jnp.sin(xsa_expand(v, y)))


def attention_scan(x, w):
    """Layers as a scan whose body has a nested jit, a named einsum, a cond
    and a while loop: exercises recursion into every sub-jaxpr kind."""

    @jax.jit
    def inner(h, wi):
        a = nx.dot(nx.as_named(h, ("t", "e")), nx.as_named(wi, ("e", "f")), dim="e")
        s = nx.softmax(a, dim="f")
        return jnp.tanh(s.values) @ wi.T / math.sqrt(wi.shape[0])

    def body(h, wi):
        h = h + inner(h, wi)
        h = jax.lax.cond(jnp.sum(h) > 0, lambda q: q * 0.9, lambda q: q * 1.1, h)
        # reverse-mode AD cannot cross a while loop: feed it a stopped value
        bump = jax.lax.while_loop(lambda c: c[0] < 2,
                                  lambda c: (c[0] + 1, c[1] + 0.01 * jnp.exp(-c[1] * c[1])),
                                  (0, jax.lax.stop_gradient(h)))[1]
        h = h + 0.1 * bump
        return h, jnp.sum(h)

    h, ys = jax.lax.scan(body, x, w)
    return jnp.sum(h ** 2) + jnp.sum(ys) + jnp.sum(jax.checkpoint(jnp.sin)(h))


def scan_args():
    return (rand(5, 4, 6), rand(6, 3, 6, 5) * 0.4)
