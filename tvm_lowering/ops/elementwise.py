"""Elementwise ops: arithmetic and comparisons, clamps, casts, and math functions.

Arithmetic and comparisons compute in the dtype PyTorch computes in; clamps take
bounds of any dtype; a cast to bfloat16 rounds as PyTorch's does. The math
functions are ones TVM's torch frontend lacks (exp2, signbit, fmax/fmin, hypot,
nextafter) or writes in forms that lose accuracy near zero, where PyTorch's do
not: it writes expm1 as exp(x) - 1, which gives 0 for |x| below float32's
epsilon (and a 1e-4 relative error well above it), atanh as
0.5 * log((1 + x) / (1 - x)) (the same), log1p as log(1 + x), and elu through
exp(x) - 1; its float32 tanh returns 0 below 1e-8 and is 1e-3 off relative at
1e-5. Small arguments are where these functions are used (expm1 of small rates,
tanh of small pre-activations), so the rules below keep PyTorch's relative
accuracy there:

  expm1   in float64: a Taylor polynomial for |x| < 1e-3, exp(x) - 1 above
  atanh   0.5 * log1p(2x / (1 - x))
  tanh    its odd Taylor polynomial for |x| < 0.01, TVM's tanh above
  elu     scale * x for x > 0, alpha * scale * expm1(input_scale * x) below (selu too)
  log1p   the C library's log1p
"""
import math

import torch
from tvm import relax, te, tirx

from ..dtypes import to_tvm
from ..schedules import MATERIALIZE
from .kit import (arg, cast, dtype, emit, emit_te, env, filled, float_compute, horner, is_float, isnan, keep_nan, out_meta,
                  pointwise, round_bf16, shape, to_dtype)
from .registry import rule


# ---- binary arithmetic and comparisons under PyTorch's type promotion -------------------------
# TVM's rules promote by their own rules (a 0-dim float64 tensor makes float16 math
# float64; int / int stays int) and LLVM codegen rejects comparisons of bool/int8/uint8
# and arithmetic on bool. These compute in the dtype PyTorch computes in: the output's
# for arithmetic, torch.result_type of the inputs for comparisons; narrow integer and
# bool math runs in int32 (exact for these ops) and is cast back; float16/bfloat16
# arithmetic in float32, rounded once (PyTorch's CPU kernels' opmath).
_ARITH = {
    "add.Tensor": relax.op.add, "sub.Tensor": relax.op.subtract, "mul.Tensor": relax.op.multiply,
    "div.Tensor": relax.op.divide, "maximum.default": relax.op.maximum, "minimum.default": relax.op.minimum,
    "max.other": relax.op.maximum, "min.other": relax.op.minimum,
}
_NAN_PICKING = {"maximum.default", "minimum.default", "max.other", "min.other"}  # a NaN operand wins, as in PyTorch
_COMPARE = {
    f"{name}.{kind}": op
    for name, op in (("lt", relax.op.less), ("le", relax.op.less_equal), ("gt", relax.op.greater),
                     ("ge", relax.op.greater_equal), ("eq", relax.op.equal), ("ne", relax.op.not_equal))
    for kind in ("Tensor", "Scalar")
}
_NARROW = {"bool", "int8", "uint8", "int16"}
_HALF = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def _binary(imp, node):
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
    elif compute in _HALF and name not in _COMPARE:
        compute = "float32"  # as PyTorch's kernels: operands (a float32 scalar too) at float32, one rounding
    bb = imp.block_builder
    if name in ("eq.Tensor", "ne.Tensor") and node.args[0] is node.args[1] and compute.startswith(("float", "bfloat")):
        # x == x (x != x) is a NaN test: isfinite's decomposition, `(x == x) * (x.abs() != inf)`. TVM's
        # simplifier folds a comparison of a value with itself to a constant, which on the GPU left
        # isfinite of a NaN true; its isnan keeps the test (and takes no bfloat16).
        x = imp.env[node.args[0]]
        nan = bb.emit(relax.op.isnan(cast(imp, x, "float32") if compute in _HALF else x))
        return nan if name == "ne.Tensor" else bb.emit(relax.op.logical_not(nan))
    if name == "div.Tensor" and not hasattr(node.args[1], "meta") and node.args[1] == 0 \
            and compute.startswith("float"):
        # TVM's constant folder rejects a division by the constant 0; x * (+-inf) is the same
        # IEEE result (+-inf, or NaN for 0 and NaN), as in a mean over no elements.
        name, node_args = "mul.Tensor", (node.args[0], math.copysign(math.inf, node.args[1]))
    else:
        node_args = node.args
    operands = [cast(imp, imp.env[a], compute) if hasattr(a, "meta") else relax.const(a, compute) for a in node_args]
    if alpha != 1:
        operands[1] = bb.emit(relax.op.multiply(operands[1], relax.const(alpha, compute)))
    out = bb.emit({**_ARITH, **_COMPARE}[name](*operands))
    if name in _NAN_PICKING:
        out = keep_nan(imp, out, *operands)
    return out if compute == out_dtype else to_dtype(imp, out, out_dtype)


