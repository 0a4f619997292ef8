"""Corpus, batches and atomic checkpoints."""

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxbackend.train import _checkpoint, _data


def test_corpus_is_stdlib_ascii_and_split_is_ordered():
    ids = _data.load_corpus(50_000)
    assert len(ids) == 50_000 and ids.min() >= 0 and ids.max() < _data.VOCAB
    first = _data.stdlib_files()[0].read_text(encoding="utf-8", errors="replace")[:100]
    assert _data.decode(ids[:100]) == first.encode("ascii", "replace").decode()
    train, val = _data.split(ids, 0.1)
    assert len(val) == 5_000 and np.array_equal(np.concatenate([train, val]), ids)
    base = _data.unigram_baseline(train, val)
    assert 2.0 < base < math.log(_data.VOCAB)


def test_batches_are_a_pure_function_of_seed_and_step():
    data = jnp.asarray(_data.load_corpus(50_000))
    x1, y1 = _data.get_batch(data, 0, 7, 4, 16)
    x2, _ = _data.get_batch(data, 0, 7, 4, 16)
    x3, _ = _data.get_batch(data, 0, 8, 4, 16)
    assert x1.shape == (4, 16) and np.array_equal(x1, x2) and not np.array_equal(x1, x3)
    np.testing.assert_array_equal(x1[:, 1:], y1[:, :-1])  # targets are inputs shifted by one


def _state():
    return {"w": jnp.arange(6.0).reshape(2, 3), "n": [jnp.int32(3), jnp.ones(4, jnp.bfloat16)]}


def test_checkpoint_roundtrip(tmp_path):
    path = _checkpoint.save(tmp_path / "c.ckpt", _state(), {"step": 5})
    state, meta = _checkpoint.load(path, _state())
    assert meta == {"step": 5}
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(_state())):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert [p.name for p in tmp_path.iterdir()] == ["c.ckpt"]  # no temp file left behind


def test_corrupt_truncated_missing_and_mismatched_checkpoints(tmp_path):
    path = _checkpoint.save(tmp_path / "c.ckpt", _state(), {"step": 5})
    blob = path.read_bytes()
    path.write_bytes(blob[:-10])
    with pytest.raises(_checkpoint.CheckpointError, match="corrupt"):
        _checkpoint.load(path, _state())
    path.write_bytes(blob[:-10] + bytes(b ^ 1 for b in blob[-10:]))
    with pytest.raises(_checkpoint.CheckpointError, match="checksum"):
        _checkpoint.load(path, _state())
    path.write_bytes(b"junk")
    with pytest.raises(_checkpoint.CheckpointError, match="not a jaxbackend checkpoint"):
        _checkpoint.load(path, _state())
    with pytest.raises(_checkpoint.CheckpointError, match="no checkpoint"):
        _checkpoint.load(tmp_path / "missing.ckpt", _state())
    good = _checkpoint.save(tmp_path / "d.ckpt", _state(), {"step": 1})
    with pytest.raises(_checkpoint.CheckpointError, match="expects"):
        _checkpoint.load(good, {"w": jnp.zeros((3, 2)), "n": [jnp.int32(0), jnp.ones(4, jnp.bfloat16)]})


def test_a_write_that_dies_before_the_rename_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    path = _checkpoint.save(tmp_path / "c.ckpt", _state(), {"step": 1})

    def crash(src, dst):
        raise OSError("simulated crash before rename")
    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated"):
        _checkpoint.save(path, {"w": jnp.zeros((2, 3)), "n": [jnp.int32(0), jnp.zeros(4, jnp.bfloat16)]},
                         {"step": 2})
    monkeypatch.undo()
    state, meta = _checkpoint.load(path, _state())
    assert meta["step"] == 1 and np.array_equal(state["w"], _state()["w"])
    assert [p.name for p in tmp_path.iterdir()] == ["c.ckpt"]
