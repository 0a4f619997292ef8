"""jaxbackend: a JAX backend for named-axis tensor programs.

Pipeline (one subpackage per stage): `named` (front end; contractions are
`einsum` equations that keep dim names) -> `passes` (jaxpr rewrites) ->
`sharding` (cost-model search over dim-name rules) -> `jit` (XLA via jax.jit).
"""

import importlib as _importlib

from jaxbackend import named as named
from jaxbackend import passes as passes
from jaxbackend._devices import simulate_cpu_devices as simulate_cpu_devices
from jaxbackend._layer import layer as layer
from jaxbackend._stacked import Stacked as Stacked
from jaxbackend._stacked import stack_layers as stack_layers
from jaxbackend._stacked import unstack_layers as unstack_layers
from jaxbackend.jit import jit as jit
from jaxbackend.named import DimError as DimError
from jaxbackend.named import NamedArray as NamedArray

# Loaded on first use: they import Flax (about 0.8 s), which a named-array
# or pass-pipeline user does not need at `import jaxbackend`.
_LAZY = ("nn", "models", "programs", "testing", "sharding", "train")


def __getattr__(name):
    if name in _LAZY:
        return _importlib.import_module(f"jaxbackend.{name}")
    raise AttributeError(f"module 'jaxbackend' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))

__version__ = "0.1.0"