rule(*_ARITH, *_COMPARE)(_binary)


# ---- division with rounding -------------------------------------------------------------------
def _div_floor_te(a, b, r, out_dt):
    """PyTorch's floor division of floats (c10's div_floor_floating) of te tensors `a` and `b`,
    `r` rounding each result as the dtype's own arithmetic would: from fmod, so a quotient just
    under an integer does not round up to it first. Staged, each stage materialized: the bfloat16
    rounding reads its input four times, and nested into one expression the kernel (and its
    compile time) would grow exponentially."""
    dt = a.dtype
    zero, one = tirx.const(0, dt), tirx.const(1, dt)

    def stage(name, f):
        return te.compute(a.shape, f, name=name, attrs={MATERIALIZE: 1})

    # the C library's fmod (TVM has no LLVM lowering of tirx.fmod), exact in float64 and back
    mod = stage("fmod", lambda *i: tirx.call_pure_extern("float64", "fmod", a(*i).astype("float64"),
                                                          b(*i).astype("float64")).astype(dt))
    div = stage("div_floor_q", lambda *i: r(a(*i) - mod(*i)))
    div = stage("div_floor_div", lambda *i: r(div(*i) / b(*i)))

    def adjust(*i):
        m, bb, d = mod(*i), b(*i), div(*i)
        # (b < 0) != (mod < 0), spelled out: LLVM takes no float comparison of two bools
        signs_differ = tirx.any(tirx.all(bb < zero, tirx.Not(m < zero)), tirx.all(tirx.Not(bb < zero), m < zero))
        return tirx.Select(tirx.all(m != zero, signs_differ), r(d - one), d)

    div = stage("div_floor_adjusted", adjust)
    floor = stage("div_floor_floor", lambda *i: tirx.floor(div(*i)))

    def result(*i):
        aa, bb, d, f = a(*i), b(*i), div(*i), floor(*i)
        f = tirx.Select(r(d - f) > tirx.const(0.5, dt), r(f + one), f)
        f = tirx.Select(d == zero, tirx.copysign(zero, aa / bb), f)
        value = tirx.Select(bb == zero, aa / bb, f)
        if out_dt == "bfloat16":
            value = round_bf16(value)
        return value.astype(out_dt)

    return te.compute(a.shape, result, name="floor_divide")


