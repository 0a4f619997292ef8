"""Checkpoints with orbax-checkpoint: per-shard, multi-process, atomic,
asynchronous, the last N kept.

A checkpoint folder (`OUT/checkpoints`) holds one orbax step folder per
saved step, `<step>/` with three items:

* `state`: the arrays (`args.StandardSave`); every process writes the
  shards it holds and reads back the shards its target sharding asks for,
  so nothing is gathered to one host and a state saved on 8 devices
  restores onto 4 (or onto a 2-process mesh) with the caller's shardings;
* `meta`: the caller's JSON (step, config, histories);
* `arrays`: one record per leaf, in pytree order: its path
  (`jax.tree_util.keystr`), shape, dtype name and a 32-bit checksum.

Atomic: orbax writes `<step>.orbax-checkpoint-tmp...` and renames it to
`<step>` when every item is written, so a kill at any instant leaves the
earlier steps intact; `remove_stale_tmp` deletes what a killed save left.
`Checkpointer.save` returns once the arrays are copied off the devices (the
files are written by a background thread) and waits for the previous save
first; `close` waits for the last one. Orbax deletes all but the `keep`
newest steps after each save.

Loading checks the records against the template before reading any array
(errors name the path, shape and dtype), then recomputes each checksum on
the restored arrays, so truncated or flipped bytes are a `CheckpointError`
(a one-line `ValueError`), never a half-right state. The checksum is
`sum(bits[i] * 2654435761 * (2 * i + 1)) mod 2**32` over the leaf's bit
pattern: every weight is odd (odd times odd), so any single flipped bit,
the sign bit included, changes it, and the weights are distinct (i < 2**31),
so swapped elements do too. It is computed on the devices as
a sharded reduction (four bytes per leaf leave them).

Typed PRNG key leaves (as in `nnx.state(model)`) are saved as their
`jax.random.key_data` with dtype name `key:<impl>` and rebuilt with
`jax.random.wrap_key_data`. `read_meta` and `steps` read only JSON and
folder names (no JAX client), so the CLI can read a checkpoint before
`--devices` decides how many devices JAX sees.
"""

from __future__ import annotations

import gc
import json
import pathlib
import shutil
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

_KEY = "key:"   # dtype-name prefix of a typed PRNG key leaf: key:<impl>
_TMP = ".orbax-checkpoint-tmp"   # orbax's suffix of a step folder still being written


class CheckpointError(ValueError):
    """A missing, corrupt or mismatched checkpoint."""


