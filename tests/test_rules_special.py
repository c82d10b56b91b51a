"""Rules of tvm_lowering/ops/special.py (the error-function family) on the values where such
functions go wrong: zeros of both signs, infinities, NaN, the far tails and the edges of their
domains. Each is compared with CPU PyTorch and required to be lowered (no `aten::` fallback
counter)."""
import math

import pytest
import torch

from rule_check import check

INF, NAN = math.inf, math.nan

pytestmark = pytest.mark.usefixtures("seeded")


def _with(values, dtype, random):
    return torch.cat([torch.tensor(values, dtype=dtype), random.to(dtype)])


@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-4), (torch.float64, 1e-12)], ids=["float32", "float64"])
def test_error_function_tails(dtype, rtol):
    """erfc and erfcx to their tails (float64 inside: erfc(10) is 2e-45, erfcx(-9) 3e35 in
    float32), log_ndtr through them, and log1p of numbers too small to survive 1 + x."""
    x = _with([0.0, -0.0, 0.5, -1.0, 5.0, 9.5, 10.0, 25.9, 26.0, 27.0, 1e30, -9.0, -30.0, INF, -INF, NAN],
              dtype, torch.randn(20) * 4)
    small = torch.tensor([1e-10, -1e-12, 3e-30, 0.5, -0.5], dtype=dtype)
    check(lambda t, s: (torch.erfc(t), torch.special.erfcx(t), torch.special.log_ndtr(t), torch.log1p(s)), x, small,
          ops=["erfc.default", "special_erfcx.default", "log1p.default"], rtol=rtol, atol=1e-300)


def test_inverse_error_functions():
    """erfinv near 0 and +-1 (and outside [-1, 1]), ndtri down to float32's smallest subnormal,
    where 2p - 1 rounds to -1 and only 2p keeps the answer."""
    u = _with([0.0, 1e-30, -1e-7, 0.5, -0.75, 1 - 2 ** -24, -1 + 2 ** -24, 1.0, -1.0, 1.5, -2.0, NAN],
              torch.float32, torch.rand(20) * 2 - 1)
    p = _with([0.0, 1.0, 1e-45, 1e-38, 1e-30, 1e-10, 0.25, 0.5, 1 - 2 ** -24, -0.1, 1.1, NAN],
              torch.float32, torch.rand(20))
    check(lambda a, b: (torch.erfinv(a), torch.special.ndtri(b)), u, p, ops=["erfinv.default", "special_ndtri.default"])


def test_inverse_error_function_gradients():
    """The backward formulas call erfinv and ndtri again, and must lower too."""
    def grads(t):
        t = t.detach().requires_grad_()
        (torch.erfinv(t * 0.9) + torch.special.ndtri((t + 1) / 2) + torch.special.erfcx(t * 5)).sum().backward()
        return t.grad

    check(grads, torch.rand(3, 4) * 2 - 1)


def test_bfloat16_producer_fused_in():
    """A cast from bfloat16 fused into these kernels (TVM miscomputes such a cast under a
    tirx.Let, which is why the rules write shared subexpressions out)."""
    x = torch.tensor([-0.0, 0.5, -0.2, 0.3, -0.9, 0.1, 0.7, 0.95], dtype=torch.bfloat16)
    check(lambda t: (torch.erfinv(t.float()), torch.special.ndtri(t.float().abs()), torch.hypot(t.float(), t.float().flip(0)),
                     torch.special.erfcx(t.float() * 40)), x)
