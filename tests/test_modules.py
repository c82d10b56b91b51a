"""torch.nn modules users train with: forward, backward and buffers on lazy match CPU."""
import copy

import pytest
import torch
from torch import nn

import ratex.lazy_tensor_core.core.lazy_model as lm
from rule_check import train_side_by_side

IMG = (4, 3, 6, 6)
SEQ = (2, 5, 8)
CASES = {
    "batchnorm2d": (lambda: nn.BatchNorm2d(3), IMG),
    "batchnorm1d-cumulative": (lambda: nn.BatchNorm1d(3, momentum=None), (4, 3)),
    "instancenorm2d-stats": (lambda: nn.InstanceNorm2d(3, affine=True, track_running_stats=True), IMG),
    "groupnorm": (lambda: nn.GroupNorm(1, 3), IMG),
    "layernorm": (lambda: nn.LayerNorm(8), SEQ),
    "embedding": (lambda: nn.Embedding(10, 4), "tokens"),
    "gelu": (lambda: nn.GELU(), SEQ),
    "gelu-tanh": (lambda: nn.GELU("tanh"), SEQ),
    "silu": (lambda: nn.SiLU(), SEQ),
    "softmax": (lambda: nn.Softmax(-1), SEQ),
    "maxpool-ceil": (lambda: nn.MaxPool2d(2, ceil_mode=True), (2, 3, 5, 5)),
    "avgpool-pad": (lambda: nn.AvgPool2d(3, 2, padding=1, count_include_pad=False), IMG),
    "adaptive-avgpool": (lambda: nn.AdaptiveAvgPool2d(1), IMG),
    "conv1d": (lambda: nn.Conv1d(8, 4, 3, padding=1), (2, 8, 5)),
    "upsample": (lambda: nn.Upsample(scale_factor=2), IMG),
    "multihead-attention": (lambda: nn.MultiheadAttention(8, 2, batch_first=True), "attention"),
    "transformer-encoder-layer": (lambda: nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True), SEQ),
    "lstm": (lambda: nn.LSTM(8, 6, batch_first=True), SEQ),
    "gru": (lambda: nn.GRU(8, 6, batch_first=True), SEQ),
    "rnn": (lambda: nn.RNN(8, 6, batch_first=True), SEQ),
}


def _call(mod, x, kind):
    out = mod(x, x, x) if kind == "attention" else mod(x)
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("name", CASES)
def test_module_matches_cpu(dev, name):
    make, shape = CASES[name]
    torch.manual_seed(0)
    ref = make()
    lazy = copy.deepcopy(ref).to(dev)
    if shape == "tokens":
        x = torch.randint(0, 10, (4, 3))
    else:
        x = torch.randn(*(SEQ if shape == "attention" else shape))
    floating = x.is_floating_point()
    xr = x.clone().requires_grad_(floating)
    xl = x.clone().to(dev).requires_grad_(floating)
    for _ in range(2):  # twice: running statistics must carry over
        yr, yl = _call(ref, xr, shape), _call(lazy, xl, shape)
        (yr * yr).sum().backward()
        (yl * yl).sum().backward()
        lm.mark_step()
        torch.testing.assert_close(yl.cpu(), yr, rtol=1e-4, atol=1e-5)
    for p, q in zip(lazy.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-4, atol=1e-4)
    for b, c in zip(lazy.buffers(), ref.buffers()):
        torch.testing.assert_close(b.cpu(), c, rtol=1e-4, atol=1e-5)
    if floating:
        torch.testing.assert_close(xl.grad.cpu(), xr.grad, rtol=1e-4, atol=1e-4)


class _PaddedAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x, pad):
        return self.mha(x, x, x, key_padding_mask=pad)[0]


class _PaddedEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, x, pad):
        return self.enc(x, src_key_padding_mask=pad)


@pytest.mark.parametrize("make", [_PaddedAttention, _PaddedEncoder])
def test_padding_mask_trains_like_cpu_without_fallback(dev, make):
    """A boolean key padding mask becomes masked_fill(mask, -inf) before the softmax: lowered
    (not run on CPU), forward, backward and SGD steps match CPU."""
    from ratex.lazy_tensor_core.debug import metrics

    torch.manual_seed(0)
    ref = make()
    lazy = copy.deepcopy(ref).to(dev)
    pad = torch.tensor([[False] * 5 + [True] * 2, [False] * 7])
    batches = [(torch.randn(2, 7, 8), pad) for _ in range(3)]
    history = train_side_by_side(lazy, ref, lambda p: torch.optim.SGD(p, lr=0.1), batches,
                                 lambda m, x, pad: m(x, pad).pow(2).mean(), dev)
    for losses in history:
        torch.testing.assert_close(*losses, rtol=1e-4, atol=1e-5)
    for p, q in zip(lazy.parameters(), ref.parameters()):
        torch.testing.assert_close(p.cpu(), q, rtol=1e-4, atol=1e-5)
    assert not [n for n in metrics.counter_names() if n.startswith("aten::")]
