"""Rules of tvm_lowering/ops/creation.py against CPU PyTorch: fills with special and lifted
values, creation in the dtype asked for, empty tensors; and whole-tensor fills, which are
device data at once."""
import warnings

import pytest
import torch

import ratex.lazy_tensor_core.core.lazy_model as lm
from ratex.lazy_tensor_core.debug import metrics
from rule_check import check, in_backward, rnd

aten = torch.ops.aten

pytestmark = pytest.mark.usefixtures("seeded")


@pytest.mark.usefixtures("tvm_kernels")
def test_full_with_special_and_lifted_fill_values():
    # nn.Transformer's causal mask: full(-inf) then triu; 2.5 is lifted to a graph input. A fill
    # through a view is a full node written into the base (a whole tensor's fill is data at once).
    def fills(x):
        a, b, c = x.clone(), x.clone(), torch.zeros(4, dtype=torch.int64, device=x.device)
        a[:].fill_(float("-inf"))
        b[:2].fill_(2.5)
        c[1:3].fill_(7)
        return torch.triu(a, 1) + x, b * x, c

    check(fills, rnd(3, 3), ops=["full.default"])


@pytest.mark.usefixtures("tvm_kernels")
def test_whole_tensor_fills_are_data_and_match_cpu():
    """torch.zeros/ones/full on the lazy device, the *_like and new_* forms and x.zero_() give
    device data at once (optimizer state made so is an input of the first step's program as of
    every later one's); the values and dtypes are PyTorch's."""
    def make(t):
        z = t.clone()
        z.zero_()
        return (torch.zeros((), device=t.device), torch.ones(2, 3, dtype=torch.int32, device=t.device),
                torch.full((2,), float("-inf"), device=t.device), torch.zeros_like(t), torch.ones_like(t, dtype=torch.bool),
                torch.full_like(t, 2.5), t.new_zeros([2]), t.new_full([3], 7, dtype=torch.int16), z)

    x = rnd(2, 3)
    lazy = make(x.to("lazy"))
    assert all(r._st.value[0].results[0] is not None for r in lazy), "a fill is still pending"
    for got, want in zip(lazy, make(x)):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got.cpu(), want)
    # a transposed input's zeros_like keeps its strides (preserve_format): traced, as before
    check(lambda t: torch.zeros_like(t.t()).stride(), rnd(2, 3))


def test_creation_in_the_dtype_asked_for():
    # inside a backward, where creation ops are graph nodes (outside it they are data at once)
    x = torch.randn(5)
    check(lambda t: in_backward(lambda g: (
        g.new_zeros([2, 3], dtype=torch.float64), g.new_ones([4], dtype=torch.int32),
        torch.zeros_like(g, dtype=torch.int64), torch.ones_like(g, dtype=torch.bool),
        g.new_full([2, 2], 2.5, dtype=torch.float64), g.new_full([3], 7, dtype=torch.int16),
        g.new_full((1, 2), 1.25, device=g.device), torch.isreal(g)), t),
          x, ops=["new_zeros.default", "new_ones.default", "zeros_like.default", "ones_like.default",
                  "new_full.default"])


@pytest.mark.usefixtures("tvm_kernels")
def test_new_empty_compiles():
    x = rnd(2, 3).to("lazy")
    metrics.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        e = aten.new_empty.default(x, [4, 1])
        lm.mark_step()  # the pending new_empty is compiled and run here
    assert (e.shape, e.dtype) == (torch.Size([4, 1]), torch.float32)
    assert e.cpu().shape == (4, 1)
    assert not [n for n in metrics.counter_names() if n.startswith("aten::")]
