"""ratex's own decompositions: ops re-expressed in simpler ATen ops that lower well.

Scalars folded into an op (alpha, value, weight) become multiplies whose float
scalars are lifted to graph inputs; where/index_put with scalars or a mask become
`where`; torch.equal a reduction on the device; the prims that PyTorch's
reference decompositions are written in become ATen ops; backward helpers are
scatters into zeros. A decomposition may return NotImplemented to leave the call
to the op's own path.

These run inside __torch_dispatch__, below autograd: their ops go to the router
directly rather than through torch's dispatcher again (a round trip per op).
"""
import torch

from ..shape import contiguous_strides
from ..tensor import LazyTensor
from . import registry
from .capture import Value, arg_sig, is_arg_tensor, is_value_arg
from .record import float_scalar_dtype, functional, liftable, scalar_input, value_op
from .registry import DECOMPOSITION, register

aten = torch.ops.aten
prims = torch.ops.prims


def _call(op, *args, **kwargs):
    return registry.dispatch(op, args, kwargs)


# ---- scalars folded into arithmetic ---------------------------------------------------------
# Each takes `last`, which records the final op: `_call` for a decomposition (a tensor the user
# gets), `value_op` for the in-place fast path (a value written straight into the target).
def _add_alpha(func):
    def decomp(a, b, *, alpha=1, last=_call):
        if alpha == 1 or not is_arg_tensor(b):
            return NotImplemented
        if liftable(alpha) and _dense(a) and _dense(b):
            # One node, a + b * alpha (addcmul's rule), as PyTorch computes it: in the result's dtype
            # (float32 for float16/bfloat16), alpha rounded to it, b not first multiplied in its own
            # dtype (Muon adds a bfloat16 update to a float32 parameter with alpha = -lr).
            dtype = torch.promote_types(arg_sig(a)[2], arg_sig(b)[2])
            if dtype.is_floating_point:
                sign = -1 if func is aten.sub.Tensor else 1
                value = value_op(aten.addcmul.default, a, b, scalar_input(sign * alpha, dtype))
                if type(value) is Value and last is _call:
                    return LazyTensor.from_value(value.value)
                return value
        return last(func, a, value_op(aten.mul.Tensor, _in_result_dtype(a, b), alpha))

    return decomp


def _in_result_dtype(a, b):
    """`b` cast to the dtype of a + b where that is wider than b's: PyTorch scales b in the
    result's dtype (a bfloat16 update transposed back and added to a float32 parameter, as Muon
    does, is not first multiplied in bfloat16)."""
    if not (is_value_arg(a) and is_value_arg(b)):
        return b
    (sa, _, da), (sb, _, db) = arg_sig(a), arg_sig(b)
    if da == db:
        return b
    dtype = torch.result_type(torch.empty(sa, dtype=da, device="meta"), torch.empty(sb, dtype=db, device="meta"))
    return b if dtype == db else _call(aten._to_copy.default, b, dtype=dtype)


def _dense(x) -> bool:
    """Whether `x` is a lazy tensor or IR value laid out row-major: a one-node result is
    built contiguous, where PyTorch's follows its inputs' layout (a.t() + b.t())."""
    if not is_value_arg(x):
        return False
    shape, strides, _ = arg_sig(x)
    return tuple(strides) == tuple(contiguous_strides(shape))


register(aten.add.Tensor, tier=DECOMPOSITION)(_add_alpha(aten.add.Tensor))
register(aten.sub.Tensor, tier=DECOMPOSITION)(_add_alpha(aten.sub.Tensor))


@register(aten.addcmul.default, tier=DECOMPOSITION)
def addcmul(self, t1, t2, *, value=1, last=_call):
    """Return self + value * t1 * t2, its last op recorded by `last`."""
    return last(aten.add.Tensor, self, value_op(aten.mul.Tensor, value_op(aten.mul.Tensor, t1, value), t2))


@register(aten.addcdiv.default, tier=DECOMPOSITION)
def addcdiv(self, t1, t2, *, value=1, last=_call):
    """Return self + t1 / t2 * value, its last op recorded by `last`."""
    return last(aten.add.Tensor, self, value_op(aten.mul.Tensor, value_op(aten.div.Tensor, t1, t2), value))


