"""Rules for ops that only AOTAutograd's graphs (the torch.compile front end) produce.

The lazy device never sees these: dynamo writes an optimizer's `addcmul_`,
`addcdiv_` (with a `value`) and `add_` (with a tensor `alpha`) as `prims.fma`.
"""
from tvm import relax

from . import rule


@rule("fma.default")
def fma(imp, node):
    """prims.fma(a, b, c) = a * b + c in the output's dtype (a Python scalar operand is a constant).

    Computed as a multiply and an add: LLVM contracts them into one FMA where the
    target allows it (ratex's CPU target has fast-math-contract), as torch's CPU kernel does."""
    from ..dtypes import to_tvm

    dtype = to_tvm(node.meta["val"].dtype)
    bb = imp.block_builder

    def operand(a):
        if hasattr(a, "meta"):
            x = imp.env[a]
            return x if str(x.ty.dtype) == dtype else bb.emit(relax.op.astype(x, dtype))
        return relax.const(a, dtype)

    a, b, c = (operand(x) for x in node.args[:3])
    return bb.emit(relax.op.add(bb.emit(relax.op.multiply(a, b)), c))
