"""jaxbackend: a JAX backend for named-axis tensor programs.

Pipeline (one subpackage per stage): `named` (front end; contractions are
`einsum` equations that keep dim names) -> `passes` (jaxpr rewrites) ->
`sharding` (cost-model search over dim-name rules) -> `jit` (XLA via jax.jit).
"""

from jaxbackend import named as named
from jaxbackend import nn as nn
from jaxbackend import models as models
from jaxbackend import testing as testing
from jaxbackend import passes as passes
from jaxbackend import sharding as sharding
from jaxbackend.jit import jit as jit
from jaxbackend.named import DimError as DimError
from jaxbackend.named import NamedArray as NamedArray

__version__ = "0.1.0"
