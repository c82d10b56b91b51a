"""Rules of tvm_lowering/ops/backward.py against CPU PyTorch: the backward ops of activations,
softmax, convolution (every output mask), pooling, padding, embedding and dropout."""
import pytest
import torch
import torch.nn.functional as F

import ratex.lazy_tensor_core.core.lazy_model as lm
import tvm_lowering
from ratex.core import graph, sync
from rule_check import check, rnd

aten = torch.ops.aten
NAN, INF = float("nan"), float("inf")

pytestmark = pytest.mark.usefixtures("seeded")


# ---- activations, softmax, dropout ------------------------------------------------------------
@pytest.mark.usefixtures("tvm_kernels")
def test_threshold_backward_and_activation_backwards():
    x = rnd(3, 7)
    x[0, :3] = torch.tensor([0.0, -1.0, 1.0])  # hit the thresholds exactly
    check(
        lambda g, x, y: (
            aten.threshold_backward.default(g, x, 0.0),
            aten.tanh_backward.default(g, y),
            aten.sigmoid_backward.default(g, y),
            aten.silu_backward.default(g, x),
            aten.gelu_backward.default(g, x),
            aten.gelu_backward.default(g, x, approximate="tanh"),
            aten.hardtanh_backward.default(g, x, -1.0, 1.0),
            aten.leaky_relu_backward.default(g, x, 0.2, False),
        ),
        rnd(3, 7), x, torch.rand(3, 7),
        ops=["threshold_backward.default", "tanh_backward.default", "sigmoid_backward.default",
             "silu_backward.default", "gelu_backward.default", "hardtanh_backward.default",
             "leaky_relu_backward.default"],
    )


@pytest.mark.usefixtures("tvm_kernels")
def test_softmax_backwards():
    x = rnd(4, 5)
    check(
        lambda g, x: (
            aten._log_softmax_backward_data.default(g, aten._log_softmax.default(x, 1, False), 1, torch.float32),
            aten._softmax_backward_data.default(g, aten._softmax.default(x, 0, False), 0, torch.float32),
            aten._log_softmax.default(x, 0, False),
        ),
        rnd(4, 5), x,
        ops=["_log_softmax_backward_data.default", "_softmax_backward_data.default", "_log_softmax.default"],
    )


@pytest.mark.usefixtures("tvm_kernels")
def test_native_dropout_backward():
    mask = torch.rand(4, 5) > 0.5
    check(lambda g, m: aten.native_dropout_backward.default(g, m, 2.0), rnd(4, 5), mask,
          ops=["native_dropout_backward.default"])


# ---- convolution ------------------------------------------------------------------------------
@pytest.mark.usefixtures("tvm_kernels")
@pytest.mark.parametrize(
    "xs,ws,stride,padding,dilation,groups",
    [
        ((2, 3, 7, 7), (4, 3, 3, 3), [1, 1], [1, 1], [1, 1], 1),
        ((2, 4, 9, 8), (6, 2, 3, 2), [2, 3], [1, 0], [1, 2], 2),
        ((1, 2, 10, 10), (2, 1, 3, 3), [3, 3], [2, 2], [2, 2], 2),  # depthwise, uneven output padding
    ],
)
def test_convolution_backward(xs, ws, stride, padding, dilation, groups):
    x, w = rnd(*xs), rnd(*ws)
    out = F.conv2d(x, w, None, stride, padding, dilation, groups)
    g = torch.randn_like(out)
    check(
        lambda g, x, w: aten.convolution_backward.default(
            g, x, w, [ws[0]], stride, padding, dilation, False, [0, 0], groups, [True, True, True]
        ),
        g, x, w,
        ops=["convolution_backward.default"],
    )


