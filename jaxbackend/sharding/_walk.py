"""The walk that fills a `_graph.Builder` from a jaxpr: `build`.

Precondition: a ClosedJaxpr; the dim-rule table of `_graph` (filled by
`_op_dims`, imported here once). Result: the frozen `Graph`. Sub-jaxprs are
walked in place, never unrolled: a `jit` / custom_jvp / custom_vjp / remat
body inlines into the caller's variables; a `cond`'s branches are walked
with multiplicity split evenly (the branch taken is unknown); a `while` body
once (its trip count is unknown); a `scan` body once with its ops'
multiplicity times the trip count, its stacked xs and ys mapped to the
body's slices axis by axis, their layer axis never sharded (see `_scan`).
Every other equation goes to its primitive's dim rule. It reads the jaxpr
and leaves it alone.
"""

from __future__ import annotations

import numpy as np

from jaxbackend import _jax, _stacked
from jaxbackend.sharding._graph import LOOP, REPLICATED, Builder, Graph, Op, dim_rule


def build(closed, in_names=None, out_names=None, in_paths=None) -> Graph:
    """Flatten `closed` into a Graph. `in_names`/`out_names`: per flat
    input/output, a tuple of dim names or None; `in_paths`: per flat input,
    where the user passed it (e.g. "params['blocks'][0]['w1']"), which names
    a dim no name reaches."""
    from jaxbackend.sharding import _op_dims  # noqa: F401  (fills the dim-rule table once)

    jaxpr, consts = _jax.jaxpr_parts(closed)
    b = Builder()
    env: dict = {}
    for var, c in zip(jaxpr.constvars, consts):
        dtype = c.dtype if hasattr(c, "dtype") else np.asarray(c).dtype
        env[var] = b.add_var(np.shape(c), dtype.itemsize, _jax.half_float_name(dtype))
    invars = [b.var_of(v.aval) for v in jaxpr.invars]
    env.update(zip(jaxpr.invars, invars))
    _walk(b, jaxpr, env, 1.0)
    outvars = [_read(env, v) for v in jaxpr.outvars]
    for vs, names in ((invars, in_names), (outvars, out_names)):
        for v, dims in zip(vs, names or ()):
            if dims is not None and v is not None:
                for a, d in enumerate(dims):
                    if d is not None:           # an axis a Flax variable leaves unnamed
                        b.label(v, a, d)
    for v in outvars:
        if v is not None:
            b.uses[v] = len(b.ops)
    # every walked jaxpr Var -> graph var: a sharding constraint inside a
    # scan body gets the layout of the body's (per-iteration) variable
    return b.finish(invars, outvars, {**b.sub_env, **env},
                    tuple(in_paths or (f"input {i}" for i in range(len(invars)))))


def _read(env, x):
    return None if isinstance(x, _jax.Literal) else env[x]


def _inline(b, body, ins, mult):
    """Walk a sub-jaxpr in place: its inputs are the caller's variables.
    Its consts are fresh variables (their values do not matter here)."""
    jaxpr = _jax.open_jaxpr(body)
    env = {}
    for var in jaxpr.constvars:
        env[var] = b.var_of(var.aval)
    for var, v in zip(jaxpr.invars, ins):
        env[var] = v if v is not None else b.var_of(var.aval)
    _walk(b, jaxpr, env, mult)
    for var, v in env.items():   # a body walked twice (cond, a shared body) keeps its first walk
        b.sub_env.setdefault(var, v)
    return [_read(env, x) for x in jaxpr.outvars]


