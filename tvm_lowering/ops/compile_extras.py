"""Rules for ops that only AOTAutograd's graphs (the torch.compile front end) produce.

The lazy device never sees these: dynamo writes an optimizer's `addcmul_`,
`addcdiv_` (with a `value`) and `add_` (with a tensor `alpha`) as `prims.fma`,
and the foreach optimizers' `_foreach_addcdiv` and `_foreach_lerp`, unrolled by
`ratex.dynamo`, give `addcdiv` and `lerp` (the lazy path decomposes those itself).
"""
from tvm import relax

from . import rule


@rule("fma.default")
def fma(imp, node):
    """prims.fma(a, b, c) = a * b + c in the output's dtype (a Python scalar operand is a constant).

    Computed as a multiply and an add: LLVM contracts them into one FMA where the
    target allows it (ratex's CPU target has fast-math-contract), as torch's CPU kernel does."""
    from ..dtypes import to_tvm

    bb = imp.block_builder
    a, b, c = _operands(imp, node, node.args[:3], to_tvm(node.meta["val"].dtype))
    return bb.emit(relax.op.add(bb.emit(relax.op.multiply(a, b)), c))


def _operands(imp, node, names, dtype):
    """Relax values of `node`'s arguments `names` (positions), cast to `dtype`; Python scalars as constants."""
    bb = imp.block_builder
    out = []
    for a in names:
        if hasattr(a, "meta"):
            x = imp.env[a]
            out.append(x if str(x.ty.dtype) == dtype else bb.emit(relax.op.astype(x, dtype)))
        else:
            out.append(relax.const(a, dtype))
    return out


@rule("addcdiv.default")
def addcdiv(imp, node):
    """self + value * t1 / t2, in the order torch's CPU kernel computes it ((value * t1) / t2).
    dynamo's optimizer graphs and the foreach Adam step produce it; floats only, as in torch."""
    from ..dtypes import to_tvm

    dtype = to_tvm(node.meta["val"].dtype)
    if not dtype.startswith("float"):
        raise TypeError(f"addcdiv of {dtype} tensors (torch allows floating point only)")
    bb = imp.block_builder
    x, t1, t2 = _operands(imp, node, node.args[:3], dtype)
    value = node.kwargs.get("value", node.args[3] if len(node.args) > 3 else 1)
    if value != 1:
        t1 = bb.emit(relax.op.multiply(relax.const(value, dtype), t1))
    return bb.emit(relax.op.add(x, bb.emit(relax.op.divide(t1, t2))))


@rule("lerp.Scalar", "lerp.Tensor")
def lerp(imp, node):
    """start + weight * (end - start) for |weight| < 0.5, else end - (end - start) * (1 - weight):
    torch's two formulas (each exact at its own end), chosen per element for a tensor weight."""
    from ..dtypes import to_tvm

    dtype = to_tvm(node.meta["val"].dtype)
    if not dtype.startswith("float"):
        raise TypeError(f"lerp of {dtype} tensors (torch allows floating point only)")
    bb = imp.block_builder
    start, end, weight = _operands(imp, node, node.args[:3], dtype)
    diff = bb.emit(relax.op.subtract(end, start))
    low = bb.emit(relax.op.add(start, bb.emit(relax.op.multiply(weight, diff))))
    high = bb.emit(relax.op.subtract(
        end, bb.emit(relax.op.multiply(diff, bb.emit(relax.op.subtract(relax.const(1, dtype), weight))))))
    w = node.args[2]
    if not hasattr(w, "meta"):
        return low if abs(w) < 0.5 else high
    small = bb.emit(relax.op.less(bb.emit(relax.op.abs(weight)), relax.const(0.5, dtype)))
    return bb.emit(relax.op.where(small, low, high))
