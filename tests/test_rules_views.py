"""Rules of tvm_lowering/ops/views.py against CPU PyTorch: views and the scatters that write
through them, as_strided with overlapping strides and an offset."""
import pytest
import torch

from rule_check import check, rnd

aten = torch.ops.aten

pytestmark = pytest.mark.usefixtures("seeded")


@pytest.mark.usefixtures("tvm_kernels")
def test_t_unsafe_view():
    check(
        lambda a, b: (aten.t.default(a), aten._unsafe_view.default(b, [3, 4]), aten.t.default(b[0])),
        rnd(2, 5), rnd(2, 6),
        ops=["t.default", "_unsafe_view.default"],
    )


@pytest.mark.usefixtures("tvm_kernels")
def test_scatters():
    check(
        lambda x, a, b, c, d: (
            aten.select_scatter.default(x, a, 1, -2),
            aten.diagonal_scatter.default(x, b, 1, 0, 2),
            aten.diagonal_scatter.default(x, c, -1, 1, 2),
            aten.slice_scatter.default(x, d, 2, -3, None, 2),
        ),
        rnd(3, 4, 5), rnd(3, 5), rnd(4, 3), rnd(3, 3), rnd(3, 4, 2),
        ops=["select_scatter.default", "diagonal_scatter.default", "slice_scatter.default"],
    )


@pytest.mark.usefixtures("tvm_kernels")
def test_slice_and_select_scatter_on_attention_projection_shapes():
    # TVM's own slice_scatter segfaulted on these shapes (nn.MultiheadAttention's in_proj gradient)
    base, src, g = rnd(3, 16, 2, 32), rnd(1, 16, 2, 32), rnd(16, 2, 32)
    check(
        lambda b, s, g: [aten.slice_scatter.default(b, s, 0, i, i + 1) for i in range(3)]
        + [aten.select_backward.default(g, [3, 16, 2, 32], 0, i) for i in range(3)]
        + [aten.slice_scatter.default(b, b[:, :, :, ::3], 3, None, None, 3),
           aten.slice_scatter.default(b, b[:, 2:12:5], 1, 2, 12, 5)],
        base, src, g, ops=["slice_scatter.default"],
    )


def test_as_strided_overlapping_and_offset():
    x = torch.randn(10)
    check(lambda t: (torch.as_strided(t, (3, 3), (1, 2), 1), torch.as_strided_scatter(t, torch.ones(2, 2, device=t.device), (2, 2), (3, 1), 2)),
          x, ops=["as_strided.default", "as_strided_scatter.default"])


def test_slice_scatters_summed_and_reshaped_match_cpu(dev):
    """A rotary embedding's gradient: two slice_scatters of a broadcast product, summed and
    reshaped. Fused into one kernel, LLVM's AVX-512 if-conversion read the wrong elements
    (garbage gradients for a Llama's q and k projections)."""
    g = torch.Generator().manual_seed(0)
    x, s = torch.randn(2, 8, 2, 8, generator=g), torch.randn(2, 8, 1, 8, generator=g)

    def fn(x, s):
        p = x * s
        z = torch.zeros(2, 8, 2, 8, device=x.device)
        return (torch.slice_scatter(z, p[..., 4:], 3, 0, 4) + torch.slice_scatter(z, p[..., :4], 3, 4)).view(2, 8, 16)

    torch.testing.assert_close(fn(x.to(dev), s.to(dev)).cpu(), fn(x, s))
