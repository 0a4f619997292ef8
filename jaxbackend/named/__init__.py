"""`jaxbackend.named` (imported as `nx`): arrays with named dims.

Semantics follow xarray and PyTensor's xtensor (no coordinates): ops
broadcast by name, reductions and contractions take dim names, and every
contraction is one `einsum` equation whose parameters carry the names, so the
traced jaxpr still knows which axis is `batch` and which is `embd`.
"""

from jaxbackend.named._array import NamedArray as NamedArray
from jaxbackend.named._einops import (
    rearrange as rearrange,
    reduce as reduce,
    repeat as repeat,
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
    ELEMENTWISE as _ELEMENTWISE,
    REDUCTIONS as _REDUCTIONS,
    arange as arange,
    argmax as argmax,
    argmin as argmin,
    as_named as as_named,
    clip as clip,
    cumsum as cumsum,
    dot as dot,
    einsum as einsum,
    full as full,
    log_softmax as log_softmax,
    logsumexp as logsumexp,
    ones as ones,
    softmax as softmax,
    where as where,
    zeros as zeros,
)

# Elementwise math (exp, log, tanh, sqrt, rsqrt, abs, maximum, ...) and the
# reductions (sum, mean, max, ...) as functions, generated from one table each.
globals().update({k: v for k, v in _ELEMENTWISE.items()})
globals().update({k: v for k, v in _REDUCTIONS.items() if k != "logsumexp"})

__all__ = sorted(k for k in globals() if not k.startswith("_"))
