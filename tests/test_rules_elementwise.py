"""Rules of tvm_lowering/ops/elementwise.py against CPU PyTorch: type promotion, integer scalars
and bounds, NaN, infinities and signed zeros, bit-level ops, and the relative accuracy of math
functions near zero, including where CPU kernels vectorize."""
import math

import pytest
import torch
import torch.nn.functional as F

from rule_check import check

aten = torch.ops.aten
INF, NAN = math.inf, math.nan

pytestmark = pytest.mark.usefixtures("seeded")


@pytest.mark.usefixtures("tvm_kernels")
def test_exp_sigmoid_and_tanh_keep_libm_results_at_the_edges():
    # CPU kernels compute float32 exp and tanh with polynomials (tvm_lowering/fastmath.py): check
    # their accuracy over float32's range, tanh's switch of formula at |x| = 0.625 and the
    # inf / 0 / NaN behaviour, in a kernel large enough to run in parallel and in a small one
    # (both vectorized).
    x = torch.cat([
        torch.linspace(-90, 90, 4001),
        torch.linspace(-0.7, 0.7, 1401),
        torch.tensor([0.0, -0.0, 1e-8, -1e-8, 1e-30, 0.625, -0.625, 88.7, 88.8, -87.3, -87.4, -200.0, 200.0]),
        torch.tensor([float("inf"), float("-inf"), float("nan")]),
    ])
    fn = lambda x: (torch.exp(x), torch.sigmoid(x), torch.tanh(x), x.exp().sum())  # noqa: E731
    ops = ["exp.default", "sigmoid.default", "tanh.default"]
    check(fn, x, ops=ops, rtol=3e-6, atol=1e-37)
    check(fn, x[-64:], ops=ops, rtol=3e-6, atol=1e-37)


def test_integer_scalars_and_bounds():
    """rsub of an int scalar, clamp of an integer tensor with one bound and of NaN, division by 0."""
    x = torch.tensor([[-2.0, 0.5, float("nan")], [3.0, -0.25, 9.0]])
    n = torch.tensor([-5, 0, 3, 12])
    check(lambda t, k: (1 - t, aten.rsub.Scalar(t, 2, alpha=3), 2 - k, torch.clamp(t, min=-1), torch.clamp(t, -1, 1),
                        torch.clamp(k, max=4), torch.clamp(k, min=0), torch.clamp(k, min=0.5), torch.clamp(t, max=float("nan")),
                        t / 0),
          x, n, ops=["rsub.Scalar", "clamp.default", "div.Tensor"])


def test_times_zero_keeps_nan():
    """TVM folds `x * 0` to 0; with x NaN or inf PyTorch gives NaN, so the zero is a graph input."""
    x = torch.tensor([float("nan"), float("inf"), 1.0])
    check(lambda t: (t * 0.0, t * 0, torch.addr(torch.zeros(3, 3, device=t.device), t, t, beta=0, alpha=0)), x)


def test_decomposed_ops_lowered():
    """Ops without a rule trace through PyTorch's decompositions instead of running on CPU."""
    x, y = torch.randn(3, 4), torch.rand(3, 4)
    check(lambda a, b: (torch.xlogy(a, b), torch.diag_embed(a), torch.nansum(a), torch.sgn(a)), x, y)


# ---- bit-level ops, NaN-ignoring extremes, mixed dtypes ---------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_bit_level_ops(dtype):
    """signbit sees -0.0 and the sign of a NaN; nextafter steps through zero, subnormals and
    infinity and returns y when x == y."""
    finfo = torch.finfo(dtype)
    x = torch.tensor([0.0, -0.0, 0.0, finfo.tiny, -finfo.tiny, 1.0, -1.0, 1.0, finfo.max, INF, -INF, NAN, 2.0, 3.0], dtype=dtype)
    y = torch.tensor([1.0, -1.0, -0.0, 0.0, -1.0, 2.0, 0.0, 1.0, INF, 0.0, 0.0, 1.0, NAN, -5.0], dtype=dtype)
    signs = torch.cat([x, -x, torch.tensor([NAN], dtype=dtype).neg()])
    check(lambda a, b, s: (torch.nextafter(a, b), torch.signbit(s), torch.exp2(a * 3), torch.exp2(s.nan_to_num())), x, y, signs,
          ops=["nextafter.default", "signbit.default", "exp2.default"])


