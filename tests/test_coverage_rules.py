"""Rules of tvm_lowering/ops/coverage.py and the decomposition tier of ratex/core/ops.py on the
corners the OpInfo conformance run found wrong: each compared with CPU PyTorch and required to be
lowered (no `aten::` fallback counter)."""
import pytest
import torch

from test_rules import check

aten = torch.ops.aten
NEG_INF = float("-inf")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def test_reductions_of_all_infinite_slices():
    """TVM's max reduction starts at the lowest finite float: a fully masked row must stay -inf."""
    x = torch.randn(3, 4)
    x[1] = NEG_INF
    check(lambda t: (torch.amax(t, 1), t.amax(), torch.amin(-t, 1), (-t).min()), x,
          ops=["amax.default", "amin.default", "min.default"])
    check(lambda t: aten._safe_softmax.default(t, 1), x)


@pytest.mark.parametrize("index", [(slice(None), slice(None), [0, 3, 0]), ([1, 0], slice(None), [2, 2])],
                         ids=["trailing", "separated"])
def test_index_put_with_full_slices(index):
    """The backward of x[:, :, idx] accumulates into the sliced dims (TVM's rule wrote one row)."""
    def fn(x, v):
        indices = [None if i == slice(None) else torch.tensor(i, device=x.device) for i in index]
        return aten.index_put.default(x, indices, v, True)
    x = torch.randn(3, 4, 5)
    check(fn, x, torch.randn(x[index].shape), ops=["index_put.default"])


def test_avg_pool3d_window_corners():
    x = torch.randn(1, 2, 5, 5, 5)
    check(lambda t: torch.nn.functional.avg_pool3d(t, (2, 3, 4), (1, 2, 2), (0, 1, 2), ceil_mode=True,
                                                   count_include_pad=False), x, ops=["avg_pool3d.default"])


def test_as_strided_overlapping_and_offset():
    x = torch.randn(10)
    check(lambda t: (torch.as_strided(t, (3, 3), (1, 2), 1), torch.as_strided_scatter(t, torch.ones(2, 2, device=t.device), (2, 2), (3, 1), 2)),
          x, ops=["as_strided.default", "as_strided_scatter.default"])


def test_decomposed_ops_lowered():
    """Ops without a rule trace through PyTorch's decompositions instead of running on CPU."""
    x, y = torch.randn(3, 4), torch.rand(3, 4)
    check(lambda a, b: (torch.xlogy(a, b), torch.diag_embed(a), torch.nansum(a), torch.sgn(a)), x, y)


def test_zero_dim_corners():
    x, i = torch.tensor(1.5), torch.tensor([0])
    check(lambda t: (torch.softmax(t, 0), torch.cumsum(t, 0), torch.max(t, 0), torch.gather(t, 0, i.to(t.device)),
                     torch.scatter_add(t, 0, i.to(t.device), torch.tensor([2.0, 7.0], device=t.device))), x)


def test_times_zero_keeps_nan():
    """TVM folds `x * 0` to 0; with x NaN or inf PyTorch gives NaN, so the zero is a graph input."""
    x = torch.tensor([float("nan"), float("inf"), 1.0])
    check(lambda t: (t * 0.0, t * 0, torch.addr(torch.zeros(3, 3, device=t.device), t, t, beta=0, alpha=0)), x)