@pytest.mark.usefixtures("tvm_kernels")
def test_convolution_backward_1d():
    x, w = rnd(2, 3, 11), rnd(4, 3, 3)
    g = torch.randn_like(F.conv1d(x, w, stride=2, padding=1))
    check(
        lambda g, x, w: aten.convolution_backward.default(
            g, x, w, [4], [2], [1], [1], False, [0], 1, [True, True, True]
        ),
        g, x, w,
        ops=["convolution_backward.default"],
    )


# (input shape, weight shape, stride, padding, dilation, transposed, output_padding, groups)
CONVS = [
    ((2, 4, 5, 6, 7), (6, 2, 3, 2, 3), [2, 1, 2], [1, 0, 1], [1, 2, 1], False, [0, 0, 0], 2),
    ((1, 2, 4, 4, 4), (2, 2, 2, 2, 2), [1, 1, 1], [0, 0, 0], [1, 1, 1], False, [0, 0, 0], 1),
    ((2, 4, 7), (4, 3, 3), [2], [1], [1], True, [1], 2),
    ((2, 4, 5, 6), (4, 2, 3, 2), [2, 3], [1, 0], [1, 2], True, [1, 2], 2),
    ((2, 3, 5, 5), (3, 2, 3, 3), [1, 1], [0, 1], [3, 3], True, [2, 2], 1),  # output padding past the stride
    ((1, 2, 3, 4, 3), (2, 3, 3, 3, 2), [2, 1, 2], [1, 1, 0], [1, 2, 1], True, [1, 1, 0], 1),
    ((2, 4, 3, 4, 5), (4, 5, 3, 3, 3), [1, 1, 1], [0, 0, 0], [1, 1, 1], True, [0, 0, 0], 1),  # nn.ConvTranspose3d(4, 5, 3)
]


@pytest.mark.usefixtures("tvm_kernels")
@pytest.mark.parametrize("xs,ws,stride,padding,dilation,transposed,out_pad,groups", CONVS)
def test_convolution_backward_any_rank(xs, ws, stride, padding, dilation, transposed, out_pad, groups):
    """1- to 3-d convolutions, plain and transposed: the three gradients of convolution_backward."""
    x, w = rnd(*xs), rnd(*ws)
    conv = (stride, padding, dilation, transposed, out_pad, groups)
    out = aten.convolution.default(x, w, None, *conv)
    check(
        lambda g, x, w: aten.convolution_backward.default(g, x, w, [out.shape[1]], *conv, [True, True, True]),
        torch.randn_like(out), x, w,
        ops=["convolution_backward.default"],
    )


@pytest.mark.usefixtures("tvm_kernels")
@pytest.mark.parametrize("xs,ws,stride,padding,dilation,transposed,out_pad,groups", CONVS[::2])
def test_convolution_autograd_of_a_strided_input(xs, ws, stride, padding, dilation, transposed, out_pad, groups):
    """Forward and autograd's gradients of a biased convolution whose input is a transposed view."""
    x, w, b = rnd(*xs).transpose(-1, 1), rnd(*ws), rnd(ws[1] * groups if transposed else ws[0])

    def fn(x, w, b, g):
        x, w, b = (t.detach().requires_grad_() for t in (x, w, b))
        out = aten.convolution.default(x.transpose(-1, 1), w, b, stride, padding, dilation, transposed, out_pad,
                                       groups)
        return (out, *torch.autograd.grad(out, (x, w, b), g))

    g = torch.randn_like(aten.convolution.default(x.transpose(-1, 1), w, b, stride, padding, dilation, transposed,
                                                  out_pad, groups))
    check(fn, x, w, b, g, ops=["convolution.default", "convolution_backward.default"])


class In:
    """Marks input `i` in the argument list given to _lower_and_run."""

    def __init__(self, i):
        self.i = i


