"""Rules of tvm_lowering/ops/indexing.py against CPU PyTorch, on the corners PyTorch defines:
include_self, NaN in max/min, ties, uneven pooling windows, negative flat indices.
Each `check` compiles one graph, so related ops share a call."""
import warnings

import pytest
import torch
import torch.nn.functional as F

import ratex.lazy_tensor_core.core.lazy_model as lm
import tvm_lowering
from ratex.core import graph, sync
from test_rules import check

aten = torch.ops.aten
NAN, INF = float("nan"), float("inf")
MODES = ("sum", "prod", "mean", "amax", "amin")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(index_reduce|reduce argument of torch.scatter).*")
        yield


def test_scatter_reduce_every_mode_with_and_without_self():
    """Duplicate targets, untouched elements (keep self), NaN in self and src, both dims."""
    x, src = torch.randn(10, 5), torch.randn(5, 5)
    x[0, 0], src[1, 1] = NAN, NAN
    index = torch.randint(0, 10, (5, 5))

    def fn(a, i, s):
        return [a.scatter_reduce(dim, i if dim == 0 else i % 5, s, mode, include_self=inc)
                for mode in MODES for inc in (True, False) for dim in (0, -1)]

    check(fn, x, index, src, ops=["scatter_reduce.two"])


def test_scatter_narrow_index_and_integers():
    """An index narrower than self after the scattered dim (TVM's scatter_elements misplaced those
    writes, also for scatter and scatter_add) and src wider than the index; integer means round
    down; bool tensors scatter too."""
    x, src = torch.randn(4, 5, 6), torch.randn(3, 3, 5)
    index = torch.randint(0, 4, (3, 2, 4))
    xi, si = torch.randint(-5, 5, (6, 3)), torch.randint(-9, 9, (4, 3))
    ii = torch.randint(0, 6, (4, 3))
    flags = torch.zeros(4, 5, 6, dtype=torch.bool)

    def fn(a, i, s, b, j, t, f):
        return ([a.scatter_reduce(0, i, s, "mean", include_self=False), a.scatter_reduce(0, i, s, "amax"),
                 a.scatter_add(0, i, s), a.scatter(0, i, s), f.scatter(0, i, s > 0), f.scatter(0, i, True)]
                + [b.scatter_reduce(0, j, t, mode) for mode in MODES])

    check(fn, x, index, src, xi, ii, si, flags,
          ops=["scatter_reduce.two", "scatter_add.default", "scatter.src", "scatter.value"])


def test_index_reduce_and_scatter_with_reduce():
    x, src = torch.randn(5, 5, 5), torch.randn(5, 10, 5)
    src[0, 0, 0] = NAN
    index = torch.randint(0, 5, (10,))
    scalar = torch.tensor(2.0)

    def fn(a, i, s, z):
        out = [a.index_reduce(1, i, s, mode, include_self=inc) for mode in MODES[1:] for inc in (True, False)]
        out += [z.index_reduce(0, i[:1] * 0, z + 1, "prod", include_self=False)]  # 0-dim self and source
        flat = a.reshape(25, 5)
        for mode in ("add", "multiply"):
            out += [flat.scatter(0, i.reshape(2, 5) * 5, s[0, :2], reduce=mode),
                    flat.scatter(1, i.reshape(2, 5).int(), 2.5, reduce=mode)]
        return out

    check(fn, x, index, src, scalar, ops=["index_reduce.default", "scatter.reduce", "scatter.value_reduce"])


def test_take_and_put_flat_negative_indices():
    x = torch.randn(3, 3)
    index = torch.tensor([[0, -1], [8, -9]])
    check(lambda a, i, s: (a.take(i), a.put(i, s, accumulate=True), a.put(i[0], s[1], accumulate=False),
                           a.put(torch.zeros_like(i), s, accumulate=True), a[0, 0].take(i[0, :1] * 0)),
          x, index, torch.randn(2, 2), ops=["take.default", "put.default"])


