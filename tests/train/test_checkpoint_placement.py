"""A good checkpoint restored onto shardings that cannot hold it is never
called corrupt (the corrupt message says: delete it)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jaxbackend.train import _checkpoint


def _mesh4():
    return jax.make_mesh((4,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])


def _saved(tmp_path):
    _checkpoint.save(tmp_path, {"w": jnp.arange(6.0), "b": jnp.ones(8)}, {"step": 1})
    return tmp_path / "1"


def test_a_template_sharding_that_does_not_divide_a_dim_names_the_leaf(tmp_path):
    step = _saved(tmp_path)
    mesh = _mesh4()
    template = {"w": jax.ShapeDtypeStruct((6,), jnp.float32, sharding=NamedSharding(mesh, P("x"))),
                "b": jax.ShapeDtypeStruct((8,), jnp.float32, sharding=NamedSharding(mesh, P("x")))}
    with pytest.raises(_checkpoint.CheckpointError) as e:
        _checkpoint.load(tmp_path, template)
    msg = str(e.value)
    assert msg == (f"checkpoint {step}: template leaf ['w'] of shape (6,) does not split evenly "
                   f"over its sharding P('x',) on mesh {{'x': 4}}; give that leaf a sharding "
                   f"whose mesh axes divide its dims.")
    assert "corrupt" not in msg and "\n" not in msg
    # the same checkpoint restores onto shardings that fit
    template["w"] = jax.ShapeDtypeStruct((6,), jnp.float32, sharding=NamedSharding(mesh, P()))
    state, _ = _checkpoint.load(tmp_path, template)
    np.testing.assert_array_equal(state["w"], np.arange(6.0))
    assert state["b"].sharding == template["b"].sharding


def test_a_readable_checkpoint_that_fails_to_place_is_not_called_corrupt(tmp_path):
    """Past the shape check (here: called directly), a restore that fails on
    the requested shardings but reads onto the default device says so."""
    step = _saved(tmp_path)
    bad = jax.ShapeDtypeStruct((6,), jnp.float32, sharding=NamedSharding(_mesh4(), P("x")))
    fine = jax.ShapeDtypeStruct((8,), jnp.float32,
                                sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    # in the saved leaf order (dict keys sorted): b, then w
    with pytest.raises(_checkpoint.CheckpointError, match="is readable, but its arrays could not "
                       "be placed on the template's shardings") as e:
        _checkpoint._restore(step, [fine, bad], placed=True)
    assert "corrupt" not in str(e.value)
    # unplaced (no template): the same failure is reported as it was
    with pytest.raises(_checkpoint.CheckpointError, match="is corrupt"):
        _checkpoint._restore(step, [fine, bad], placed=False)


def test_a_damaged_checkpoint_with_a_template_is_still_corrupt(tmp_path):
    step = _saved(tmp_path)
    for f in (step / "state").rglob("*"):
        if f.is_file() and f.parent.name == "d":
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    template = {k: jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(_mesh4(), P()))
                for k, s in (("w", (6,)), ("b", (8,)))}
    with pytest.raises(_checkpoint.CheckpointError, match=f"checkpoint {step} is corrupt"):
        _checkpoint.load(tmp_path, template)