def _lower_and_run(op, args, cpu_inputs):
    """Lower one op straight through tvm_lowering (internal) and run it; return its non-None outputs.

    Used where the lazy device cannot reach a rule today: ops with None outputs
    (output_mask False) are rejected by ratex's shape inference and run eagerly.
    """
    import operator

    import tvm
    import tvm_lowering
    from torch import fx

    g = fx.Graph()
    phs = []
    for i, t in enumerate(cpu_inputs):
        p = g.placeholder(f"in{i}")
        p.meta["val"] = torch.empty(t.shape, dtype=t.dtype, device="meta")
        phs.append(p)
    call = g.call_function(op, tuple(phs[a.i] if isinstance(a, In) else a for a in args))
    vals = op(*[phs[a.i].meta["val"] if isinstance(a, In) else a for a in args])
    call.meta["val"] = vals
    outs = []
    for i, v in enumerate(vals):
        if v is not None:
            item = g.call_function(operator.getitem, (call, i))
            item.meta["val"] = v
            outs.append(item)
    g.output(tuple(outs))
    mod = tvm_lowering.import_graph(g)
    target = tvm_lowering.resolve_target("CPU")
    vm = tvm.relax.VirtualMachine(tvm_lowering.build(mod, target), tvm.cpu())
    res = vm["main"](*[tvm.runtime.tensor(t.numpy()) for t in cpu_inputs])
    return [torch.from_numpy(r.numpy()) for r in res]


@pytest.mark.usefixtures("tvm_kernels")
def test_convolution_backward_output_mask():
    x, w = rnd(2, 3, 6, 6), rnd(4, 3, 3, 3)
    g = torch.randn_like(F.conv2d(x, w, padding=1))
    for mask in ([False, True, True], [True, False, False], [False, False, True]):
        args = (In(0), In(1), In(2), [4], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, mask)
        got = _lower_and_run(aten.convolution_backward.default, args, [g, x, w])
        # (CPU may fill outputs that the mask turns off, so pick by the mask.)
        want = [t for t, m in zip(aten.convolution_backward.default(g, x, w, *args[3:]), mask) if m]
        assert len(got) == len(want)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.usefixtures("tvm_kernels")
@pytest.mark.parametrize("xs,ws,stride,padding,dilation,transposed,out_pad,groups", CONVS[2:4] + CONVS[5:6])
def test_transposed_convolution_backward_output_mask(xs, ws, stride, padding, dilation, transposed, out_pad, groups):
    x, w = rnd(*xs), rnd(*ws)
    conv = [stride, padding, dilation, transposed, out_pad, groups]
    g = torch.randn_like(aten.convolution.default(x, w, None, *conv))
    for mask in ([False, True, True], [True, False, False], [False, False, True]):
        args = (In(0), In(1), In(2), [g.shape[1]], *conv, mask)
        got = _lower_and_run(aten.convolution_backward.default, args, [g, x, w])
        want = [t for t, m in zip(aten.convolution_backward.default(g, x, w, *args[3:]), mask) if m]
        assert len(got) == len(want)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# ---- pooling ----------------------------------------------------------------------------------
@pytest.mark.usefixtures("tvm_kernels")
@pytest.mark.parametrize(
    "shape,k,s,p,ceil,cip,div",
    [((2, 3, 7, 6), [2, 2], [2, 2], [0, 0], False, True, None),
     ((2, 3, 7, 6), [3, 3], [2, 2], [1, 1], True, False, None),
     ((2, 3, 7, 6), [3, 2], [1, 2], [1, 1], False, True, None),
     ((2, 3, 7, 6), [2, 2], [2, 2], [1, 0], True, True, 3),
     ((2, 3, 5, 5, 5), [2, 2, 2], [2, 2, 2], [1, 1, 1], False, True, None),
     ((1, 2, 5, 6, 7), [3, 2, 3], [2, 1, 2], [1, 1, 0], True, False, None),
     ((3, 4, 4, 4), [2, 2, 2], [1, 2, 1], [0, 1, 1], False, True, 1),  # no batch dim
     ((1, 3, 7, 7, 7), [5, 1, 1], [1, 1, 1], [2, 0, 0], False, True, None)],  # LocalResponseNorm's window
)
def test_avg_pool_backward(shape, k, s, p, ceil, cip, div):
    x = rnd(*shape)
    pool, pool_backward = ((aten.avg_pool3d.default, aten.avg_pool3d_backward.default) if len(k) == 3 else
                           (aten.avg_pool2d.default, aten.avg_pool2d_backward.default))
    g = torch.randn_like(pool(x, k, s, p, ceil, cip, div))
    check(
        lambda g, x: (pool(x, k, s, p, ceil, cip, div), pool_backward(g, x, k, s, p, ceil, cip, div)),
        g, x, ops=[pool.__name__, pool_backward.__name__],
    )


