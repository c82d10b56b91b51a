"""Special functions and IEEE-754 bit-level ops that TVM's torch frontend lacks.

Found by the OpInfo conformance run (scripts/conformance.py). The special functions
(erfc, erfcx, erfinv, ndtri) compute in float64 whatever their dtype, so float32 results
are right to the last bit or two: float64 erf and erfc come from the C math library (as TVM's
own float64 erf does); the rest is built on them here. erfinv and ndtri are lowered for
float32 accuracy only, so float64 ones run on CPU PyTorch. Several are registered under both
their ATen name and the name of the prim PyTorch decomposes them into (`erfinv` ->
`erf_inv`, `special_ndtri` -> `ndtri`), so either form lowers.
"""
import math

import torch
from tvm import relax, te, tirx

from . import rule
from .nn import cast, dtype, emit, env, out_meta, shape

F64 = "float64"
# The unsigned integer of each float's width, for bit-level work (unsigned: the GPU pipeline
# narrows int64 values to int32, which would cut float64 bit patterns in half).
_BITS = {"float16": "uint16", "bfloat16": "uint16", "float32": "uint32", "float64": "uint64"}
_NARROW = {"bool", "int8", "uint8", "int16"}  # LLVM rejects max/min on these: computed in int32


def _c(value, dt=F64):
    return tirx.const(value, dt)


def _dtype(expr):
    return str(expr.ty.dtype)


def _is_float(dt):
    return dt.startswith("float") or dt.startswith("bfloat")


def _elementwise(imp, node, fn, compute, nargs=1):
    """`fn` per element of the node's first `nargs` arguments, broadcast to the output shape and
    cast to `compute` first; the result is cast to the output dtype.

    `fn` may use a subexpression more than once, but must not bind it with a tirx.Let: TVM's
    bfloat16 legalization computes garbage from a Let whose value reads a bfloat16 tensor,
    as one does once a cast from bfloat16 is fused in. LLVM merges the repeated parts."""
    out_shape, out_dt = out_meta(node)
    xs = []
    for a in node.args[:nargs]:
        x = cast(imp, env(imp, a), compute) if isinstance(a, torch.fx.Node) else relax.const(a, compute)
        xs.append(x if shape(x) == out_shape else emit(imp, relax.op.broadcast_to(x, out_shape)))

    def kernel(*ts):
        return te.compute(out_shape, lambda *i: fn(*(t(*i) for t in ts)).astype(out_dt),
                          name=node.target.__name__.split(".")[0])

    return imp.block_builder.emit_te(kernel, *xs)


def _float_compute(node):
    """float64 for float64 results, float32 for the narrower float ones (and int inputs)."""
    return F64 if out_meta(node)[1] == F64 else "float32"


# ---- where with operands of two dtypes (heaviside's decomposition mixes float and int64) ----
@rule("where.self")
def where(imp, node):
    """The branches promoted to the output dtype first (TVM's rule needs them equal)."""
    _, dt = out_meta(node)
    cond = env(imp, node.args[0])
    branches = [cast(imp, env(imp, b), dt) if isinstance(b, torch.fx.Node) else relax.const(b, dt)
                for b in node.args[1:3]]
    return emit(imp, relax.op.where(cast(imp, cond, "bool"), *branches))


# ---- simple elementwise ops ------------------------------------------------------------------
@rule("exp2.default")
def exp2(imp, node):
    return _elementwise(imp, node, tirx.exp2, _float_compute(node))


@rule("log1p.default", tir=True)
def log1p(imp, node):
    """The C library's log1p: TVM's rule is log(1 + x), which loses all of a small x (log_ndtr
    of large x is log1p of a tiny number)."""
    return _elementwise(imp, node, tirx.log1p, _float_compute(node))


