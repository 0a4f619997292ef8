"""`NamedArray`: a jax.Array whose axes have names.

A JAX pytree whose only leaf is the array and whose static data (the treedef
aux) is the tuple of dim names. Sizes are never in the treedef: they come from
the leaf, so `jax.jit` retraces on new sizes exactly as it would for a plain
array and the C++ dispatch path sees one ordinary leaf.

Unflattening never validates: JAX and Flax rebuild pytrees with placeholder
leaves (None, ShapeDtypeStruct, PartitionSpec, tracers of other ranks), so
checks happen only at user-facing construction (`as_named`) and in ops.

Every method is declared here, with its signature, and delegates in one
line to the module function that does the work (`_elementwise` for the
operators, `_reductions`, `_layout`, `_gather`, `_ops`), as Haliax's
`NamedArray` does. Those modules import this one for the class, so a method
imports its module when called rather than this file importing it at the
top, which would be an import cycle. Once the package is loaded that import
is a `sys.modules` lookup (under a microsecond), paid while tracing only:
a compiled call never runs these methods.
"""

from __future__ import annotations

import operator
from types import EllipsisType
from typing import Any, Sequence, Union

import jax
from jax.typing import ArrayLike, DTypeLike

from jaxbackend.named import _errors

# Where an op takes dims: one name, several, or None / `...` for all of them.
Dims = Union[str, Sequence[str], EllipsisType, None]