def test_integer_inputs():
    """signbit, fmax and fmin of integers and bools; exp2 and erfc of integers promote to float."""
    i = torch.tensor([-3, 0, 2, 7, -1])
    check(lambda a, b: (torch.signbit(a), torch.fmax(a, b), torch.fmin(a, b), torch.fmax(a > 0, b > 0),
                        torch.exp2(a), torch.erfc(a)),
          i, i.flip(0))


def test_nan_ignoring_max_min_and_hypot():
    """fmax/fmin take the number over a NaN (broadcasting); hypot neither overflows at 1e30 nor
    underflows at 1e-30 in float32, and an infinity beats a NaN."""
    a = torch.tensor([[NAN], [1.0], [NAN], [-2.0]])
    b = torch.tensor([2.0, NAN, -INF, 0.0, NAN])
    x = torch.tensor([3.0, 1e30, 1e-30, 0.0, INF, NAN, -INF, NAN, -4.0])
    y = torch.tensor([4.0, 1e30, 1e-30, 0.0, NAN, INF, 1.0, 1.0, 0.0])
    check(lambda s, t, u, v: (torch.fmax(s, t), torch.fmin(s, t), torch.hypot(u, v)), a, b, x, y,
          ops=["fmax.default", "fmin.default", "hypot.default"])


def test_where_with_branches_of_two_dtypes():
    """heaviside decomposes into where(x == 0, values, where(x < 0, 0, 1)): float and int64 branches."""
    x = torch.tensor([-1.0, 0.0, -0.0, 2.0, NAN, INF, -INF])
    v = torch.tensor([0.5, 0.25, -3.0, 1.0, 7.0, 1.0, 2.0])
    check(lambda s, t: (torch.heaviside(s, t), torch.heaviside(s, t[1])), x, v, ops=["where.self"])
    check(lambda s: torch.ops.aten.where.self(s > 0, s, torch.tensor(3, device=s.device)), x, ops=["where.self"])


# ---- relative accuracy ------------------------------------------------------------------------
# OpInfo's samples are small (no vectorized loop) and compared with atol 1e-5, which hid
# two classes of errors these tests check with a relative tolerance on 8192-element
# inputs spanning tiny to moderate magnitudes: a vectorized float32 tan that returned
# about x itself (LLVM's fast-math folding of sin/cos), and log1p/expm1/atanh/tanh/elu
# that returned 0 for arguments below float32's epsilon.
TINY_TO_ONE = torch.logspace(-30, 0, 2048)
X = torch.cat([torch.linspace(-3, 3, 4096), TINY_TO_ONE, -TINY_TO_ONE])


FUNCTIONS = {
    "tan": (torch.tan, None),
    "tanh": (torch.tanh, None),
    "expm1": (torch.expm1, None),
    "log1p": (torch.log1p, lambda x: x.abs()),
    "atanh": (torch.atanh, lambda x: x.clamp(-0.99, 0.99)),
    "elu": (F.elu, None),
    "selu": (torch.selu, None),
}


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_relative_accuracy_on_a_vectorized_tensor(name):
    fn, domain = FUNCTIONS[name]
    x = X if domain is None else domain(X)
    # float32 results against float64 references: a few float32 ulp (tanh: TVM's
    # float32 tanh above 0.01 is ~1e-6 relative)
    reference = fn(x.double())
    got = check(fn, x, rtol=1, atol=1)  # lowered, no CPU fallback; tolerance checked below
    torch.testing.assert_close(got.double(), reference, rtol=2e-6 if name == "tanh" else 5e-7, atol=1e-37)


def test_special_values():
    x = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1.0, -1.0, 100.0, -100.0])
    check(lambda t: (torch.expm1(t), torch.log1p(t), torch.tanh(t), F.elu(t), torch.tan(t)), x)
    check(torch.atanh, torch.tensor([0.0, 1.0, -1.0, 2.0, -2.0, float("nan")]))


