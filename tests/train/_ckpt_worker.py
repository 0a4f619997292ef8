"""Subprocesses of tests/train/test_orbax.py (not collected by pytest).

`mp PID PORT DIR`: one of 2 processes (4 CPU devices each, gloo
collectives, a (2, 4) mesh over both). It trains a sharded two-layer
regression model for 4 SGD steps, saving after step 2 and step 4; then
restores step 2 onto the same shardings, runs steps 3 and 4 again and
checks the result equals the saved step 4 bit for bit (each process on the
shards it holds). Prints "mp ok <pid>" on success.

`remesh DIR`: 4 CPU devices. DIR/arrays holds arrays saved from an 8-device
mesh (by the test); they are restored onto two other 4-device layouts and
compared with DIR/expected.npz. DIR/run holds a training run saved with
`devices=8`; it is resumed with `devices=4` (the plan's shardings on the
4-device mesh, no further steps) and its parameters compared with the
saved ones. Writes DIR/remesh.json.
"""

import json
import os
import pathlib
import sys

MODE = sys.argv[1]
from jaxbackend._devices import cpu_device_flags  # noqa: E402

os.environ["XLA_FLAGS"] = cpu_device_flags(4)
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

if MODE == "mp":
    jax.config.update("jax_cpu_collectives_implementation", "gloo")


def _sgd_step(params, x, y):
    def loss(p):
        h = jnp.tanh(x @ p["w1"] + p["b1"])
        return jnp.mean((h @ p["w2"] - y) ** 2)
    grads = jax.grad(loss)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def mp(pid: int, port: int, folder: str) -> None:
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=pid, initialization_timeout=60)
    from jaxbackend.train import _checkpoint

    assert jax.device_count() == 8 and jax.local_device_count() == 4
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    specs = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None)}
    rng = np.random.default_rng(0)
    host = {"w1": rng.normal(size=(16, 32)), "b1": rng.normal(size=32),
            "w2": rng.normal(size=(32, 8))}
    # Every process builds only the shards its devices hold.
    params = {k: jax.make_array_from_callback(v.shape, NamedSharding(mesh, specs[k]),
                                              lambda idx, v=v: v[idx].astype(np.float32))
              for k, v in host.items()}
    xs, ys = rng.normal(size=(4, 8, 16)), rng.normal(size=(4, 8, 8))
    batch = NamedSharding(mesh, P("data"))
    data = [(jax.make_array_from_callback(x.shape, batch, lambda i, x=x: x[i].astype(np.float32)),
             jax.make_array_from_callback(y.shape, batch, lambda i, y=y: y[i].astype(np.float32)))
            for x, y in zip(xs, ys)]
    step = jax.jit(_sgd_step, donate_argnums=0)
    with _checkpoint.Checkpointer(folder, keep=2) as saver:
        for i, (x, y) in enumerate(data):
            params = step(params, x, y)
            if i + 1 in (2, 4):  # async: step 3 runs while step 2 is written
                saver.save(i + 1, {"params": params}, {"step": i + 1})
    final = {k: [np.asarray(s.data) for s in v.addressable_shards] for k, v in params.items()}
    state, meta = _checkpoint.load(folder, {"params": params}, step=2)
    assert meta == {"step": 2}, meta
    resumed = state["params"]
    for k, v in resumed.items():
        assert v.sharding == params[k].sharding, (k, v.sharding)
    for x, y in data[2:]:
        resumed = step(resumed, x, y)
    for k, v in resumed.items():
        for got, want in zip((np.asarray(s.data) for s in v.addressable_shards), final[k]):
            np.testing.assert_array_equal(got, want)
    saved4, _ = _checkpoint.load(folder, {"params": resumed}, step=4)
    for k, v in saved4["params"].items():
        for got, want in zip((np.asarray(s.data) for s in v.addressable_shards), final[k]):
            np.testing.assert_array_equal(got, want)
    print("mp ok", pid, flush=True)
    jax.distributed.shutdown()


def remesh(folder: str) -> None:
    from jaxbackend.train import TrainConfig, _checkpoint, train

    folder_path = pathlib.Path(folder)
    expected = np.load(folder_path / "expected.npz")
    mesh = jax.make_mesh((4,), ("model",))
    report: dict = {"devices": jax.device_count()}
    for name, spec in (("rows", P("model")), ("cols", P(None, "model"))):
        target = {k: jax.ShapeDtypeStruct(expected[k].shape, expected[k].dtype,
                                          sharding=NamedSharding(mesh, spec if expected[k].ndim == 2
                                                                 else P()))
                  for k in expected.files}
        got, _ = _checkpoint.load(folder_path / "arrays", target)
        for k in expected.files:
            np.testing.assert_array_equal(np.asarray(got[k]), expected[k])
            assert got[k].sharding == target[k].sharding
        report[name] = sorted({len(got[k].sharding.device_set) for k in expected.files})
    cfg = json.loads((folder_path / "run.json").read_text())
    saved, _ = _checkpoint.load(folder_path / "run" / "checkpoints")
    lines: list = []
    # As many steps as were saved: the result's parameters are the restored ones.
    result = train(TrainConfig(**{**cfg, "devices": 4, "resume": True}), log=lines.append)
    report["resumed"] = [ln for ln in lines if ln.startswith("resumed from")]
    flat = jax.tree_util.tree_flatten_with_path({"params": result["params"]})[0]
    for path, x in flat:
        np.testing.assert_array_equal(np.asarray(x), np.asarray(saved[jax.tree_util.keystr(path)]))
    report["restored_params"] = len(flat)
    report["param_devices"] = sorted({len(x.sharding.device_set) for _, x in flat})
    print(json.dumps(report), flush=True)
    (folder_path / "remesh.json").write_text(json.dumps(report))


if __name__ == "__main__":
    if MODE == "mp":
        mp(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    else:
        remesh(sys.argv[2])
