"""Corpus, batches and orbax checkpoints: round trip, every error message,
a killed save, typed PRNG keys."""

import math

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


def _big_state():  # ['w'] large enough to be stored in a data file of its own
    return {"w": jnp.arange(600.0).reshape(20, 30), "n": [jnp.int32(3), jnp.ones(4, jnp.bfloat16)]}


def test_checkpoint_roundtrip(tmp_path):
    path = _checkpoint.save(tmp_path, _state(), {"step": 5})
    assert path == tmp_path / "5"
    state, meta = _checkpoint.load(tmp_path, _state())
    assert meta == {"step": 5}
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(_state())):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert [p.name for p in tmp_path.iterdir()] == ["5"]  # no temp folder left behind
    flat, _ = _checkpoint.load(tmp_path)  # no template: path -> array
    assert sorted(flat) == ["['n'][0]", "['n'][1]", "['w']"]
    assert flat["['n'][1]"].dtype == jnp.bfloat16


def test_checksum_changes_with_any_single_flipped_bit_and_with_order():
    # every bit of every element, the float32 sign bit at odd positions included
    x = np.arange(1.0, 9.0, dtype=np.float32)
    base = int(_checkpoint._checksum(jnp.asarray(x)))
    bits = x.view(np.uint32)
    for i in range(x.size):
        for b in range(32):
            flipped = bits.copy()
            flipped[i] ^= np.uint32(1 << b)
            assert int(_checkpoint._checksum(jnp.asarray(flipped.view(np.float32)))) != base, (i, b)
    assert int(_checkpoint._checksum(jnp.asarray(x[[1, 0, *range(2, 8)]]))) != base


def test_saved_meta_is_the_meta_at_save_time(tmp_path):
    # the background save must not see what the caller appends afterwards
    history = [1.0]
    with _checkpoint.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, _state(), {"step": 1, "history": history})
        history.extend(range(1000))
    assert _checkpoint.read_meta(tmp_path)["history"] == [1.0]


def _data_file(step_dir):
    """The largest file of the saved arrays (it holds the values of ['w'])."""
    files = [f for f in (step_dir / "state").rglob("*") if f.is_file() and f.parent.name == "d"]
    return max(files, key=lambda f: f.stat().st_size)


def test_corrupt_truncated_missing_and_mismatched_checkpoints(tmp_path):
    big = _big_state()
    path = _checkpoint.save(tmp_path, big, {"step": 5})
    data = _data_file(path)
    blob = data.read_bytes()
    # A flipped bit inside the stored values: the checksum names the array.
    data.write_bytes(blob[:100] + bytes([blob[100] ^ 4]) + blob[101:])
    with pytest.raises(_checkpoint.CheckpointError,
                       match=r"corrupt \(array \['w'\] fails its checksum"):
        _checkpoint.load(tmp_path, big)
    data.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(_checkpoint.CheckpointError, match=f"checkpoint {path} is corrupt"):
        _checkpoint.load(tmp_path, big)
    data.write_bytes(blob)
    (path / "meta" / "metadata").write_text("{truncated")
    with pytest.raises(_checkpoint.CheckpointError, match=r"is corrupt \(meta: JSONDecodeError\)"):
        _checkpoint.read_meta(tmp_path)
    with pytest.raises(_checkpoint.CheckpointError, match="no checkpoint in"):
        _checkpoint.load(tmp_path / "missing", big)
    with pytest.raises(_checkpoint.CheckpointError, match="has no checkpoint of step 4"):
        _checkpoint.load(tmp_path, big, step=4)
    good = tmp_path / "good"
    _checkpoint.save(good, _state(), {"step": 1})
    with pytest.raises(_checkpoint.CheckpointError, match="expects"):
        _checkpoint.load(good, {"w": jnp.zeros((3, 2)), "n": [jnp.int32(0), jnp.ones(4, jnp.bfloat16)]})


def test_each_error_is_one_line(tmp_path):
    _checkpoint.save(tmp_path, _big_state(), {"step": 1})
    (_data_file(tmp_path / "1")).write_bytes(b"")
    for call in (lambda: _checkpoint.load(tmp_path, _big_state()),
                 lambda: _checkpoint.load(tmp_path, {**_big_state(), "w": jnp.zeros(2)}),
                 lambda: _checkpoint.read_meta(tmp_path / "none")):
        with pytest.raises(_checkpoint.CheckpointError) as e:
            call()
        assert len(str(e.value).splitlines()) == 1 and len(str(e.value)) < 300, str(e.value)


def test_a_save_killed_before_its_rename_keeps_the_old_checkpoint(tmp_path):
    # What a save killed mid-write leaves: a temp folder beside the steps.
    _checkpoint.save(tmp_path, _state(), {"step": 1})
    tmp = tmp_path / "2.orbax-checkpoint-tmp-1234"
    (tmp / "state").mkdir(parents=True)
    (tmp / "state" / "partial").write_bytes(b"partial")
    assert _checkpoint.steps(tmp_path) == [1]
    state, meta = _checkpoint.load(tmp_path, _state())
    assert meta["step"] == 1 and np.array_equal(state["w"], _state()["w"])
    assert _checkpoint.remove_stale_tmp(tmp_path) == [tmp]
    assert [p.name for p in tmp_path.iterdir()] == ["1"]


def test_load_errors_name_the_parameter_path(tmp_path):
    _checkpoint.save(tmp_path, _state(), {"step": 1})
    err = _checkpoint.CheckpointError
    with pytest.raises(err, match=r"array \['w'\] has shape \(2, 3\) float32 but the model expects"):
        _checkpoint.load(tmp_path, {**_state(), "w": jnp.zeros((3, 2))})
    with pytest.raises(err, match=r"lacks \['extra'\]"):
        _checkpoint.load(tmp_path, {**_state(), "extra": jnp.zeros(2)})
    with pytest.raises(err, match=r"holds \['n'\]\[1\], which the model lacks"):
        _checkpoint.load(tmp_path, {"w": jnp.zeros((2, 3)), "n": [jnp.int32(0)]})


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
    save_checkpoint(tmp_path, state, {"step": 0})
    fresh = GPT(cfg, rngs=nnx.Rngs(1, dropout=jax.random.key(5, impl="rbg")))
    again, _ = load_checkpoint(tmp_path, {"model": nnx.state(fresh), "key": jax.random.key(0)})
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
