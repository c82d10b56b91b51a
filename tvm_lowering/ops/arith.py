"""Fixes for TVM rules whose results differ from PyTorch on some arguments.

Each rule here replaces a TVM rule that computed something else (found by the
OpInfo conformance run), delegating to TVM where its rule is right.
"""
from tvm import relax

from . import rule
from .nn import arg as _arg


@rule("sum.dim_IntList")
def sum_dim(imp, node):
    x = imp.env[node.args[0]]
    if x.ty.ndim == 0:  # summing a 0-dim tensor over dim 0 (or []) returns it unchanged
        dtype = str(node.meta["val"].dtype).replace("torch.", "")
        return x if str(x.ty.dtype) == dtype else imp.block_builder.emit(relax.op.astype(x, dtype))
    return imp._sum(node)


@rule("select.int")
def select(imp, node):
    """TVM's rule reads out of bounds for a negative index; normalise it first."""
    x = imp.env[node.args[0]]
    ndim = x.ty.ndim
    dim = node.args[1] % ndim
    size = int(x.ty.shape.values[dim])
    index = node.args[2] + size if node.args[2] < 0 else node.args[2]
    part = imp.block_builder.emit(relax.op.strided_slice(x, axes=[dim], begin=[index], end=[index + 1]))
    return imp.block_builder.emit(relax.op.squeeze(part, axis=[dim]))


@rule("std.correction")
def std(imp, node):
    """TVM's std ignores `correction`; its var honours it, so std = sqrt(var)."""
    var = imp.convert_map["var.correction"](node)
    return imp.block_builder.emit(relax.op.sqrt(var))


@rule("elu.default")
def elu(imp, node):
    """ELU with PyTorch's scale and input_scale (TVM's rule drops them, which breaks selu)."""
    x = imp.env[node.args[0]]
    alpha, scale, input_scale = (float(_arg(node, i, n, 1)) for i, n in ((1, "alpha"), (2, "scale"), (3, "input_scale")))
    dt = str(x.ty.dtype)
    bb = imp.block_builder
    neg = bb.emit(relax.op.multiply(
        relax.const(alpha, dt),
        relax.op.subtract(relax.op.exp(relax.op.multiply(x, relax.const(input_scale, dt))), relax.const(1.0, dt)),
    ))
    out = bb.emit(relax.op.where(relax.op.greater(x, relax.const(0.0, dt)), x, neg))
    return out if scale == 1 else bb.emit(relax.op.multiply(out, relax.const(scale, dt)))


@rule("bitwise_right_shift.Tensor_Scalar", "__rshift__.Scalar")
def right_shift(imp, node):
    """Arithmetic shift of an integer tensor by a constant (TVM has no rule for it)."""
    x = imp.env[node.args[0]]
    amount = relax.const(int(node.args[1]), str(x.ty.dtype))
    return imp.block_builder.emit(relax.op.right_shift(x, amount))
