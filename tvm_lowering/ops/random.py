"""Random ops drawing from a seed that is a graph input (see ratex/core/random.py).

The hash must stay bit-identical to `ratex.core.random.hash_uniform`. It is
built from plain Relax integer ops (fused into one kernel later), not a TE
compute, so that the same expression also lives inside a TorchScript forward
that `relax.transform.Gradient` differentiates: the mask hangs off the seed
only, and `where`'s gradient rule stops at its boolean condition.
"""
from tvm import relax

from . import rule
from .nn import emit, shape

op = relax.op


def _i64(v):
    return relax.const(v, "int64")


def keep_mask(imp, seed, out_shape, p):
    """Bool tensor of `out_shape`: uniform(seed, flat index) >= p.

    The hash starts from flat * K + seed (mod 2**32), summed here as one small
    per-axis term idx_i * (stride_i * K mod 2**32) at a time, broadcast against
    the seed: no full-size index tensor exists that constant folding could bake
    into the program.
    """
    m32 = _i64(0xFFFFFFFF)
    h = op.bitwise_and(seed, m32)
    stride = 1
    for axis in reversed(range(len(out_shape))):
        idx = op.arange(0, out_shape[axis], 1, "int64")
        idx = op.reshape(idx, [out_shape[axis]] + [1] * (len(out_shape) - 1 - axis))
        h = op.add(h, op.multiply(idx, _i64((stride * 0x9E3779B1) & 0xFFFFFFFF)))
        stride *= out_shape[axis]
    h = emit(imp, op.bitwise_and(h, m32))
    for shift, mul in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
        h = emit(imp, op.bitwise_xor(h, op.right_shift(h, _i64(shift))))
        h = emit(imp, op.bitwise_and(op.multiply(h, _i64(mul)), m32))
    h = emit(imp, op.bitwise_xor(h, op.right_shift(h, _i64(16))))
    u = op.multiply(op.astype(op.right_shift(h, _i64(8)), "float32"), relax.const(1.0 / (1 << 24), "float32"))
    return emit(imp, op.greater_equal(u, relax.const(p, "float32")))


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
