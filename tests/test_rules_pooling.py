"""Rules of tvm_lowering/ops/pooling.py against CPU PyTorch: ties and NaN in max pools, window
corners of average pools, uneven windows of adaptive pools (their gradients: test_rules_backward.py)."""
import pytest
import torch
import torch.nn.functional as F

from rule_check import check

aten = torch.ops.aten
NAN = float("nan")

pytestmark = pytest.mark.usefixtures("seeded")


@pytest.mark.usefixtures("tvm_kernels")
@pytest.mark.parametrize(
    "shape,k,s,p,d,ceil",
    [
        ((2, 3, 8, 8), [2, 2], [2, 2], [0, 0], [1, 1], False),
        ((1, 2, 7, 9), [3, 2], [2, 1], [1, 1], [1, 2], True),
        ((2, 7, 7), [3, 3], [2, 2], [1, 1], [2, 2], False),  # no batch dim
        ((2, 3, 5, 5, 5), [2, 2, 2], [2, 2, 2], [0, 0, 0], [1, 1, 1], False),
        ((1, 2, 5, 6, 7), [3, 2, 2], [2, 1, 2], [1, 0, 1], [1, 2, 1], True),
        ((2, 4, 5, 6), [2, 3, 2], [1, 2, 2], [1, 1, 0], [2, 1, 1], False),  # no batch dim
    ],
)
def test_max_pool_with_indices_and_backward(shape, k, s, p, d, ceil):
    x = torch.randint(-3, 3, shape).float()  # many ties: first max must win
    x.view(-1)[5] = float("-inf")
    x.view(-1)[[17, 18, 26]] = float("nan")  # NaN wins; among NaNs the last one
    pool, pool_backward = ((aten.max_pool3d_with_indices.default, aten.max_pool3d_with_indices_backward.default)
                           if len(k) == 3 else
                           (aten.max_pool2d_with_indices.default, aten.max_pool2d_with_indices_backward.default))

    def fn(x):
        out, idx = pool(x, k, s, p, d, ceil)
        gi = pool_backward(out * 2 + 1, x, k, s, p, d, ceil, idx)
        return out, idx, gi

    check(fn, x, ops=[pool.__name__, pool_backward.__name__])


@pytest.mark.usefixtures("tvm_kernels")
def test_max_pool3d_of_a_strided_input():
    """Autograd through nn.MaxPool3d of a permuted (non-contiguous) view, indices returned."""
    x = torch.randn(2, 6, 5, 4, 3)

    def fn(x):
        x = x.detach().requires_grad_()
        out, idx = F.max_pool3d(x.permute(0, 4, 3, 2, 1), 2, 2, 1, return_indices=True)
        return out, idx, torch.autograd.grad(out, x, torch.ones_like(out))[0]

    check(fn, x, ops=["max_pool3d_with_indices.default", "max_pool3d_with_indices_backward.default"])


@pytest.mark.usefixtures("tvm_kernels")
@pytest.mark.parametrize("cip,div", [(True, None), (False, None), (True, 2)])
def test_avg_pool3d_of_a_strided_input(cip, div):
    """Autograd through avg_pool3d of a permuted (non-contiguous) view, windows past the padding."""
    x = torch.randn(2, 6, 5, 4, 3)

    def fn(x):
        x = x.detach().requires_grad_()
        out = F.avg_pool3d(x.permute(0, 4, 3, 2, 1), (3, 2, 3), (2, 1, 2), (1, 1, 0), ceil_mode=True,
                           count_include_pad=cip, divisor_override=div)
        return out, torch.autograd.grad(out, x, torch.ones_like(out))[0]

    check(fn, x, ops=["avg_pool3d.default", "avg_pool3d_backward.default"])


def test_avg_pool3d_window_corners():
    x = torch.randn(1, 2, 5, 5, 5)
    check(lambda t: torch.nn.functional.avg_pool3d(t, (2, 3, 4), (1, 2, 2), (0, 1, 2), ceil_mode=True,
                                                   count_include_pad=False), x, ops=["avg_pool3d.default"])


def test_adaptive_pools_uneven_windows():
    """8 -> 5 and 7 -> 3 give overlapping windows of two widths; max ties go to the first position
    and NaN wins (the last NaN's index)."""
    x = torch.randn(2, 3, 8, 7)
    x[0, 0, 0, 0], x[0, 0, 1, 1] = NAN, NAN
    x[1, 1, :3, :3] = 1.0
    check(lambda a: (F.adaptive_avg_pool2d(a, (5, 3)), F.adaptive_avg_pool1d(a[0], 5), F.adaptive_avg_pool3d(a, (2, 5, 4)),
                     F.adaptive_max_pool2d(a, (5, 3), return_indices=True), F.adaptive_max_pool1d(a[0], 3, return_indices=True),
                     F.adaptive_max_pool3d(a, (2, 3, 3), return_indices=True)),
          x, ops=["_adaptive_avg_pool2d.default", "_adaptive_avg_pool3d.default", "adaptive_max_pool2d.default",
                  "adaptive_max_pool3d.default"])


@pytest.mark.usefixtures("tvm_kernels")
@pytest.mark.parametrize("shape,k,out", [
    ((2, 3, 7, 9), (2, 3), (4, 5)),
    ((3, 7, 6), (2, 3), (4, 3)),  # no batch dim
    ((1, 2, 6, 6), (3, 3), (1, 1)),  # one window: it ends at the input's end
    ((2, 2, 5, 7, 9), (2, 2, 3), (3, 4, 5)),
    ((2, 5, 6, 7), (2, 3, 2), (3, 2, 4)),  # 3-D, no batch dim
])
def test_fractional_max_pool_and_backward(shape, k, out):
    """Windows placed by the random samples (one per plane and pooled dim, read W, H in 2-D and
    T, H, W in 3-D): sizes differ per dim so that a sample read for the wrong dim shows."""
    nd = len(k)
    x = torch.randint(-3, 3, shape).float()  # ties: the first max wins
    x.view(-1)[[4, 9]] = NAN
    planes = (shape[0] if len(shape) == nd + 2 else 1, shape[-nd - 1], nd)
    samples = torch.rand(planes)
    pool, pool_backward = ((aten.fractional_max_pool2d.default, aten.fractional_max_pool2d_backward.default) if nd == 2
                           else (aten.fractional_max_pool3d.default, aten.fractional_max_pool3d_backward.default))

    def fn(x, samples):
        vals, idx = pool(x, k, out, samples)
        return vals, idx, pool_backward(torch.ones_like(vals).cumsum(-1), x, k, out, idx)

    check(fn, x, samples, ops=[pool.__name__])
