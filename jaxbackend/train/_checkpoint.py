"""Atomic checkpoints: a kill at any instant leaves either the previous
checkpoint or the new one, never a torn file.

Write: serialize to memory, write `<path>.tmp-<pid>`, flush + fsync, then
`os.replace` onto `<path>` (atomic on POSIX) and fsync the folder so the
rename itself is durable. Read: the file starts with a magic line and the
SHA-256 of the payload, so truncation or bit rot is detected and reported
as `CheckpointError` (a one-line `ValueError`), never a half-loaded state.

The payload is an `.npz` of the state's leaves in pytree order plus a JSON
`meta` (step, config, anything the caller adds). Loading restores into a
template pytree with the same structure (built from the same config), and
checks every leaf's shape and dtype against it.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pathlib

import jax
import numpy as np

MAGIC = b"JAXBACKEND-CKPT-1\n"


class CheckpointError(ValueError):
    """A missing, corrupt or mismatched checkpoint."""


def save(path, state, meta: dict) -> pathlib.Path:
    """Atomically write `state` (a pytree of arrays) and `meta` (JSON-able)."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    leaves = [np.asarray(jax.device_get(x)) for x in jax.tree.leaves(state)]
    buf = io.BytesIO()
    # npz stores bfloat16 as raw 2-byte voids: keep dtype names alongside.
    dtypes = json.dumps([x.dtype.name for x in leaves]).encode()
    np.savez(buf, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
             dtypes=np.frombuffer(dtypes, dtype=np.uint8),
             **{f"leaf_{i}": x for i, x in enumerate(leaves)})
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


def read_meta(path) -> dict:
    return _read(path)[0]


def _read(path):
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
    with np.load(io.BytesIO(payload)) as z:
        meta = json.loads(bytes(z["meta"]).decode())
        names = json.loads(bytes(z["dtypes"]).decode())
        leaves = [z[f"leaf_{i}"].view(_dtype(n)) for i, n in enumerate(names)]
    return meta, leaves


def _dtype(name):
    import ml_dtypes  # ships with jaxlib; knows bfloat16 and friends

    return np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)


def load(path, template):
    """(state, meta): leaves read from `path`, arranged like `template`."""
    meta, leaves = _read(path)
    want, tree = jax.tree.flatten(template)
    if len(want) != len(leaves):
        raise CheckpointError(f"checkpoint {pathlib.Path(path)} holds {len(leaves)} arrays but this "
                              f"model has {len(want)}; resume with the same model flags.")
    for i, (w, got) in enumerate(zip(want, leaves)):
        if tuple(np.shape(w)) != got.shape or np.dtype(w.dtype) != got.dtype:
            raise CheckpointError(
                f"checkpoint array {i} has shape {got.shape} {got.dtype} but the model expects "
                f"{tuple(np.shape(w))} {np.dtype(w.dtype)}; resume with the same model flags.")
    return jax.tree.unflatten(tree, leaves), meta