@rule("signbit.default")
def signbit(imp, node):
    """The sign bit itself, so -0.0 and NaNs with the bit set count as negative."""
    dt = dtype(env(imp, node.args[0]))
    if dt in _BITS:
        bits = _BITS[dt]
        sign = _c(1 << (int(bits[4:]) - 1), bits)
        return _elementwise(imp, node, lambda v: tirx.reinterpret(bits, v) >= sign, dt)
    if dt == "bool" or dt.startswith("uint"):
        return emit(imp, relax.op.zeros(relax.ShapeExpr(out_meta(node)[0]), "bool"))
    return _elementwise(imp, node, lambda v: v < _c(0, dt), dt)


def _nan_ignoring(pick):
    """fmax/fmin: a NaN loses to a number; two NaNs give NaN."""
    def fn(a, b):
        if not _is_float(_dtype(a)):
            return pick(a, b)
        return tirx.Select(tirx.isnan(a), b, tirx.Select(tirx.isnan(b), a, pick(a, b)))
    return fn


@rule("fmax.default", "fmin.default")
def fmax_fmin(imp, node):
    _, dt = out_meta(node)
    pick = tirx.Max if node.target.__name__.startswith("fmax") else tirx.Min
    return _elementwise(imp, node, _nan_ignoring(pick), "int32" if dt in _NARROW else dt, nargs=2)


def _hypot(a, b):
    """sqrt(a² + b²) scaled by the larger magnitude, so it neither overflows nor underflows;
    an infinity wins over a NaN (C's hypot, which PyTorch follows)."""
    dt = _dtype(a)
    a, b = tirx.abs(a), tirx.abs(b)
    big, small = tirx.Max(a, b), tirx.Min(a, b)
    r = small / big
    out = big * tirx.sqrt(_c(1, dt) + r * r)
    out = tirx.Select(big == _c(0, dt), _c(0, dt), out)
    out = tirx.Select(tirx.isnan(a) | tirx.isnan(b), _c(math.nan, dt), out)
    return tirx.Select(tirx.isinf(a) | tirx.isinf(b), _c(math.inf, dt), out)


@rule("hypot.default")
def hypot(imp, node):
    return _elementwise(imp, node, _hypot, _float_compute(node), nargs=2)


def _nextafter(x, y):
    """The float next to x towards y, by stepping x's bit pattern (sign and magnitude) by one."""
    dt = _dtype(x)
    bits = _BITS[dt]
    ix = tirx.reinterpret(bits, x)
    up = tirx.Select(x > _c(0, dt), x < y, y < x)  # the magnitude grows: one step up the bit pattern
    step = tirx.reinterpret(dt, tirx.Select(up, ix + _c(1, bits), ix - _c(1, bits)))
    tiniest = tirx.reinterpret(dt, _c(1, bits))  # from zero: the smallest subnormal, signed like y
    out = tirx.Select(x == _c(0, dt), tirx.Select(y > _c(0, dt), tiniest, -tiniest), step)
    out = tirx.Select(x == y, y, out)
    return tirx.Select(tirx.isnan(x) | tirx.isnan(y), x + y, out)


@rule("nextafter.default")
def nextafter(imp, node):
    _, dt = out_meta(node)
    if dt not in ("float32", "float64"):
        raise NotImplementedError(f"nextafter on {dt} (lowered for float32 and float64)")
    return _elementwise(imp, node, _nextafter, dt, nargs=2)


# ---- the error function family, in float64 --------------------------------------------------
def _erfc(x):
    """The C library's (CUDA's) float64 erfc: TVM has no erfc intrinsic."""
    return tirx.call_pure_extern(F64, "erfc", x)


# exp(x²) overflows float64 beyond x = 26.6; past 26 the asymptotic series of erfcx, cut after
# its z⁶ term (z = 1 / 2x²), is exact to float64 precision (the next term is below 1e-15).
_ERFCX_SERIES_FROM = 26.0


def _erfcx(x):
    """exp(x²) erfc(x), without the overflow of exp(x²) for large x."""
    direct = tirx.exp(x * x) * _erfc(x)

    z = _c(0.5) / (x * x)
    series = _c(1)  # 1 - z + 1·3 z² - 1·3·5 z³ + ... in Horner form
    for k in range(6, 0, -1):
        series = _c(1) - _c(2 * k - 1) * z * series
    return tirx.Select(x < _c(_ERFCX_SERIES_FROM), direct, series / (x * _c(math.sqrt(math.pi))))