def test_take_from_empty_tensor_raises():
    """No index is valid there: the call raises as on CPU, nothing reads memory."""
    with pytest.raises(IndexError):
        check(lambda a, i: a.take(i), torch.randn(0), torch.tensor([0]))


def test_running_extremes_and_logcumsumexp():
    """cummax/cummin report the last of equal values; a NaN takes over (and a later NaN moves the
    index). logcumsumexp keeps equal infinities and a -1000 next to 0."""
    x = torch.tensor([[1., 3, 3, 2, 3, NAN, 1, NAN]] * 2).T.contiguous()
    y = torch.tensor([[INF, INF, 1., -INF, NAN, 2.], [-INF, -INF, 1., INF, 2., 3.], [-1000., 0., 50., -3., 88., 89.]])
    check(lambda a, b, c, z: (torch.cummax(a, 0), torch.cummin(-a, 0), torch.cummax(c, 1), torch.cummin(z, 0),
                              torch.logcumsumexp(b, 1), torch.logcumsumexp(b, 0), torch.logcumsumexp(a * 20, 0)),
          x, y, torch.randint(0, 3, (4, 5)), torch.tensor(2.0),
          ops=["cummax.default", "cummin.default", "logcumsumexp.default"])


def test_adaptive_pools_uneven_windows():
    """8 -> 5 and 7 -> 3 give overlapping windows of two widths; max ties go to the first position
    and NaN wins (the last NaN's index)."""
    x = torch.randn(2, 3, 8, 7)
    x[0, 0, 0, 0], x[0, 0, 1, 1] = NAN, NAN
    x[1, 1, :3, :3] = 1.0
    check(lambda a: (F.adaptive_avg_pool2d(a, (5, 3)), F.adaptive_avg_pool1d(a[0], 5), F.adaptive_avg_pool3d(a, (2, 5, 4)),
                     F.adaptive_max_pool2d(a, (5, 3), return_indices=True), F.adaptive_max_pool1d(a[0], 3, return_indices=True),
                     F.adaptive_max_pool3d(a, (2, 3, 3), return_indices=True)),
          x, ops=["_adaptive_avg_pool2d.default", "_adaptive_avg_pool3d.default", "adaptive_max_pool2d.default",
                  "adaptive_max_pool3d.default"])


def test_adaptive_pool_backward():
    """The max gradient lands where each max came from (overlapping windows add up); the 3-D average
    gradient spreads over windows of uneven sizes."""
    x = torch.randn(2, 3, 8, 7)
    _, indices = F.adaptive_max_pool2d(x, (5, 3), return_indices=True)
    check(lambda g, a, i, g3: (aten.adaptive_max_pool2d_backward.default(g, a, i),
                               aten._adaptive_avg_pool3d_backward.default(g3, a)),
          torch.randn(2, 3, 5, 3), x, indices, torch.randn(2, 2, 5, 4),
          ops=["adaptive_max_pool2d_backward.default", "_adaptive_avg_pool3d_backward.default"])


def _pool_grads(g, a, window, stride, padding=0):
    _, i = aten.max_pool2d_with_indices.default(a, [window, window], [stride, stride], [padding, padding])
    return aten.max_pool2d_with_indices_backward.default(g, a, [window, window], [stride, stride],
                                                         [padding, padding], [1, 1], False, i)


def _lowered_text(fn, *args):
    """The Relax module the lazy device builds for fn(*args) (nothing is run)."""
    out = fn(*[a.to("lazy") for a in args])  # noqa: F841  (kept alive: pending until the cut)
    step = graph.cut([st.value for st in sync.pending_storages()])
    text = tvm_lowering.import_graph(graph.to_fx(step), library=True, host_kernels=True).script()
    lm.mark_step()
    return text