class Checkpointer:
    """Saves steps into `directory` in the background, keeping the `keep`
    newest (None: all). Use as a context manager (or call `close`): leaving it waits
    until the last save is on disk. Every process of a multi-process run
    calls `save` with the same step."""

    def __init__(self, directory, keep: int | None = 3):
        self.directory = pathlib.Path(directory).absolute()
        opts = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True,
                                            cleanup_tmp_directories=True)
        self._manager = ocp.CheckpointManager(self.directory, options=opts)

    def save(self, step: int, state, meta: dict) -> pathlib.Path:
        """Starts writing `state` (a pytree of arrays) and `meta` (JSON-able)
        as `step`; returns the step's folder (final once `wait` returns)."""
        arrays, records = _to_savable(state)
        # A copy: orbax serialises it in the background, while the caller may
        # go on appending to lists it holds (the loss history).
        meta = json.loads(json.dumps(meta))
        self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta),
            arrays=ocp.args.JsonSave(records)), force=True)
        return self.directory / str(step)

    def wait(self) -> None:
        """Blocks until every started save is on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def save(directory, state, meta: dict, step: int | None = None,
         keep: int | None = None) -> pathlib.Path:
    """Writes one step (default `meta["step"]`, else 0) and waits for it;
    with `keep`, deletes all but the `keep` newest steps (default: none)."""
    with Checkpointer(directory, keep) as ckpt:
        return ckpt.save(meta.get("step", 0) if step is None else step, state, meta)


def _to_savable(state) -> tuple:
    """(leaves with keys as key data, the leaves' records)."""
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    leaves, records = [], []
    for path, x in flat:
        where = jax.tree_util.keystr(path)
        if _is_key(x):
            name, x = _KEY + str(jax.random.key_impl(x)), jax.random.key_data(x)
        else:
            try:  # numbers and numpy arrays: onto the default device
                x = x if isinstance(x, jax.Array) else jnp.asarray(x)
            except TypeError:
                raise CheckpointError(f"state leaf {where} ({type(x).__name__}) is not an array; "
                                      f"save only arrays and numbers.") from None
            name = x.dtype.name
        leaves.append(x)
        records.append(dict(path=where, shape=list(x.shape), dtype=name))
    for record, sum_ in zip(records, _checksums(leaves)):
        record["checksum"] = sum_
    return leaves, records


def _is_key(x) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


@jax.jit
def _checksum(x):
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    size = x.dtype.itemsize
    bits = jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16}.get(size, jnp.uint32))
    bits = bits.astype(jnp.uint32)  # 8-byte dtypes gained a trailing dim of 2 words
    # The flat index from per-dim iotas: a reshape would regather a sharded leaf.
    index = jnp.zeros(bits.shape, jnp.uint32)
    for d, n in enumerate(bits.shape):
        index = index * jnp.uint32(n) + jax.lax.broadcasted_iota(jnp.uint32, bits.shape, d)
    weight = (index * jnp.uint32(2) + jnp.uint32(1)) * jnp.uint32(2654435761)   # odd
    return jnp.sum(bits * weight, dtype=jnp.uint32)


def _checksums(leaves) -> list:
    """The leaves' checksums. One compiled call per leaf, not one program
    for all: leaves repeat a few shapes (a parameter and its two Adam
    moments), so this compiles a few small programs where one program of
    all leaves took seconds to compile. Every process calls in the same
    order (each call is a collective over the leaf's devices)."""
    sums = [_checksum(x) for x in leaves]
    return [int(np.asarray(c.addressable_data(0))) for c in sums]


def steps(directory) -> list:
    """The finished steps in `directory`, oldest first (reads only names)."""
    directory = pathlib.Path(directory)
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and p.is_dir())


def _step_dir(directory, step: int | None) -> pathlib.Path:
    directory = pathlib.Path(directory)
    have = steps(directory)
    if not have:
        raise CheckpointError(f"no checkpoint in {directory}; train without --resume first, or "
                              f"point --out at the folder that holds checkpoints/.")
    if step is None:
        return directory / str(have[-1])
    if step not in have:
        raise CheckpointError(f"{directory} has no checkpoint of step {step} (it has steps "
                              f"{', '.join(map(str, have))}); pass one of those.")
    return directory / str(step)