@register(aten.lerp.Scalar, tier=DECOMPOSITION)
def lerp_scalar(self, end, weight, *, last=_call):
    """Return torch's lerp of self and end by the number `weight` (see `lerp_formula`), its last
    op recorded by `last`."""
    small, w = lerp_formula(weight, arg_sig(self)[2])
    diff = value_op(aten.sub.Tensor, end, self)
    if small:
        return last(aten.add.Tensor, self, value_op(aten.mul.Tensor, diff, w))
    return last(aten.sub.Tensor, end, value_op(aten.mul.Tensor, diff, w))


def lerp_formula(weight, dtype):
    """(small, w): torch's CPU lerp computes start + w * (end - start) where |weight| < 0.5
    (small), else end - (end - start) * w, each exact at its own end; there w = 1 - weight,
    computed as torch computes it, in the tensor's opmath type after rounding weight to it
    (1 - 0.95 in float64 is not 1 - float32(0.95)). Muon's nesterov update, grad.lerp(buf, 0.95),
    takes the second formula; under the first, about a third of its elements round otherwise."""
    if not dtype.is_floating_point or abs(weight) < 0.5:
        return True, weight
    opmath = torch.float64 if dtype is torch.float64 else torch.float32
    return False, (1 - torch.tensor(weight, dtype=opmath)).item()


@register(aten.rsub.Scalar, tier=DECOMPOSITION)
def _rsub_scalar(self, other, alpha=1):
    scaled = self if alpha == 1 else aten.mul.Tensor(self, alpha)
    if not liftable(other):
        return NotImplemented
    dtype = float_scalar_dtype(self.dtype)
    lhs = LazyTensor.from_cpu(torch.tensor(other, dtype=dtype), adopt=True)
    return aten.sub.Tensor(lhs, scaled)


# ---- selections ------------------------------------------------------------------------------
@register(aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar, tier=DECOMPOSITION)
def _where_scalars(cond, a, b):
    """where with Python scalars: the scalars become 0-dim tensors of the promoted dtype."""
    dtype = torch.result_type(a, b)
    a, b = (x if isinstance(x, torch.Tensor) else functional(aten.full.default, ([], x), {"dtype": dtype})
            for x in (a, b))
    return aten.where.self(cond, aten._to_copy.default(a, dtype=dtype), aten._to_copy.default(b, dtype=dtype))


@register(aten.index_put.default, tier=DECOMPOSITION)
def _index_put_mask(self, indices, values, accumulate=False):
    """x[mask] = v with one boolean mask and a single value is a `where` (no data-dependent shape)."""
    if len(indices) != 1 or indices[0] is None or indices[0].dtype not in (torch.bool, torch.uint8):
        return NotImplemented
    mask = indices[0]
    if values.numel() != 1 or tuple(mask.shape) != tuple(self.shape[:mask.dim()]):
        return NotImplemented
    mask = aten.view.default(mask.to(self.device).bool(), list(mask.shape) + [1] * (self.dim() - mask.dim()))
    value = aten._to_copy.default(aten.view.default(values, []), dtype=self.dtype)
    if accumulate:
        value = aten.add.Tensor(self, value)
    return aten.where.self(mask, value, self)


@register(aten.equal.default, tier=DECOMPOSITION)
def _equal(a, b):
    """torch.equal as a reduction on the device: one boolean comes back, not both tensors."""
    if not isinstance(b, torch.Tensor) or a.dtype != b.dtype:
        return NotImplemented
    if tuple(a.shape) != tuple(b.shape):
        return False
    return bool(aten.all.default(aten.eq.Tensor(a, b)).item())


# ---- prims: PyTorch's reference decompositions are written with them ---------------------
register(prims.where.default, tier=DECOMPOSITION)(aten.where.self)