@jax.tree_util.register_pytree_with_keys_class
class NamedArray:
    __slots__ = ("values", "dims")
    __array_priority__ = 100  # numpy defers `np_array + named` to us

    def __init__(self, values: Any, dims: tuple[str, ...]):
        # Internal constructor: callers have checked len(dims) == ndim.
        self.values = values
        self.dims = dims

    # -- pytree -----------------------------------------------------------
    def tree_flatten_with_keys(self):
        return ((jax.tree_util.GetAttrKey("values"), self.values),), self.dims

    def tree_flatten(self):
        return (self.values,), self.dims

    @classmethod
    def tree_unflatten(cls, dims, leaves):
        return cls(leaves[0], dims)

    # -- properties ---------------------------------------------------------
    @property
    def shape(self) -> tuple:
        return tuple(self.values.shape)

    @property
    def sizes(self) -> dict:
        return dict(zip(self.dims, self.values.shape))

    @property
    def dtype(self):
        return self.values.dtype

    @property
    def ndim(self) -> int:
        return len(self.dims)

    @property
    def size(self) -> int:
        n = 1
        for s in self.values.shape:
            n *= s
        return n

    def __len__(self):
        if not self.dims:
            raise TypeError("len() of a 0-d NamedArray")
        return self.values.shape[0]

    def __repr__(self):
        inner = ", ".join(f"{d}: {n}" for d, n in zip(self.dims, self.shape))
        return f"NamedArray({{{inner}}}, dtype={self.dtype})\n{self.values!r}"

    def _repr_html_(self) -> str:
        from jaxbackend.named import _display
        return _display.html(self)

    def __bool__(self):
        return bool(self.values)

    def item(self):
        return self.values.item()

    def axis(self, dim: str, op: str = "axis") -> int:
        """Position of `dim`, or a DimError listing the dims that exist."""
        if len(self.values.shape) != len(self.dims):
            raise _errors.rank_mismatch(op, self.values.shape, self.dims)
        try:
            return self.dims.index(dim)
        except ValueError:
            raise _errors.unknown_dim(op, dim, self.dims) from None

    def check_rank(self, op: str) -> NamedArray:
        """self, or a DimError if the leaf's rank and the dims disagree."""
        if len(self.values.shape) != len(self.dims):
            raise _errors.rank_mismatch(op, self.values.shape, self.dims)
        return self

    def astype(self, dtype: DTypeLike) -> NamedArray:
        return NamedArray(self.values.astype(dtype), self.dims)

    # -- operators: elementwise, broadcast by name (`_elementwise`) ---------
    # Comparisons are elementwise too, so NamedArray is unhashable (as jax.Array).
    __hash__ = None  # type: ignore[assignment]

    def __add__(self, other: Operand) -> NamedArray:
        from jaxbackend.named import _elementwise
        return _elementwise.add(self, other)

    def __radd__(self, other: Operand) -> NamedArray:
        from jaxbackend.named import _elementwise
        return _elementwise.add(other, self)

    def __sub__(self, other: Operand) -> NamedArray:
        from jaxbackend.named import _elementwise
        return _elementwise.subtract(self, other)

    def __rsub__(self, other: Operand) -> NamedArray:
        from jaxbackend.named import _elementwise
        return _elementwise.subtract(other, self)

    def __mul__(self, other: Operand) -> NamedArray:
        from jaxbackend.named import _elementwise
        return _elementwise.multiply(self, other)

    def __rmul__(self, other: Operand) -> NamedArray:
        from jaxbackend.named import _elementwise
        return _elementwise.multiply(other, self)

    def __truediv__(self, other: Operand) -> NamedArray:
        from jaxbackend.named import _elementwise
        return _elementwise.divide(self, other)

    def __rtruediv__(self, other: Operand) -> NamedArray:
        from jaxbackend.named import _elementwise
        return _elementwise.divide(other, self)

    def __floordiv__(self, other: Operand) -> NamedArray:
        from jaxbackend.named import _elementwise
        return _elementwise.floor_divide(self, other)

    def __rfloordiv__(self, other: Operand) -> NamedArray:
        from jaxbackend.named import _elementwise
        return _elementwise.floor_divide(other, self)

    def __mod__(self, other: Operand) -> NamedArray:
        from jaxbackend.named import _elementwise
        return _elementwise.mod(self, other)

    def __rmod__(self, other: Operand) -> NamedArray:
        from jaxbackend.named import _elementwise
        return _elementwise.mod(other, self)

    def __pow__(self, other: Operand) -> NamedArray:
        from jaxbackend.named import _elementwise
        return _elementwise.power(self, other)

    def __rpow__(self, other: Operand) -> NamedArray:
        from jaxbackend.named import _elementwise
        return _elementwise.power(other, self)

    def __and__(self, other: Operand) -> NamedArray:
        from jaxbackend.named import _elementwise
        return _elementwise.logical_and(self, other)

    def __rand__(self, other: Operand) -> NamedArray:
        from jaxbackend.named import _elementwise
        return _elementwise.logical_and(other, self)

    def __or__(self, other: Operand) -> NamedArray:
        from jaxbackend.named import _elementwise
        return _elementwise.logical_or(self, other)

    def __ror__(self, other: Operand) -> NamedArray:
        from jaxbackend.named import _elementwise
        return _elementwise.logical_or(other, self)

    def __xor__(self, other: Operand) -> NamedArray:
        from jaxbackend.named import _elementwise
        return _elementwise.logical_xor(self, other)

    def __rxor__(self, other: Operand) -> NamedArray:
        from jaxbackend.named import _elementwise
        return _elementwise.logical_xor(other, self)

    def __lt__(self, other: Operand) -> NamedArray:
        from jaxbackend.named import _elementwise
        return _elementwise.less(self, other)

    def __le__(self, other: Operand) -> NamedArray:
        from jaxbackend.named import _elementwise
        return _elementwise.less_equal(self, other)

    def __gt__(self, other: Operand) -> NamedArray:
        from jaxbackend.named import _elementwise
        return _elementwise.greater(self, other)

    def __ge__(self, other: Operand) -> NamedArray:
        from jaxbackend.named import _elementwise
        return _elementwise.greater_equal(self, other)

    def __eq__(self, other: Operand) -> NamedArray:  # type: ignore[override]
        from jaxbackend.named import _elementwise
        return _elementwise.equal(self, other)

    def __ne__(self, other: Operand) -> NamedArray:  # type: ignore[override]
        from jaxbackend.named import _elementwise
        return _elementwise.not_equal(self, other)

    def __neg__(self) -> NamedArray:
        from jaxbackend.named import _elementwise
        return _elementwise.negative(self)

    def __pos__(self) -> NamedArray:
        return self

    def __abs__(self) -> NamedArray:
        from jaxbackend.named import _elementwise
        return _elementwise.abs(self)

    def __invert__(self) -> NamedArray:
        return NamedArray(operator.invert(self.values), self.dims)

    def clip(self, min: Operand | None = None, max: Operand | None = None) -> NamedArray:
        from jaxbackend.named import _elementwise
        return _elementwise.clip(self, min, max)

    # -- contraction (`_ops`): `a @ b` contracts the dims they share --------
    def __matmul__(self, other: NamedArray) -> NamedArray:
        from jaxbackend.named import _ops
        return _ops.dot(self, other)

    def __rmatmul__(self, other: NamedArray) -> NamedArray:
        from jaxbackend.named import _ops
        return _ops.dot(other, self)

    def dot(self, *others: NamedArray, dim: Dims = None) -> NamedArray:
        from jaxbackend.named import _ops
        return _ops.dot(self, *others, dim=dim)

    # -- reductions over named dims (`_reductions`) ---------------------------
    def sum(self, dim: Dims = None, **kwargs: Any) -> NamedArray:
        from jaxbackend.named import _reductions
        return _reductions.sum(self, dim, **kwargs)

    def mean(self, dim: Dims = None, **kwargs: Any) -> NamedArray:
        from jaxbackend.named import _reductions
        return _reductions.mean(self, dim, **kwargs)

    def max(self, dim: Dims = None, **kwargs: Any) -> NamedArray:
        from jaxbackend.named import _reductions
        return _reductions.max(self, dim, **kwargs)

    def min(self, dim: Dims = None, **kwargs: Any) -> NamedArray:
        from jaxbackend.named import _reductions
        return _reductions.min(self, dim, **kwargs)

    def prod(self, dim: Dims = None, **kwargs: Any) -> NamedArray:
        from jaxbackend.named import _reductions
        return _reductions.prod(self, dim, **kwargs)

    def std(self, dim: Dims = None, **kwargs: Any) -> NamedArray:
        from jaxbackend.named import _reductions
        return _reductions.std(self, dim, **kwargs)

    def var(self, dim: Dims = None, **kwargs: Any) -> NamedArray:
        from jaxbackend.named import _reductions
        return _reductions.var(self, dim, **kwargs)

    def any(self, dim: Dims = None, **kwargs: Any) -> NamedArray:
        from jaxbackend.named import _reductions
        return _reductions.any(self, dim, **kwargs)

    def all(self, dim: Dims = None, **kwargs: Any) -> NamedArray:
        from jaxbackend.named import _reductions
        return _reductions.all(self, dim, **kwargs)

    def logsumexp(self, dim: Dims = None, **kwargs: Any) -> NamedArray:
        from jaxbackend.named import _reductions
        return _reductions.logsumexp(self, dim, **kwargs)

    def argmax(self, dim: str) -> NamedArray:
        from jaxbackend.named import _reductions
        return _reductions.argmax(self, dim)

    def argmin(self, dim: str) -> NamedArray:
        from jaxbackend.named import _reductions
        return _reductions.argmin(self, dim)

    def cumsum(self, dim: str) -> NamedArray:
        from jaxbackend.named import _reductions
        return _reductions.cumsum(self, dim)

    # -- selection and layout (`_layout`, `_gather`) ---------------------------
    def isel(self, indexers: dict[str, Any] | None = None, **kwargs: Any) -> NamedArray:
        from jaxbackend.named import _layout
        return _layout.isel(self, indexers, **kwargs)

    def take(self, indices: NamedArray | ArrayLike, dim: str, *,
             index_dims: Sequence[str] | None = None, mode: str | None = None,
             fill_value: ArrayLike | None = None) -> NamedArray:
        from jaxbackend.named import _gather
        return _gather.take(self, indices, dim, index_dims=index_dims, mode=mode,
                            fill_value=fill_value)

    def rename(self, mapping: dict[str, str] | None = None, **kwargs: str) -> NamedArray:
        from jaxbackend.named import _layout
        return _layout.rename(self, mapping, **kwargs)

    def transpose(self, *dims: str | EllipsisType) -> NamedArray:
        from jaxbackend.named import _layout
        return _layout.transpose(self, *dims)

    def expand_dims(self, dim: str | dict[str, int], size: int = 1) -> NamedArray:
        from jaxbackend.named import _layout
        return _layout.expand_dims(self, dim, size)

    def squeeze(self, dim: str | Sequence[str] | None = None) -> NamedArray:
        from jaxbackend.named import _layout
        return _layout.squeeze(self, dim)

    def stack(self, dims: dict[str, Sequence[str]] | None = None,
              **kwargs: Sequence[str]) -> NamedArray:
        from jaxbackend.named import _layout
        return _layout.stack(self, dims, **kwargs)

    def unstack(self, dims: dict[str, dict[str, int]] | None = None,
                **kwargs: dict[str, int]) -> NamedArray:
        from jaxbackend.named import _layout
        return _layout.unstack(self, dims, **kwargs)

    def __getitem__(self, key: dict[str, Any] | EllipsisType) -> NamedArray:
        from jaxbackend.named import _layout
        return _layout.getitem(self, key)

    def __setitem__(self, key: EllipsisType, value: NamedArray) -> None:
        from jaxbackend.named import _layout
        _layout.setitem(self, key, value)


# An elementwise operand: a NamedArray, or a scalar (an unnamed array only
# where no NamedArray takes part).
Operand = Union[NamedArray, ArrayLike]