def _json(step_dir: pathlib.Path, item: str):
    try:
        return json.loads((step_dir / item / "metadata").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {step_dir} is corrupt ({item}: "
                              f"{type(e).__name__}); delete it and train again.") from None


def read_meta(directory, step: int | None = None) -> dict:
    """The JSON metadata of `step` (default: the newest); reads no arrays."""
    return _json(_step_dir(directory, step), "meta")


def remove_stale_tmp(directory) -> list:
    """Deletes step folders a killed save left half-written; returns them.
    Call it before saving into `directory` (a live save's folder goes too)."""
    directory = pathlib.Path(directory)
    stale = sorted(p for p in directory.glob(f"*{_TMP}*")) if directory.is_dir() else []
    for p in stale:
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    return stale


def load(directory, template=None, step: int | None = None):
    """(state, meta) of `step` (default: the newest), arranged like
    `template` and placed on its leaves' shardings (arrays or
    `jax.ShapeDtypeStruct`s with `sharding=`); without a template, a dict
    path -> array on the default device."""
    step_dir = _step_dir(directory, step)
    records, meta = _json(step_dir, "arrays"), _json(step_dir, "meta")
    if template is None:
        flat, tree = [(r["path"], _abstract_of(r)) for r in records], None
    else:
        paths, tree = jax.tree_util.tree_flatten_with_path(template)
        flat = [(jax.tree_util.keystr(p), x) for p, x in paths]
        _check_records(step_dir, records, flat)
    targets, placed = [_target(x) for _, x in flat], template is not None
    if placed:
        _check_placeable(step_dir, [p for p, _ in flat], targets)
    got = _restore(step_dir, targets, placed=placed)
    for r, x, sum_ in zip(records, got, _checksums(got)):
        if sum_ != r["checksum"]:
            raise CheckpointError(f"checkpoint {step_dir} is corrupt (array {r['path']} fails its "
                                  f"checksum); delete it and train again.")
    leaves = [jax.random.wrap_key_data(x, impl=r["dtype"][len(_KEY):])
              if r["dtype"].startswith(_KEY) else x for r, x in zip(records, got)]
    if tree is None:
        return {r["path"]: x for r, x in zip(records, leaves)}, meta
    return jax.tree.unflatten(tree, leaves), meta


def _restore(step_dir: pathlib.Path, targets: list, placed: bool = False) -> list:
    """The arrays of `step_dir` placed as `targets` say; a failure is a
    `CheckpointError` naming the first one. With `placed` (targets from the
    caller's template), a failed restore is tried again onto the default
    device: if that reads, the files are fine and the template's shardings
    are what failed, and the message says so instead of calling the
    checkpoint corrupt (whose advice, delete it, would lose a good one)."""
    got, reason = _try_restore(step_dir, targets)
    if got is not None:
        return got
    if placed:
        plain = [_target(jax.ShapeDtypeStruct(t.shape, t.dtype)) for t in targets]
        if _try_restore(step_dir, plain)[0] is not None:
            raise CheckpointError(
                f"checkpoint {step_dir} is readable, but its arrays could not be placed on the "
                f"template's shardings ({reason}); pass a template whose shardings fit its "
                f"shapes on this machine's devices, or none.")
    raise CheckpointError(f"checkpoint {step_dir} is corrupt ({reason}); delete it and train "
                          f"again.")


def _check_placeable(step_dir, paths, targets) -> None:
    """Every target's sharding splits its shape evenly (what orbax needs)."""
    for path, t in zip(paths, targets):
        try:
            t.sharding.shard_shape(t.shape)
        except ValueError:
            mesh = getattr(t.sharding, "mesh", None)
            where = f" on mesh {dict(mesh.shape)}" if mesh is not None else ""
            raise CheckpointError(
                f"checkpoint {step_dir}: template leaf {path} of shape {tuple(t.shape)} does not "
                f"split evenly over its sharding {getattr(t.sharding, 'spec', t.sharding)}{where}; "
                f"give that leaf a sharding whose mesh axes divide its dims.") from None


def _try_restore(step_dir: pathlib.Path, targets: list) -> tuple:
    """(the restored arrays, None), or (None, the first sentence of why
    orbax failed)."""
    _drop_failed_reads()  # before: a failing read may report while restore still runs
    try:
        return list(ocp.Checkpointer(ocp.CompositeCheckpointHandler()).restore(
            step_dir.absolute(), args=ocp.args.Composite(
                state=ocp.args.StandardRestore(targets)))["state"]), None
    except Exception as e:  # orbax and tensorstore raise many types for unreadable files
        # The first sentence: tensorstore appends pages of details.
        first = (str(e).strip().split(". ")[0].splitlines() or [type(e).__name__])[0]
        reason = textwrap.shorten(first, 120, placeholder=" ...")
    with warnings.catch_warnings():
        # reads the failed restore never started are collected unawaited
        # (seen under load: orbax's metadata read), a RuntimeWarning each
        warnings.filterwarnings("ignore", r"coroutine .* was never awaited", RuntimeWarning)
        gc.collect()  # the suspended reads report now, not at some later line of output
    return None, reason


_FAILED_READ = "_read_array_index_and_device_put"   # orbax's per-shard read coroutine
_dropping: list = []


def _drop_failed_reads() -> None:
    """The reads of a failed restore's other shards are left suspended: each
    prints "Exception ignored in <coroutine ...>" to stderr when it is
    collected, and a read finishing late, "Event loop is closed" (its loop
    is gone), on any thread, at any time. A one-line error must stay one
    line: once a process restores, drop exactly those two reports (all
    others reach the hook that was installed before)."""
    if _dropping:
        return
    previous = sys.unraisablehook

    def hook(report) -> None:
        late = (isinstance(report.exc_value, RuntimeError)
                and str(report.exc_value) == "Event loop is closed")
        if not late and getattr(report.object, "__qualname__", None) != _FAILED_READ:
            previous(report)
    _dropping.append(hook)
    sys.unraisablehook = hook


def _abstract_of(record):
    name = record["dtype"]
    dtype = jnp.uint32 if name.startswith(_KEY) else jnp.dtype(name)
    return jax.ShapeDtypeStruct(tuple(record["shape"]), dtype)


def _target(x):
    """What orbax restores a leaf as: shape, dtype and sharding of key data
    for a key, else of the leaf (an unplaced leaf: the default device)."""
    if _is_key(x):
        x = jax.random.key_data(x)
    elif not hasattr(x, "shape"):  # a number
        x = jnp.asarray(x)
    sharding = getattr(x, "sharding", None) or jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def _check_records(step_dir, records, flat) -> None:
    saved, want = [r["path"] for r in records], [p for p, _ in flat]
    if saved != want:
        saved_set, want_set = set(saved), set(want)
        missing = [p for p in want if p not in saved_set]
        extra = [p for p in saved if p not in want_set]
        what = (f"lacks {missing[0]}" if missing else
                f"holds {extra[0]}, which the model lacks" if extra else
                "holds the model's arrays in another order")
        raise CheckpointError(f"checkpoint {step_dir} {what} ({len(saved)} arrays saved, "
                              f"{len(want)} expected); resume with the same model flags.")
    for r, (where, x) in zip(records, flat):
        shape, name = tuple(np.shape(jax.random.key_data(x) if _is_key(x) else x)), _dtype_name(x)
        if tuple(r["shape"]) != shape or r["dtype"] != name:
            raise CheckpointError(
                f"checkpoint array {where} has shape {tuple(r['shape'])} {r['dtype']} but the "
                f"model expects {shape} {name}; resume with the same model flags.")


def _dtype_name(x) -> str:
    if _is_key(x):
        return _KEY + str(jax.random.key_impl(x))
    return jnp.dtype(x.dtype).name if hasattr(x, "dtype") else jnp.asarray(x).dtype.name


# Settings older checkpoints did not record, and the value they all had.
RECORDED_SINCE = {"stack_layers": False}


def recorded(ckpt, key: str):
    """The value of setting `key` the checkpoint at `ckpt` was written with."""
    return {**RECORDED_SINCE, **read_meta(ckpt).get("config", {})}[key]


def check_resumable(ckpt, identity: dict):
    """A resume with `identity` (the run's `TrainConfig.model_key` plus model
    and data) can continue the checkpoint at `ckpt`: the same settings,
    `steps` not below the saved step; else a one-line `CheckpointError`."""
    meta = read_meta(ckpt)
    # Older checkpoints lack some keys: compare what they recorded, or what
    # every run had before a key was recorded.
    saved = {**RECORDED_SINCE, **meta.get("config", {})}
    diff = [f"the data differs (checksum {saved[k]} in the checkpoint, {v} now)" if k == "data"
            else f"{k}={saved[k]!r} (checkpoint) vs {v!r} (now)"
            for k, v in identity.items() if k != "steps" and k in saved and saved[k] != v]
    if diff:
        raise CheckpointError(
            f"checkpoint {ckpt} was written with other settings: {'; '.join(diff)}; "
            f"resume with the checkpoint's settings.")
    if identity["steps"] < meta["step"]:
        raise CheckpointError(
            f"steps={identity['steps']} is below the checkpoint's step {meta['step']}; resume with "
            f"steps >= {meta['step']} (more steps extend the run).")