@rule("div.Tensor_mode", "floor_divide.default")
def div_mode(imp, node):
    """Floats divided with trunc or floor rounding as PyTorch's CPU kernels divide: a half-precision
    quotient rounds to its dtype before trunc (a bfloat16 quotient of 2.999 is 3), floor division
    goes through fmod, each step in the dtype's precision; other dtypes are TVM's rules."""
    name = node.target.__name__
    _, dt = out_meta(node)
    mode = "floor" if name == "floor_divide.default" else node.kwargs.get("rounding_mode", arg(node, 2, "rounding_mode"))
    if not is_float(dt) or mode not in ("trunc", "floor"):
        return imp.tvm_rules[name](node)
    compute = float_compute(node)
    if dt == "bfloat16":
        r = round_bf16
    elif dt == "float16":
        r = lambda v: v.astype("float16").astype("float32")  # noqa: E731
    else:
        r = lambda v: v  # noqa: E731
    if mode == "trunc":
        return pointwise(imp, node, lambda a, b: tirx.trunc(r(a / b)), compute, nargs=2)
    out_shape = out_meta(node)[0]
    xs = []
    for a in node.args[:2]:
        x = cast(imp, env(imp, a), compute) if isinstance(a, torch.fx.Node) else relax.const(a, compute)
        xs.append(x if shape(x) == out_shape else emit(imp, relax.op.broadcast_to(x, out_shape)))
    return emit_te(imp, lambda a, b: _div_floor_te(a, b, r, dt), *xs, primfunc_name_hint="floor_divide")


@rule("addcmul.default")
def addcmul(imp, node):
    """self + value * t1 * t2, computed in the output's dtype (narrow integers in int32).
    ratex records an optimizer's `p.add_(buf, alpha=-lr)` as addcmul(p, buf, lr_input)."""
    out_dtype = to_tvm(node.meta["val"].dtype)
    compute = "int32" if out_dtype in _NARROW else "float32" if out_dtype in _HALF else out_dtype
    bb = imp.block_builder
    x, t1, t2 = (cast(imp, imp.env[a], compute) for a in node.args[:3])
    prod = bb.emit(relax.op.multiply(t1, t2))
    value = node.kwargs.get("value", 1)
    if value != 1:
        prod = bb.emit(relax.op.multiply(relax.const(value, compute), prod))
    out = bb.emit(relax.op.add(x, prod))
    return out if compute == out_dtype else to_dtype(imp, out, out_dtype)


@rule("rsub.Scalar")
def rsub(imp, node):
    """other - alpha * x in the output dtype (TVM's rule makes an int32 constant of an int scalar)."""
    _, dt = out_meta(node)
    compute = "int32" if dt in _NARROW else dt
    x = cast(imp, env(imp, node.args[0]), compute)
    alpha = arg(node, 2, "alpha", 1)
    if alpha != 1:
        x = emit(imp, relax.op.multiply(x, relax.const(alpha, compute)))
    return cast(imp, emit(imp, relax.op.subtract(relax.const(arg(node, 1, "other"), compute), x)), dt)


@rule("bitwise_right_shift.Tensor_Scalar", "__rshift__.Scalar")
def right_shift(imp, node):
    """Arithmetic shift of an integer tensor by a constant (TVM has no rule for it)."""
    x = imp.env[node.args[0]]
    amount = relax.const(int(node.args[1]), str(x.ty.dtype))
    return imp.block_builder.emit(relax.op.right_shift(x, amount))


@rule("where.self", "where.ScalarOther", "where.ScalarSelf", "where.Scalar")
def where(imp, node):
    """The branches promoted to the output dtype first (TVM's rule needs them equal); a scalar branch
    (TorchScript records where.ScalarOther) is a constant of that dtype."""
    _, dt = out_meta(node)
    cond = env(imp, node.args[0])
    branches = [cast(imp, env(imp, b), dt) if isinstance(b, torch.fx.Node) else relax.const(b, dt)
                for b in node.args[1:3]]
    return emit(imp, relax.op.where(cast(imp, cond, "bool"), *branches))


@rule("masked_fill.Scalar")
def masked_fill(imp, node):
    """where(mask, value, x) with the value a constant of x's dtype (TVM's rule legalizes a
    +-inf or NaN fill through a `full` whose dtype TVM's own kernel then can't read)."""
    _, dt = out_meta(node)
    x, mask = env(imp, node.args[0]), env(imp, node.args[1])
    value = relax.const(arg(node, 2, "value"), dt)
    return emit(imp, relax.op.where(cast(imp, mask, "bool"), value, cast(imp, x, dt)))