@pytest.mark.usefixtures("tvm_kernels")
def test_adaptive_avg_pool2d_backward():
    x = rnd(2, 3, 7, 5)
    g = rnd(2, 3, 3, 2)
    check(lambda g, x: aten._adaptive_avg_pool2d_backward.default(g, x), g, x,
          ops=["_adaptive_avg_pool2d_backward.default"])


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


# ---- padding ----------------------------------------------------------------------------------
@pytest.mark.usefixtures("tvm_kernels")
@pytest.mark.parametrize(
    "shape,pad",
    [((3, 4), (1, 1)), ((3, 4, 5), (-1, 2)), ((3, 4, 5, 6), (1, 2, 3, 4)), ((3, 4, 5, 6), (2, -1, 0, 3)),
     ((3, 4, 5, 6, 7), (1, 2, 3, 4, 5, 6)), ((2, 1, 1, 1, 3), (2, 2, 1, 0, 0, 3)),  # size 1: both ends on one
     ((5, 3, 4), (-4, 5)), ((2, 4, 6), (3, -7))],  # cropped past one end: every position reads the other
)
def test_replication_pad_backward(shape, pad):
    """Gradients of padding the last 1 to 3 dims, negative padding (a crop) included."""
    name = f"replication_pad{len(pad) // 2}d"
    forward, backward = getattr(aten, name).default, getattr(aten, f"{name}_backward").default
    x = rnd(*shape)
    g = torch.randn_like(forward(x, pad))
    check(lambda g, x: backward(g, x, pad), g, x, ops=[backward.__name__])


@pytest.mark.usefixtures("tvm_kernels")
def test_replication_pad3d_autograd_of_a_strided_input():
    x = rnd(2, 3, 6, 5, 4)
    pad = (1, 2, 0, 3, 2, 1)

    def fn(x, g):
        x = x.detach().requires_grad_()
        out = F.pad(x.transpose(1, 3), pad, mode="replicate")
        return out, torch.autograd.grad(out, x, g)[0]

    g = torch.randn_like(F.pad(x.transpose(1, 3), pad, mode="replicate"))
    check(fn, x, g, ops=["replication_pad3d_backward.default"])


# ---- embedding --------------------------------------------------------------------------------
@pytest.mark.usefixtures("tvm_kernels")
@pytest.mark.parametrize("shape,dim", [((6, 4, 3), 2), ((6, 4, 3), 0), ((5, 7), 1)])
def test_weight_norm_backward(shape, dim):
    """wav2vec2's position embedding: a convolution whose weight is weight-normed over its last dim."""
    v = rnd(*shape)
    g = rnd(*[n if d == dim else 1 for d, n in enumerate(shape)])
    check(lambda gw, v, g: aten._weight_norm_interface_backward.default(
        gw, v, g, aten._weight_norm_interface.default(v, g, dim)[1], dim), rnd(*shape), v, g,
        ops=["_weight_norm_interface_backward.default"])


def test_embedding_dense_backward():
    idx = torch.tensor([[1, 3, 1], [0, 3, 4]])
    g = rnd(2, 3, 4)
    check(
        lambda g, i: (
            aten.embedding_dense_backward.default(g, i, 6, -1, False),
            aten.embedding_dense_backward.default(g, i, 6, 3, True),
        ),
        g, idx, ops=["embedding_dense_backward.default"],
    )