def _walk(b, jaxpr, env, mult):
    for eqn in jaxpr.eqns:
        ins = [_read(env, x) for x in eqn.invars]
        name = eqn.primitive.name
        if name == "scan":
            outs = _scan(b, eqn, ins, mult)
        elif name == "while":
            _, nc, body, nb = _jax.while_parts(eqn)
            outs = _inline(b, body, ins[nc:], mult)  # trip count unknown: 1
            for v, w in zip(ins[nc + nb:], outs):
                for a in range(len(b.shapes[w]) if v is not None and w is not None else 0):
                    b.union(v, a, w, a)
            # the loop state is buffers XLA holds across the loop (`_liveness`)
            b.loop_state.update(v for v in ins[nc + nb:] + outs if v is not None)
        elif name == "cond":
            branches = _jax.cond_branches(eqn)
            outs = None
            for br in branches:
                o = _inline(b, br, ins[1:], mult / len(branches))
                outs = o if outs is None else outs
        elif (body := _jax.call_body(eqn)) is not None:
            if _stacked.splits_layers(eqn) and ins[0] is not None:
                b.unshardable[b.base[ins[0]]] = LOOP   # a layer axis (`jb.stack_layers`)
            outs = _inline(b, body, ins, mult)
        else:
            outs = [b.var_of(x.aval) for x in eqn.outvars]
            dim_rule(name)(b, eqn, ins, outs, mult)
            if name == "sharding_constraint" and (pin := _jax.constraint_axes(eqn)) is not None:
                b.constraints.append((outs[0], pin))   # the user's own layout: kept by the plan
            for v in outs:
                b.origin[v] = eqn
            for v in ins:
                if v is not None:
                    b.uses[v] = len(b.ops) - 1
            env.update(zip(eqn.outvars, outs))
            continue
        # Call-like: alias the callee's outputs to the equation's outputs.
        for x, v in zip(eqn.outvars, outs):
            if v is None:
                v = b.var_of(x.aval)
            env[x] = v


def _scan(b, eqn, ins, mult):
    body, nc, nk, length, _ = _jax.scan_parts(eqn)
    start = len(b.ops)   # a stacked result's buffer is written from the first trip on
    inner_ins = []
    for i, v in enumerate(ins):
        if i < nc + nk or v is None:
            inner_ins.append(v)
        else:   # xs: the body sees one slice; axis a of the slice is axis a+1 outside
            w = b.add_var(b.shapes[v][1:], b.itemsize[v], b.half.get(v))
            for a in range(len(b.shapes[w])):
                b.union(v, a + 1, w, a)
            # Slicing iteration i needs the stacked axis whole on every
            # device: a layer axis sharded over devices costs an all-gather
            # of every layer's weights (XLA gathers the whole stack before
            # the loop), so the layer axis is never sharded; it is a program
            # input's axis when the caller keeps layers stacked
            # (`jb.stack_layers`), and would otherwise be a search option.
            b.unshardable[b.base[v]] = LOOP
            n = len(b.shapes[w])
            b.ops.append(Op("map", mult, b.shapes[w], tuple((w, a) for a in range(n)),
                            ((v, (REPLICATED,) + tuple(range(n))),), ((w, tuple(range(n))),), (), 0.0))
            inner_ins.append(w)
            b.uses[v] = len(b.ops)
    outs = _inline(b, body, inner_ins, mult * int(length))
    # to XLA a scan is a `while` over all its operands: each (a const, the
    # carry, the whole xs) is a buffer made before the loop and held to its
    # last trip (`_liveness`), whatever the body reads of it
    for v in ins:
        if v is not None:
            b.uses[v] = max(b.uses[v], len(b.ops) - 1)
            b.loop_state.add(v)
    result = []
    for i, (x, v) in enumerate(zip(eqn.outvars, outs)):
        if i < nk:
            result.append(v)
        else:   # ys: stacked along a new leading axis
            w = b.var_of(x.aval)
            n = len(b.shapes[w])
            ins_map = ()
            if v is not None:
                for a in range(len(b.shapes[v])):
                    b.union(w, a + 1, v, a)
                b.uses[v] = len(b.ops)
                ins_map = ((v, tuple(range(1, n))),)
            # The stacked result is a real buffer (e.g. residuals kept for
            # the backward scan): produced here, never fused away. Its layer
            # axis is not sharded either (as the xs above).
            b.unshardable[b.base[w]] = LOOP
            b.ops.append(Op("map", mult, b.shapes[w], tuple((w, a) for a in range(n)), ins_map,
                            ((w, tuple(range(n))),), (), 0.0))
            b.pinned.add(w)
            b.stacked_from[w] = start
            result.append(w)
    for i in range(nk):   # carry in and out are the same dims
        if ins[nc + i] is not None and result[i] is not None:
            for a in range(len(b.shapes[result[i]])):
                b.union(ins[nc + i], a, result[i], a)
    return result
