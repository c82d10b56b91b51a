"""Rules of tvm_lowering/ops/gamma.py (lgamma, digamma, polygamma, Hurwitz zeta, the I0/I1 Bessel
family) against CPU PyTorch, on the values where these functions are hard: poles, signed zeros,
infinities, NaN, large arguments, and either side of each method's switch-over points."""
import pytest
import torch

from rule_check import check

INF, NAN = float("inf"), float("nan")
BESSEL = ["i0.default", "special_i0e.default", "special_i1.default", "special_i1e.default",
          "special_modified_bessel_i0.default", "special_modified_bessel_i1.default"]

pytestmark = pytest.mark.usefixtures("seeded")


def _gamma_points(dtype=torch.float32):
    """Poles, zeros and infinities of lgamma/digamma, the reflection's side, values stepped up to
    10 and past it, and random ones."""
    special = [0.0, -0.0, -1.0, -2.0, -2.5, -0.3, -8.48, -1e6 - 0.5, 1e-30, 0.5, 1.0, 1.4616321, 2.0, 9.99, 10.0,
               10.01, 25.3, 171.6, 1e30, INF, -INF, NAN]
    return torch.cat([torch.tensor(special, dtype=dtype), torch.randn(40, dtype=dtype) * 10])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_lgamma_digamma(dtype):
    check(lambda t: (torch.lgamma(t), torch.digamma(t)), _gamma_points(dtype), ops=["lgamma.default", "digamma.default"])


def test_polygamma_orders():
    """n = 0 is digamma; n = 1 has PyTorch's trigamma special values at +-inf; n >= 2 is a zeta.
    Negative integers are left out: PyTorch's float trigamma returns large finite values there
    (sin(pi x) in float is not 0), where the function has poles (this kernel: inf). So are
    points within 0.05 of them, where that float sin loses the 1e-4 the check asks for."""
    x = torch.tensor([0.0, -2.5, -0.3, -7.8, -8.45, 1e-3, 0.5, 1.0, 3.7, 9.99, 10.5, 1e4, INF, -INF, NAN])
    check(lambda t: tuple(torch.polygamma(n, t) for n in range(5)), torch.cat([x, torch.rand(20) * 9]),
          ops=["polygamma.default"])


def test_polygamma_near_poles_float64():
    """In float64 PyTorch is accurate next to the poles too, where the values are largest."""
    x = torch.tensor([-8.9999, -3.0001, -2.5, -0.9999, 1e-8, -1e-8, -7.49], dtype=torch.float64)
    check(lambda t: tuple(torch.polygamma(n, t) for n in (1, 2, 5)), x, ops=["polygamma.default"], rtol=1e-9)


def test_zeta_special_values_and_broadcast():
    """s = 1 and s < 1, q at the poles, q < 0 with integer and non-integer s, q = inf, NaN, s = inf;
    a scalar s or q reaches the rule as prims.zeta."""
    s = torch.tensor([1.0, 0.5, 2.0, 2.5, 3.0, 5.0, 11.0, INF, NAN])[:, None]
    q = torch.tensor([0.0, -1.0, -2.5, -2.25, -100.5, 1e-3, 0.5, 1.0, 7.5, 1e8, INF, -INF, NAN])
    check(lambda a, b: (torch.special.zeta(a, b), torch.special.zeta(a, 2.0), torch.special.zeta(3.0, b)),
          s, q, ops=["special_zeta.default"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bessel_family(dtype):
    """Both sides of |x| = 20 (series / asymptotic expansion); in float32, exp(|x|) overflows above
    88.72 as in PyTorch's float kernels, though I0(89) would fit; at +-inf I0 and I1 are NaN."""
    big = [88.7, 89.0, 100.0] if dtype == torch.float32 else [700.0, 710.0]
    x = torch.tensor([0.0, -0.0, 1e-30, 0.5, 7.99, 8.01, 19.99, 20.0, 20.01, 50.0, *big, INF, NAN], dtype=dtype)
    x = torch.cat([x, -x, torch.randn(20, dtype=dtype) * 30])
    check(lambda t: (torch.i0(t), torch.special.i0e(t), torch.special.i1(t), torch.special.i1e(t),
                     torch.special.modified_bessel_i0(t), torch.special.modified_bessel_i1(t)), x, ops=BESSEL)


def test_integer_and_half_inputs():
    """Integer inputs compute in float (float32 result); half ones round the float64 value once."""
    n = torch.arange(-3, 6)
    check(lambda t: (torch.lgamma(t), torch.digamma(t), torch.i0(t), torch.special.i1e(t)), n,
          ops=["lgamma.default", "digamma.default", "i0.default", "special_i1e.default"])
    h = (torch.randn(16) * 5).half()
    check(lambda t: (torch.lgamma(t), torch.polygamma(2, t), torch.special.i0e(t)), h, rtol=2e-3, atol=1e-3,
          ops=["lgamma.default", "polygamma.default", "special_i0e.default"])


def test_gradients():
    """The backward formulas call the same ops: lgamma' = digamma, digamma' = polygamma(1),
    polygamma(n)' = polygamma(n+1), I0' = I1 and I1' = I0 - I1 / x (0.5 at x = 0)."""
    def grads(t):
        t = t.detach().requires_grad_()
        ys = (torch.lgamma(t), torch.digamma(t), torch.polygamma(2, t), torch.i0(t), torch.special.i1(t),
              torch.special.i0e(t), torch.special.i1e(t))
        return torch.autograd.grad([y.sum() for y in ys], [t] * len(ys))

    x = torch.cat([torch.tensor([0.0, -2.5, 0.5, 30.0]), torch.rand(12) * 8 + 0.1])
    check(grads, x, ops=["polygamma.default", "special_i0e.default", "special_i1e.default"])


def test_bfloat16_inputs_and_fused_bfloat16_casts():
    """The kernels bind values with tirx.Let, which TVM's bfloat16 legalization miscomputes when
    the value reads a bfloat16 tensor: lgamma of x.bfloat16().float() was off by 1e5."""
    x = torch.linspace(0.5, 6, 8192).bfloat16()
    check(lambda t: (t.float().lgamma(), t.float().digamma(), torch.special.i0e(t.float()),
                     torch.special.zeta(t.float() + 1, 2.0)), x)
    check(torch.lgamma, x, rtol=1e-2, atol=1e-2)  # bfloat16 results: within a bfloat16 ulp