def test_fused_bfloat16_cast():
    """A bfloat16 input cast to float32 inside the same kernel (TVM's bfloat16 legalization
    miscomputed a tirx.Let over it: x.float().exp() gave inf)."""
    x = torch.linspace(-3, 3, 8192).bfloat16()
    check(lambda t: [f(t.float()) for f in (torch.exp, torch.sigmoid, torch.tanh, torch.expm1, torch.tan, F.elu)],
          x, rtol=1e-6, atol=1e-6)


def test_relu_keeps_nan_and_signed_zero_and_its_gradient_is_pytorchs(dev):
    """relu is clamp_min(x, 0) in PyTorch: NaN stays NaN and -0.0 stays -0.0 (TVM's max(x, 0)
    gave 0 for both); its gradient is 0 where the output is <= 0 (x = 0 included) and passes
    where x is NaN."""
    x = torch.tensor([float("nan"), -0.0, 0.0, -1.0, 2.0, float("inf"), float("-inf")])
    ref = x.clone().requires_grad_()
    torch.relu(ref).mul(3.0).sum().backward()
    lazy = x.to(dev).requires_grad_()
    out = torch.relu(lazy)
    out.mul(3.0).sum().backward()
    got = out.detach().cpu()
    want = torch.relu(x)
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.equal(torch.signbit(got), torch.signbit(want))
    assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))
    assert torch.equal(lazy.grad.cpu(), ref.grad), (lazy.grad.cpu(), ref.grad)


# Activations with parameters, at values other than their defaults (OpInfo samples mostly use
# the defaults: celu with alpha=1 was right while any other alpha was wrong).
ACTIVATIONS = {
    "celu alpha=2": lambda t: F.celu(t, 2.0),
    "celu alpha=0.5": lambda t: F.celu(t, 0.5),
    "celu_ alpha=2": lambda t: F.celu(t * 1, 2.0, inplace=True),  # backward from the output
    "elu alpha scale input_scale": lambda t: aten.elu(t, 0.7, 1.3, 0.6),
    "elu negative alpha": lambda t: F.elu(t, -0.5),
    "elu_ alpha=0.3": lambda t: F.elu(t * 1, 0.3, inplace=True),
    "selu": F.selu,
    "rrelu eval": lambda t: F.rrelu(t, 0.1, 0.4, training=False),
    "hardtanh": lambda t: F.hardtanh(t, -0.5, 1.5),
    "softplus beta threshold": lambda t: F.softplus(t, beta=2.0, threshold=1.5),
    "softplus negative beta": lambda t: F.softplus(t, beta=-1.0, threshold=2.0),
    "leaky_relu": lambda t: F.leaky_relu(t, 0.2),
    "threshold": lambda t: F.threshold(t, 0.3, -2.0),
    "softshrink": lambda t: F.softshrink(t, 0.7),
    "hardshrink": lambda t: F.hardshrink(t, 0.7),
}


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_activations_with_parameters_forward_and_backward(name):
    """Forward and input gradient (through the backward ops autograd records on the lazy device)."""
    fn = ACTIVATIONS[name]
    x = torch.randn(6, 5) * 3
    x[0] = torch.tensor([0.7, -0.7, 0.0, 1.5, -0.5])  # on the thresholds and shrink bounds
    g = torch.randn(6, 5)

    def forward_backward(t, g):
        t = t.detach().requires_grad_()
        y = fn(t)
        return y, torch.autograd.grad(y, t, g)[0]

    check(forward_backward, x, g)


def test_rrelu_training_draws_slopes_in_its_range():
    """rrelu in training draws a slope per negative element in [lower, upper]; its gradient is
    that slope (values are random: checked against their law, not CPU's draws)."""
    x = torch.randn(64, 32)
    xl = x.to("lazy").requires_grad_()
    y = F.rrelu(xl, 0.1, 0.4, training=True)
    y.backward(torch.ones_like(y))
    y, grad = y.detach().cpu(), xl.grad.cpu()
    neg = x < 0
    slopes = y[neg] / x[neg]
    assert torch.equal(y[~neg], x[~neg]) and torch.equal(grad[~neg], torch.ones_like(x[~neg]))
    assert slopes.min() >= 0.1 and slopes.max() <= 0.4 and slopes.std() > 0.07  # uniform: std 0.087
    torch.testing.assert_close(grad[neg], slopes)


