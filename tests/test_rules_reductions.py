"""Rules of tvm_lowering/ops/reductions.py against CPU PyTorch: 0-dim inputs, reductions over no
elements, over every dim and of every dtype, NaN and ties in arg-reductions, slices of only -inf,
running extremes and log-sum-exp."""
import pytest
import torch

from rule_check import check

aten = torch.ops.aten
NAN, INF = float("nan"), float("inf")
NEG_INF = float("-inf")
# These scans are host loops, which only CPU builds have: on GPU they fall back to PyTorch.
HOST_LOOPS = pytest.mark.cpu_only("host-loop kernels: cummax, cummin and logcumsumexp")

pytestmark = pytest.mark.usefixtures("seeded")


def test_zero_dim_views_and_reductions():
    """TVM's rules index a dim that a 0-dim tensor lacks."""
    x, i = torch.tensor(-1.5), torch.tensor([0])
    check(lambda t: (t.squeeze(0), t.transpose(0, -1), t.mean(0, keepdim=True), t.mean(-1),
                     t.argmax(), t.argmin(0, keepdim=True), t.prod(0), torch.any(t, 0), torch.any(t, dim=()),
                     torch.index_select(t, 0, i.to(t.device))),
          x, ops=["squeeze.dim", "transpose.int", "mean.dim", "argmax.default", "argmin.default",
                  "any.dim", "any.dims", "index_select.default"])


def test_zero_dim_corners():
    x, i = torch.tensor(1.5), torch.tensor([0])
    check(lambda t: (torch.softmax(t, 0), torch.cumsum(t, 0), torch.max(t, 0), torch.gather(t, 0, i.to(t.device)),
                     torch.scatter_add(t, 0, i.to(t.device), torch.tensor([2.0, 7.0], device=t.device))), x)


def test_reductions_over_all_dims_and_of_any_dtype():
    x = torch.randn(3, 4)
    x[0, 1] = 0
    check(lambda t: (t.mean(dim=[]), torch.any(t, 1), torch.any(t.int(), dim=(0,), keepdim=True),
                     t.argmax(), t.argmin(dim=-1, keepdim=True), t.prod(1), t.int().prod(),
                     torch.linalg.vector_norm(t, 2, dim=[]), torch.linalg.vector_norm(t, 3, dim=[], keepdim=True),
                     torch.linalg.vector_norm(t, float("inf"), dim=[]), t.norm()),
          x, ops=["mean.dim", "any.dim", "any.dims", "argmax.default", "argmin.default", "prod.default",
                  "linalg_vector_norm.default"])


def test_reductions_of_all_infinite_slices():
    """TVM's max reduction starts at the lowest finite float: a fully masked row must stay -inf."""
    x = torch.randn(3, 4)
    x[1] = NEG_INF
    check(lambda t: (torch.amax(t, 1), t.amax(), torch.amin(-t, 1), (-t).min()), x,
          ops=["amax.default", "amin.default", "min.default"])
    check(lambda t: aten._safe_softmax.default(t, 1), x)


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


