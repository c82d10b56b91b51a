"""Dropout on the lazy device: right keep-rate and scaling, fresh masks from a cached program,
repeatable under torch.manual_seed, and the compiled hash agrees with the CPU implementation."""
import torch
import torch.nn.functional as F

import ratex.lazy_tensor_core.core.lazy_model as lm
from ratex.core import sync
from ratex.lazy_tensor_core.debug import metrics


def _step(dev, p=0.3):
    x = torch.ones(200, 50, device=dev).requires_grad_()
    y = F.dropout(x, p, training=True)
    y.sum().backward()
    lm.mark_step()
    return y.cpu(), x.grad.cpu()


def test_dropout_keep_rate_scaling_and_grad(dev):
    torch.manual_seed(0)
    y, grad = _step(dev)
    dropped = (y == 0).float().mean().item()
    assert abs(dropped - 0.3) < 0.02, dropped
    torch.testing.assert_close(y[y != 0], torch.full_like(y[y != 0], 1 / 0.7))
    torch.testing.assert_close(grad, y)  # d(sum(dropout(x)))/dx = mask * scale
    assert "ratex::seeded_dropout.default" in metrics.counter_names()
    assert not [c for c in metrics.counter_names() if c.startswith("aten::")]


def test_cached_program_draws_fresh_masks_and_manual_seed_repeats(dev):
    sync.reset_cache()
    torch.manual_seed(1)
    first, _ = _step(dev)
    second, _ = _step(dev)
    assert metrics.counter_value("UncachedCompile") == 1
    assert not torch.equal(first, second)
    torch.manual_seed(1)
    again, _ = _step(dev)
    assert torch.equal(again, first)


def test_compiled_mask_equals_cpu_implementation(dev):
    seed = torch.tensor(987654321)
    x = torch.randn(5, 7, 3)
    want = torch.ops.ratex.seeded_dropout(x, seed, 0.5)
    got = torch.ops.ratex.seeded_dropout(x.to(dev), seed.to(dev), 0.5)
    torch.testing.assert_close(got[0].cpu(), want[0])
    assert torch.equal(got[1].cpu(), want[1])


def test_eval_mode_dropout_is_identity(dev):
    x = torch.randn(4, 4)
    torch.testing.assert_close(F.dropout(x.to(dev), 0.5, training=False).cpu(), x)
