"""Sparse COO tensors on the lazy device: `nn.Embedding(sparse=True)`'s gradient, and what
SparseAdam and autograd do with it.

A `LazySparse` is a wrapper tensor of layout torch.sparse_coo whose indices (int64,
[sparse_dim, nnz]) and values ([nnz, *dense sizes]) are lazy tensors: an op on it is a few
ops on them, traced like any other. PyTorch builds the embedding gradient in ATen ops that
end in `_sparse_coo_tensor_with_dims_and_tensors`, whose handler here makes the LazySparse.

Coalescing is the one step whose result shape depends on data: the number of distinct
indices is the number of rows of the values. `_coalesce` therefore reads the indices (a sync
point), finds the distinct ones and where each entry goes on the CPU, and sums the values
into their rows on the device with index_add, in the order CPU PyTorch's coalesce adds
duplicates up (that of a CPU sort of the indices), so the sums are CPU's to the bit. Each
distinct count is a new shape, compiled once, as for any new input shape.

A call that mixes a dense lazy tensor with a sparse one (`exp_avg.add_(sparse)`,
`exp_avg.sparse_mask(grad)`) comes here too: LazyTensor's dispatch leaves a call with an
argument of another tensor subclass to that subclass. Any other op on a sparse lazy tensor
raises NotImplementedError naming it.
"""
import torch

from ..device import LAZY
from ..tensor import LazyTensor
from .registry import HANDLER, dispatch, register

aten = torch.ops.aten


def _call(op, *args, **kwargs):
    return dispatch(op, args, kwargs)


class LazySparse(torch.Tensor):
    """A sparse COO tensor on the lazy device whose indices and values are lazy tensors."""

    @staticmethod
    def __new__(cls, indices, values, size, coalesced=False):
        t = torch.Tensor._make_wrapper_subclass(cls, tuple(size), dtype=values.dtype, device=LAZY,
                                                layout=torch.sparse_coo)
        t._set(indices, values, coalesced)
        return t

    def _set(self, indices, values, coalesced):
        self._sp_indices, self._sp_values, self._sp_coalesced = indices, values, bool(coalesced)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        handler = _OPS.get(func)
        if handler is None:
            raise NotImplementedError(
                f"{func} on a sparse lazy tensor: the lazy device runs on sparse COO tensors what sparse "
                "embedding gradients and the optimizers that take them need (coalesce, _indices, _values, add, "
                "mul and div by a number, sparse_mask, to_dense, .cpu()); call .to_dense() first")
        return handler(*args, **(kwargs or {}))

    def new(self, *args, **kwargs):
        """Return a sparse lazy tensor from (indices, values, size), as torch.Tensor.new does for
        sparse tensors (SparseAdam builds its updates so)."""
        if len(args) != 3 or kwargs:
            raise NotImplementedError("new() of a sparse lazy tensor takes (indices, values, size), got "
                                      f"{len(args)} positional and {sorted(kwargs)} keyword arguments")
        indices, values, size = args
        return _make(indices.shape[0], values.dim() - 1, list(size), indices, values)

    def __repr__(self):
        return (f"LazySparse(size={tuple(self.shape)}, nnz={self._sp_values.shape[0]}, dtype={self.dtype}, "
                f"device='lazy:0', coalesced={self._sp_coalesced})")


_OPS = {}  # OpOverload -> fn(*args, **kwargs) for calls that reach LazySparse.__torch_dispatch__


def _on_sparse(*ops):
    def file(fn):
        for op in ops:
            _OPS[op] = fn
        return fn

    return file


def _lazy(x, what):
    if not isinstance(x, LazyTensor):
        raise RuntimeError(f"a sparse lazy tensor's {what} must be on the lazy device, got a tensor on "
                           f"{getattr(x, 'device', type(x).__name__)}")
    return x


def _make(sparse_dim, dense_dim, size, indices, values, *, dtype=None, is_coalesced=None, **_):
    _lazy(indices, "indices")
    _lazy(values, "values")
    if indices.dtype is not torch.int64 or indices.dim() != 2 or indices.shape[0] != sparse_dim:
        raise RuntimeError(f"sparse indices must be int64 of shape ({sparse_dim}, nnz), got {indices.dtype} "
                           f"{tuple(indices.shape)}")
    if len(size) != sparse_dim + dense_dim or values.dim() != dense_dim + 1 or values.shape[0] != indices.shape[1]:
        raise RuntimeError(f"sparse values of shape {tuple(values.shape)} do not fit indices of shape "
                           f"{tuple(indices.shape)} and size {tuple(size)}")
    if dtype is not None and dtype != values.dtype:
        values = _call(aten._to_copy.default, values, dtype=dtype)
    return LazySparse(indices, values, size, bool(is_coalesced))