# ---- clamps -----------------------------------------------------------------------------------
@rule("clamp.default", "clamp_min.default", "clamp_max.default")
def clamp(imp, node):
    """Bounds in the output dtype; an absent bound is no bound (TVM's rule passes +-inf, which an
    integer tensor can't hold); NaN inputs stay NaN. TVM's clamp_max reads its bound from the
    third argument, which it does not have, so clamped nothing."""
    _, dt = out_meta(node)
    x = cast(imp, env(imp, node.args[0]), dt)
    name = node.target.__name__
    if name == "clamp.default":
        lo, hi = arg(node, 1, "min"), arg(node, 2, "max")
    else:
        bound = arg(node, 1, name[6:9])
        lo, hi = (bound, None) if name.startswith("clamp_min") else (None, bound)
    if any(isinstance(b, float) and math.isnan(b) for b in (lo, hi)):
        return filled(imp, node, math.nan)  # a NaN bound makes every element NaN
    out = x
    if lo is not None:
        out = emit(imp, relax.op.maximum(out, relax.const(lo, dt)))
    if hi is not None:
        out = emit(imp, relax.op.minimum(out, relax.const(hi, dt)))
    return keep_nan(imp, out, x)


@rule("hardtanh.default", "relu6.default")
def hardtanh(imp, node):
    """TVM's clip, which has a gradient for jit.script, but NaN staying NaN (its comparisons made
    it max_val)."""
    x = env(imp, node.args[0])
    if node.target.__name__.startswith("relu6"):
        lo, hi = 0.0, 6.0
    else:
        lo, hi = arg(node, 1, "min_val", -1.0), arg(node, 2, "max_val", 1.0)
    return keep_nan(imp, emit(imp, relax.op.clip(x, lo, hi)), x)


@rule("clamp.Tensor", "clamp_min.Tensor", "clamp_max.Tensor")
def clamp_tensor(imp, node):
    """Bounds of another dtype are promoted with the input first (TVM's rule mixes dtypes); a NaN
    in the input or a bound gives NaN, as in PyTorch."""
    x = env(imp, node.args[0])
    name = node.target.__name__
    _, dt = out_meta(node)
    lo = arg(node, 1, "min") if not name.startswith("clamp_max") else None
    hi = arg(node, 2, "max") if name.startswith("clamp.") else arg(node, 1, "max") if name.startswith("clamp_max") else None
    x = cast(imp, x, dt)
    bounds = [cast(imp, env(imp, b), dt) if b is not None else None for b in (lo, hi)]
    out = x
    if bounds[0] is not None:
        out = emit(imp, relax.op.maximum(out, bounds[0]))
    if bounds[1] is not None:
        out = emit(imp, relax.op.minimum(out, bounds[1]))
    return keep_nan(imp, out, x, *(b for b in bounds if b is not None))


@rule("isnan.default", "isinf.default", "isfinite.default")
def float_class(imp, node):
    """TVM's rules, with a bfloat16 input widened to float32 first (exact; TVM's isnan, isinf
    and isfinite take no bfloat16)."""
    x = env(imp, node.args[0])
    if dtype(x) == "bfloat16":
        x = cast(imp, x, "float32")
    if not is_float(dtype(x)):  # an integer is never NaN or infinite
        return filled(imp, node, node.target.__name__.startswith("isfinite"))
    name = node.target.__name__.split(".")[0]
    if name == "isfinite":  # TVM's isfinite called NaN finite on the GPU (its isnan and isinf are right there)
        return emit(imp, relax.op.logical_not(relax.op.logical_or(relax.op.isnan(x), relax.op.isinf(x))))
    return emit(imp, {"isnan": relax.op.isnan, "isinf": relax.op.isinf}[name](x))


# ---- casts ------------------------------------------------------------------------------------
@rule("_to_copy.default")
def to_copy(imp, node):
    out = imp.tvm_rules["_to_copy.default"](node)
    x = imp.env[node.args[0]]
    if str(out.ty.dtype) != "bfloat16" or str(x.ty.dtype) == "bfloat16":
        return out
    return to_dtype(imp, x, "bfloat16")