@register(prims.div.default, tier=DECOMPOSITION)
def _prims_div(a, b):
    if a.dtype.is_floating_point or a.dtype.is_complex:
        return aten.div.Tensor(a, b)
    return aten.div.Tensor_mode(a, b, rounding_mode="trunc")


@register(prims.broadcast_in_dim.default, tier=DECOMPOSITION)
def _prims_broadcast_in_dim(a, shape, broadcast_dimensions):
    sizes = [1] * len(shape)
    for size, d in zip(a.shape, broadcast_dimensions):
        sizes[d] = size
    return aten.expand.default(aten.view.default(a, sizes), list(shape))


@register(prims.var.default, tier=DECOMPOSITION)
def _prims_var(a, dims, correction=1, *, output_dtype=None):
    return aten.var.correction(a, dims, correction=correction)


@register(prims.sum.default, tier=DECOMPOSITION)
def _prims_sum(a, dims, *, output_dtype=None):
    return aten.sum.dim_IntList(a, dims, dtype=output_dtype)


@register(prims.convert_element_type.default, tier=DECOMPOSITION)
def _prims_convert_element_type(a, dtype):
    return aten._to_copy.default(a, dtype=dtype)


# ---- backward helpers PyTorch emits that are scatters into zeros ----------------------------
def _zeros(sizes, like):
    return functional(aten.full.default, (list(sizes), 0), {"dtype": like.dtype})


@register(aten.select_backward.default, tier=DECOMPOSITION)
def _select_backward(grad, input_sizes, dim, index):
    return aten.select_scatter.default(_zeros(input_sizes, grad), grad, dim, index)


@register(aten.slice_backward.default, tier=DECOMPOSITION)
def _slice_backward(grad, input_sizes, dim, start, end, step):
    return aten.slice_scatter.default(_zeros(input_sizes, grad), grad, dim, start, end, step)


# ---- loss gradients PyTorch has no decomposition for -----------------------------------------
@register(aten.multi_margin_loss_backward.default, tier=DECOMPOSITION)
def _multi_margin_loss_backward(grad, x, target, p, margin, weight=None, reduction=1):
    """nn.MultiMarginLoss's input gradient, as ATen's CPU kernel computes it: each class j whose
    margin term z_j = margin - x[y] + x[j] is positive gets (1 or 2 z_j) * w[y] / classes (and / rows
    for a mean), the target class minus their sum; times the output gradient. Inputs ATen refuses
    (p other than 1 and 2, mismatched shapes) take the op's own path, which raises ATen's error."""
    rows = x.reshape(1, -1) if x.dim() < 2 else x
    if p not in (1, 2) or rows.dim() != 2 or target.numel() != rows.shape[0] or 0 in rows.shape \
            or (weight is not None and weight.numel() != rows.shape[1]):
        return NotImplemented
    n, classes = rows.shape
    target = target.reshape(n, 1)
    z = aten.add.Tensor(aten.sub.Tensor(rows, aten.gather.default(rows, 1, target)), margin)
    is_target = aten.eq.Tensor(torch.arange(classes, device=x.device).view(1, classes), target)
    active = aten.logical_and.default(aten.gt.Scalar(z, 0), aten.logical_not.default(is_target))
    scale = 1.0 / (classes * n) if reduction == 1 else 1.0 / classes
    h = aten.mul.Tensor(z, 2 * scale) if p == 2 else aten.full_like.default(z, scale)
    if weight is not None:
        h = aten.mul.Tensor(h, aten.index_select.default(weight, 0, target.reshape(n)).view(n, 1))
    h = aten.where.self(active, h, aten.zeros_like.default(h))
    h = aten.where.self(is_target, aten.neg.default(aten.sum.dim_IntList(h, [1], True)), h)
    per_row = grad if grad.dim() == 0 else grad.reshape(-1, 1)  # a 0-dim one may be a CPU scalar
    return aten.mul.Tensor(h, per_row).view(x.shape)