@register(aten._sparse_coo_tensor_with_dims_and_tensors.default, tier=HANDLER)
def _sparse_coo(func, args, kwargs):
    return _make(*args, **kwargs)


@_on_sparse(aten._indices.default)
def _indices(s):
    return s._sp_indices


@_on_sparse(aten._values.default)
def _values(s):
    return s._sp_values


def _coalesced_part(s, k):
    if not s._sp_coalesced:
        raise RuntimeError("Cannot get indices or values on an uncoalesced sparse tensor, please call .coalesce() "
                           "first")
    return (s._sp_indices, s._sp_values)[k]


_OPS[aten.indices.default] = lambda s: _coalesced_part(s, 0)
_OPS[aten.values.default] = lambda s: _coalesced_part(s, 1)
_OPS[aten._nnz.default] = lambda s: s._sp_values.shape[0]
_OPS[aten.sparse_dim.default] = lambda s: s._sp_indices.shape[0]
_OPS[aten.dense_dim.default] = lambda s: s._sp_values.dim() - 1
_OPS[aten.is_coalesced.default] = lambda s: s._sp_coalesced


@_on_sparse(aten._coalesced_.default)
def _coalesced_(s, coalesced):
    s._sp_coalesced = bool(coalesced)
    return s


@_on_sparse(aten.detach.default, aten.alias.default)
def _alias(s):
    return LazySparse(s._sp_indices, s._sp_values, s.shape, s._sp_coalesced)


@_on_sparse(aten.detach_.default)
def _detach_(s):
    return s


@_on_sparse(aten.clone.default)
def _clone(s, memory_format=None):
    return LazySparse(_call(aten.clone.default, s._sp_indices), _call(aten.clone.default, s._sp_values), s.shape,
                      s._sp_coalesced)


@_on_sparse(aten.neg.default)
def _neg(s):
    return LazySparse(s._sp_indices, _call(aten.neg.default, s._sp_values), s.shape, s._sp_coalesced)


def _scaler(op):
    def scale(s, other):
        if not isinstance(s, LazySparse) or (isinstance(other, torch.Tensor)
                                             and (other.dim() != 0 or isinstance(other, LazySparse))):
            raise NotImplementedError(f"{op} with a sparse lazy tensor: it multiplies or divides by a number or a "
                                      "0-dim tensor only")
        return LazySparse(s._sp_indices, _call(op, s._sp_values, other), s.shape, s._sp_coalesced)

    return scale


_OPS[aten.mul.Scalar] = _OPS[aten.mul.Tensor] = _scaler(aten.mul.Tensor)
_OPS[aten.div.Scalar] = _OPS[aten.div.Tensor] = _scaler(aten.div.Tensor)


@_on_sparse(aten._coalesce.default, aten.coalesce.default)
def _coalesce(s):
    """The sparse tensor with each index once, its values summed: the indices are read here."""
    if s._sp_coalesced:
        return s
    indices = s._sp_indices._to_cpu()
    sizes = s.shape[:indices.shape[0]]
    flat = torch.zeros(indices.shape[1], dtype=torch.int64)
    for d, n in enumerate(sizes):
        flat = flat * n + indices[d]
    distinct, where = torch.unique(flat, sorted=True, return_inverse=True)
    order = flat.sort().indices  # CPU's coalesce adds duplicates up in the order of this sort
    rows, rest = [], distinct
    for n in reversed(sizes):
        rows.append(rest % n)
        rest = rest // n
    indices = torch.stack(rows[::-1]) if rows else torch.zeros((0, len(distinct)), dtype=torch.int64)
    values = LazyTensor.from_cpu(torch.zeros((len(distinct),) + tuple(s._sp_values.shape[1:]), dtype=s.dtype))
    entries = _call(aten.index_select.default, s._sp_values, 0, LazyTensor.from_cpu(order))
    values = _call(aten.index_add.default, values, 0, LazyTensor.from_cpu(where[order]), entries)
    return LazySparse(LazyTensor.from_cpu(indices), values, s.shape, True)