@pytest.mark.parametrize("value", [-INF, INF, NAN, -6e4, 2.5])
def test_masked_fill_with_any_float_fill(value):
    mask = torch.rand(3, 1, 5) > 0.5
    check(lambda x, m: (x.masked_fill(m, value), x.half().masked_fill(m, value)), torch.randn(3, 4, 5), mask,
          ops=["masked_fill.Scalar"])


def test_masked_fill_of_integers_and_bools():
    mask = torch.rand(3, 5) > 0.5
    check(lambda x, m: (x.masked_fill(m, 7), (x > 4).masked_fill(m, True)), torch.arange(15).view(3, 5), mask,
          ops=["masked_fill.Scalar"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_maximum_minimum_and_clamps_let_nan_through(dtype):
    """PyTorch's maximum, minimum and clamps return NaN where an operand (or a tensor bound) is
    NaN; TVM's maximum, minimum and clip are comparisons that dropped it, on either side."""
    n = NAN
    x = torch.tensor([n, 1.0, -2.0, 3.0, 0.25, 7.0, -INF, n], dtype=dtype)
    lo = torch.tensor([0.0, n, 0.0, 0.0, 0.5, 0.0, 0.0, n], dtype=dtype)
    hi = torch.tensor([5.0, 5.0, n, 5.0, 5.0, 5.0, 5.0, 1.0], dtype=dtype)
    check(lambda t, a, b: (torch.maximum(t, a), torch.minimum(a, t), torch.max(t, b), torch.min(b, t),
                           torch.clamp(t, a, b), torch.clamp(t, min=a), torch.clamp(t, max=b), torch.clamp_min(t, a),
                           torch.clamp_max(t, b), torch.clamp_min(t, 0.5), torch.clamp_max(t, 0.5),
                           torch.clamp(t, -1.0, 2.0), F.hardtanh(t), F.hardtanh(t, -0.5, 1.5), F.relu6(t)),
          x, lo, hi, ops=["maximum.default", "minimum.default", "clamp.Tensor", "clamp_min.Tensor", "clamp_max.Tensor",
                          "clamp_min.default", "clamp_max.default", "clamp.default", "hardtanh.default"])


def test_clamp_max_with_a_scalar_bound_clamps():
    """TVM's clamp_max rule reads its bound from a third argument the op does not have: it clamped
    nothing."""
    x = torch.randn(4, 5) * 3
    check(lambda t: (torch.clamp_max(t, 0.5), t.clamp_max(-1), torch.clamp_max(t.int(), 1)), x,
          ops=["clamp_max.default"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_division_with_rounding_rounds_like_pytorch(dtype):
    """PyTorch's CPU kernels round a half-precision quotient to its dtype before trunc (a bfloat16
    quotient of 2.999 is 3) and floor-divide floats through fmod; TVM's rules truncated and floored
    the float32 quotient, one off near integers. Zeros, signed zeros and division by zero too."""
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(400, generator=g) * 20).to(dtype), (torch.randn(400, generator=g) * 3).to(dtype)
    a[:6] = torch.tensor([0.0, -0.0, 5.0, -5.0, 0.0, 7.0])
    b[:6] = torch.tensor([3.0, 3.0, 0.0, -0.0, -2.0, -7.0])
    check(lambda x, y: (torch.div(x, y, rounding_mode="trunc"), torch.div(x, y, rounding_mode="floor"),
                        torch.floor_divide(x, y)),
          a, b, ops=["div.Tensor_mode", "floor_divide.default"], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_small_integer_powers_are_pytorchs_products_bit_for_bit(dtype):
    """x^2, x^3, x^-1, x^-2 as PyTorch's kernels compute them (products, a quotient), with
    infinities, signed zeros, NaN, tiny and huge values; another exponent keeps pow."""
    x = torch.cat([torch.randn(3000, dtype=dtype) * 10,
                   torch.tensor([0.0, -0.0, INF, -INF, NAN, 1e-30, -1e-30, 1e30, -1e20, 3.0], dtype=dtype)])
    check(lambda t: tuple(torch.pow(t, e) for e in (2, 3, 3.0, -1, -2.0)), x, ops=["pow.Tensor_Scalar"], rtol=0, atol=0)
    check(lambda t: (torch.pow(t, 2.5), t.pow(3).sum()), x.abs(), ops=["pow.Tensor_Scalar"])  # libm's pow; a sum
