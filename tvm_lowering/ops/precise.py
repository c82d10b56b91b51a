"""Elementwise functions whose TVM forms lose accuracy near zero, where PyTorch's do not.

TVM's torch frontend writes expm1 as exp(x) - 1, which gives 0 for |x| below
float32's epsilon (and a 1e-4 relative error well above it), atanh as
0.5 * log((1 + x) / (1 - x)) (the same) and elu through exp(x) - 1; its float32
tanh returns 0 below 1e-8 and is 1e-3 off relative at 1e-5. Small arguments are
where these functions are used (expm1 of small rates, tanh of small
pre-activations), so the rules below keep PyTorch's relative accuracy there
(log1p: see special.py):

  expm1   in float64: a Taylor polynomial for |x| < 1e-3, exp(x) - 1 above
  atanh   0.5 * log1p(2x / (1 - x))
  tanh    its odd Taylor polynomial for |x| < 0.01, TVM's tanh above
  elu     scale * x for x > 0, alpha * scale * expm1(input_scale * x) below
"""
from tvm import relax, te, tirx

from . import rule
from .nn import arg, env, emit_te, out_meta


def _f64(x):
    return x if str(x.ty) == "float64" else x.astype("float64")


def _poly(x, coefs):
    """coefs[0] + coefs[1] x + ... by Horner's rule."""
    acc = tirx.const(coefs[-1], str(x.ty))
    for c in reversed(coefs[:-1]):
        acc = acc * x + tirx.const(c, str(x.ty))
    return acc


# No tirx.Let below (TVM's bfloat16 legalization miscomputes one over a fused bfloat16
# cast, see fastmath.fast_exp): subexpressions repeat and LLVM merges them.
def expm1_expr(x):
    """exp(x) - 1 for a TIR float expression, accurate relative to the result near 0."""
    d = _f64(x)
    # x (1 + x/2 + x^2/6 + x^3/24 + x^4/120): the first omitted term is below 2e-18 relative
    series = d * _poly(d, [1.0, 1 / 2, 1 / 6, 1 / 24, 1 / 120])
    value = tirx.Select(tirx.abs(d) < tirx.const(1e-3, "float64"), series, tirx.exp(d) - tirx.const(1.0, "float64"))
    return value.astype(str(x.ty))


def _atanh(x):
    d = _f64(x)
    value = tirx.const(0.5, "float64") * tirx.log1p(tirx.const(2.0, "float64") * d / (tirx.const(1.0, "float64") - d))
    return value.astype(str(x.ty))


def _tanh(x):
    dt = str(x.ty)
    # x - x^3/3 + 2x^5/15 - 17x^7/315: the first omitted term is below 1e-17 relative at 0.01
    series = x * _poly(x * x, [1.0, -1 / 3, 2 / 15, -17 / 315])
    return tirx.Select(tirx.abs(x) < tirx.const(0.01, dt), series, tirx.tanh(x))


def _unary(name, fn):
    def lower(imp, node):
        x = env(imp, node.args[0])
        _, out_dtype = out_meta(node)
        if str(x.ty.dtype) != out_dtype:  # integer inputs compute in the float result dtype
            x = imp.block_builder.emit(relax.op.astype(x, out_dtype))
        return emit_te(imp, lambda t: te.compute(t.shape, lambda *i: fn(t(*i)), name=name), x)

    return lower


rule("expm1.default")(_unary("expm1", expm1_expr))
rule("atanh.default")(_unary("atanh", _atanh))
rule("tanh.default")(_unary("tanh", _tanh))


@rule("elu.default")
def elu(imp, node):
    """elu(x, alpha, scale, input_scale) as ATen defines it (TVM's rule drops the scales, which breaks selu)."""
    x = env(imp, node.args[0])
    alpha, scale, input_scale = (float(arg(node, i, n, 1.0)) for i, n in ((1, "alpha"), (2, "scale"), (3, "input_scale")))

    def compute(t):
        def at(*i):
            v = t(*i)
            dt = str(v.ty)
            neg = tirx.const(alpha * scale, dt) * expm1_expr(v * tirx.const(input_scale, dt))
            return tirx.Select(v > tirx.const(0, dt), v * tirx.const(scale, dt), neg)

        return te.compute(t.shape, at, name="elu")

    return emit_te(imp, compute, x)
