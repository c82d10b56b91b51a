"""Special functions of the error-function family (erfc, erfcx, erfinv, ndtri) as elementwise TE
kernels; TVM's torch frontend has none of them. gamma.py holds the gamma and Bessel families.

They compute in float64 whatever their dtype, so float32 results are right to the last bit or
two: float64 erf and erfc come from the C math library (as TVM's own float64 erf does); the rest
is built on them here. erfinv and ndtri are lowered for float32 accuracy only, so float64 ones
run on CPU PyTorch. Several are registered under both their ATen name and the name of the prim
PyTorch decomposes them into (`erfinv` -> `erf_inv`, `special_ndtri` -> `ndtri`), so either
form lowers.
"""
import math

from tvm import tirx

from .kit import out_meta, pointwise
from .registry import rule


F64 = "float64"


def _c(value, dt=F64):
    return tirx.const(value, dt)


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
    return lambda imp, node: pointwise(imp, node, fn, F64)


rule("erfc.default")(_float64_rule(_erfc))
rule("special_erfcx.default", "erfcx.default")(_float64_rule(_erfcx))


def _inverse_rule(fn):
    def lower(imp, node):
        if out_meta(node)[1] == F64:
            raise NotImplementedError("erfinv and ndtri of float64 (lowered to 3e-9 relative: float32 accuracy)")
        return pointwise(imp, node, fn, F64)
    return lower


rule("erfinv.default", "erf_inv.default")(_inverse_rule(_erfinv))
rule("special_ndtri.default", "ndtri.default")(_inverse_rule(_ndtri))
