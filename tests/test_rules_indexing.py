"""Rules of tvm_lowering/ops/indexing.py against CPU PyTorch, on the corners PyTorch defines:
include_self, NaN in max/min, ties, negative flat indices, full slices in index_put, empty
inputs to cat. Each `check` compiles one graph, so related ops share a call."""
import warnings

import pytest
import torch

import ratex.lazy_tensor_core.core.lazy_model as lm
import tvm_lowering
from ratex.core import graph, sync
from rule_check import check, rnd

aten = torch.ops.aten
NAN = float("nan")
MODES = ("sum", "prod", "mean", "amax", "amin")
# These scatters are host loops, which only CPU builds have: on GPU they fall back to PyTorch.
HOST_LOOPS = pytest.mark.cpu_only("host-loop kernels: scatter reductions")

pytestmark = pytest.mark.usefixtures("seeded")


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(index_reduce|reduce argument of torch.scatter).*")
        yield


# ---- scatter ----------------------------------------------------------------------------------
@HOST_LOOPS
def test_scatter_reduce_every_mode_with_and_without_self():
    """Duplicate targets, untouched elements (keep self), NaN in self and src, both dims."""
    x, src = torch.randn(10, 5), torch.randn(5, 5)
    x[0, 0], src[1, 1] = NAN, NAN
    index = torch.randint(0, 10, (5, 5))

    def fn(a, i, s):
        return [a.scatter_reduce(dim, i if dim == 0 else i % 5, s, mode, include_self=inc)
                for mode in MODES for inc in (True, False) for dim in (0, -1)]

    check(fn, x, index, src, ops=["scatter_reduce.two"])


@HOST_LOOPS
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


@HOST_LOOPS
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


@pytest.mark.usefixtures("tvm_kernels")
def test_scatter_add_amax_zero_new_empty():
    idx = torch.tensor([[0, 1, 2, 0], [1, 1, 0, 2]])

    def fn(x, s, i):
        e = aten.new_empty.default(x, [2, 3])
        return (
            aten.scatter_add.default(x, 1, i, s),
            aten.amax.default(x, [1], True),
            aten.amax.default(x, [], False),
            aten.zero.default(x),
            torch.tensor(e.shape), torch.tensor([], dtype=e.dtype),  # new_empty: only shape/dtype
        )

    check(fn, rnd(2, 3), rnd(2, 5), idx,
          ops=["scatter_add.default", "amax.default", "zero.default", "new_empty.default"])


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


# ---- index_put, index_select, take/put, cat ---------------------------------------------------
@pytest.mark.parametrize("index", [(slice(None), slice(None), [0, 3, 0]), ([1, 0], slice(None), [2, 2])],
                         ids=["trailing", "separated"])
def test_index_put_with_full_slices(index):
    """The backward of x[:, :, idx] accumulates into the sliced dims (TVM's rule wrote one row)."""
    def fn(x, v):
        indices = [None if i == slice(None) else torch.tensor(i, device=x.device) for i in index]
        return aten.index_put.default(x, indices, v, True)
    x = torch.randn(3, 4, 5)
    check(fn, x, torch.randn(x[index].shape), ops=["index_put.default"])


def test_index_select_zero_dim():
    check(lambda a, b, i: (a.index_select(0, i), b.index_select(-1, i + 2), b.index_select(0, i.reshape(1))),
          torch.tensor(2.0), torch.randn(3, 4), torch.tensor(0), ops=["index_select.default"])


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


def test_cat_skips_legacy_empty_inputs():
    """PyTorch lets a 1-D (0,) tensor join tensors of any rank; it adds nothing."""
    a, b = torch.randn(2, 3), torch.randn(2, 2)
    check(lambda s, t: (torch.cat([s, torch.empty(0, device=s.device), t], 1), torch.cat([s, t.int()], -1)),
          a, b, ops=["cat.default"])