@rule("to.device", "to.dtype", "to.dtype_layout", "to.other")
def to(imp, node):
    """The forms a TorchScript trace records: a cast to the dtype PyTorch says (the device is
    the program's own). TVM's rule keeps x's dtype when a device comes first."""
    return to_dtype(imp, env(imp, node.args[0]), out_meta(node)[1])


# ---- powers in half precision -----------------------------------------------------------------
# TVM's power takes float32/float64 only. PyTorch's CPU kernels compute a float16 or bfloat16
# power in float32 with the exponent first converted to the tensor's dtype, and round once;
# bfloat16's x^3 and x^-2 are products of bfloat16 values, rounded after each operation.
@rule("pow.Tensor_Scalar", "pow.Tensor_Tensor")
def power(imp, node):
    shp, dt = out_meta(node)
    if dt in ("float32", "float64") and node.target.__name__ == "pow.Tensor_Scalar" \
            and isinstance(node.args[1], (int, float)) and float(node.args[1]) in _PRODUCTS:
        return _as_products(imp, env(imp, node.args[0]), float(node.args[1]), dt)
    if dt not in _HALF:
        return imp.tvm_rules[node.target.__name__](node)
    if imp.differentiable:  # Relax's power, which has a gradient, in float32
        x, e = (cast(imp, env(imp, a), "float32") if isinstance(a, torch.fx.Node) else relax.const(a, "float32")
                for a in node.args[:2])
        return cast(imp, emit(imp, relax.op.power(x, e)), dt)
    x = cast(imp, to_dtype(imp, env(imp, node.args[0]), dt), "float32")
    e = node.args[1]
    if isinstance(e, torch.fx.Node):
        e = cast(imp, to_dtype(imp, env(imp, e), dt), "float32")
        args = [t if shape(t) == shp else emit(imp, relax.op.broadcast_to(t, shp)) for t in (x, e)]
        return _half_kernel(imp, dt, shp, lambda v, p: tirx.pow(v, p), *args)
    e = torch.tensor(float(e), dtype=_HALF[dt]).item()
    r = round_bf16 if dt == "bfloat16" else (lambda v: v)
    one = tirx.const(1.0, "float32")
    special = {3.0: lambda v: r(v * v) * v, -2.0: lambda v: one / r(v * v), 2.0: lambda v: v * v,
               0.5: tirx.sqrt, -1.0: lambda v: one / v}
    fn = special.get(e)  # float16's single rounding gives the same: these products of float16 are exact in float32
    x = x if shape(x) == shp else emit(imp, relax.op.broadcast_to(x, shp))
    return _half_kernel(imp, dt, shp, fn or (lambda v: tirx.pow(v, tirx.const(e, "float32"))), x)


# x^e for these exponents is what PyTorch's CPU and CUDA kernels compute (products and a
# quotient: pow_tensor_scalar_optimized_kernel), not pow(): bit for bit, and vectorized where
# TVM's power is a scalar libm call per element (GPT-2's gelu_new: x^3, 0.35 ms a call).
_PRODUCTS = {2.0: lambda x: relax.op.multiply(x, x),
             3.0: lambda x: relax.op.multiply(relax.op.multiply(x, x), x),
             -1.0: lambda x: relax.op.divide(relax.const(1.0, dtype(x)), x),
             -2.0: lambda x: relax.op.divide(relax.const(1.0, dtype(x)), relax.op.multiply(x, x))}


def _as_products(imp, x, e, dt):
    return emit(imp, _PRODUCTS[e](to_dtype(imp, x, dt)))  # x^e has x's shape: no broadcast


def _half_kernel(imp, dt, shp, fn, *args):
    """fn of float32 elements, rounded to `dt` (bfloat16: explicitly, see kit.round_bf16)."""
    def at(*values):
        value = fn(*values)
        return (round_bf16(value) if dt == "bfloat16" else value).astype(dt)

    return emit_te(imp, lambda *ts: te.compute(shp, lambda *i: at(*(t(*i) for t in ts)), name="pow"), *args,
                   primfunc_name_hint="pow")


