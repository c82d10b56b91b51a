"""Random ops drawing from a seed that is a graph input (see ratex/core/random.py).

The hash must stay bit-identical to `ratex.core.random.hash_uniform`. It is
built from plain Relax integer ops (fused into one kernel later), not a TE
compute, so that the same expression also lives inside a TorchScript forward
that `relax.transform.Gradient` differentiates: the mask hangs off the seed
only, and `where`'s gradient rule stops at its boolean condition.
"""
import math

from tvm import relax

from . import rule
from .nn import emit, shape

op = relax.op


def _i64(v):
    return relax.const(v, "int64")


def keep_mask(imp, seed, out_shape, p):
    """Bool tensor of `out_shape`: uniform(seed, flat index) >= p."""
    n = math.prod(out_shape)
    m32 = _i64(0xFFFFFFFF)
    h = emit(imp, op.arange(0, n, 1, "int64"))
    h = emit(imp, op.bitwise_and(op.add(op.multiply(h, _i64(0x9E3779B1)), op.bitwise_and(seed, m32)), m32))
    for shift, mul in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
        h = emit(imp, op.bitwise_xor(h, op.right_shift(h, _i64(shift))))
        h = emit(imp, op.bitwise_and(op.multiply(h, _i64(mul)), m32))
    h = emit(imp, op.bitwise_xor(h, op.right_shift(h, _i64(16))))
    u = op.multiply(op.astype(op.right_shift(h, _i64(8)), "float32"), relax.const(1.0 / (1 << 24), "float32"))
    return emit(imp, op.reshape(op.greater_equal(u, relax.const(p, "float32")), out_shape))


def dropout(imp, x, seed, p):
    """(x * keep / (1 - p), keep) with keep = keep_mask(seed, x.shape, p)."""
    keep = keep_mask(imp, seed, shape(x), p)
    dt = str(x.ty.dtype)
    out = emit(imp, op.where(keep, op.multiply(x, relax.const(1.0 / (1.0 - p), dt)), relax.const(0, dt)))
    return out, keep


@rule("seeded_dropout.default")
def seeded_dropout(imp, node):
    x, seed, p = imp.env[node.args[0]], imp.env[node.args[1]], float(node.args[2])
    return emit(imp, relax.Tuple(dropout(imp, x, seed, p)))
