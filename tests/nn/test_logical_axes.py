"""`nn.partition_specs` on models that are not built from jaxbackend.nn:
Flax logical-axis metadata (`nnx.with_partitioning`) is read as dim names,
and a model with unnamed parameters warns instead of silently replicating."""

import warnings

import jax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxbackend import nn


def _flax_mlp(named: bool):
    def init(names):
        base = nnx.initializers.lecun_normal()
        return nnx.with_partitioning(base, names) if named else base

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(8, 32, kernel_init=init(("embed", "mlp")), rngs=rngs)
            self.down = nnx.Linear(32, 8, kernel_init=init(("mlp", "embed")), rngs=rngs)

    with nnx.use_eager_sharding(False):
        return MLP(nnx.Rngs(0))


def test_flax_logical_axis_metadata_names_the_dims():
    model = _flax_mlp(named=True)
    dims = nn.param_dims(model)
    assert dims["up"]["kernel"] == ("embed", "mlp") and dims["down"]["kernel"] == ("mlp", "embed")
    with pytest.warns(UserWarning, match="no dim names"):      # the biases have none
        specs = nn.partition_specs(model, {"mlp": "model", "embed": None})
    assert specs["up"]["kernel"] == P(None, "model")
    assert specs["down"]["kernel"] == P("model", None)


def test_unnamed_model_warns_and_names_a_parameter():
    model = _flax_mlp(named=False)
    with pytest.warns(UserWarning, match=r"4 variables carry no dim names \(e\.g\. \['down'\]"):
        specs = nn.partition_specs(model, {"mlp": "model"})
    assert all(s == P() for s in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)))


def test_named_layers_do_not_warn():
    model = nn.MLP(8, 32, rngs=nnx.Rngs(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        specs = nn.partition_specs(model, {"mlp": "model"})
    assert specs["up"]["kernel"] == P(None, "model")
