"""Special functions of the gamma family, and modified Bessel functions, as elementwise TE kernels
(special.py holds the error-function family).

TVM has no lowering for any of these. Every kernel computes in float64 whatever
the input dtype (PyTorch promotes integer inputs to float and computes half
ones in float) and casts to the output dtype PyTorch recorded. Poles,
infinities, NaN and signed zeros come out as PyTorch's CPU kernels give them.

The methods are textbook identities, chosen to reach double precision with a
fixed, unrolled amount of work per element:

  lgamma, digamma  the recurrence G(x+1) = x G(x) steps x up to >= 10, where
                   Stirling's series (and digamma's asymptotic series) have
                   converged; negative x goes through the reflection formula.
  zeta(s, q)       Hurwitz zeta: 10 terms of its sum, then the Euler-Maclaurin
                   tail. Negative q (where only integer s is defined) is
                   rewritten as three Hurwitz zetas of positive arguments.
  polygamma(n, x)  (-1)^(n+1) n! zeta(n+1, x); digamma for n = 0.
  I0, I1           power series up to |x| = 20, asymptotic expansion beyond;
                   computed exponentially scaled (i0e, i1e), which cannot
                   overflow, and multiplied by exp(|x|) for I0 and I1.

Every intermediate used more than once is bound with a Let: TE would otherwise
repeat its whole expression at each use, compounding stage by stage.

Results are closer to the true values than PyTorch's where its kernels lose
precision: its float trigamma near negative integers (sin(pi x) in float; at
the poles themselves it returns large finite values, this gives inf), and its
float64 zeta where q < 0 sums terms that cancel.
"""
import math
from fractions import Fraction

import torch
from tvm import relax, te, tirx

from .kit import cast, emit, emit_te, env, horner, out_meta, shape
from .registry import rule

_F64 = "float64"
_INF = float("inf")
_NAN = float("nan")
_SHIFT_TO = 10  # lgamma and digamma step their argument up to at least this
_ZETA_TERMS = 10  # Hurwitz zeta terms summed before the Euler-Maclaurin tail
_MAX_MULTIPLIED_POWER = 32  # integer powers up to this are products (rounding grows with the count)
_BESSEL_SERIES_MAX = 20.0  # |x| up to which I0/I1 use their power series
_BESSEL_SERIES_TERMS = 36  # its last term is below 1e-17 of the sum at |x| = 20
_BESSEL_ASYMPTOTIC_TERMS = 28  # and the asymptotic expansion's, from |x| = 20 on
_LOG_FLOAT32_MAX = 88.72283905206835  # PyTorch's float kernels overflow exp(|x|) above this


def _bernoulli(count):
    """B_0 .. B_{count-1} as Fractions, from sum_{k<=n} C(n+1, k) B_k = 0."""
    b = [Fraction(1)]
    for n in range(1, count):
        b.append(-sum(math.comb(n + 1, k) * b[k] for k in range(n)) / (n + 1))
    return b


_B = _bernoulli(20)
# Stirling's series: lgamma(z) ~ (z - 1/2) log z - z + log(2 pi)/2 + sum_j B_2j / (2j (2j-1) z^(2j-1))
_STIRLING = [float(_B[2 * j] / (2 * j * (2 * j - 1))) for j in range(1, 8)]
# digamma(z) ~ log z - 1/(2z) - sum_j B_2j / (2j z^2j)
_DIGAMMA = [float(_B[2 * j] / (2 * j)) for j in range(1, 8)]
# Euler-Maclaurin tail of the Hurwitz zeta: B_2j / (2j)!
_EULER_MACLAURIN = [float(_B[2 * j] / math.factorial(2 * j)) for j in range(1, 10)]


def _bessel_asymptotic(nu):
    """c_k of I_nu(x) e^-x sqrt(2 pi x) ~ sum_k c_k / x^k."""
    c = [1.0]
    for k in range(1, _BESSEL_ASYMPTOTIC_TERMS):
        c.append(c[-1] * ((2 * k - 1) ** 2 - 4 * nu * nu) / (8 * k))
    return c


_BESSEL_ASYMPTOTIC = {0: _bessel_asymptotic(0), 1: _bessel_asymptotic(1)}


# ---- float64 TIR expression helpers ---------------------------------------------------------
def _c(value):
    return tirx.const(value, _F64)


