"""Orbax checkpoints of sharded state: per shard on 8 simulated devices,
across a 2-process cluster (save, restore, resume training bit-exact), onto
a 4-device mesh, asynchronous saves of donated buffers, keep-last-N."""

import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxbackend.train import TrainConfig, _checkpoint, train
from tests._cluster import run_two, worker_env

WORKER = pathlib.Path(__file__).with_name("_ckpt_worker.py")


def _sharded(mesh, spec, shape, seed):
    host = np.random.default_rng(seed).normal(size=shape).astype(np.float32)
    return jax.device_put(host, NamedSharding(mesh, spec)), host


def test_sharded_state_round_trips_per_shard_on_8_devices(tmp_path):
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    w, w_host = _sharded(mesh, P("data", "model"), (8, 16), 0)
    b, b_host = _sharded(mesh, P("model"), (16,), 1)
    state = {"w": w, "b": b, "count": jnp.int32(7)}
    _checkpoint.save(tmp_path, state, {"step": 3})
    # Every device wrote its own shard: nothing was gathered to one array.
    assert (tmp_path / "3" / "state" / "ocdbt.process_0").is_dir()
    got, meta = _checkpoint.load(tmp_path, state)
    assert meta == {"step": 3}
    assert got["w"].sharding == w.sharding and got["b"].sharding == b.sharding
    np.testing.assert_array_equal(np.asarray(got["w"]), w_host)
    np.testing.assert_array_equal(np.asarray(got["b"]), b_host)
    assert int(got["count"]) == 7


def test_two_processes_save_restore_and_resume_bit_exact(tmp_path):
    logs = run_two(WORKER, lambda i, port: ["mp", str(i), str(port), str(tmp_path / "ckpt")])
    assert all(f"mp ok {i}" in log for i, log in enumerate(logs))
    assert _checkpoint.steps(tmp_path / "ckpt") == [2, 4]
    # Each process wrote its own shards.
    assert {p.name for p in (tmp_path / "ckpt" / "4" / "state").glob("ocdbt.process_*")} == \
        {"ocdbt.process_0", "ocdbt.process_1"}


def test_restore_onto_a_4_device_mesh(tmp_path):
    # Saved here, on 8 devices: arrays split 8 ways, and a training run on a
    # devices=8 plan. Restored in a process that has only 4 devices.
    mesh = jax.make_mesh((8,), ("model",))
    w, w_host = _sharded(mesh, P("model"), (16, 8), 2)
    v, v_host = _sharded(mesh, P(None, "model"), (4, 16), 3)
    _checkpoint.save(tmp_path / "arrays", {"v": v, "w": w}, {"step": 1})
    np.savez(tmp_path / "expected.npz", v=v_host, w=w_host)
    cfg = dict(steps=2, batch=8, seq=16, layers=1, embd=16, heads=2, max_chars=50_000,
               eval_batches=1, sample_chars=0, warmup=1, eval_every=0, ckpt_every=0, quiet=True,
               out=str(tmp_path / "run"))
    train(TrainConfig(**cfg, devices=8), log=lambda s: None)
    (tmp_path / "run.json").write_text(json.dumps(cfg))
    r = subprocess.run([sys.executable, str(WORKER), "remesh", str(tmp_path)], env=worker_env(),
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    report = json.loads((tmp_path / "remesh.json").read_text())
    assert report["devices"] == 4
    assert report["rows"] == [4] and report["cols"] == [4]
    assert report["resumed"] == [f"resumed from {tmp_path / 'run' / 'checkpoints' / '2'} at step 2"]
    assert report["restored_params"] > 0 and report["param_devices"] == [4]


def test_async_save_of_donated_buffers_keeps_the_saved_values(tmp_path):
    # The step donates its input: the save must hold its own copy of the
    # values by the time `save` returns, whatever the step does next.
    mesh = jax.make_mesh((8,), ("model",))
    x, host = _sharded(mesh, P("model"), (4096, 64), 4)
    bump = jax.jit(lambda a: a * 3.0 + 1.0, donate_argnums=0)
    with _checkpoint.Checkpointer(tmp_path, keep=2) as saver:
        saver.save(1, {"x": x}, {"step": 1})
        for _ in range(5):
            x = bump(x)
    got, _ = _checkpoint.load(tmp_path, {"x": x})
    np.testing.assert_array_equal(np.asarray(got["x"]), host)


def test_keep_last_n(tmp_path):
    with _checkpoint.Checkpointer(tmp_path, keep=2) as saver:
        for step in range(1, 6):
            saver.save(step, {"a": jnp.full(3, step)}, {"step": step})
    assert _checkpoint.steps(tmp_path) == [4, 5]
    assert _checkpoint.read_meta(tmp_path) == {"step": 5}
    assert _checkpoint.read_meta(tmp_path, step=4) == {"step": 4}
    got, _ = _checkpoint.load(tmp_path, {"a": jnp.zeros(3, jnp.int32)}, step=4)
    np.testing.assert_array_equal(got["a"], [4, 4, 4])
