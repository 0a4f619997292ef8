"""The corpus: the Python standard library's own source text, as characters.

No download: every Python install carries `sysconfig.get_paths()["stdlib"]`.
We read its top-level `*.py` files in sorted name order (deterministic for a
given Python), keep ASCII (anything else becomes `?`) and encode each char as
its code point, so the vocabulary is exactly 128 ids and needs no table.
The last `val_fraction` of the text is the validation split.

Your own data: `load_text(path)` reads a text file the same way (`--data
FILE`), and `as_ids` takes a text or an array of token ids (a vocabulary
larger than 128 is then `vocab_size(ids)`).

Batches are a pure function of (seed, step): step `s` draws its window
offsets from `fold_in(key(seed), s)`. A resumed run therefore sees exactly
the batches the uninterrupted run would have, with no data-loader state to
checkpoint.
"""

from __future__ import annotations

import functools
import pathlib
import sysconfig
import zlib

import jax
import jax.numpy as jnp
import numpy as np

VOCAB = 128


def stdlib_files() -> list:
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    if not files:
        raise FileNotFoundError(f"no .py files in the standard library folder {root}; "
                                f"this Python install carries no stdlib source to train on.")
    return files


def encode(text: str) -> np.ndarray:
    raw = np.frombuffer(text.encode("ascii", errors="replace"), dtype=np.uint8)
    return raw.astype(np.int32)


def decode(ids) -> str:
    return "".join(chr(int(i)) if 0 <= int(i) < VOCAB else "?" for i in ids)


@functools.lru_cache(maxsize=4)
def load_corpus(max_chars: int = 2_000_000) -> np.ndarray:
    """Token ids of the first `max_chars` characters of the stdlib source."""
    parts, n = [], 0
    for f in stdlib_files():
        text = f.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        n += len(text)
        if n >= max_chars:
            break
    ids = encode("".join(parts)[:max_chars])
    ids.setflags(write=False)
    return ids


def load_text(path, max_chars: int = 2_000_000) -> np.ndarray:
    """Token ids of the first `max_chars` characters of the text file `path`."""
    file = pathlib.Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"--data {path}: no such file; give a path to a text file.")
    return as_ids(file.read_text(encoding="utf-8", errors="replace")[:max_chars], f"--data {path}")


def as_ids(data, what: str = "data") -> np.ndarray:
    """A text (encoded as chars) or a 1-d array of non-negative int token ids,
    as a read-only int32 array."""
    ids = encode(data) if isinstance(data, str) else np.asarray(data)
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{what} is an array of shape {ids.shape} and dtype {ids.dtype}; give a "
                         f"text or a 1-d array of integer token ids.")
    if ids.size and ids.min() < 0:
        raise ValueError(f"{what} holds a negative token id {ids.min()}; ids must be >= 0.")
    ids = ids.astype(np.int32)
    ids.setflags(write=False)
    return ids


def load(data, path, max_chars: int) -> tuple:
    """(token ids, what they are): `data` (a text or token ids), else the
    text file at `path`, else the stdlib source; at most `max_chars` chars."""
    if data is not None:
        ids = as_ids(data[:max_chars] if isinstance(data, str) else data)
        return ids, "the given text" if isinstance(data, str) else "the given token ids"
    if path is not None:
        return load_text(path, max_chars), path
    return load_corpus(max_chars), "stdlib source"


def vocab_size(ids: np.ndarray) -> int:
    """The vocabulary the model needs: the 128 chars, or more if ids go higher."""
    return max(VOCAB, int(ids.max()) + 1 if ids.size else 0)


def fingerprint(ids: np.ndarray) -> str:
    """A checksum of the token ids: a resume must see the same data."""
    return f"{zlib.crc32(np.ascontiguousarray(ids, dtype=np.int32).tobytes()):08x}-{len(ids)}"


def split(ids: np.ndarray, val_fraction: float = 0.1):
    """(train, val): the last `val_fraction` of the text is validation."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction} must be in (0, 1).")
    cut = int(len(ids) * (1.0 - val_fraction))
    return ids[:cut], ids[cut:]


def unigram_baseline(train: np.ndarray, val: np.ndarray) -> float:
    """Cross entropy (nats/char) of val under train's character frequencies
    (add-one smoothed): what a model that ignores context can reach."""
    vocab = vocab_size(np.concatenate([train, val]))
    counts = np.bincount(train, minlength=vocab).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[val].mean())


def get_batch(data: jax.Array, seed: int, step: int, batch: int, seq: int):
    """(inputs, targets), each (batch, seq) int32; a pure function of
    (seed, step), jit-friendly (`data` is a device array)."""
    if data.shape[0] <= seq + 1:
        raise ValueError(f"the text has {data.shape[0]} chars, too few for --seq {seq}; "
                         f"use a shorter --seq.")
    key = jax.random.fold_in(jax.random.key(seed), step)
    starts = jax.random.randint(key, (batch,), 0, data.shape[0] - seq - 1)
    idx = starts[:, None] + jnp.arange(seq + 1)[None, :]
    win = data[idx]
    return win[:, :-1], win[:, 1:]


def eval_batches(data: np.ndarray, batch: int, seq: int, max_batches: int = 8) -> list:
    """Fixed, evenly spaced validation windows (same for every evaluation)."""
    n = batch * max_batches
    span = len(data) - seq - 1
    if span <= 0:
        raise ValueError(f"the validation text has {len(data)} chars, too few for --seq {seq}.")
    starts = np.linspace(0, span - 1, n).astype(np.int64)
    win = np.stack([data[s: s + seq + 1] for s in starts])
    return [(win[i: i + batch, :-1], win[i: i + batch, 1:]) for i in range(0, n, batch)]
