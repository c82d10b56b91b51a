"""Forward results of ATen ops on the lazy device vs CPU, driven by PyTorch's OpInfo samples."""
import pytest
import torch
from torch.testing._internal.common_methods_invocations import op_db
from torch.utils._pytree import tree_map

import ratex.lazy_tensor_core.core.lazy_model as lm
from ratex.lazy_tensor_core.debug import metrics

# Ops users' models are made of; each must match CPU (lowered or by fallback).
OPS = """
abs acos add addcdiv addcmul addmm amax amin argmax argmin asin atan bmm cat ceil clamp cos cosh
cumsum div exp expand flatten floor gather nn.functional.hardtanh index_select le lerp log log1p log_softmax
logical_not lt masked_fill matmul max_pool2d_with_indices_backward maximum mean minimum mm mul
nn.functional.conv2d nn.functional.gelu nn.functional.hardswish nn.functional.layer_norm
nn.functional.leaky_relu nn.functional.linear nn.functional.mse_loss nn.functional.nll_loss
nn.functional.relu nn.functional.silu nn.functional.softplus nn.functional.avg_pool2d
nn.functional.embedding neg permute pow reciprocal remainder reshape round rsqrt rsub sigmoid sign sin
sinh softmax sqrt square squeeze stack sub sum t tanh transpose tril triu unsqueeze var view where
select std nn.functional.selu nn.functional.elu
""".split()

# These must lower to TVM (no aten:: fallback counted) for every sample tried.
LOWERED = set("""
abs add addmm bmm cat cos div exp flatten log log_softmax mm mul neg nn.functional.linear
nn.functional.relu permute reshape rsqrt sigmoid sin softmax sqrt sub sum t tanh transpose unsqueeze view
where
""".split())

MAX_SAMPLES = 3
_by_name = {}
for _op in op_db:
    _by_name.setdefault(_op.name, _op)


def _samples(opinfo):
    out = []
    for s in opinfo.sample_inputs("cpu", torch.float32, requires_grad=False):
        out.append(s)
        if len(out) == MAX_SAMPLES:
            break
    return out


def _to(dev):
    return lambda x: x.to(dev) if isinstance(x, torch.Tensor) else x


def test_op_list_is_large_enough():
    assert len(OPS) >= 60 and all(name in _by_name for name in OPS), [n for n in OPS if n not in _by_name]


@pytest.mark.parametrize("name", OPS)
def test_forward_matches_cpu(dev, name):
    opinfo = _by_name[name]
    samples = _samples(opinfo)
    assert samples, f"no float32 samples for {name}"
    for sample in samples:
        want = opinfo(sample.input, *sample.args, **sample.kwargs)
        lazy = tree_map(_to(dev), (sample.input, sample.args, sample.kwargs))
        got = opinfo(lazy[0], *lazy[1], **lazy[2])
        lm.mark_step()
        got = tree_map(lambda x: x.cpu() if isinstance(x, torch.Tensor) else x, got)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, equal_nan=True)
    if name in LOWERED:
        fallbacks = [c for c in metrics.counter_names() if c.startswith("aten::")]
        assert not fallbacks, f"{name} fell back to CPU: {fallbacks}"
