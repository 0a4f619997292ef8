"""Named multi-head self-attention: causal mask, grouped-query attention,
optional rotary positions, optional sliding window.

Dims: the input carries a sequence dim (`time=`, default "time") and `embd`
(plus any batch dims). Projections are `Linear`s: q: embd -> (head, hd);
k, v: embd -> (kv_head, hd); out: (head, hd) -> embd. With grouped-query
attention (`kv_heads < heads`) the query heads are split by name, head ->
(kv_head, group), so each group of query heads reads one key/value head
without copying k or v (no `repeat`): the score contraction simply has
`kv_head` as a batch dim and `group` as a free dim. Keys get their sequence
dim renamed `<time>_k` (`time_k`), so the scores carry (..., time, time_k)
and the causal mask is `time >= time_k` by name. A sliding window
(`sliding_window=w`, Mistral's and Gemma's local layers) keeps, besides,
only keys fewer than w positions back (`time - time_k < w`: each query sees
w positions, itself included); without `causal`, fewer than w either way.
Mixing windowed and global layers (alternating) is a per-layer argument.

Precision: `dtype` (compute) and `param_dtype` (storage) as in the other
layers; scores and softmax run in at least float32.

Rotary positions (RoPE, the "rotate half" form) rotate the first and second
halves of `hd` of q and k by position-dependent angles; `rope(...)` is
exported so positional references can apply the same formula.

Decoding with a key/value cache (`init_cache`, `decode`): the cache is a
pair of fixed-size buffers (k, v) with dims (..., kv_<time>, kv_head or
head, hd), passed in and returned (the module holds no decoding state). A
call on positions pos .. pos+t-1 writes their k and v into the buffers at
`pos` (`lax.dynamic_update_slice`, so `pos` may be traced and one compiled
step serves every position) and attends over the whole buffer with the mask
`pos + time >= kv_<time>`: entries past the current position, never written
or left over, are masked out. The score, softmax and value contractions are
those of `__call__` with `kv_<time>` as the key dim, so a prefill of the whole
window computes what `__call__` computes.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jaxbackend import named as nx
from jaxbackend.nn._layers import Dropout, Linear, cast, check_input


def rope_tables(t: int, hd: int, base: float = 10000.0, dtype=jnp.float32, start=0):
    """cos and sin tables of shape (t, hd // 2) for positions start .. start+t-1
    (`start` may be traced)."""
    inv = 1.0 / (base ** (jnp.arange(0, hd // 2, dtype=jnp.float32) * 2.0 / hd))
    pos = jnp.arange(t, dtype=jnp.float32)
    if not isinstance(start, int) or start:  # no add where the positions start at 0
        pos = pos + jnp.asarray(start, jnp.float32)  # exact for positions < 2**24
    ang = pos[:, None] * inv[None, :]
    return jnp.cos(ang).astype(dtype), jnp.sin(ang).astype(dtype)


def rope(x: nx.NamedArray, *, time: str = "time", hd: str = "hd", base: float = 10000.0,
         start=0):
    """Rotate halves of `hd` by angles set by the position along `time`; the
    first entry of `time` is position `start` (an int, or a traced scalar)."""
    n, t = x.sizes[hd], x.sizes[time]
    if n % 2:
        raise nx.DimError(f"rope: dim {hd!r} has size {n}; rotary positions need an even head dim.")
    cos, sin = rope_tables(t, n, base, x.dtype, start)
    cos, sin = nx.as_named(cos, (time, hd)), nx.as_named(sin, (time, hd))
    x1, x2 = x.isel({hd: slice(0, n // 2)}), x.isel({hd: slice(n // 2, n)})
    out = nx.concat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=hd)
    return out.transpose(*x.dims)


class MultiHeadAttention(nnx.Module):
    """Self-attention over the sequence dim `time` (an argument, default
    "time"): (..., time, embd) -> (..., time, embd); keys use `<time>_k`.
    `decode` is the same attention over a key/value cache (dim `kv_<time>`)."""

    def __init__(self, embd: int, heads: int, *, kv_heads: int | None = None,
                 head_dim: int | None = None, causal: bool = True, rotary: bool = False,
                 sliding_window: int | None = None, use_bias: bool = True, dropout: float = 0.0,
                 time: str = "time", dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs):
        if not isinstance(time, str) or not time:
            raise nx.DimError(f"MultiHeadAttention: time={time!r} must be a dim name (a non-empty "
                              f"str), the input's sequence dim.")
        kv_heads = heads if kv_heads is None else kv_heads
        if heads % kv_heads:
            raise nx.DimError(f"MultiHeadAttention: heads={heads} is not a multiple of "
                              f"kv_heads={kv_heads}; pick kv_heads dividing heads.")
        if head_dim is None:
            if embd % heads:
                raise nx.DimError(f"MultiHeadAttention: embd={embd} does not divide by "
                                  f"heads={heads}; pass head_dim= or change heads.")
            head_dim = embd // heads
        self.embd, self.heads, self.kv_heads, self.head_dim = embd, heads, kv_heads, head_dim
        if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(
                sliding_window, int) or sliding_window < 1):
            raise ValueError(f"MultiHeadAttention: sliding_window={sliding_window!r} must be a "
                             f"positive int (the positions each query sees, itself included) "
                             f"or None for attention over the whole sequence.")
        self.causal, self.rotary, self.sliding_window = causal, rotary, sliding_window
        self.time, self.time_k = time, f"{time}_k"
        kv = "head" if kv_heads == heads else "kv_head"
        self.kv_dim = kv
        kw = dict(use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.query = Linear({"embd": embd}, {"head": heads, "hd": head_dim}, **kw)
        self.key = Linear({"embd": embd}, {kv: kv_heads, "hd": head_dim}, **kw)
        self.value = Linear({"embd": embd}, {kv: kv_heads, "hd": head_dim}, **kw)
        self.out = Linear({"head": heads, "hd": head_dim}, {"embd": embd}, **kw)
        self.dropout = Dropout(dropout, rngs=rngs)

    def __call__(self, x: nx.NamedArray) -> nx.NamedArray:
        tq, tk = self.time, self.time_k
        self._check(x, "MultiHeadAttention", tk, "keys use that name")
        q, k, v = self.query(x), self.key(x), self.value(x)
        if self.rotary:
            q, k = rope(q, time=tq), rope(k, time=tq)
        k, v = k.rename({tq: tk}), v.rename({tq: tk})
        return self._attend(q, k, v, tk, 0 if self.causal else None)

    def _check(self, x: nx.NamedArray, op: str, taken: str, why: str) -> None:
        # x has embd of the layer's size, the sequence dim, and not `taken`
        check_input(op, x, {"embd": self.embd})
        if self.time not in x.dims or taken in x.dims:
            raise nx.DimError(f"{op}: the input has dims {x.dims}; it needs the sequence dim "
                              f"{self.time!r} and no {taken!r} dim ({why}); pass time=<the "
                              f"input's sequence dim>.")

    def init_cache(self, sizes: dict, length: int, dtype) -> tuple:
        """Empty (zero) k and v buffers for `decode`: dims (*sizes, kv_<time>,
        kv_head or head, hd), `sizes` the input's dims other than time and
        embd (e.g. {"batch": 1}), `length` the longest context, `dtype` that
        of the layer's k and v (its compute dtype)."""
        shape = {**sizes, f"kv_{self.time}": length, self.kv_dim: self.kv_heads,
                 "hd": self.head_dim}
        return nx.zeros(shape, dtype), nx.zeros(shape, dtype)

    def decode(self, x: nx.NamedArray, cache: tuple, pos) -> tuple:
        """Causal attention of x's positions pos .. pos+t-1 (t = size of
        `time`) over themselves and the cached earlier positions: returns
        (out, cache with x's k and v written at `pos`). `pos` may be traced;
        the caller keeps pos + t <= the buffer length (XLA clamps a write that
        would run past the end)."""
        tq, tc = self.time, f"kv_{self.time}"
        self._check(x, "MultiHeadAttention.decode", tc, "the cache uses that name")
        if not self.causal:
            raise ValueError("MultiHeadAttention.decode: the layer has causal=False; a cache "
                             "only holds the past, so decode needs a causal layer.")
        q, k, v = self.query(x), self.key(x), self.value(x)
        if self.rotary:
            q, k = rope(q, time=tq, start=pos), rope(k, time=tq, start=pos)
        k_cache, v_cache = (_write(buf, new.rename({tq: tc}), tc, pos)
                            for buf, new in zip(cache, (k, v)))
        return self._attend(q, k_cache, v_cache, tc, pos), (k_cache, v_cache)

    def _attend(self, q, k, v, tk: str, start) -> nx.NamedArray:
        # q: (..., time, head, hd) at positions start .. start+t-1; k, v:
        # (..., tk, kv_dim, hd) at positions 0 ..; start None: no causal mask
        # (positions then start at 0 for the sliding window).
        if self.kv_dim != "head":  # GQA: head -> (kv_head, group), by name
            q = q.unstack(head={"kv_head": self.kv_heads, "group": self.heads // self.kv_heads})
        # scores and softmax in at least float32 (a bfloat16 softmax over a
        # long row rounds its largest terms); the weights go back to v's dtype
        s = cast(nx.dot(q, k, dim="hd"), jnp.promote_types(q.dtype, jnp.float32))
        s = s / math.sqrt(self.head_dim)
        w = self.sliding_window
        if start is not None or w is not None:  # by name: query vs key position
            q_pos = nx.arange(q.sizes[self.time], dim=self.time)
            if start is not None and (not isinstance(start, int) or start):
                q_pos = q_pos + start
            k_pos = nx.arange(k.sizes[tk], dim=tk)
            if w is None:
                keep = q_pos >= k_pos
            else:                                      # fewer than w back (and ahead)
                back = q_pos - k_pos
                keep = back < w
                keep = keep & (back >= 0) if start is not None else keep & (-back < w)
            s = _causal(s, keep)
        a = self.dropout(cast(nx.softmax(s, dim=tk), v.dtype))
        o = nx.dot(a, v, dim=tk)
        if self.kv_dim != "head":
            o = o.stack(head=("kv_head", "group"))
        return self.out(o)


def _causal(s: nx.NamedArray, keep: nx.NamedArray) -> nx.NamedArray:
    """s where keep (query time x key time), else s's lowest value.

    Under `jax.checkpoint`, so reverse mode keeps `keep` for the backward
    select, not the mask broadcast to the scores' shape: that was a
    (batch, head, time, time_k) boolean per layer, which a rolled step
    stacks as a scan residual (16 MiB a layer at batch 64, 4 heads, 256
    positions); the backward pass broadcasts it again. Values and gradients
    are the `nx.where`'s, bit for bit (the same select, forward and back)."""
    fill = jnp.finfo(s.dtype).min
    return jax.checkpoint(lambda s, keep: nx.where(keep, s, fill), prevent_cse=False)(s, keep)


def _write(buf: nx.NamedArray, new: nx.NamedArray, dim: str, pos) -> nx.NamedArray:
    """`new` written into `buf` from entry `pos` of `dim` (same dims and dtype,
    at most as long along `dim`)."""
    t = new.sizes.get(dim, 0)
    if (new.sizes != {**buf.sizes, dim: t} or not 1 <= t <= buf.sizes[dim]
            or new.dtype != buf.dtype):
        raise nx.DimError(f"MultiHeadAttention.decode: the cache has sizes {buf.sizes} and dtype "
                          f"{buf.dtype} but the new keys/values have {new.sizes} and {new.dtype}; "
                          f"build the cache with init_cache for this input.")
    new = new.transpose(*buf.dims)
    start = [jnp.asarray(pos, jnp.int32) if d == dim else jnp.int32(0) for d in buf.dims]
    return nx.NamedArray(lax.dynamic_update_slice(buf.values, new.values, start), buf.dims)
