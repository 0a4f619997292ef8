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


def test_load_errors_name_the_parameter_path(tmp_path):
    path = _checkpoint.save(tmp_path / "c.ckpt", _state(), {"step": 1})
    err = _checkpoint.CheckpointError
    with pytest.raises(err, match=r"array \['w'\] has shape \(2, 3\) float32 but the model expects"):
        _checkpoint.load(path, {**_state(), "w": jnp.zeros((3, 2))})
    with pytest.raises(err, match=r"lacks \['extra'\]"):
        _checkpoint.load(path, {**_state(), "extra": jnp.zeros(2)})
    with pytest.raises(err, match=r"holds \['n'\]\[1\], which the model lacks"):
        _checkpoint.load(path, {"w": jnp.zeros((2, 3)), "n": [jnp.int32(0)]})


_TINY_GPT = dict(vocab_size=20, seq_len=8, n_layers=1, embd=8, heads=2, dropout=0.1)


def test_model_state_with_rng_keys_roundtrips(tmp_path):
    from flax import nnx

    from jaxbackend.models import GPT, GPTConfig
    from jaxbackend.train import load_checkpoint, save_checkpoint

    cfg = GPTConfig(**_TINY_GPT)
    model = GPT(cfg, rngs=nnx.Rngs(0, dropout=jax.random.key(3, impl="rbg")))
    state = {"model": nnx.state(model), "key": jax.random.key(4)}
    is_key = lambda x: jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)  # noqa: E731
    assert {str(jax.random.key_impl(k)) for k in jax.tree.leaves(state) if is_key(k)} == \
        {"threefry2x32", "rbg"}
    path = save_checkpoint(tmp_path / "m.ckpt", state, {"step": 0})
    fresh = GPT(cfg, rngs=nnx.Rngs(1, dropout=jax.random.key(5, impl="rbg")))
    again, _ = load_checkpoint(path, {"model": nnx.state(fresh), "key": jax.random.key(0)})
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(state)):
        assert a.dtype == b.dtype  # key<fry>, key<rbg>: the impl survives
        if is_key(b):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_array_equal(a, b)
    nnx.update(fresh, again["model"])
    tokens = jnp.arange(8)[None] % 20
    np.testing.assert_array_equal(fresh(tokens).values, model(tokens).values)  # same dropout draws


def test_generate_leaves_the_callers_train_or_eval_mode():
    from flax import nnx

    from jaxbackend.models import GPT, GPTConfig, generate

    model = GPT(GPTConfig(**_TINY_GPT), rngs=nnx.Rngs(0))
    modes = lambda: {m.deterministic for _, m in nnx.iter_graph(model)  # noqa: E731
                     if isinstance(m, nnx.Dropout)}
    model.eval()
    generate(model, [1, 2], 2, key=jax.random.key(0))
    assert modes() == {True}
    model.train()
    generate(model, [1, 2], 2, key=jax.random.key(0))
    assert modes() == {False}


def test_stale_temp_files_of_dead_writers_are_removed(tmp_path):
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # a pid that no longer runs
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        stale = tmp_path / f"c.ckpt.tmp-{proc.pid}"
        busy = tmp_path / f"c.ckpt.tmp-{live.pid}"
        other = tmp_path / "notes.tmp-1"
        for f in (stale, busy, other):
            f.write_bytes(b"partial")
        assert _checkpoint.remove_stale_tmp(tmp_path / "c.ckpt") == [stale]
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([busy.name, other.name])
    finally:
        live.kill()
        live.wait()