# ---- functions accurate near zero -------------------------------------------------------------
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


@rule("celu.default")
def celu(imp, node):
    """celu(x, alpha) is elu(x, alpha, 1, 1 / alpha) (TVM's rule divides exp(x), not x, by alpha)."""
    alpha = float(arg(node, 1, "alpha", 1.0))  # never 0: PyTorch's shape inference rejects it
    return _elu(imp, env(imp, node.args[0]), alpha, 1.0, 1.0 / alpha)


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


# ---- activations in a jit.script forward ------------------------------------------------------
# Composite ops the lazy device sees as their parts; a scripted forward records them whole.
# Written in Relax ops whose gradients (TVM's and autodiff.py's) are PyTorch's backward
# formulas, at the thresholds too: where(c, a, b) passes the gradient of the branch taken.
def _activation(fn):
    """A script rule computing fn(x, const, *args) on the node's first argument."""
    def lower(imp, node):
        x = env(imp, node.args[0])
        dt = dtype(x)
        return emit(imp, fn(x, lambda v: relax.const(v, dt), *node.args[1:]))

    return lower


def _threshold(x, c, threshold, value):
    return relax.op.where(relax.op.less_equal(x, c(threshold)), c(value), x)


def _hardshrink(x, c, lambd=0.5):
    dead = relax.op.logical_and(relax.op.greater_equal(x, c(-lambd)), relax.op.less_equal(x, c(lambd)))
    return relax.op.where(dead, c(0.0), x)


def _hardswish(x, c):
    # x * (x + 3) / 6 strictly between -3 and 3, in PyTorch's order (its backward's bounds); x * 0
    # below keeps PyTorch's -0.0
    inner = relax.op.divide(relax.op.multiply(x, relax.op.add(x, c(3.0))), c(6.0))
    low = relax.op.multiply(x, c(0.0))
    return relax.op.where(relax.op.less_equal(x, c(-3.0)), low, relax.op.where(relax.op.less(x, c(3.0)), inner, x))


def _log_sigmoid(x, c):
    return relax.op.negative(relax.op.nn.softplus(relax.op.negative(x)))  # its gradient at 0 is sigmoid(0)


def _mish(x, c):
    return relax.op.multiply(x, relax.op.tanh(relax.op.nn.softplus(x)))


def _rrelu(x, c, lower=1 / 8, upper=1 / 3, training=False, generator=None):
    if training:
        raise NotImplementedError("rrelu in training mode in a scripted forward (random slopes)")
    return relax.op.nn.leakyrelu(x, (lower + upper) / 2)


def _glu(x, c, dim=-1):
    a, b = (relax.TupleGetItem(relax.op.split(x, 2, axis=dim), i) for i in (0, 1))
    return relax.op.multiply(a, relax.op.sigmoid(b))


for _name, _fn in (("threshold", _threshold), ("hardshrink", _hardshrink), ("hardswish", _hardswish),
                   ("log_sigmoid", _log_sigmoid), ("mish", _mish), ("rrelu", _rrelu), ("glu", _glu)):
    rule(f"{_name}.default", script=True)(_activation(_fn))


@rule("log1p.default", tir=True)
def log1p(imp, node):
    """The C library's log1p: TVM's rule is log(1 + x), which loses all of a small x (log_ndtr
    of large x is log1p of a tiny number)."""
    return pointwise(imp, node, tirx.log1p, float_compute(node))


# ---- functions TVM lacks, and IEEE-754 bit-level ops ------------------------------------------
# The unsigned integer of each float's width, for bit-level work (unsigned: the GPU pipeline
# narrows int64 values to int32, which would cut float64 bit patterns in half).
_BITS = {"float16": "uint16", "bfloat16": "uint16", "float32": "uint32", "float64": "uint64"}


@rule("exp2.default")
def exp2(imp, node):
    return pointwise(imp, node, tirx.exp2, float_compute(node))


