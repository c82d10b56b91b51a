"""exp for CPU kernels as plain arithmetic, so LLVM can vectorize it.

TVM lowers `T.exp` to LLVM's `llvm.exp` intrinsic, which the x86 backend
turns into one scalar libm call per element even inside a vectorized loop: a
1024x1024 exp runs far slower than torch's. The CPU pipeline legalizes exp,
sigmoid and tanh with the rules below, which compute float32 exp as range reduction
plus a polynomial that vectorizes (on par with torch's on that exp):

    exp(x) = 2^n * exp(r),  n = round(x / ln 2),  r = x - n ln 2,  |r| <= ln2 / 2

with exp(r) as its degree-7 Taylor polynomial (truncation error below 6e-9
relative, under float32's rounding) and 2^n built in the exponent bits.
Results are within a few ulp of libm's; above float32's range the result is
inf, NaN stays NaN, and below -87.34 (where libm returns denormals down to
1e-45) it is 0. Softmax and log_softmax keep TVM's legalization: their exp
sits inside a reduction, where this form measured slower than libm's scalar
call (the kernel library runs them on CPU by default).

relu is legalized here too, on every target, as select(x < 0, 0, x): TVM's
max(x, 0) becomes LLVM's maxnum (CUDA's fmaxf), which returns 0 for NaN (and
for -0.0) where PyTorch keeps them.
"""
import tvm
from tvm import te, tirx

_LOG2E = 1.4426950408889634
_LN2_HI = 0.693359375  # ln 2 split so that n * _LN2_HI is exact for |n| < 2^9
_LN2_LO = -2.12194440e-4
_MAX = 88.72283  # exp overflows float32 above this
_MIN = -87.33654  # and leaves the normal range below this
_TAYLOR = [1 / 5040, 1 / 720, 1 / 120, 1 / 24, 1 / 6, 1 / 2, 1.0, 1.0]  # highest power first


def _f32(value):
    return tirx.const(value, "float32")


def _pow2(n):
    """2^n for an int32 `n` in [-126, 127], built in a float32's exponent bits."""
    return tirx.reinterpret("float32", tirx.shift_left(n + tirx.const(127, "int32"), tirx.const(23, "int32")))


def _is_nan(x):
    """isnan(x) for float32 `x`, from its bits: a select on tirx.isnan makes TVM scalarize the whole
    loop (exp ran at a tenth of torch's speed), and TVM folds x != x to false."""
    bits = tirx.bitwise_and(tirx.reinterpret("int32", x), tirx.const(0x7FFFFFFF, "int32"))
    return bits > tirx.const(0x7F800000, "int32")


def fast_exp(x):
    """Return a float32 TIR expression equal to exp(x) within a few ulp.

    Written without tirx.Let: TVM's bfloat16 legalization miscomputes a Let whose
    value reads a bfloat16 tensor (a fused `x.float().exp()` gave inf); LLVM merges
    the repeated subexpressions instead.
    """
    c = tirx.max(tirx.min(x, _f32(_MAX)), _f32(_MIN))
    n = tirx.floor(c * _f32(_LOG2E) + _f32(0.5))
    r = c - n * _f32(_LN2_HI) - n * _f32(_LN2_LO)
    poly = _f32(_TAYLOR[0])
    for k in _TAYLOR[1:]:
        poly = poly * r + _f32(k)
    # 2^n in two halves: n reaches 128 near the overflow bound and -126 near the underflow one
    ni = n.astype("int32")
    half = tirx.shift_right(ni, tirx.const(1, "int32"))
    value = poly * _pow2(half) * _pow2(ni - half)
    value = tirx.Select(x > _f32(_MAX), _f32(float("inf")), tirx.Select(x < _f32(_MIN), _f32(0.0), value))
    return tirx.Select(_is_nan(x), x, value)


# tanh's odd Taylor series up to x^19: below |x| = 0.625 it is within float32's rounding.
_TANH_TAYLOR = [1.0, -1 / 3, 2 / 15, -17 / 315, 62 / 2835, -1382 / 155925, 21844 / 6081075,
                -929569 / 638512875, 6404582 / 10854718875, -443861162 / 1856156927625]


