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
  elu     scale * x for x > 0, alpha * scale * expm1(input_scale * x) below (selu too)
"""
from tvm import relax, te, tirx

from . import rule
from .nn import arg, emit_te, env, horner, out_meta


def _f64(x):
    return x if str(x.ty) == "float64" else x.astype("float64")


# No tirx.Let below (TVM's bfloat16 legalization miscomputes one over a fused bfloat16
# cast, see fastmath.fast_exp): subexpressions repeat and LLVM merges them.
def expm1_expr(x):
    """exp(x) - 1 for a TIR float expression, accurate relative to the result near 0."""
    d = _f64(x)
    # x (1 + x/2 + x^2/6 + x^3/24 + x^4/120): the first omitted term is below 2e-18 relative
    series = d * horner(d, [1.0, 1 / 2, 1 / 6, 1 / 24, 1 / 120])
    value = tirx.Select(tirx.abs(d) < tirx.const(1e-3, "float64"), series, tirx.exp(d) - tirx.const(1.0, "float64"))
    return value.astype(str(x.ty))


def _atanh(x):
    d = _f64(x)
    value = tirx.const(0.5, "float64") * tirx.log1p(tirx.const(2.0, "float64") * d / (tirx.const(1.0, "float64") - d))
    return value.astype(str(x.ty))


def _tanh(x):
    dt = str(x.ty)
    # x - x^3/3 + 2x^5/15 - 17x^7/315: the first omitted term is below 1e-17 relative at 0.01
    series = x * horner(x * x, [1.0, -1 / 3, 2 / 15, -17 / 315])
    return tirx.Select(tirx.abs(x) < tirx.const(0.01, dt), series, tirx.tanh(x))


def _unary(name, fn, relax_form=None):
    """Rule computing `fn` elementwise; in a jit.script forward `relax_form` (Relax ops that
    Relax's Gradient can differentiate) where given."""
    def lower(imp, node):
        x = env(imp, node.args[0])
        _, out_dtype = out_meta(node)
        if str(x.ty.dtype) != out_dtype:  # integer inputs compute in the float result dtype
            x = imp.block_builder.emit(relax.op.astype(x, out_dtype))
        if imp.differentiable and relax_form is not None:
            return imp.block_builder.emit(relax_form(x, lambda v: relax.const(v, out_dtype)))
        return emit_te(imp, lambda t: te.compute(t.shape, lambda *i: fn(t(*i)), name=name), x, primfunc_name_hint=name)

    return lower


def _atanh_relax(x, c):  # relax.atanh has no gradient
    return relax.op.multiply(c(0.5), relax.op.log(relax.op.divide(relax.op.add(c(1.0), x), relax.op.subtract(c(1.0), x))))


rule("expm1.default", tir=True)(_unary("expm1", expm1_expr))
rule("atanh.default")(_unary("atanh", _atanh, _atanh_relax))
rule("tanh.default", tir=True)(_unary("tanh", _tanh))


@rule("elu.default")
def elu(imp, node):
    """elu(x, alpha, scale, input_scale) as ATen defines it (TVM's rule drops the scales)."""
    scales = (float(arg(node, i, n, 1.0)) for i, n in ((1, "alpha"), (2, "scale"), (3, "input_scale")))
    return _elu(imp, env(imp, node.args[0]), *scales)


@rule("selu.default")
def selu(imp, node):
    """selu is elu with fixed alpha and scale (TVM's relax.nn.selu has no gradient for jit.script)."""
    return _elu(imp, env(imp, node.args[0]), 1.6732632423543772, 1.0507009873554805, 1.0)


def _elu(imp, x, alpha, scale, input_scale):
    """scale * x for x > 0, alpha * scale * expm1(input_scale * x) below. In a jit.script forward
    it is made of Relax ops, which Relax's Gradient can differentiate, with exp(x) - 1 for expm1."""
    if imp.differentiable:
        dt = str(x.ty.dtype)
        c = lambda v: relax.const(v, dt)  # noqa: E731
        neg = relax.op.multiply(c(alpha * scale), relax.op.subtract(relax.op.exp(relax.op.multiply(x, c(input_scale))), c(1.0)))
        return imp.block_builder.emit(relax.op.where(relax.op.greater(x, c(0.0)), relax.op.multiply(x, c(scale)), neg))

    def compute(t):
        def at(*i):
            v = t(*i)
            dt = str(v.ty)
            neg = tirx.const(alpha * scale, dt) * expm1_expr(v * tirx.const(input_scale, dt))
            return tirx.Select(v > tirx.const(0, dt), v * tirx.const(scale, dt), neg)

        return te.compute(t.shape, at, name="elu")

    return emit_te(imp, compute, x)