def _index_args(s):
    return [_call(aten.select.int, s._sp_indices, 0, d) for d in range(s._sp_indices.shape[0])]


def _dense_plus(dense, s, alpha, inplace):
    """dense + alpha * s: the values added at their indices, duplicates in entry order, as on CPU.
    With alpha other than 1 a sum can part from CPU's in its last bit: CPU's axpy fuses the
    multiply into the add, here the values are scaled first (SGD's and Adagrad's sparse steps)."""
    if dense.shape != s.shape:
        raise RuntimeError(f"adding a sparse tensor of size {tuple(s.shape)} to a dense one of size "
                           f"{tuple(dense.shape)}: the sizes must match")
    values = s._sp_values if alpha == 1 else _call(aten.mul.Tensor, s._sp_values, alpha)
    op = aten.index_put_.default if inplace else aten.index_put.default
    return _call(op, dense, _index_args(s), values, True)


@_on_sparse(aten.add.Tensor)
def _add(a, b, alpha=1):
    if isinstance(a, LazySparse) and isinstance(b, LazySparse):
        if a.shape != b.shape:
            raise RuntimeError(f"adding sparse tensors of sizes {tuple(a.shape)} and {tuple(b.shape)}: they must match")
        values = b._sp_values if alpha == 1 else _call(aten.mul.Tensor, b._sp_values, alpha)
        return LazySparse(_call(aten.cat.default, [a._sp_indices, b._sp_indices], 1),
                          _call(aten.cat.default, [a._sp_values, values]), a.shape)
    if isinstance(b, LazySparse):
        return _dense_plus(_lazy(a, "dense operand"), b, alpha, False)
    if alpha != 1:
        raise NotImplementedError("sparse + alpha * dense on the lazy device: alpha must be 1")
    return _dense_plus(_lazy(b, "dense operand"), a, 1, False)


@_on_sparse(aten.add_.Tensor)
def _add_(a, b, alpha=1):
    if isinstance(a, LazySparse):
        if not isinstance(b, LazySparse):
            raise NotImplementedError("adding a dense tensor into a sparse lazy tensor in place")
        total = _add(a, b, alpha)
        a._set(total._sp_indices, total._sp_values, False)
        return a
    return _dense_plus(_lazy(a, "dense operand"), b, alpha, True)


@_on_sparse(aten.sparse_mask.default)
def _sparse_mask(dense, mask):
    """The dense tensor's entries at the mask's indices, as a sparse tensor with those indices."""
    _lazy(dense, "dense operand")
    if dense.shape != mask.shape:
        raise RuntimeError(f"sparse_mask of a tensor of size {tuple(dense.shape)} with a mask of size "
                           f"{tuple(mask.shape)}: the sizes must match")
    return LazySparse(mask._sp_indices, _call(aten.index.Tensor, dense, _index_args(mask)), mask.shape,
                      mask._sp_coalesced)


@_on_sparse(aten.zero_.default)
def _zero_(s):
    empty = torch.zeros((0,) + tuple(s._sp_values.shape[1:]), dtype=s.dtype)
    s._set(LazyTensor.from_cpu(torch.zeros((s._sp_indices.shape[0], 0), dtype=torch.int64)),
           LazyTensor.from_cpu(empty), True)
    return s


@_on_sparse(aten._to_dense.default, aten.to_dense.default)
def _to_dense(s, dtype=None, masked_grad=None):
    zeros = LazyTensor.from_cpu(torch.zeros(tuple(s.shape), dtype=dtype or s.dtype))
    values = s._sp_values if dtype in (None, s.dtype) else _call(aten._to_copy.default, s._sp_values, dtype=dtype)
    return _call(aten.index_put.default, zeros, _index_args(s), values, True)


@_on_sparse(aten._to_copy.default)
def _to_copy(s, *, dtype=None, layout=None, device=None, **_):
    if layout not in (None, torch.sparse_coo):
        raise NotImplementedError(f"converting a sparse lazy tensor to {layout}: use .to_dense()")
    values = s._sp_values if dtype in (None, s.dtype) else _call(aten._to_copy.default, s._sp_values, dtype=dtype)
    if device is not None and torch.device(device).type != LAZY.type:
        return torch.sparse_coo_tensor(s._sp_indices._to_cpu(), values._to_cpu(), tuple(s.shape),
                                       is_coalesced=s._sp_coalesced, check_invariants=True).to(device)
    return LazySparse(s._sp_indices, values, s.shape, s._sp_coalesced)
