"""`jaxbackend.nn`: Flax NNX layers that take and return NamedArrays.

Every parameter is an `nnx.Param` with `dims` metadata naming its axes, so
sharding rules (dim name -> mesh axis) become parameter shardings
(`partition_specs`, `shardings`) or Flax logical axis rules
(`flax_logical_axis_rules`, `annotate_logical_axes`).
"""

from jaxbackend.nn._attention import MultiHeadAttention as MultiHeadAttention
from jaxbackend.nn._attention import rope as rope
from jaxbackend.nn._blocks import MLP as MLP
from jaxbackend.nn._blocks import TransformerBlock as TransformerBlock
from jaxbackend.nn._layers import Dropout as Dropout
from jaxbackend.nn._layers import Embedding as Embedding
from jaxbackend.nn._layers import LayerNorm as LayerNorm
from jaxbackend.nn._layers import Linear as Linear
from jaxbackend.nn._layers import RMSNorm as RMSNorm
from jaxbackend.nn._params import annotate_logical_axes as annotate_logical_axes
from jaxbackend.nn._params import check_divisible as check_divisible
from jaxbackend.nn._params import flax_logical_axis_rules as flax_logical_axis_rules
from jaxbackend.nn._params import functional as functional
from jaxbackend.nn._params import named as named
from jaxbackend.nn._params import param_dims as param_dims
from jaxbackend.nn._params import partition_specs as partition_specs
from jaxbackend.nn._params import shardings as shardings
