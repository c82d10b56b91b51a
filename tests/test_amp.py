"""ratex.amp.autocast (CUDA autocast's op lists on lazy tensors) and torch.amp.GradScaler('lazy'),
against CPU PyTorch doing by hand what each policy says."""
import pytest
import torch
import torch.nn.functional as F

import ratex
import ratex.lazy_tensor_core.core.lazy_model as lm
from ratex.lazy_tensor_core.debug import metrics

bf16 = torch.bfloat16


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 8, generator=g), torch.randn(3, 8, generator=g), torch.randn(3, generator=g)


# name: (f on tensors, dtype of the result under autocast, the CPU reference with the casts spelled out)
CASES = {
    "linear in bf16": (lambda x, w, b: F.linear(x, w, b), bf16,
                       lambda x, w, b: F.linear(x.to(bf16), w.to(bf16), b.to(bf16))),
    "matmul in bf16": (lambda x, w, b: x @ w.t(), bf16, lambda x, w, b: x.to(bf16) @ w.t().to(bf16)),
    "softmax of bf16 in float32": (lambda x, w, b: torch.softmax(x.to(bf16), -1), torch.float32,
                                   lambda x, w, b: torch.softmax(x.to(bf16), -1, dtype=torch.float32)),
    "sum of bf16 in float32": (lambda x, w, b: x.to(bf16).sum(), torch.float32,
                               lambda x, w, b: x.to(bf16).sum(dtype=torch.float32)),
    "layer_norm of bf16 in float32": (lambda x, w, b: F.layer_norm(x.to(bf16), (8,)), torch.float32,
                                      lambda x, w, b: F.layer_norm(x.to(bf16).float(), (8,))),
    "exp of bf16 in float32": (lambda x, w, b: torch.exp(x.to(bf16)), torch.float32,
                               lambda x, w, b: torch.exp(x.to(bf16).float())),
    "mse_loss in float32": (lambda x, w, b: F.mse_loss(x.to(bf16), x), torch.float32,
                            lambda x, w, b: F.mse_loss(x.to(bf16).float(), x)),
    "addcmul promotes to the widest": (lambda x, w, b: torch.addcmul(x, x.to(bf16), x.to(bf16)), torch.float32,
                                       lambda x, w, b: torch.addcmul(x, x.to(bf16).float(), x.to(bf16).float())),
    "relu keeps its input's dtype": (lambda x, w, b: torch.relu(x), torch.float32, lambda x, w, b: torch.relu(x)),
}


@pytest.mark.parametrize("name", CASES)
def test_each_policy_matches_cpu_with_its_casts(dev, name):
    f, dtype, reference = CASES[name]
    x, w, b = _data()
    metrics.reset()
    with ratex.amp.autocast(dtype=bf16):
        got = f(x.to(dev), w.to(dev), b.to(dev))
    assert got.dtype == dtype
    want = reference(x, w, b)
    assert want.dtype == dtype
    torch.testing.assert_close(got.cpu(), want, rtol=1e-2, atol=1e-2)
    assert not [c for c in metrics.counter_names() if c.startswith("aten::")]


def test_cpu_tensors_and_a_disabled_block_are_left_alone(dev):
    x, w, b = _data()
    with ratex.amp.autocast(dtype=bf16):
        assert ratex.amp.is_enabled() and ratex.amp.get_dtype() == bf16
        assert F.linear(x, w, b).dtype == torch.float32  # CPU tensors: not this autocast's business
        with ratex.amp.autocast(enabled=False):
            assert not ratex.amp.is_enabled()
            assert F.linear(x.to(dev), w.to(dev), b.to(dev)).dtype == torch.float32
        assert F.linear(x.to(dev), w.to(dev)).dtype == bf16
    assert not ratex.amp.is_enabled()
    assert F.linear(x.to(dev), w.to(dev)).dtype == torch.float32


def test_autocast_as_a_decorator(dev):
    x, w, _ = _data()

    @ratex.amp.autocast(dtype=torch.float16)
    def project(a, b):
        return a @ b.t()

    assert project(x.to(dev), w.to(dev)).dtype == torch.float16


def test_binary_cross_entropy_is_refused_as_on_cuda(dev):
    p = torch.rand(4).to(dev)
    with ratex.amp.autocast(dtype=bf16), pytest.raises(RuntimeError, match="binary_cross_entropy_with_logits"):
        F.binary_cross_entropy(p, torch.ones(4).to(dev))


@pytest.mark.parametrize("kwargs, message", [
    ({"dtype": torch.float32}, r"dtype=torch.float32\): use torch.bfloat16 or torch.float16"),
    ({"enabled": 1}, r"enabled=1\): use True or False"),
])
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ratex.amp.autocast(**kwargs)


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def test_a_bf16_training_step_keeps_float32_weights_and_gradients(dev):
    """Matmuls in bfloat16, the loss in float32, float32 gradients for float32 weights: the
    losses follow CPU PyTorch's where the same casts are made by hand."""
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    ref, model = _mlp(), _mlp().to(dev)
    ref_opt, opt = torch.optim.SGD(ref.parameters(), lr=0.5), torch.optim.SGD(model.parameters(), lr=0.5)

    def ref_forward(a):
        h = F.relu(F.linear(a.to(bf16), ref[0].weight.to(bf16), ref[0].bias.to(bf16)))
        return F.linear(h, ref[2].weight.to(bf16), ref[2].bias.to(bf16))

    for _ in range(3):
        opt.zero_grad()
        with ratex.amp.autocast(dtype=bf16):
            out = model(x.to(dev))
            loss = F.cross_entropy(out, y.to(dev))
        assert out.dtype == bf16 and loss.dtype == torch.float32
        loss.backward()
        assert all(p.grad.dtype == torch.float32 for p in model.parameters())
        opt.step()
        lm.mark_step()
        ref_opt.zero_grad()
        ref_loss = F.cross_entropy(ref_forward(x).float(), y)
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(loss.item(), ref_loss.item(), rtol=2e-2, atol=2e-2)
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_grad_scaler_skips_a_step_with_inf_and_grows_as_on_the_cpu(dev):
    """float32 gradients, so both devices compute the same numbers: the scale goes the same way
    (backed off after the inf at step 1, grown after two clean steps) and so do the weights."""
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    runs = {}
    for device in ("cpu", dev):
        model = _mlp().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler(device.type if isinstance(device, torch.device) else device,
                                      init_scale=2.0 ** 8, growth_interval=2)
        scales, firsts = [], []
        for step in range(5):
            opt.zero_grad()
            loss = F.cross_entropy(model(x.to(device)), y.to(device))
            if step == 1:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            lm.mark_step()
            scales.append(scaler.get_scale())
            firsts.append(model[0].weight[0, 0].item())
        runs[str(device)] = (scales, firsts, [p.detach().cpu() for p in model.parameters()])
    (cpu_scales, cpu_firsts, cpu_params), (scales, firsts, params) = runs["cpu"], runs[str(dev)]
    assert scales == cpu_scales == [256.0, 128.0, 128.0, 256.0, 256.0]
    assert firsts[1] == firsts[0]  # the step with inf changed nothing
    torch.testing.assert_close(firsts, cpu_firsts)
    torch.testing.assert_close(params, cpu_params)
