"""`NamedArray`: a jax.Array whose axes have names.

A JAX pytree whose only leaf is the array and whose static data (the treedef
aux) is the tuple of dim names. Sizes are never in the treedef: they come from
the leaf, so `jax.jit` retraces on new sizes exactly as it would for a plain
array and the C++ dispatch path sees one ordinary leaf.

Unflattening never validates: JAX and Flax rebuild pytrees with placeholder
leaves (None, ShapeDtypeStruct, PartitionSpec, tracers of other ranks), so
checks happen only at user-facing construction (`as_named`) and in ops.

Methods are thin: the work lives in `_ops` (math, broadcasting by name) and
`_layout` (selection and layout); both emit the primitives a hand-written
`jnp` program would.
"""

from __future__ import annotations

import jax

from jaxbackend.named import _errors


@jax.tree_util.register_pytree_with_keys_class
class NamedArray:
    __slots__ = ("values", "dims")
    __array_priority__ = 100  # numpy defers `np_array + named` to us

    def __init__(self, values, dims):
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

    def check_rank(self, op: str) -> "NamedArray":
        """self, or a DimError if the leaf's rank and the dims disagree."""
        if len(self.values.shape) != len(self.dims):
            raise _errors.rank_mismatch(op, self.values.shape, self.dims)
        return self

    def astype(self, dtype) -> "NamedArray":
        return NamedArray(self.values.astype(dtype), self.dims)

    # Methods below are bound in `_ops` / `_layout` (kept there so this file
    # stays the data type and its protocol, not the op library).