@rule("signbit.default")
def signbit(imp, node):
    """The sign bit itself, so -0.0 and NaNs with the bit set count as negative."""
    dt = dtype(env(imp, node.args[0]))
    if dt in _BITS:
        bits = _BITS[dt]
        sign = tirx.const(1 << (int(bits[4:]) - 1), bits)
        return pointwise(imp, node, lambda v: tirx.reinterpret(bits, v) >= sign, dt)
    if dt == "bool" or dt.startswith("uint"):
        return emit(imp, relax.op.zeros(relax.ShapeExpr(out_meta(node)[0]), "bool"))
    return pointwise(imp, node, lambda v: v < tirx.const(0, dt), dt)


def _nan_ignoring(pick):
    """fmax/fmin: a NaN loses to a number; two NaNs give NaN."""
    def fn(a, b):
        if not is_float(dtype(a)):
            return pick(a, b)
        return tirx.Select(isnan(a), b, tirx.Select(isnan(b), a, pick(a, b)))
    return fn


@rule("fmax.default", "fmin.default")
def fmax_fmin(imp, node):
    _, dt = out_meta(node)
    pick = tirx.Max if node.target.__name__.startswith("fmax") else tirx.Min
    return pointwise(imp, node, _nan_ignoring(pick), "int32" if dt in _NARROW else dt, nargs=2)


def _hypot(a, b):
    """sqrt(a² + b²) scaled by the larger magnitude, so it neither overflows nor underflows;
    an infinity wins over a NaN (C's hypot, which PyTorch follows)."""
    dt = dtype(a)
    a, b = tirx.abs(a), tirx.abs(b)
    big, small = tirx.Max(a, b), tirx.Min(a, b)
    r = small / big
    out = big * tirx.sqrt(tirx.const(1, dt) + r * r)
    out = tirx.Select(big == tirx.const(0, dt), tirx.const(0, dt), out)
    out = tirx.Select(isnan(a) | isnan(b), tirx.const(math.nan, dt), out)
    return tirx.Select(tirx.isinf(a) | tirx.isinf(b), tirx.const(math.inf, dt), out)


@rule("hypot.default")
def hypot(imp, node):
    return pointwise(imp, node, _hypot, float_compute(node), nargs=2)


def _nextafter(x, y):
    """The float next to x towards y, by stepping x's bit pattern (sign and magnitude) by one."""
    dt = dtype(x)
    bits = _BITS[dt]
    ix = tirx.reinterpret(bits, x)
    up = tirx.Select(x > tirx.const(0, dt), x < y, y < x)  # the magnitude grows: one step up the bit pattern
    step = tirx.reinterpret(dt, tirx.Select(up, ix + tirx.const(1, bits), ix - tirx.const(1, bits)))
    tiniest = tirx.reinterpret(dt, tirx.const(1, bits))  # from zero: the smallest subnormal, signed like y
    out = tirx.Select(x == tirx.const(0, dt), tirx.Select(y > tirx.const(0, dt), tiniest, -tiniest), step)
    out = tirx.Select(x == y, y, out)
    return tirx.Select(isnan(x) | isnan(y), x + y, out)


@rule("nextafter.default")
def nextafter(imp, node):
    _, dt = out_meta(node)
    if dt not in ("float32", "float64"):
        raise NotImplementedError(f"nextafter on {dt} (lowered for float32 and float64)")
    return pointwise(imp, node, _nextafter, dt, nargs=2)


# ---- ops only AOTAutograd's graphs produce (the torch.compile front end) -----------------------
# dynamo writes an optimizer's addcmul_, addcdiv_ (with a value) and add_ (with a tensor alpha) as
# prims.fma, and the foreach optimizers' _foreach_addcdiv and _foreach_lerp, unrolled by
# ratex.dynamo, give addcdiv and lerp; the lazy path decomposes those itself.
@rule("fma.default")
def fma(imp, node):
    """prims.fma(a, b, c) = a * b + c in the output's dtype (a Python scalar operand is a constant).

    Computed as a multiply and an add: LLVM contracts them into one FMA where the
    target allows it (ratex's CPU target has fast-math-contract), as torch's CPU kernel does."""
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
