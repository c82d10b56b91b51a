"""Fixes for TVM rules whose results differ from PyTorch on some arguments.

Each rule here replaces a TVM rule that computed something else (found by the
OpInfo conformance run), delegating to TVM where its rule is right.
"""
import math

import torch
from tvm import relax, te, tirx

from . import rule


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


@rule("full.default")
def full(imp, node):
    """The fill value broadcast to the shape. (TVM's rule fails to compile with an explicit
    dtype — its legalization takes the dtype attribute for a string — e.g. the -inf causal
    mask of nn.Transformer, and it cannot take a fill value that ratex lifted to an input.)"""
    fill = node.args[1]
    dtype = str(node.meta["val"].dtype).replace("torch.", "")
    shape = [int(s) for s in node.args[0]]
    if not isinstance(fill, torch.fx.Node):
        return imp.block_builder.emit(relax.op.broadcast_to(relax.const(fill, dtype), shape))
    value = imp.env[fill]
    if str(value.ty.dtype) != dtype:
        value = imp.block_builder.emit(relax.op.astype(value, dtype))
    return imp.block_builder.emit(relax.op.broadcast_to(value, shape))


@rule("bitwise_right_shift.Tensor_Scalar", "__rshift__.Scalar")
def right_shift(imp, node):
    """Arithmetic shift of an integer tensor by a constant (TVM has no rule for it)."""
    x = imp.env[node.args[0]]
    amount = relax.const(int(node.args[1]), str(x.ty.dtype))
    return imp.block_builder.emit(relax.op.right_shift(x, amount))


# ---- elementwise binary ops under PyTorch's type promotion ------------------------------
# TVM's rules promote by their own rules (a 0-dim float64 tensor makes float16 math
# float64; int / int stays int) and LLVM codegen rejects comparisons of bool/int8/uint8
# and arithmetic on bool. These compute in the dtype PyTorch computes in: the output's
# for arithmetic, torch.result_type of the inputs for comparisons; narrow integer and
# bool math runs in int32 (exact for these ops) and is cast back.
_ARITH = {
    "add.Tensor": relax.op.add, "sub.Tensor": relax.op.subtract, "mul.Tensor": relax.op.multiply,
    "div.Tensor": relax.op.divide, "maximum.default": relax.op.maximum, "minimum.default": relax.op.minimum,
}
_COMPARE = {
    f"{name}.{kind}": op
    for name, op in (("lt", relax.op.less), ("le", relax.op.less_equal), ("gt", relax.op.greater),
                     ("ge", relax.op.greater_equal), ("eq", relax.op.equal), ("ne", relax.op.not_equal))
    for kind in ("Tensor", "Scalar")
}
_NARROW = {"bool", "int8", "uint8", "int16"}


def _as(bb, x, dtype: str):
    """`x` computed in `dtype` (a cast only where it is another)."""
    return x if str(x.ty.dtype) == dtype else bb.emit(relax.op.astype(x, dtype))


def _binary(imp, node):
    from ..dtypes import to_tvm

    name = node.target.__name__
    alpha = 1  # add/sub's alpha scales the second operand, below: TVM's rule ignores it
    if name in ("add.Tensor", "sub.Tensor") and set(node.kwargs) <= {"alpha"}:
        alpha = node.kwargs.get("alpha", 1)
    elif len(node.args) > 2 or node.kwargs:  # rounding_mode=: TVM's rule handles it
        return imp.tvm_rules[name](node)
    vals = [a.meta["val"] if hasattr(a, "meta") else a for a in node.args]
    out_dtype = to_tvm(node.meta["val"].dtype)
    compute = to_tvm(torch.result_type(*vals)) if name in _COMPARE else out_dtype
    if compute in _NARROW:
        compute = "int32"
    bb = imp.block_builder
    if name == "div.Tensor" and not hasattr(node.args[1], "meta") and node.args[1] == 0 \
            and compute.startswith("float"):
        # TVM's constant folder rejects a division by the constant 0; x * (+-inf) is the same
        # IEEE result (+-inf, or NaN for 0 and NaN), as in a mean over no elements.
        name, node_args = "mul.Tensor", (node.args[0], math.copysign(math.inf, node.args[1]))
    else:
        node_args = node.args
    operands = [_as(bb, imp.env[a], compute) if hasattr(a, "meta") else relax.const(a, compute) for a in node_args]
    if alpha != 1:
        operands[1] = bb.emit(relax.op.multiply(operands[1], relax.const(alpha, compute)))
    out = bb.emit({**_ARITH, **_COMPARE}[name](*operands))
    return out if compute == out_dtype else bb.emit(relax.op.astype(out, out_dtype))


rule(*_ARITH, *_COMPARE)(_binary)


@rule("addcmul.default")
def addcmul(imp, node):
    """self + value * t1 * t2, computed in the output's dtype (narrow integers in int32).
    ratex records an optimizer's `p.add_(buf, alpha=-lr)` as addcmul(p, buf, lr_input)."""
    from ..dtypes import to_tvm

    out_dtype = to_tvm(node.meta["val"].dtype)
    compute = "int32" if out_dtype in _NARROW else out_dtype
    bb = imp.block_builder
    x, t1, t2 = (_as(bb, imp.env[a], compute) for a in node.args[:3])
    prod = bb.emit(relax.op.multiply(t1, t2))
    value = node.kwargs.get("value", 1)
    if value != 1:
        prod = bb.emit(relax.op.multiply(relax.const(value, compute), prod))
    out = bb.emit(relax.op.add(x, prod))
    return out if compute == out_dtype else bb.emit(relax.op.astype(out, out_dtype))


# ---- casts to bfloat16 ------------------------------------------------------------------
# TVM computes bfloat16 in float32 and, inside a fused kernel, folds
# float32 -> bfloat16 -> float32 casts away, so `x.bfloat16().float()` would not round.
# The cast rounds explicitly (to nearest even, as PyTorch does) while still float32;
# the bfloat16 cast that follows is then exact, folded or not.
def _round_to_bf16_te(x):
    def at(*i):
        v = x(*i)
        bits = tirx.reinterpret("uint32", v)
        odd = (bits >> tirx.const(16, "uint32")) & tirx.const(1, "uint32")
        up = (bits + tirx.const(0x7FFF, "uint32") + odd) & tirx.const(0xFFFF0000, "uint32")
        return tirx.Select(tirx.isnan(v), v, tirx.reinterpret("float32", up))

    return te.compute(x.shape, at, name="round_to_bfloat16")


@rule("_to_copy.default")
def to_copy(imp, node):
    out = imp.tvm_rules["_to_copy.default"](node)
    x = imp.env[node.args[0]]
    if str(out.ty.dtype) != "bfloat16" or str(x.ty.dtype) == "bfloat16":
        return out
    bb = imp.block_builder
    x32 = x if str(x.ty.dtype) == "float32" else bb.emit(relax.op.astype(x, "float32"))
    return bb.emit(relax.op.astype(bb.emit_te(_round_to_bf16_te, x32), "bfloat16"))