def _let(name, value, body):
    """body(v), v a float64 variable bound to `value`."""
    var = tirx.Var(name, _F64)
    return tirx.Let(var, value, body(var))


def _select(cond, a, b):
    as_expr = lambda v: _c(v) if isinstance(v, (int, float)) else v  # noqa: E731
    return tirx.Select(cond, as_expr(a), as_expr(b))


def _is_nonpositive_integer(x):
    return tirx.all(x <= 0.0, tirx.floor(x) == x)


def _stepped(y, body):
    """body(z, stepped) for a variable y > 0: k in 0..10 unit steps take y to z = y + k >= 10
    (k = 0 for NaN); stepped(term, empty) lists term(y + i) for i < k and `empty` for k <= i < 10."""
    def with_k(k):
        def stepped(term, empty):
            return [_select(_c(float(i)) < k, term(y + float(i)), empty) for i in range(_SHIFT_TO)]

        return _let("z", y + k, lambda z: body(z, stepped))

    return _let("k", _select(y < float(_SHIFT_TO), tirx.ceil(_SHIFT_TO - y), 0.0), with_k)


# ---- lgamma, digamma --------------------------------------------------------------------------
def _lgamma_positive(y):
    """lgamma(y), y > 0: Stirling's series at z = y + k, less log(y (y+1) ... (y+k-1))."""
    def at(z, stepped):
        def stirling(w):
            return ((z - 0.5) * (tirx.log(z) - 1.0) + (0.5 * math.log(2 * math.pi) - 0.5)
                    + w * horner(w * w, _STIRLING))

        return _let("w", 1.0 / z, stirling) - tirx.log(math.prod(stepped(lambda t: t, 1.0)))

    return _let("y", y, lambda y: _stepped(y, at))


def lgamma(x):
    """lgamma(x) = log|Gamma(x)| of a float64 variable: +inf at 0, -1, -2, ... and at -inf."""
    def at(log_g):
        # |Gamma(x) Gamma(1-x)| = pi / |sin(pi x)|; with r = x - round(x), sin(pi r) keeps its precision
        reflected = math.log(math.pi) - tirx.log(tirx.abs(tirx.sin(math.pi * (x - tirx.round(x))))) - log_g
        return _select(_is_nonpositive_integer(x), _INF, tirx.if_then_else(x < 0.0, reflected, log_g))

    return _let("log_g", _lgamma_positive(_select(x < 0.0, 1.0 - x, x)), at)


def _digamma_positive(y):
    """digamma(y), y > 0: the asymptotic series at z = y + k, less 1/y + ... + 1/(y+k-1)."""
    def at(z, stepped):
        def series(w):
            return tirx.log(z) - 0.5 * w - w * w * horner(w * w, _DIGAMMA)

        return _let("w", 1.0 / z, series) - sum(stepped(lambda t: 1.0 / t, 0.0))

    return _let("y", y, lambda y: _stepped(y, at))


def digamma(x):
    """digamma(x) of a float64 variable: -inf at +0, +inf at -0, NaN at -1, -2, ... and -inf."""
    def at(psi):
        # digamma(1-x) - digamma(x) = pi / tan(pi x); with r = x - round(x), tan(pi r) keeps its precision
        reflected = psi - math.pi / tirx.tan(math.pi * (x - tirx.round(x)))
        return _select(x == 0.0, tirx.copysign(_c(_INF), -x),
                       _select(_is_nonpositive_integer(x), _NAN, tirx.if_then_else(x < 0.0, reflected, psi)))

    return _let("psi", _digamma_positive(_select(x < 0.0, 1.0 - x, x)), at)


# ---- Hurwitz zeta, polygamma ------------------------------------------------------------------
def _reciprocal_power(base, s):
    """base^-s for base > 0. A constant integer s (polygamma's) multiplies, which LLVM can
    vectorize; pow is a libm call per element."""
    if isinstance(s, tirx.FloatImm) and s.value == int(s.value) and 1 <= s.value <= _MAX_MULTIPLIED_POWER:
        return _let("base", base, lambda b: 1.0 / math.prod([b] * int(s.value)))
    return tirx.pow(base, -s)


