"""Rules of tvm_lowering/ops/corners.py on the corners the OpInfo conformance run found falling
back: 0-dim inputs, reductions over no elements, dtype arguments, integer scalars and bounds, empty
dim lists. Each is compared with CPU PyTorch and required to be lowered (no `aten::` fallback)."""
import pytest
import torch

from test_rules import check, in_backward

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def test_zero_dim_views_and_reductions():
    """TVM's rules index a dim that a 0-dim tensor lacks."""
    x, i = torch.tensor(-1.5), torch.tensor([0])
    check(lambda t: (t.squeeze(0), t.transpose(0, -1), t.mean(0, keepdim=True), t.mean(-1),
                     t.argmax(), t.argmin(0, keepdim=True), t.prod(0), torch.any(t, 0), torch.any(t, dim=()),
                     torch.index_select(t, 0, i.to(t.device))),
          x, ops=["squeeze.dim", "transpose.int", "mean.dim", "argmax.default", "argmin.default",
                  "any.dim", "any.dims", "index_select.default"])


def test_reductions_over_all_dims_and_of_any_dtype():
    x = torch.randn(3, 4)
    x[0, 1] = 0
    check(lambda t: (t.mean(dim=[]), torch.any(t, 1), torch.any(t.int(), dim=(0,), keepdim=True),
                     t.argmax(), t.argmin(dim=-1, keepdim=True), t.prod(1), t.int().prod(),
                     torch.linalg.vector_norm(t, 2, dim=[]), torch.linalg.vector_norm(t, 3, dim=[], keepdim=True),
                     torch.linalg.vector_norm(t, float("inf"), dim=[]), t.norm()),
          x, ops=["mean.dim", "any.dim", "any.dims", "argmax.default", "argmin.default", "prod.default",
                  "linalg_vector_norm.default"])


def test_arg_extremes_pick_the_first_nan_and_the_first_tie():
    x = torch.tensor([[1.0, float("nan"), 3.0, float("nan")], [2.0, 5.0, 5.0, -1.0], [-1.0, 4.0, -1.0, 0.0]])
    check(lambda t: (t.argmax(1), t.argmin(1), t.argmax(), t[1:].argmin(), t.argmax(0, keepdim=True),
                     torch.max(t, 1), torch.min(t, 0)),
          x, ops=["argmax.default", "argmin.default", "max.dim", "min.dim"])


@pytest.mark.parametrize("shape, dim, correction", [((0,), None, 1), ((0, 4), [0], 0), ((1, 4), [0], 1),
                                                    ((2, 3), [1], 3), ((3, 4), [1], 0.5), ((), None, 0)])
def test_var_corners(shape, dim, correction):
    """Over no elements var is NaN; for N <= correction it is inf (NaN where every deviation is 0)."""
    x = torch.randn(shape)
    check(lambda t: (torch.var(t, dim, correction=correction), torch.std(t, dim, correction=correction),
                     torch.var_mean(t, dim, correction=correction, keepdim=True)),
          x, ops=["var.correction"], expected_warning="var\\(\\)|std\\(\\)|std_mean|var_mean")


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


def test_integer_scalars_and_bounds():
    """rsub of an int scalar, clamp of an integer tensor with one bound and of NaN, division by 0."""
    x = torch.tensor([[-2.0, 0.5, float("nan")], [3.0, -0.25, 9.0]])
    n = torch.tensor([-5, 0, 3, 12])
    check(lambda t, k: (1 - t, aten.rsub.Scalar(t, 2, alpha=3), 2 - k, torch.clamp(t, min=-1), torch.clamp(t, -1, 1),
                        torch.clamp(k, max=4), torch.clamp(k, min=0), torch.clamp(k, min=0.5), torch.clamp(t, max=float("nan")),
                        t / 0),
          x, n, ops=["rsub.Scalar", "clamp.default", "div.Tensor"])


def test_cat_skips_legacy_empty_inputs():
    """PyTorch lets a 1-D (0,) tensor join tensors of any rank; it adds nothing."""
    a, b = torch.randn(2, 3), torch.randn(2, 2)
    check(lambda s, t: (torch.cat([s, torch.empty(0, device=s.device), t], 1), torch.cat([s, t.int()], -1)),
          a, b, ops=["cat.default"])


def test_pixel_shuffle_and_addbmm():
    x = torch.randn(2, 1, 8, 2, 3)
    m, b1, b2 = torch.randn(4, 5), torch.randn(3, 4, 6), torch.randn(3, 6, 5)
    check(lambda t: torch.pixel_shuffle(t, 2), x, ops=["pixel_shuffle.default"])
    check(lambda i, p, q: (torch.addbmm(i, p, q), torch.addbmm(i[0], p, q, beta=0.5, alpha=-2),
                           torch.addbmm(torch.full_like(i, float("nan")), p, q, beta=0)),
          m, b1, b2, ops=["addbmm.default"])


def test_matmul_with_empty_inner_dim():
    check(lambda a, b: torch.matmul(a, b), torch.randn(2, 3, 0), torch.randn(0, 4))


def test_glu_through_tensor_split():
    """glu's decomposition splits with tensor_split.sections: slices, not a CPU run; uneven sections too."""
    x = torch.randn(4, 6)
    check(lambda t: (torch.nn.functional.glu(t, 0), torch.nn.functional.glu(t, -1), torch.tensor_split(t, 4, 1)), x)
