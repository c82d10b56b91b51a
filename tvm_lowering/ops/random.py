"""Random ops drawing from a seed that is a graph input (see ratex/core/random.py).

The hash must stay bit-identical to `ratex.core.random.hash_uniform`.
"""
from tvm import te, tirx

from . import rule
from .nn import emit_te, shape

def _i64(v):
    return tirx.const(v, "int64")


_M32 = _i64(0xFFFFFFFF)


def _uniform(seed, out_shape):
    def at(*idx):
        flat = _i64(0)
        for i, n in zip(idx, out_shape):
            flat = flat * _i64(n) + i.astype("int64")
        h = (flat * _i64(0x9E3779B1) + (seed[()] & _M32)) & _M32
        h = h ^ (h >> _i64(16))
        h = (h * _i64(0x85EBCA6B)) & _M32
        h = h ^ (h >> _i64(13))
        h = (h * _i64(0xC2B2AE35)) & _M32
        h = h ^ (h >> _i64(16))
        return (h >> _i64(8)).astype("float32") * tirx.const(1.0 / (1 << 24), "float32")

    return at


def _dropout_te(x, seed, p):
    u = _uniform(seed, [int(s) for s in x.shape])
    scale = 1.0 / (1.0 - p)
    mask = te.compute(x.shape, lambda *i: u(*i) >= tirx.const(p, "float32"), name="keep")
    out = te.compute(
        x.shape, lambda *i: tirx.Select(mask(*i), x(*i) * tirx.const(scale, x.dtype), tirx.const(0, x.dtype))
    )
    return [out, mask]


@rule("seeded_dropout.default")
def seeded_dropout(imp, node):
    x, seed, p = imp.env[node.args[0]], imp.env[node.args[1]], float(node.args[2])
    shape(x)
    return emit_te(imp, _dropout_te, x, seed, p)