@register(aten.multilabel_margin_loss_forward.default, tier=DECOMPOSITION)
def _multilabel_margin_loss_one_sample(x, target, reduction):
    """A 0-D or 1-D input as one row: unreduced, its meta kernel gives the loss shape (1,) where
    ATen gives (), so the row's loss is viewed as ()."""
    if x.dim() > 1 or target.dim() != x.dim() or (x.dim() == 1 and reduction != 0):
        return NotImplemented
    out, is_target = aten.multilabel_margin_loss_forward.default(x.view(1, -1), target.view(1, -1), reduction)
    return out.view([]), is_target.view(x.shape)


@register(aten.multilabel_margin_loss_backward.default, tier=DECOMPOSITION)
def _multilabel_margin_loss_backward(grad, x, target, reduction, is_target):
    """nn.MultiLabelMarginLoss's input gradient, as ATen's CPU kernel computes it (the op has no
    meta kernel to trace): each term 1 - x[target] + x[i] > 0 of a listed target (before the
    first -1) and a class i not listed adds 1/C (1/(N C) for a mean) to i and takes it from the
    target; times the output gradient."""
    rows, tgt, listed_before = (t.reshape(1, -1) if x.dim() < 2 else t for t in (x, target, is_target))
    if rows.dim() != 2 or 0 in rows.shape or tuple(tgt.shape) != tuple(rows.shape) \
            or tuple(listed_before.shape) != tuple(rows.shape):
        return NotImplemented  # the op's own path raises ATen's error
    n, classes = rows.shape
    listed = aten.eq.Scalar(aten.cumsum.default(aten.lt.Scalar(tgt, 0), 1), 0)
    safe = aten.where.self(listed, tgt, aten.zeros_like.default(tgt))
    z = aten.add.Tensor(aten.rsub.Scalar(aten.gather.default(rows, 1, safe).unsqueeze(2), 1), rows.unsqueeze(1))
    live = aten.logical_and.default(aten.logical_and.default(listed.unsqueeze(2), aten.eq.Scalar(listed_before, 0).unsqueeze(1)),
                                    aten.gt.Scalar(z, 0))
    step = 1.0 / (n * classes) if reduction == 1 else 1.0 / classes
    terms = aten.mul.Tensor(aten._to_copy.default(live, dtype=x.dtype), step)
    onehot = aten.logical_and.default(aten.eq.Tensor(safe.unsqueeze(2), torch.arange(classes, device=x.device)),
                                      listed.unsqueeze(2))
    taken = aten.sum.dim_IntList(aten.mul.Tensor(onehot, aten.sum.dim_IntList(terms, [2], True)), [1])
    gi = aten.sub.Tensor(aten.sum.dim_IntList(terms, [1]), taken)
    per_row = grad if reduction != 0 or grad.dim() == 0 else grad.reshape(n, 1)
    return aten.mul.Tensor(gi, per_row).view(x.shape)


@register(aten.fractional_max_pool2d_backward.default, aten.fractional_max_pool3d_backward.default,
          tier=DECOMPOSITION)
def _fractional_max_pool_backward(grad, x, kernel_size, output_size, indices):
    """Each output gradient added into the input position its max came from (`indices`: flat
    positions in each plane): a scatter_add per plane. The 3-D op has no meta kernel to trace."""
    nd = len(kernel_size)
    if tuple(grad.shape) != tuple(indices.shape) or x.dim() not in (nd + 1, nd + 2):
        return NotImplemented  # the op's own path raises ATen's error
    planes, volume = x.shape[:-nd].numel(), x.shape[-nd:].numel()
    out = aten.scatter_add.default(_zeros([planes, volume], grad), 1, indices.reshape(planes, -1),
                                   grad.reshape(planes, -1))
    return out.view(x.shape)


@register(aten._safe_softmax.default, tier=DECOMPOSITION)
def _safe_softmax(x, dim, dtype=None):
    """softmax, but 0 (not NaN) for rows that are entirely -inf (masked-out attention rows)."""
    out = aten._softmax.default(x if dtype is None else aten._to_copy.default(x, dtype=dtype), dim, False)
    masked = aten.eq.Scalar(aten.amax.default(x, [dim], True), float("-inf"))
    return aten.where.self(masked, functional(aten.zeros_like.default, (out,), {}), out)