def test_max_pool_gradient_with_its_own_indices_is_a_gather():
    """Tiling 2x2 windows whose indices come from the forward in the same graph: a gather per input
    element. Ties (first wins), NaN (last wins), all -inf windows and a leftover-free 3-D input;
    overlapping windows, padding, indices of another window or from outside the graph keep the
    scatter."""
    x = torch.randn(2, 3, 6, 8)
    x[0, 0, :2, :2] = 1.0  # a tie
    x[0, 1, 2:4, 2:4] = torch.tensor([[NAN, 0.5], [NAN, 2.0]])
    x[1, 2, 4:6, 6:8] = -INF
    g = torch.randn(2, 3, 3, 4)
    check(lambda gg, a, g3, a3: (_pool_grads(gg, a, 2, 2), _pool_grads(g3, a3, 2, 2)),
          g, x, torch.randn(3, 3, 4), x[0], ops=["max_pool2d_with_indices_backward.default"])
    assert "max_pool2d_backward_gather" in _lowered_text(lambda gg, a: _pool_grads(gg, a, 2, 2), g, x)
    text = _lowered_text(lambda gg, a: _pool_grads(gg, a, 3, 2, 1), torch.randn(2, 3, 3, 4), x)
    assert "gather" not in text and "scatter_elements" in text

    def other_indices(gg, a, i):
        _, flipped = aten.max_pool2d_with_indices.default(a.flip(-1), [2, 2], [2, 2])  # same window: gather
        _, wider = aten.max_pool2d_with_indices.default(a, [3, 3], [2, 2], [1, 1])  # 3x3 windows, same shape
        return [aten.max_pool2d_with_indices_backward.default(gg, a, [2, 2], [2, 2], [0, 0], [1, 1], False, k)
                for k in (i, flipped, wider)]

    check(other_indices, g, x, torch.randint(0, 48, (2, 3, 3, 4)),
          ops=["max_pool2d_with_indices_backward.default"])


def test_index_select_zero_dim():
    check(lambda a, b, i: (a.index_select(0, i), b.index_select(-1, i + 2), b.index_select(0, i.reshape(1))),
          torch.tensor(2.0), torch.randn(3, 4), torch.tensor(0), ops=["index_select.default"])


def test_group_norm_and_spatial_nll():
    x = torch.randn(2, 4, 3, 5)
    target = torch.randint(0, 4, (2, 3, 5))
    target[0, 0, 0] = -100  # ignored
    weight = torch.rand(4)

    def fn(a, t, w):
        out = list(aten.native_group_norm.default(a, w, w + 1, 2, 4, 15, 2, 1e-5)) + [F.group_norm(a, 4)]
        for reduction in ("none", "mean", "sum"):
            out += [F.cross_entropy(a, t, reduction=reduction), F.cross_entropy(a, t, w, reduction=reduction)]
        return out

    check(fn, x, target, weight, ops=["native_group_norm.default", "nll_loss2d_forward.default"])


def test_host_loop_kernels_only_in_cpu_builds():
    """A module not built for the CPU (CUDA) gets no host-loop kernels: cummax falls back to PyTorch,
    scatter_add over an index spanning self uses TVM's portable scatter_elements."""
    x = torch.randn(6, 5).to("lazy")
    index = torch.randint(0, 6, (4, 5)).to("lazy")
    for fn, portable in ((lambda: torch.cummax(x, 0), False), (lambda: x.scatter_add(0, index, x[:4]), True)):
        out = fn()  # noqa: F841 - kept alive: its pending value is the graph's root
        fx = graph.to_fx(graph.cut([st.value for st in sync.pending_storages()]))
        assert "scatter_elements" not in str(tvm_lowering.import_graph(fx, host_kernels=True))  # ratex's loops
        if portable:
            assert "scatter_elements" in str(tvm_lowering.import_graph(fx))
        else:
            with pytest.raises(tvm_lowering.LoweringError, match="only a CPU kernel"):
                tvm_lowering.import_graph(fx)
        lm.mark_step()