_TWO_OVER_SQRT_PI = 2 / math.sqrt(math.pi)


def _winitzki(a, q):
    """Winitzki's closed-form erfinv(a), within 2.3e-3 relative; log(1 - a²) is taken as
    log(q (1 + a)) to keep the tail."""
    k = 0.147
    log_1ma2 = tirx.log(q * (_c(1) + a))
    t = _c(2 / (math.pi * k)) + log_1ma2 / _c(2)
    return tirx.sqrt(tirx.sqrt(t * t - log_1ma2 / _c(k)) - t)


def _halley_step(y, a, q):
    """One Halley step towards erf(y) = a: on f = erf(y) - a near the centre, on
    g = log erfc(y) - log q in the tail (a > 1/2), where erfc falls off too steeply for a step
    on it to land close but its log is nearly quadratic. The step is y - d / (1 + d c), with
    d the Newton step and c = -f''/2f' (-g''/2g')."""
    e = _erfcx(y)  # log erfc(y) = log e - y², g' = -(2/sqrt(pi)) / e
    g1 = -_c(_TWO_OVER_SQRT_PI) / e
    d_tail = (tirx.log(e) - y * y - tirx.log(q)) / g1
    d_centre = (tirx.erf(y) - a) / (_c(_TWO_OVER_SQRT_PI) * tirx.exp(-y * y))
    # if_then_else, not Select: only the branch taken pays for its erf or erfcx
    return tirx.if_then_else(a > _c(0.5), y - d_tail / (_c(1) + d_tail * (y + g1 / _c(2))),
                             y - d_centre / (_c(1) + d_centre * y))


def _inverse_erf(a, q):
    """y >= 0 with erf(y) = a, for 0 <= a < 1 given together with q = 1 - a (accurate when tiny).

    One Halley step from Winitzki's start cubes its error: 2.3e-3 -> 3e-9 relative, down to
    q = 1e-300 (checked against PyTorch's float64 erfinv and ndtri). That is exact for float32
    results but not float64 ones; a second step would make the kernel's expression (written
    out in full: see _elementwise) fifteen times larger.
    """
    return _halley_step(_winitzki(a, q), a, q)


def _erfinv(x):
    a = tirx.abs(x)
    y = tirx.Select(a == _c(1), _c(math.inf), _inverse_erf(a, _c(1) - a))
    return tirx.Select(a > _c(1), _c(math.nan), y * tirx.Select(x < _c(0), _c(-1), _c(1)))


def _ndtri(p):
    """sqrt(2) erfinv(2p - 1), through 2p itself below p = 1/2 (1 - 2p would round it away)."""
    lower = p < _c(0.5)
    two_p = p * _c(2)
    y = _c(math.sqrt(2)) * _inverse_erf(tirx.Select(lower, _c(1) - two_p, two_p - _c(1)),
                                         tirx.Select(lower, two_p, _c(2) - two_p))
    y = y * tirx.Select(lower, _c(-1), _c(1))
    y = tirx.Select(p == _c(0), _c(-math.inf), tirx.Select(p == _c(1), _c(math.inf), y))
    return tirx.Select((p < _c(0)) | (p > _c(1)), _c(math.nan), y)


def _float64_rule(fn):
    return lambda imp, node: _elementwise(imp, node, fn, F64)


rule("erfc.default")(_float64_rule(_erfc))
rule("special_erfcx.default", "erfcx.default")(_float64_rule(_erfcx))


def _inverse_rule(fn):
    def lower(imp, node):
        if out_meta(node)[1] == F64:
            raise NotImplementedError("erfinv and ndtri of float64 (lowered to 3e-9 relative: float32 accuracy)")
        return _elementwise(imp, node, fn, F64)
    return lower


rule("erfinv.default", "erf_inv.default")(_inverse_rule(_erfinv))
rule("special_ndtri.default", "ndtri.default")(_inverse_rule(_ndtri))