@HOST_LOOPS
def test_running_extremes_and_logcumsumexp():
    """cummax/cummin report the last of equal values; a NaN takes over (and a later NaN moves the
    index). logcumsumexp keeps equal infinities and a -1000 next to 0."""
    x = torch.tensor([[1., 3, 3, 2, 3, NAN, 1, NAN]] * 2).T.contiguous()
    y = torch.tensor([[INF, INF, 1., -INF, NAN, 2.], [-INF, -INF, 1., INF, 2., 3.], [-1000., 0., 50., -3., 88., 89.]])
    check(lambda a, b, c, z: (torch.cummax(a, 0), torch.cummin(-a, 0), torch.cummax(c, 1), torch.cummin(z, 0),
                              torch.logcumsumexp(b, 1), torch.logcumsumexp(b, 0), torch.logcumsumexp(a * 20, 0)),
          x, y, torch.randint(0, 3, (4, 5)), torch.tensor(2.0),
          ops=["cummax.default", "cummin.default", "logcumsumexp.default"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_max_and_min_reductions_return_nan(dtype):
    """A NaN in a slice is its max and its min (TVM's comparisons skipped it), the inf norms too."""
    x = torch.tensor([[1.0, NAN, 3.0, -2.0], [4.0, 0.5, 2.0, 1.0], [NEG_INF, NEG_INF, NAN, NEG_INF]], dtype=dtype)
    check(lambda t: (t.amax(-1), t.amin(1, keepdim=True), t.amax(0), t.max(), t[1].min(), t[:, :2].amax(),
                     torch.linalg.vector_norm(t.float(), INF, dim=1), torch.linalg.vector_norm(t.float(), -INF, dim=0),
                     torch.linalg.vector_norm(t.float(), INF)),
          x, ops=["amax.default", "amin.default", "max.default", "min.default", "linalg_vector_norm.default"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sort_and_topk_order_nan_as_the_largest(dtype):
    """NaN sorts last ascending and first descending, with its index; -0.0 equals 0.0 (so a stable
    sort keeps their order); median is NaN with the first NaN's index where the slice holds one."""
    x = torch.tensor([[1.0, NAN, 3.0, -2.0, INF, NEG_INF], [0.0, -0.0, 2.0, NAN, 0.0, NAN],
                      [4.0, 0.5, 2.0, 1.0, -0.0, 3.0]], dtype=dtype)
    check(lambda t: (torch.sort(t, -1), torch.sort(t, 1, descending=True), torch.sort(t, stable=True),
                     torch.sort(t, dim=0, descending=True, stable=True), torch.argsort(t, dim=1, stable=True),
                     torch.topk(t, 3), torch.topk(t, 2, dim=0, largest=False), torch.median(t, 1), torch.median(t[2]),
                     torch.median(t, 0, keepdim=True)),
          x, ops=["sort.default", "sort.stable", "topk.default", "median.dim", "median.default"])


def test_bfloat16_sort_and_topk_sort():
    """TVM's CPU sort kernel has no bfloat16: the values came out unsorted, the indices wrong.
    Distinct values (eighths, exact in bfloat16): PyTorch's default sort orders ties either way."""
    x = ((torch.randperm(240) - 120) / 8).reshape(6, 40).bfloat16()
    check(lambda t: (torch.sort(t, -1), torch.sort(t, dim=0, descending=True, stable=True), torch.topk(t, 5),
                     torch.topk(t, 3, dim=0, largest=False), torch.msort(t)),
          x, ops=["sort.default", "sort.stable", "topk.default"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_histc_counts_as_cpu_at_the_edges_outside_and_at_nan(dtype):
    """The bin of an element next to an edge is the truncated (x - min) * bins / (max - min) of
    PyTorch's kernel (in float32, x * (bins / (max - min)) puts some of these in another bin):
    the 64 values either side of every edge, the ends, outside, inf and NaN."""
    edges = torch.linspace(-2.5, 3.7, 8, dtype=dtype)
    near, up, down = [edges], edges, edges
    for _ in range(64):
        up, down = torch.nextafter(up, edges + 1), torch.nextafter(down, edges - 1)
        near += [up, down]
    x = torch.cat([torch.randn(487, dtype=dtype) * 3, *near, torch.tensor([NAN, INF, NEG_INF, -2.5, 3.7], dtype=dtype)])
    check(lambda t: (torch.histc(t, bins=7, min=-2.5, max=3.7), torch.histc(t.view(12, -1)[:, :50], 13, 0.1, 0.2),
                     torch.histc(t[:0], 3, 0, 1)), x, ops=["histc.default"], rtol=0, atol=0)


def test_histc_of_integers_counts_as_pytorchs_cuda_kernel():
    """An integer histc (transformers' Mixtral counts its experts so, off the CPU), whose CPU
    kernel PyTorch lacks: counted as the float kernel counts the same integers."""
    import ratex  # noqa: F401
    from ratex.lazy_tensor_core.debug import metrics

    experts = torch.randint(0, 8, (64,), dtype=torch.int32)
    metrics.reset()
    got = torch.histc(experts.to("lazy"), bins=8, min=0, max=8).cpu()
    assert got.dtype == torch.int32 and metrics.counter_value("ratex::histc.default") == 1
    assert torch.equal(got, torch.histc(experts.double(), bins=8, min=0, max=8).to(torch.int32))
    wide = torch.arange(-3, 40, dtype=torch.int64)  # bins of 43 / 7: truncation, the ends, outside
    got = torch.histc(wide.to("lazy"), bins=7, min=-1, max=33).cpu()
    assert torch.equal(got, torch.histc(wide.double(), bins=7, min=-1, max=33).to(torch.int64))
