"""In-place and out= ops: compute the result functionally, then write it through the view chain.

The general path (`mutating`) runs the op's functional twin and assigns the
result; in-place arithmetic on operands of the target's own shape and dtype (an
optimizer's every update) records its ops straight on IR values instead, and the
commonest of those (SGD's) as one written-out node.
"""
import functools

import torch

from .. import metrics, shape
from ..ir import Node
from ..tensor import LazyTensor
from . import registry
from .capture import BINARY_SPEC, TERNARY_SPEC, Value, collect
from .decompose import addcdiv, addcmul, lerp_scalar
from .eager import run as eager, unlowerable
from .record import functional, lifted_dtype, liftable, lowered_counter, scalar_input, value_op
from .registry import HANDLER, PATH, register
from .schema import functional_of, type_name, written

aten = torch.ops.aten


@register("mutating", tier=PATH)
def mutating(func, args, kwargs):
    """Trace an op that writes one argument as its functional twin plus a write; return the target."""
    written_ = written(func)
    fop = functional_of(func)
    if len(written_) != 1 or fop is None:
        return eager(func, args, kwargs)
    kind, key = written_[0]
    target = args[key] if kind == "pos" else kwargs[key]
    if not isinstance(target, LazyTensor):
        return eager(func, args, kwargs)
    if fop.is_view:  # t_, transpose_, unsqueeze_, ...: the tensor becomes a new view of its storage
        target._assume(registry.dispatch(fop, args, kwargs))
        return target
    fkwargs = {k: v for k, v in kwargs.items() if k != key} if kind == "kw" else kwargs
    result = registry.dispatch(fop, args, fkwargs)
    if not _fits(result, target):  # PyTorch's own checks and errors for the in-place form
        if isinstance(result, LazyTensor) and not torch.can_cast(result.dtype, target.dtype):
            raise RuntimeError(f"result type {type_name(result.dtype)} can't be cast to the desired output "
                               f"type {type_name(target.dtype)}")  # meta kernels don't check it
        spec, _, metas = collect(func, args, kwargs)
        try:
            out = shape.infer(func, spec, metas)
        except shape.NoMeta:
            return eager(func, args, kwargs)
        if out.metas and out.metas[0] is not None and out.metas[0].shape != target._sig[0]:
            return eager(func, args, kwargs)  # it changes the tensor's shape (resize_): PyTorch does that
    assign(target, result)
    return target


def _fits(result, target) -> bool:
    """Whether `result` can be written into `target` as is: same shape and dtype, and no
    element of target aliases another (an expanded tensor, stride 0)."""
    return isinstance(result, LazyTensor) and result._sig[0] == target._sig[0] \
        and result.dtype == target.dtype and 0 not in target._sig[1]


def assign(target, result):
    """Write the lazy tensor `result` into `target` (same shape), casting to target's dtype; return None."""
    if tuple(result.shape) != tuple(target.shape):
        raise RuntimeError(
            f"output with shape {list(target.shape)} doesn't match the broadcast shape {list(result.shape)}"
        )
    if result.dtype != target.dtype:
        result = registry.dispatch(aten._to_copy.default, (result,), {"dtype": target.dtype})
    target._write(result._value())


# ---- in-place arithmetic ------------------------------------------------------------------
# An optimizer's every update (buf.mul_(momentum), p.add_(buf, alpha=-lr),
# v.addcmul_(g, g, value=1 - beta2)): when every tensor operand has the target's shape and
# dtype and the scalars are plain numbers, the result has the target's meta, so the functional
# ops are recorded straight on IR values and written -- no result tensor, no nested dispatch.
# Anything else (broadcasting, type promotion, an expanded target) takes `mutating`.
def _binary_inplace(fop, sign):
    def value(self, other, *, alpha=1):
        if alpha != 1:
            if type(other) is not LazyTensor:
                return None
            if liftable(alpha):  # p.add_(buf, alpha=-lr): one node, self + other * alpha, the lr an input
                return value_op(aten.addcmul.default, self, other, scalar_input(sign * alpha, self._sig[2]))
            other = value_op(aten.mul.Tensor, other, alpha)
        return value_op(fop, self, other)

    return value


def _no_alpha(fop):
    def value(self, other):
        return value_op(fop, self, other)

    return value


# in-place op -> (functional op, sign of its alpha; 0: it takes none)
_ELEMENTWISE_INPLACE = {
    aten.add_.Tensor: (aten.add.Tensor, 1),
    aten.sub_.Tensor: (aten.sub.Tensor, -1),
    aten.mul_.Tensor: (aten.mul.Tensor, 0),
    aten.div_.Tensor: (aten.div.Tensor, 0),
}
_INPLACE_ARITH = {
    **{f: _binary_inplace(fop, sign) if sign else _no_alpha(fop) for f, (fop, sign) in _ELEMENTWISE_INPLACE.items()},
    aten.addcmul_.default: functools.partial(addcmul, last=value_op),
    aten.addcdiv_.default: functools.partial(addcdiv, last=value_op),
    aten.lerp_.Scalar: functools.partial(lerp_scalar, last=value_op),
}
_INPLACE_RECIPES = {id(f): recipe for f, recipe in _INPLACE_ARITH.items()}  # by id, like registry._routes
_SIMPLE_INPLACE = {id(f): entry for f, entry in _ELEMENTWISE_INPLACE.items()}