def _hurwitz_positive(s, a):
    """zeta(s, a) for s > 1 (a variable or constant), a > 0: 10 terms of the sum, then the
    Euler-Maclaurin tail at b = a + 10, taken as b^(1-s) times
        1/(s-1) + 1/(2b) + sum_j B_2j/(2j)! s(s+1)...(s+2j-2) b^-2j
    (b^(1-s), unlike b^-s, is representable wherever the tail is)."""
    s_minus_1 = _c(s.value - 1.0) if isinstance(s, tirx.FloatImm) else s - 1.0

    def tail(b):
        def at(p, inv_b2):
            acc = _c(_EULER_MACLAURIN[-1])
            for j in range(len(_EULER_MACLAURIN) - 1, 0, -1):
                acc = _EULER_MACLAURIN[j - 1] + (s + float(2 * j - 1)) * (s + float(2 * j)) * inv_b2 * acc
            # p = 0 (b^(1-s) underflowed): the tail vanishes, though the bracket may overflow
            return _select(p > 0.0, p * (1.0 / s_minus_1 + (0.5 + s / b * acc) / b), 0.0)

        return _let("p", _reciprocal_power(b, s_minus_1), lambda p: _let("inv_b2", 1.0 / (b * b), lambda i: at(p, i)))

    def at(a):
        head = sum(_reciprocal_power(a + float(i), s) for i in range(_ZETA_TERMS))
        return head + _let("b", a + float(_ZETA_TERMS), tail)

    return _let("a", a, at)


def zeta(s, q):
    """Hurwitz zeta(s, q) = sum_{i>=0} (q+i)^-s of float64 variables, with PyTorch's special
    values: inf for s = 1 and for q = 0, -1, -2, ...; NaN for s < 1, for q < 0 with s not an
    integer, and for q = +inf; for s = +inf, 1 at q = 1, inf below and NaN above."""
    def at(f):
        # q < 0: zeta(s, q) = zeta(s, f) + sum_{j=1..m} (f-j)^-s, f = q + m in (0, 1), and for an
        # integer s that finite sum is (-1)^s (zeta(s, 1-f) - zeta(s, 1-q)). 1 - f is taken as
        # ceil(q) - q, which is exact where 1 - f would round away q's digits (q near 0). The two
        # large terms are added first: at q = -m - 1/2 with s odd they cancel exactly.
        sign = 1.0 - 2.0 * (s - 2.0 * tirx.floor(s * 0.5))
        below_zero = ((_hurwitz_positive(s, f) + sign * _hurwitz_positive(s, tirx.ceil(q) - q))
                      - sign * _hurwitz_positive(s, 1.0 - q))
        # a branch, not a select: the three zetas cost 30 powers, wasted on the other side
        value = tirx.if_then_else(q < 0.0, below_zero, _hurwitz_positive(s, q))
        at_infinite_s = _select(q == 1.0, 1.0, _select(q < 1.0, _INF, _NAN))
        return _select(s == 1.0, _INF, _select(s < 1.0, _NAN, _select(
            _is_nonpositive_integer(q), _INF, _select(tirx.all(q < 0.0, tirx.floor(s) != s), _NAN, _select(
                s == _INF, at_infinite_s, _select(q == _INF, _NAN, value))))))

    return _let("f", q - tirx.floor(q), at)


def polygamma(n):
    """x -> polygamma(n, x), the n-th derivative of digamma, for an integer n >= 0."""
    if n == 0:
        return digamma

    def at(x):
        value = ((-1) ** (n + 1) * float(math.factorial(n))) * zeta(_c(float(n + 1)), x)
        if n == 1:  # PyTorch's trigamma kernel is not zeta's: 0 at +inf, NaN at -inf
            return _select(x == _INF, 0.0, _select(x == -_INF, _NAN, value))
        return value

    return at


# ---- modified Bessel functions of the first kind ----------------------------------------------
def _bessel_scaled(nu, ax):
    """I_nu(ax) e^-ax for a variable ax = |x| and nu in (0, 1)."""
    def series(y):
        acc = _c(1.0)  # sum_k y^k / (k! (k+nu)!), nested from the last term
        for k in range(_BESSEL_SERIES_TERMS, 0, -1):
            acc = 1.0 + acc * y * (1.0 / (k * (k + nu)))
        return acc * tirx.exp(-ax) * (ax * 0.5 if nu else 1.0)

    def asymptotic(t):
        return horner(t, _BESSEL_ASYMPTOTIC[nu]) / tirx.sqrt((2 * math.pi) * ax)

    return tirx.if_then_else(ax <= _BESSEL_SERIES_MAX, _let("y", ax * ax * 0.25, series), _let("t", 1.0 / ax, asymptotic))


