"""Atomic checkpoints: a kill at any instant leaves either the previous
checkpoint or the new one, never a torn file.

Write: serialize to memory, write `<path>.tmp-<pid>`, flush + fsync, then
`os.replace` onto `<path>` (atomic on POSIX) and fsync the folder so the
rename itself is durable. Read: the file starts with a magic line and the
SHA-256 of the payload, so truncation or bit rot is detected and reported
as `CheckpointError` (a one-line `ValueError`), never a half-loaded state.

The payload is an `.npz` of the state's leaves in pytree order plus a JSON
`meta` (step, config, anything the caller adds), each leaf's dtype name and
its path (`jax.tree_util.keystr`, e.g. `['params']['head']['kernel']`).
Loading restores into a template pytree with the same structure (built from
the same config), and checks every leaf's path, shape and dtype against it;
errors name the path. Typed PRNG key arrays (as in `nnx.state(model)`) are
stored as their `jax.random.key_data` with dtype name `key:<impl>` and
rebuilt with `jax.random.wrap_key_data(..., impl=<impl>)`.

A process killed between writing `<path>.tmp-<pid>` and the rename leaves
that file behind; `remove_stale_tmp` (run when training starts) deletes the
ones whose process is gone.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

MAGIC = b"JAXBACKEND-CKPT-1\n"
_KEY = "key:"   # dtype-name prefix of a typed PRNG key leaf: key:<impl>


class CheckpointError(ValueError):
    """A missing, corrupt or mismatched checkpoint."""


def save(path, state, meta: dict) -> pathlib.Path:
    """Atomically write `state` (a pytree of arrays) and `meta` (JSON-able)."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    paths = [jax.tree_util.keystr(k) for k, _ in flat]
    leaves, names = [], []
    for where, x in zip(paths, (x for _, x in flat)):
        if _is_key(x):
            leaves.append(np.asarray(jax.device_get(jax.random.key_data(x))))
            names.append(_KEY + str(jax.random.key_impl(x)))
            continue
        try:
            leaves.append(np.asarray(jax.device_get(x)))
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"state leaf {where} ({type(x).__name__}) is not an array "
                                  f"({e}); save only arrays and numbers.") from None
        names.append(leaves[-1].dtype.name)
    buf = io.BytesIO()
    # npz stores bfloat16 as raw 2-byte voids: keep dtype names alongside.
    arrays: dict = dict(meta=_json_bytes(meta), dtypes=_json_bytes(names), paths=_json_bytes(paths))
    arrays.update({f"leaf_{i}": x for i, x in enumerate(leaves)})
    np.savez(buf, **arrays)
    payload = buf.getvalue()
    digest = hashlib.sha256(payload).hexdigest().encode() + b"\n"
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC + digest + payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def _json_bytes(obj) -> np.ndarray:
    return np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8)


def _is_key(x) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def remove_stale_tmp(path) -> list:
    """Delete `<path>.tmp-<pid>` files left by a process that died while
    saving (the pid is not alive); returns the removed paths. A live pid's
    file is kept: that process may be writing it now."""
    path = pathlib.Path(path)
    removed = []
    for tmp in path.parent.glob(f"{path.name}.tmp-*"):
        pid = tmp.name.rpartition("-")[2]
        if not pid.isdigit() or (int(pid) != os.getpid() and _alive(int(pid))):
            continue
        tmp.unlink(missing_ok=True)
        removed.append(tmp)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def read_meta(path) -> dict:
    """The checkpoint's JSON metadata (reads no arrays: creates no JAX client)."""
    with np.load(io.BytesIO(_payload(path))) as z:
        return json.loads(bytes(z["meta"]).decode())


def _read(path):
    """(meta, leaves) in pytree order, key arrays rebuilt."""
    return _read_all(path)[:2]


def _read_all(path):
    with np.load(io.BytesIO(_payload(path))) as z:
        meta = json.loads(bytes(z["meta"]).decode())
        names = json.loads(bytes(z["dtypes"]).decode())
        leaves = [_leaf(z[f"leaf_{i}"], n) for i, n in enumerate(names)]
        # Checkpoints written before paths were recorded: None.
        paths = json.loads(bytes(z["paths"]).decode()) if "paths" in z.files else None
    return meta, leaves, paths


def _payload(path) -> bytes:
    """The checked npz bytes of the checkpoint at `path`."""
    path = pathlib.Path(path)
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}; train without --resume first, or point "
                              f"--out at the folder that holds checkpoint.ckpt.")
    blob = path.read_bytes()
    head = len(MAGIC) + 65
    if not blob.startswith(MAGIC) or len(blob) < head:
        raise CheckpointError(f"{path} is not a jaxbackend checkpoint (bad header); delete it "
                              f"and train again.")
    digest, payload = blob[len(MAGIC): head - 1], blob[head:]
    if hashlib.sha256(payload).hexdigest().encode() != digest:
        raise CheckpointError(f"checkpoint {path} is corrupt (checksum mismatch); delete it and "
                              f"train again.")
    return payload


def _leaf(raw: np.ndarray, name: str):
    if name.startswith(_KEY):
        return jax.random.wrap_key_data(jnp.asarray(raw), impl=name[len(_KEY):])
    return raw.view(_dtype(name))


def _dtype(name):
    import ml_dtypes  # ships with jaxlib; knows bfloat16 and friends

    return np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)


def load(path, template):
    """(state, meta): leaves read from `path`, arranged like `template`."""
    meta, leaves, paths = _read_all(path)
    flat, tree = jax.tree_util.tree_flatten_with_path(template)
    want = [jax.tree_util.keystr(k) for k, _ in flat]
    if paths is not None and paths != want:
        missing = [p for p in want if p not in set(paths)]
        extra = [p for p in paths if p not in set(want)]
        if missing:
            what = f"lacks {missing[0]}"
        elif extra:
            what = f"holds {extra[0]}, which the model lacks"
        else:
            what = "holds the model's arrays in another order"
        raise CheckpointError(f"checkpoint {pathlib.Path(path)} {what} ({len(paths)} arrays saved, "
                              f"{len(want)} expected); resume with the same model flags.")
    if len(want) != len(leaves):
        raise CheckpointError(f"checkpoint {pathlib.Path(path)} holds {len(leaves)} arrays but this "
                              f"model has {len(want)}; resume with the same model flags.")
    for where, (_, w), got in zip(want, flat, leaves):
        if tuple(np.shape(w)) != tuple(got.shape) or _dtype_name(w) != _dtype_name(got):
            raise CheckpointError(
                f"checkpoint array {where} has shape {tuple(got.shape)} {_dtype_name(got)} but "
                f"the model expects {tuple(np.shape(w))} {_dtype_name(w)}; resume with the same "
                f"model flags.")
    return jax.tree.unflatten(tree, leaves), meta


def _dtype_name(x) -> str:
    # Key arrays have no numpy dtype; their jax dtype names the impl (key<fry>).
    return str(x.dtype) if _is_key(x) else np.dtype(x.dtype).name