@register(*_INPLACE_ARITH, tier=HANDLER)
def _inplace_arith(func, args, kwargs):
    target = args[0]
    if not _same_meta_operands(target, args, kwargs):
        return mutating(func, args, kwargs)
    simple = _SIMPLE_INPLACE.get(id(func))
    if simple is not None and len(args) == 2 and not unlowerable:
        value = _simple_inplace_value(simple, target, args[1], kwargs)
        if value is not None:
            target._write(value)
            return target
    value = _inplace_value(func, args, kwargs)
    if value is None:
        return mutating(func, args, kwargs)
    if type(value) is Value:
        node, idx = value.value
        if node.metas[idx] == (target._sig[0], target.dtype):
            target._write(value.value)
            return target
        value = LazyTensor.from_value(value.value)
    assign(target, value)  # a step fell back to a tensor: assign checks and casts as `mutating` does
    return target


def _inplace_value(func, args, kwargs):
    try:
        return _INPLACE_RECIPES[id(func)](*args, **kwargs)
    except TypeError:  # an argument the recipe doesn't take: the general path reports it
        return None


# The commonest of them -- SGD's buf.mul_(momentum), buf.add_(grad), p.add_(buf, alpha=-lr) --
# written out: the same decisions as the recipes above (lifted scalars, addcmul for a float
# alpha), recorded as one node with the target's meta and no shape inference (operands of
# the target's shape and dtype, checked by _same_meta_operands, keep both).
# Anything else (an int scalar, 0 or 1, an int alpha) is left to the recipes.
def _simple_inplace_value(simple, target, other, kwargs):
    """The IR value of `target <op>= other`, or None where the recipe must decide."""
    fop, sign = simple
    alpha = 1
    if kwargs:
        if not sign or len(kwargs) != 1 or "alpha" not in kwargs:
            return None
        alpha = kwargs["alpha"]
    t = type(other)
    if t is LazyTensor:
        if alpha == 1:
            op, spec = fop, BINARY_SPEC
            inputs = (target._value(), other._value())
        elif type(alpha) is float and liftable(alpha):
            op, spec = aten.addcmul.default, TERNARY_SPEC
            inputs = (target._value(), other._value(), scalar_input(sign * alpha, target._sig[2]).value)
        else:
            return None
    elif t is float and alpha == 1 and liftable(other):
        op, spec = fop, BINARY_SPEC
        inputs = (target._value(), scalar_input(other, lifted_dtype(fop, target._sig[2])).value)
    else:
        return None
    counter = lowered_counter(op)
    if counter is None:
        return None
    node, idx = inputs[0]
    metrics.counts[counter] += 1
    return (Node(op, spec, inputs, (node.metas[idx],)), 0)


def _same_meta_operands(target, args, kwargs) -> bool:
    if type(target) is not LazyTensor:
        return False
    shape, strides, dtype = target._sig
    if not dtype.is_floating_point or 0 in strides:
        return False
    for i in range(1, len(args)):
        x = args[i]
        t = type(x)
        if t is LazyTensor:
            sig = x._sig
            if sig[0] != shape or sig[2] != dtype:
                return False
        elif t is not float and t is not int:
            return False
    for v in kwargs.values():
        if type(v) is not float and type(v) is not int:
            return False
    return True


# ---- writes a schema doesn't declare ----------------------------------------------------------
@register(aten.native_batch_norm.default, tier=HANDLER)
def _native_batch_norm(func, args, kwargs):
    """native_batch_norm updates running stats in place without saying so in its schema."""
    names = ("input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps")
    a = dict(zip(names, args), **kwargs)
    out = functional(func, args, kwargs)
    rm, rv = a["running_mean"], a["running_var"]
    if a["training"] and rm is not None and rv is not None:
        x, momentum = a["input"], a["momentum"]
        dims = [0] + list(range(2, x.dim()))
        mean = aten.mean.dim(x, dims)
        var = aten.var.correction(x, dims, correction=1)
        assign(rm, aten.add.Tensor(aten.mul.Tensor(rm, 1 - momentum), aten.mul.Tensor(mean, momentum)))
        assign(rv, aten.add.Tensor(aten.mul.Tensor(rv, 1 - momentum), aten.mul.Tensor(var, momentum)))
    if not a["training"]:  # PyTorch's CPU kernel saves no statistics in eval mode (its meta kernel says [C])
        empty = torch.empty(0, dtype=out[1].dtype)
        out = (out[0], LazyTensor.from_cpu(empty), LazyTensor.from_cpu(empty))
    return out