def bessel(nu, scaled, float32_exp):
    """x -> I_nu(x), or I_nu(x) e^-|x| when `scaled`. With `float32_exp` exp(|x|) overflows
    where float32's does, as in PyTorch's kernels for float and half inputs."""
    def unscaled(ax):
        big = tirx.exp(ax)
        if float32_exp:
            big = _select(ax > _LOG_FLOAT32_MAX, _INF, big)
        return big * _bessel_scaled(nu, ax)  # inf * 0 at |x| = inf: NaN, as PyTorch gives

    def at(x):
        value = _let("ax", tirx.abs(x), lambda ax: _bessel_scaled(nu, ax) if scaled else unscaled(ax))
        return _let("v", value, lambda v: _select(x < 0.0, -v, v)) if nu else value

    return at


# ---- rules -----------------------------------------------------------------------------------
# The kernels bind values with tirx.Let, and TVM's bfloat16 legalization miscomputes a Let
# whose value reads a bfloat16 tensor (lgamma of a bfloat16 input was off by 1e5). So the
# inputs are cast to float64 by Relax, and the kernel is marked opaque (op_pattern 8) so
# that FuseOps does not fuse that cast, or any bfloat16 producer, back into it. 16-bit
# results are stored as float64 and cast by Relax after the kernel, for the same reason.
_OPAQUE = {"op_pattern": 8}


def _elementwise(imp, node, name, fn, *args):
    """fn(*float64 variables) at each element of `args` (tensors, broadcast to the output's
    shape, or numbers), cast to the output's dtype."""
    out_shape, result_dtype = out_meta(node)
    out_dtype = result_dtype if result_dtype in ("float32", _F64) else _F64
    tensors = [cast(imp, env(imp, a), _F64) for a in args if isinstance(a, torch.fx.Node)]
    tensors = [x if shape(x) == out_shape else emit(imp, relax.op.broadcast_to(x, out_shape)) for x in tensors]

    def bind(values, bound=()):
        if len(bound) == len(values):
            return fn(*bound)
        return _let(f"x{len(bound)}", values[len(bound)], lambda v: bind(values, bound + (v,)))

    def kernel(*placeholders):
        def at(*i):
            loads = iter(placeholders)
            values = [next(loads)(*i) if isinstance(a, torch.fx.Node) else _c(float(a)) for a in args]
            return bind(values).astype(out_dtype)

        return te.compute(out_shape, at, name=name)

    return cast(imp, emit_te(imp, kernel, *tensors, primfunc_attrs=_OPAQUE), result_dtype)


@rule("lgamma.default")
def lgamma_rule(imp, node):
    return _elementwise(imp, node, "lgamma", lgamma, node.args[0])


@rule("digamma.default")
def digamma_rule(imp, node):
    return _elementwise(imp, node, "digamma", digamma, node.args[0])


@rule("polygamma.default")
def polygamma_rule(imp, node):
    n = node.args[0]
    if n < 0:  # PyTorch refuses it; let its kernel say so
        raise NotImplementedError(f"polygamma of order n={n} (n must be >= 0)")
    return _elementwise(imp, node, f"polygamma{n}", polygamma(n), node.args[1])


@rule("special_zeta.default", "zeta.default")  # zeta.default: prims.zeta, of a tensor and a number
def zeta_rule(imp, node):
    return _elementwise(imp, node, "zeta", zeta, node.args[0], node.args[1])


_BESSEL = {  # overload -> (nu, exponentially scaled)
    "i0.default": (0, False), "special_modified_bessel_i0.default": (0, False), "special_i0e.default": (0, True),
    "special_i1.default": (1, False), "special_modified_bessel_i1.default": (1, False), "special_i1e.default": (1, True),
}


@rule(*_BESSEL)
def bessel_rule(imp, node):
    nu, scaled = _BESSEL[node.target.__name__]
    float32_exp = out_meta(node)[1] != _F64
    name = f"i{nu}e" if scaled else f"i{nu}"
    return _elementwise(imp, node, name, bessel(nu, scaled, float32_exp), node.args[0])