def fast_tanh(x):
    """Return a float32 TIR expression equal to tanh(x) within 1.4 ulp (PyTorch's: 0.5).

    1 - 2 / (exp(2|x|) + 1) with the sign of x where |x| >= 0.625 (the quotient is then at
    most 0.46, so the subtraction loses nothing), the Taylor polynomial below. TVM's own tanh
    calls libm's exp twice per element, scalar even in a vectorized loop.
    """
    ax = tirx.Select(x < _f32(0.0), -x, x)
    big = _f32(1.0) - _f32(2.0) / (fast_exp(ax * _f32(2.0)) + _f32(1.0))
    big = tirx.Select(x < _f32(0.0), -big, big)
    x2 = x * x
    poly = _f32(_TANH_TAYLOR[-1])
    for k in reversed(_TANH_TAYLOR[:-1]):
        poly = poly * x2 + _f32(k)
    return tirx.Select(ax < _f32(0.625), x * poly, big)


def _exp(x):
    return fast_exp(x) if str(x.ty) == "float32" else tirx.exp(x)


def _float32(legalize):
    """Use `legalize` for float32 calls, TVM's own legalization for other dtypes."""
    def rule(bb, call):
        if str(call.ty.dtype) != "float32":
            return call.op.get_attr("FLegalize")(bb, call)
        return legalize(bb, call)
    return rule


def _relu(bb, call):
    # TVM's relu is max(x, 0), which LLVM's maxnum makes 0 for NaN; PyTorch's clamp_min keeps
    # NaN (and -0.0).
    return bb.call_te(lambda x: te.compute(x.shape, lambda *i: tirx.Select(x(*i) < tirx.const(0, x.dtype),
                                                                           tirx.const(0, x.dtype), x(*i)),
                                           name="relu"), call.args[0], primfunc_name_hint="relu")


# Rules for every target: CUDA's fmaxf drops NaN as LLVM's maxnum does.
EXACT = {"relax.nn.relu": _relu}

# The CPU pipeline's rules: EXACT's, and exp, sigmoid and tanh that vectorize.
LEGALIZE = {
    **EXACT,
    "relax.exp": _float32(lambda bb, call: bb.call_te(lambda x: te.compute(x.shape, lambda *i: _exp(x(*i)), name="exp"), call.args[0],
                                                      primfunc_name_hint="exp")),
    "relax.tanh": _float32(lambda bb, call: bb.call_te(
        lambda x: te.compute(x.shape, lambda *i: fast_tanh(x(*i)), name="tanh"), call.args[0], primfunc_name_hint="tanh")),
    "relax.sigmoid": _float32(lambda bb, call: bb.call_te(
        lambda x: te.compute(x.shape, lambda *i: tirx.const(1, "float32") / (tirx.const(1, "float32") + _exp(-x(*i))), name="sigmoid"),
        call.args[0], primfunc_name_hint="sigmoid")),
}


# ---- tan ------------------------------------------------------------------------------
# TVM writes tan for LLVM as sin(x) / cos(x). With the target's fast-math-reassoc flag
# LLVM folds that quotient back into a tan call, and its vectorized form returned values
# near x itself (tan(-3) gave -3: every float32 tensor of 4096+ elements, where the loop
# vectorizes, and float64 alike). Dividing by sin(x + pi/2) instead computes the same
# quotient in float64 (pi/2's rounding is far below float32's ulp) in a form LLVM has no
# fold for. Registered over TVM's own rule, for every kernel this process compiles.
def _tan_legalize(call):
    x = call.args[0]
    dt = str(x.ty)  # "float32", or "float32x8" once vectorized
    lanes = dt[len(dt.rstrip("0123456789")):] if "x" in dt else ""
    wide = "float64" + (("x" + lanes) if lanes else "")
    d = x if dt.startswith("float64") else x.astype(wide)
    value = tirx.sin(d) / tirx.sin(d + tirx.const(1.5707963267948966, wide))
    return value if dt.startswith("float64") else value.astype(dt)


tvm.ir.register_op_attr("tirx.tan", "llvm.FLegalize", _tan_legalize, level=20)
