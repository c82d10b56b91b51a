"""Training on the plain lazy device matches CPU PyTorch, and steps reuse one compiled program."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ratex.lazy_tensor_core.core.lazy_model as lm
from ratex.core import sync
from ratex.lazy_tensor_core.debug import metrics


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 4 * 4, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv(x)), 2)
        return F.log_softmax(self.fc(torch.flatten(x, 1)), dim=1)


def mlp():
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 10), nn.LogSoftmax(dim=1))


def train(model, device, batches, lr=0.05):
    model = model.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = F.nll_loss(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        if device.type == "lazy":
            lm.mark_step()
        losses.append(loss.item())
    return losses, [p.detach().cpu() for p in model.parameters()]


def batches(shape, steps=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*shape, generator=g), torch.randint(0, 10, (shape[0],), generator=g)) for _ in range(steps)]


@pytest.mark.parametrize("make, shape", [(mlp, (6, 12)), (SmallCNN, (3, 1, 8, 8))], ids=["mlp", "cnn"])
def test_sgd_momentum_matches_cpu(dev, make, shape):
    torch.manual_seed(0)
    model = make()
    data = batches(shape)
    want_losses, want_params = train(copy.deepcopy(model), torch.device("cpu"), data)
    got_losses, got_params = train(model, dev, data)
    torch.testing.assert_close(got_losses, want_losses, rtol=1e-4, atol=1e-5)
    for got, want in zip(got_params, want_params):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def _compiles():
    return metrics.counter_value("UncachedCompile") or 0


def test_same_step_compiles_once_and_new_shape_compiles_again(dev):
    sync.reset_cache()
    w = torch.randn(4, 4).to(dev)  # data, not a pending random op of the first step

    def step(n):
        x = torch.randn(n, 4).to(dev)
        return (x @ w).relu().sum(1)

    outs = [step(3)]
    lm.mark_step()
    outs.append(step(3))
    lm.mark_step()
    assert _compiles() == 1
    assert metrics.counter_value("CachedCompile") >= 1
    outs.append(step(5))
    lm.mark_step()
    assert _compiles() == 2
    assert [tuple(o.shape) for o in outs] == [(3,), (3,), (5,)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64])
def test_comparing_with_a_new_number_does_not_recompile(dev, dtype):
    """A value read into Python and compared with a tensor (a line search's `f_new > f + c1 * t *
    gtd`, LBFGS with strong_wolfe) is a new number every time: it is a graph input, not a
    constant of a program compiled for it, and compares as PyTorch does (in the tensor's dtype,
    or float32 for an integer tensor)."""
    x = (torch.randn(64) * 4).to(dtype)
    xl = x.to(dev)
    got, want, counts = [], [], []
    for v in (0.3, 1.7, -2.25, 0.1, 1e-3):
        for op in (torch.lt, torch.le, torch.gt, torch.ge, torch.eq, torch.ne):
            got.append(op(xl, v).cpu())
            want.append(op(x, v))
        counts.append(_compiles())
    assert counts == [counts[0]] * len(counts), f"compiles after each value: {counts}"
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_learning_rate_change_does_not_recompile(dev):
    torch.manual_seed(0)
    model = mlp().to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    x, y = batches((4, 12), steps=1)[0]
    counts = []
    for _ in range(4):
        opt.zero_grad()
        F.nll_loss(model(x.to(dev)), y.to(dev)).backward()
        opt.step()
        sched.step()
        lm.mark_step()
        counts.append(_compiles())
    # step 1 has no momentum buffers yet; from step 2 on the program is the same whatever the lr
    assert counts[1] == counts[2] == counts[3], counts
