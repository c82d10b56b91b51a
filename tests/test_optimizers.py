"""torch.optim optimizers on the lazy device match CPU, with one compile for all steps after the first."""
import copy

import pytest
import torch
import torch.nn.functional as F

import ratex.lazy_tensor_core.core.lazy_model as lm
from ratex.lazy_tensor_core.debug import metrics

OPTIMIZERS = {
    "sgd-nesterov-wd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2),
    "adadelta": lambda p: torch.optim.Adadelta(p, lr=1.0),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-2),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_optimizer_matches_cpu(dev, name):
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model = copy.deepcopy(ref).to(dev)
    opt, ref_opt = OPTIMIZERS[name](model.parameters()), OPTIMIZERS[name](ref.parameters())
    g = torch.Generator().manual_seed(1)
    compiles = []
    for _ in range(5):
        x, y = torch.randn(5, 8, generator=g), torch.randint(0, 4, (5,), generator=g)
        opt.zero_grad()
        loss = F.cross_entropy(model(x.to(dev)), y.to(dev))
        loss.backward()
        opt.step()
        lm.mark_step()
        ref_opt.zero_grad()
        ref_loss = F.cross_entropy(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(loss.item(), ref_loss.item(), rtol=1e-4, atol=1e-5)
        compiles.append(metrics.counter_value("UncachedCompile"))
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.cpu(), q, rtol=1e-4, atol=1e-5)
    assert len(set(compiles[1:])) == 1, f"recompiled after the first step: {compiles}"
    assert not [c for c in metrics.counter_names() if c.startswith("aten::")]
