"""Views and in-place ops keep PyTorch's aliasing semantics on the lazy device."""
import pytest
import torch

import ratex.lazy_tensor_core.core.lazy_model as lm
from ratex.lazy_tensor_core.debug import metrics


def base(device):
    return torch.arange(24, dtype=torch.float32).reshape(4, 6).to(device)


def slice_assign(d):
    x = base(d)
    x[2:4] = torch.ones(2, 6, device=d)
    return [x]


def strided_view_mul_(d):
    x = base(d)
    x[:, ::2].mul_(2)
    return [x]


def add_out_into_view(d):
    x = base(d)
    v = x[1]
    torch.add(x[0], x[2], out=v)
    return [x, v]


def view_sees_base_write(d):
    x = base(d)
    v = x[0]
    x.add_(1)
    return [v]


def write_through_transpose(d):
    x = base(d)
    v = x.t()
    v[0, 1] = 100
    return [x, v]


def param_data_index_write(d):
    p = torch.nn.Parameter(base(d))
    p.data[0] = 1
    return [p.detach()]


def param_data_assign(d):
    p = torch.nn.Parameter(base(d))
    p.data = torch.zeros(4, 6, device=d)
    return [p.detach()]


def inplace_t_(d):
    x = base(d)
    x.t_()
    return [x, list(x.shape)]


def unsqueeze_then_transpose_(d):
    x = base(d)
    x.unsqueeze_(0)
    x.transpose_(0, 1)
    return [x, list(x.shape)]


def zero_grad_keeps_tensors(d):
    m = torch.nn.Linear(3, 2).to(d)
    m.weight.data.fill_(0.5)
    m.bias.data.zero_()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m(torch.ones(1, 3, device=d)).sum().backward()
    grad = m.weight.grad
    opt.zero_grad(set_to_none=False)
    return [m.weight.grad, grad, m.weight.grad is grad]


def view_of_view_fill(d):
    x = base(d)
    x.view(6, 4)[0].fill_(-1)
    return [x, x.reshape(24)]


def split_views_write(d):
    x = base(d)
    _, b = x.split(3, dim=1)
    b.mul_(10)
    return [x]


def diagonal_zero_(d):
    x = base(d)
    x.diagonal().zero_()
    return [x]


def mask_assign(d):
    x = base(d)
    x[x > 10] = 0
    return [x]


def column_iadd(d):
    x = base(d)
    x[:, 1] += 5
    return [x]


def unbind_neg_(d):
    x = base(d)
    x.unbind(0)[2].neg_()
    return [x]


def promotion(d):
    x = base(d).to(torch.int64)
    return [x + 2.5, x > 3, x * True, x // 4, x.float() / 3]


def optimizer_arithmetic(d):
    # the in-place fast path: operands of the target's shape and dtype, plain-number scalars
    g = torch.Generator().manual_seed(0)
    x, y, z = (torch.rand(4, 6, generator=g).add(0.5).to(d) for _ in range(3))
    x.mul_(0.9).add_(y, alpha=-0.1)
    x.addcmul_(y, z, value=0.01).addcdiv_(y, z, value=-0.5)
    x.lerp_(z, 0.3)
    x.sub_(y, alpha=2).div_(3).mul_(2)
    x.addcmul_(x, x)  # the target as its own operand
    x[1].add_(y[2], alpha=0.5)  # a view as the target: written through to the base
    y.t().mul_(z.t())
    return [x, y, z]


def inplace_arithmetic_general_path(d):
    # broadcasting, type promotion, a 0-dim operand, an integer target: no fast path
    x = base(d)
    x.add_(torch.ones(6, device=d), alpha=2)
    x.mul_(torch.tensor(0.5, device=d))
    x.add_(base(d).double())
    x.add_(1.5, alpha=2)
    i = base(d).to(torch.int64)
    i.mul_(3).add_(i, alpha=2)
    return [x, i, torch.add(x, 1.5, alpha=2), torch.sub(i, 2, alpha=3)]  # alpha with a scalar other


CASES = [
    optimizer_arithmetic, inplace_arithmetic_general_path,
    slice_assign, strided_view_mul_, add_out_into_view, view_sees_base_write, write_through_transpose,
    param_data_index_write, param_data_assign, inplace_t_, unsqueeze_then_transpose_, zero_grad_keeps_tensors,
    view_of_view_fill, split_views_write, diagonal_zero_, mask_assign, column_iadd, unbind_neg_, promotion,
]


def _cpu(x):
    return x.cpu() if isinstance(x, torch.Tensor) else x


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_matches_cpu(dev, case):
    want = case(torch.device("cpu"))
    got = case(dev)
    lm.mark_step()
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if isinstance(w, torch.Tensor):
            assert g.device == dev
            assert g.dtype == w.dtype and g.shape == w.shape
            torch.testing.assert_close(_cpu(g), w)
        else:
            assert g == w


def test_inplace_arithmetic_errors_match_cpu(dev):
    for d in (torch.device("cpu"), dev):
        i = torch.arange(6, device=d)
        with pytest.raises(RuntimeError, match="can't be cast"):
            i.mul_(0.5)
        e = torch.ones(1, 6, device=d).expand(4, 6)
        with pytest.raises(RuntimeError, match="single memory location"):
            e.add_(torch.ones(4, 6, device=d))
        x = torch.ones(4, 6, device=d)
        with pytest.raises(RuntimeError, match="doesn't match the broadcast shape"):
            x.add_(torch.ones(2, 4, 6, device=d))


def test_optimizer_update_builds_no_intermediate_tensors(dev):
    p, buf, grad = (torch.ones(3, 3, device=dev) for _ in range(3))
    lm.mark_step()
    before = metrics.counter_value("CreateLazyTensor")
    buf.mul_(0.9).add_(grad)
    p.add_(buf, alpha=-0.01)
    assert metrics.counter_value("CreateLazyTensor") == before
    torch.testing.assert_close(p.cpu(), torch.full((3, 3), 1 - 0.019))


@pytest.mark.parametrize("alpha", [0.5, 2])
def test_add_alpha_keeps_its_inputs_layout(dev, alpha):
    """a.t() + b.t() * alpha is laid out like its inputs (transposed), as on CPU."""
    a, b = torch.randn(4, 3), torch.randn(4, 3)
    want = torch.add(a.t(), b.t(), alpha=alpha)
    got = torch.add(a.to(dev).t(), b.to(dev).t(), alpha=alpha)
    assert got.stride() == want.stride()
    torch.testing.assert_close(got.cpu(), want)
