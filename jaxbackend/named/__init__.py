"""`jaxbackend.named` (imported as `nx`): arrays with named dims.

Semantics follow xarray and PyTensor's xtensor (no coordinates): ops
broadcast by name, reductions and contractions take dim names, and every
contraction is one `einsum` equation whose parameters carry the names, so the
traced jaxpr still knows which axis is `batch` and which is `embd`.

Where things live: `_array` (the NamedArray pytree and its methods),
`_elementwise` (broadcasting by name, math, operators), `_reductions`,
`_ops` (construction, `dot`, `einsum`), `_layout` (isel, rename,
transpose, stack, ...), `_gather` (take, cross_entropy), `_einops`,
`_einsum` (the primitive), `_errors`.
"""

from jaxbackend.named._array import NamedArray as NamedArray
from jaxbackend.named._einops import (
    rearrange as rearrange,
    reduce as reduce,
    repeat as repeat,
)
from jaxbackend.named._elementwise import (
    abs as abs,
    add as add,
    arctan2 as arctan2,
    ceil as ceil,
    clip as clip,
    cos as cos,
    divide as divide,
    equal as equal,
    erf as erf,
    exp as exp,
    expm1 as expm1,
    floor as floor,
    floor_divide as floor_divide,
    gelu as gelu,
    greater as greater,
    greater_equal as greater_equal,
    isfinite as isfinite,
    isnan as isnan,
    less as less,
    less_equal as less_equal,
    log as log,
    log1p as log1p,
    logical_and as logical_and,
    logical_not as logical_not,
    logical_or as logical_or,
    logical_xor as logical_xor,
    maximum as maximum,
    minimum as minimum,
    mod as mod,
    multiply as multiply,
    negative as negative,
    not_equal as not_equal,
    power as power,
    reciprocal as reciprocal,
    relu as relu,
    round as round,
    rsqrt as rsqrt,
    sigmoid as sigmoid,
    sign as sign,
    silu as silu,
    sin as sin,
    sqrt as sqrt,
    square as square,
    stop_gradient as stop_gradient,
    subtract as subtract,
    tanh as tanh,
    where as where,
)
from jaxbackend.named._einsum import einsum_p as einsum_p
from jaxbackend.named._errors import DimError as DimError
from jaxbackend.named._gather import cross_entropy as cross_entropy, take as take
from jaxbackend.named._layout import (
    concat as concat,
    expand_dims as expand_dims,
    isel as isel,
    rename as rename,
    squeeze as squeeze,
    stack as stack,
    transpose as transpose,
    unstack as unstack,
)
from jaxbackend.named._ops import (
    arange as arange,
    as_named as as_named,
    dot as dot,
    einsum as einsum,
    full as full,
    ones as ones,
    zeros as zeros,
)
from jaxbackend.named._reductions import (
    all as all,
    any as any,
    argmax as argmax,
    argmin as argmin,
    cumsum as cumsum,
    log_softmax as log_softmax,
    logsumexp as logsumexp,
    max as max,
    mean as mean,
    min as min,
    prod as prod,
    softmax as softmax,
    std as std,
    sum as sum,
    var as var,
)

__all__ = [
    "DimError", "NamedArray", "abs", "add", "all", "any", "arange", "arctan2", "argmax", "argmin",
    "as_named", "ceil", "clip", "concat", "cos", "cross_entropy", "cumsum", "divide", "dot",
    "einsum", "einsum_p", "equal", "erf", "exp", "expand_dims", "expm1", "floor", "floor_divide",
    "full", "gelu", "greater", "greater_equal", "isel", "isfinite", "isnan", "less", "less_equal",
    "log", "log1p", "log_softmax", "logical_and", "logical_not", "logical_or", "logical_xor",
    "logsumexp", "max", "maximum", "mean", "min", "minimum", "mod", "multiply", "negative",
    "not_equal", "ones", "power", "prod", "rearrange", "reciprocal", "reduce", "relu", "rename",
    "repeat", "round", "rsqrt", "sigmoid", "sign", "silu", "sin", "softmax", "sqrt", "square",
    "squeeze", "stack", "std", "stop_gradient", "subtract", "sum", "take", "tanh", "transpose",
    "unstack", "var", "where", "zeros",
]
