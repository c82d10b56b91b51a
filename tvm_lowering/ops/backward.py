"""Rules for the backward ops autograd emits on the lazy device: of activations, softmax, losses,
convolution, pooling, padding, normalization and embedding."""
import math
import operator

import numpy as np
import torch
from torch import fx
from tvm import relax, te, tirx

from .. import pool_grad
from . import bounds
from .kit import (accumulation, arg, cast, dtype, emit, emit_te, env, nll_pick, out_meta, pair, pool_window, scalar, scatter_into,
                  shape, to_dtype, tuple_out, zeros)
from .nn import CONV, conv_window, transposed_conv
from .registry import rule


op = relax.op


def _mask(node, i, name, n):
    m = arg(node, i, name, None)
    return [True] * n if m is None else list(m)


# ---- elementwise activations ------------------------------------------------------------------
@rule("threshold_backward.default")
def threshold_backward(imp, node):
    g = env(imp, node.args[0])
    x = env(imp, node.args[1])
    th = arg(node, 2, "threshold")
    return emit(imp, op.where(op.less_equal(x, scalar(th, dtype(x))), op.zeros_like(g), g))


@rule("tanh_backward.default")
def tanh_backward(imp, node):
    g, y = env(imp, node.args[0]), env(imp, node.args[1])
    one = scalar(1.0, dtype(y))
    return emit(imp, op.multiply(g, op.subtract(one, op.multiply(y, y))))


@rule("sigmoid_backward.default")
def sigmoid_backward(imp, node):
    g, y = env(imp, node.args[0]), env(imp, node.args[1])
    one = scalar(1.0, dtype(y))
    return emit(imp, op.multiply(g, op.multiply(y, op.subtract(one, y))))


@rule("silu_backward.default")
def silu_backward(imp, node):
    g, x = env(imp, node.args[0]), env(imp, node.args[1])
    one = scalar(1.0, dtype(x))
    s = emit(imp, op.sigmoid(x))
    return emit(imp, op.multiply(g, op.multiply(s, op.add(one, op.multiply(x, op.subtract(one, s))))))


@rule("gelu_backward.default")
def gelu_backward(imp, node):
    g, x = env(imp, node.args[0]), env(imp, node.args[1])
    approximate = arg(node, 2, "approximate", "none")
    dt = dtype(x)
    c = lambda v: scalar(v, dt)  # noqa: E731
    if approximate == "tanh":
        beta, kappa = math.sqrt(2.0 / math.pi), 0.044715
        x2 = emit(imp, op.multiply(x, x))
        inner = op.multiply(c(beta), op.add(x, op.multiply(c(kappa), op.multiply(x2, x))))
        th = emit(imp, op.tanh(inner))
        left_d = op.multiply(c(0.5), op.add(c(1.0), th))
        right_d = op.multiply(
            op.multiply(op.multiply(c(0.5), x), op.subtract(c(1.0), op.multiply(th, th))),
            op.multiply(c(beta), op.add(c(1.0), op.multiply(c(3 * kappa), x2))),
        )
        return emit(imp, op.multiply(g, op.add(left_d, right_d)))
    cdf = op.multiply(c(0.5), op.add(c(1.0), op.erf(op.multiply(x, c(1 / math.sqrt(2.0))))))
    pdf = op.multiply(c(1 / math.sqrt(2 * math.pi)), op.exp(op.multiply(c(-0.5), op.multiply(x, x))))
    return emit(imp, op.multiply(g, op.add(cdf, op.multiply(x, pdf))))


@rule("hardtanh_backward.default")
def hardtanh_backward(imp, node):
    g, x = env(imp, node.args[0]), env(imp, node.args[1])
    lo, hi = arg(node, 2, "min_val"), arg(node, 3, "max_val")
    dt = dtype(x)
    out = op.logical_or(op.less_equal(x, scalar(lo, dt)), op.greater_equal(x, scalar(hi, dt)))
    return emit(imp, op.where(out, op.zeros_like(g), g))


@rule("leaky_relu_backward.default")
def leaky_relu_backward(imp, node):
    g, x = env(imp, node.args[0]), env(imp, node.args[1])
    slope = arg(node, 2, "negative_slope")
    dt = dtype(x)
    return emit(imp, op.where(op.greater(x, scalar(0.0, dt)), g, op.multiply(g, scalar(slope, dt))))


@rule("softshrink_backward.default", "hardshrink_backward.default")
def shrink_backward(imp, node):
    """g where |x| > lambd, else 0 (both shrinks pass the gradient where they pass x; NaN passes)."""
    g, x = env(imp, node.args[0]), env(imp, node.args[1])
    lambd = arg(node, 2, "lambd")
    dt = dtype(x)
    dead = op.logical_and(op.greater_equal(x, scalar(-lambd, dt)), op.less_equal(x, scalar(lambd, dt)))
    return emit(imp, op.where(dead, op.zeros_like(g), g))


@rule("native_dropout_backward.default")
def native_dropout_backward(imp, node):
    g, mask = env(imp, node.args[0]), env(imp, node.args[1])
    scale = arg(node, 2, "scale")
    dt = dtype(g)
    return emit(imp, op.multiply(op.multiply(g, cast(imp, mask, dt)), scalar(scale, dt)))


# ---- softmax ----------------------------------------------------------------------------------
@rule("_log_softmax_backward_data.default")
def log_softmax_backward(imp, node):
    g, y = _softmax_acc(imp, node)
    dim = arg(node, 2, "dim")
    _, out_dt = out_meta(node)
    s = op.sum(g, axis=[dim] if shape(g) else None, keepdims=True)
    return to_dtype(imp, emit(imp, op.subtract(g, op.multiply(op.exp(y), s))), out_dt)


@rule("_softmax_backward_data.default")
def softmax_backward(imp, node):
    g, y = _softmax_acc(imp, node)
    dim = arg(node, 2, "dim")
    _, out_dt = out_meta(node)
    s = op.sum(op.multiply(g, y), axis=[dim] if shape(g) else None, keepdims=True)
    return to_dtype(imp, emit(imp, op.multiply(y, op.subtract(g, s))), out_dt)


def _softmax_acc(imp, node):
    """The gradient and output of a softmax backward, float16/bfloat16 ones in float32: PyTorch's
    CPU kernel sums in float32 and rounds the gradient once (a bfloat16 sum over a vocabulary
    loses the small terms)."""
    g, y = env(imp, node.args[0]), env(imp, node.args[1])
    acc = accumulation(dtype(g))
    return cast(imp, g, acc), cast(imp, y, acc)


# ---- losses -----------------------------------------------------------------------------------
@rule("nll_loss_backward.default")
def nll_loss_backward(imp, node):
    go = env(imp, node.args[0])
    x = env(imp, node.args[1])
    target = env(imp, node.args[2])
    weight = env(imp, arg(node, 3, "weight"))
    reduction = arg(node, 4, "reduction", 1)
    ignore_index = arg(node, 5, "ignore_index", -100)
    total = env(imp, arg(node, 6, "total_weight"))
    if len(shape(x)) > 2:
        raise NotImplementedError("nll_loss_backward on more than 2 dims")
    onehot, w_t = nll_pick(imp, (x, target, weight, ignore_index))
    if reduction == 1:
        go = emit(imp, op.divide(go, total))
    coef = emit(imp, op.negative(op.multiply(w_t, go)))
    return emit(imp, op.multiply(onehot, op.expand_dims(coef, -1)))


@rule("mse_loss_backward.default")
def mse_loss_backward(imp, node):
    go, x, t = (env(imp, a) for a in node.args[:3])
    reduction = arg(node, 3, "reduction", 1)
    dt = dtype(x)
    n = 1
    for s in shape(x):
        n *= s
    factor = 2.0 / n if reduction == 1 else 2.0
    return emit(imp, op.multiply(op.multiply(op.subtract(x, t), scalar(factor, dt)), go))


# ---- convolution ------------------------------------------------------------------------------
def _conv_weight_grad(imp, x, g, stride, padding, dilation, groups, k):
    """grad_weight (O, C/groups, *k) of conv(x, weight) whose output gradient is `g` (N, O, *out):

    grad_w[o, c, i] = sum_{n, j} g[n, o, j] * xpad[n, group(o) * C/groups + c, j * stride + i * dilation],
    a convolution of x (its batch read as channels) with g as the kernel, stride and dilation swapped.
    """
    nsp = len(stride)
    n, c = shape(x)[:2]
    sizes = shape(x)[2:]
    spatial = list(range(2, 2 + nsp))
    xr = emit(imp, op.reshape(x, [n, groups, c // groups, *sizes]))
    xr = emit(imp, op.permute_dims(xr, [2, 1, 0, *(d + 1 for d in spatial)]))
    xr = emit(imp, op.reshape(xr, [c // groups, groups * n, *sizes]))
    gr = emit(imp, op.permute_dims(g, [1, 0, *spatial]))  # (O, N, *out)
    gw = emit(imp, CONV[nsp][0](xr, gr, strides=dilation, padding=padding, dilation=stride, groups=groups))
    gw = emit(imp, op.permute_dims(gw, [1, 0, *spatial]))  # (O, C/groups, *k'), k' >= k
    if shape(gw)[2:] != list(k):
        gw = emit(imp, op.strided_slice(gw, spatial, [0] * nsp, list(k)))
    return gw


@rule("convolution_backward.default")
def convolution_backward(imp, node):
    """(grad_input, grad_weight, grad_bias) of a 1-, 2- or 3-d convolution, transposed or not.

    A transposed convolution's input gradient is the plain convolution of g with its weight,
    and its weight gradient a plain convolution's with the roles of input and output gradient
    swapped: y = conv_transpose(x, w) is the adjoint of x' = conv(y', w).
    """
    g, x, w = (env(imp, a) for a in node.args[:3])
    stride, padding, dilation = conv_window(node, 4, x)
    transposed = arg(node, 7, "transposed")
    groups = arg(node, 9, "groups")
    mask = _mask(node, 10, "output_mask", 3)
    window = (stride, padding, dilation, groups)
    spatial = list(range(2, len(shape(x))))
    grad_in = grad_w = grad_b = None
    if mask[0] and transposed:
        # Positions past x's size (output padding of at least the stride) are sliced off.
        grad_in = emit(imp, CONV[len(stride)][0](g, w, strides=stride, padding=padding, dilation=dilation,
                                                 groups=groups))
        if shape(grad_in) != shape(x):
            grad_in = emit(imp, op.strided_slice(grad_in, spatial, [0] * len(spatial), shape(x)[2:]))
    elif mask[0]:
        grad_in = transposed_conv(imp, g, w, *window, shape(x)[2:])
    if mask[1]:
        inp, out_grad = (g, x) if transposed else (x, g)
        grad_w = _conv_weight_grad(imp, inp, out_grad, *window, shape(w)[2:])
    if mask[2]:
        grad_b = emit(imp, op.sum(g, axis=[0, *spatial]))
    return tuple_out(imp, node, [grad_in, grad_w, grad_b])


# ---- pooling ----------------------------------------------------------------------------------
def _pool_indices_in_window(node):
    """Whether a max_pool2d_with_indices_backward call's windows tile its input (see
    pool_grad.tiles) and its indices are ones that max_pool2d_with_indices computed in this
    graph with that window over a plane of the same size: then every index lies in its own
    window, which no other window overlaps."""
    kernel, stride = pair(arg(node, 2, "kernel_size")), arg(node, 3, "stride")
    stride = pair(stride) if stride else kernel  # [] = the window, as in the forward
    padding, dilation = pair(arg(node, 4, "padding")), pair(arg(node, 5, "dilation"))
    g, x, idx = node.args[0], node.args[1], arg(node, 7, "indices")
    if not all(isinstance(a, fx.Node) for a in (g, x, idx)):
        return False
    xs, gs = list(x.meta["val"].shape), list(g.meta["val"].shape)
    if len(xs) < 3 or not pool_grad.tiles(kernel, stride, padding, dilation, xs[-2:], gs[-2:]):
        return False
    if not (idx.target is operator.getitem and idx.args[1] == 1):
        return False
    pool = idx.args[0]
    if getattr(pool, "target", None) is not torch.ops.aten.max_pool2d_with_indices.default:
        return False
    window = list(pool_window(pool)) + [pair(arg(pool, 4, "dilation", 1))]
    return window == [kernel, stride, padding, dilation] and list(pool.args[0].meta["val"].shape)[-2:] == xs[-2:]


def _pool_grad_gather(g, idx, kernel, x_shape):
    """The gradient lands where its window's index points: idx holds flat places h * W + w."""
    width = x_shape[-1]
    return pool_grad.select_winners(g, x_shape, kernel,
                                    lambda window, h, w: idx(*window) == (h * width + w).astype(idx.dtype),
                                    "max_pool2d_backward_gather")


@rule("max_pool2d_with_indices_backward.default", "max_pool3d_with_indices_backward.default")
def max_pool_with_indices_backward(imp, node):
    """Each output gradient added into the input position its max came from."""
    g = env(imp, node.args[0])
    x = env(imp, node.args[1])
    idx = env(imp, arg(node, 7, "indices"))
    xs, gs = shape(x), shape(g)
    n = 3 if node.target.__name__.startswith("max_pool3d") else 2
    if n == 2 and _pool_indices_in_window(node):  # a gather, per input element: no zero fill, no scatter
        return emit_te(imp, _pool_grad_gather, g, idx, pair(arg(node, 2, "kernel_size")), xs,
                       primfunc_name_hint="max_pool2d_backward_gather")
    lead = xs[:-n]
    gflat = emit(imp, op.reshape(g, lead + [math.prod(gs[-n:])]))
    iflat = emit(imp, op.reshape(idx, lead + [math.prod(gs[-n:])]))
    base = zeros(imp, lead + [math.prod(xs[-n:])], dtype(g))
    out = emit(imp, op.scatter_elements(base, iflat, gflat, axis=len(lead), reduction="add"))
    return emit(imp, op.reshape(out, xs))


def _avg_pool_bwd_te(g, in_sizes, kernel, stride, padding, count_include_pad, divisor):
    """Each input element gets g / divisor from every window covering it, over the last
    len(kernel) dims; windows and divisors are those of the forward (pooling._avg_pool_te)."""
    n = len(kernel)
    out_sizes = g.shape[-n:]
    dt = str(g.dtype)

    def div_of(out_idx):
        if divisor:
            return tirx.const(divisor, "int32")
        starts = [o * s - p for o, s, p in zip(out_idx, stride, padding)]
        ends = [tirx.min(b + k, size + p) for b, k, size, p in zip(starts, kernel, in_sizes, padding)]
        if not count_include_pad:
            starts = [tirx.max(b, 0) for b in starts]
            ends = [tirx.min(e, size) for e, size in zip(ends, in_sizes)]
        return math.prod([e - b for b, e in zip(starts, ends)])

    scaled = te.compute(g.shape, lambda *i: g[i] / div_of(i[-n:]).astype(dt), name="avg_pool_scaled")

    def body(*idx):
        lead_idx, pos = idx[:-n], idx[-n:]
        acc = tirx.const(0, dt)
        for offs in np.ndindex(*kernel):
            shifted = [q + p - o for q, p, o in zip(pos, padding, offs)]
            outs = [tirx.floordiv(v, s) for v, s in zip(shifted, stride)]
            ok = tirx.all(*[tirx.all(v >= 0, tirx.floormod(v, s) == 0, o < size)
                            for v, s, o, size in zip(shifted, stride, outs, out_sizes)])
            acc = acc + tirx.if_then_else(ok, scaled[(*lead_idx, *outs)], tirx.const(0, dt))
        return acc

    return te.compute((*g.shape[:-n], *in_sizes), body, name=f"avg_pool{n}d_backward")


@rule("avg_pool2d_backward.default", "avg_pool3d_backward.default")
def avg_pool_backward(imp, node):
    g = env(imp, node.args[0])
    x = env(imp, node.args[1])
    n = 3 if node.target.__name__.startswith("avg_pool3d") else 2
    kernel, stride, padding = pool_window(node, first=2, n=n)
    cip = arg(node, 6, "count_include_pad")
    divisor = arg(node, 7, "divisor_override")
    return emit_te(imp, _avg_pool_bwd_te, g, shape(x)[-n:], kernel, stride, padding, cip, divisor)


def _adaptive_avg_bwd_te(g, in_sizes):
    """Each input element gets g / window size from every output window covering it (over the last
    len(in_sizes) dims; window o spans [floor(o * in / out), ceil((o + 1) * in / out)))."""
    nd = len(in_sizes)
    out_sizes = [int(s) for s in g.shape[-nd:]]
    dt = str(g.dtype)
    axes = [te.reduce_axis((0, m), name=f"o{i}") for i, m in enumerate(out_sizes)]

    def body(*idx):
        lead_idx, pos = idx[:-nd], idx[-nd:]
        starts = [tirx.floordiv(o * n, m) for o, n, m in zip(axes, in_sizes, out_sizes)]
        ends = [tirx.floordiv((o + 1) * n + m - 1, m) for o, n, m in zip(axes, in_sizes, out_sizes)]
        inside = tirx.all(*[tirx.all(s <= p, p < e) for s, p, e in zip(starts, pos, ends)])
        area = ends[0] - starts[0]
        for s, e in zip(starts[1:], ends[1:]):
            area = area * (e - s)
        return te.sum(
            tirx.if_then_else(inside, g[(*lead_idx, *axes)] / area.astype(dt), tirx.const(0, dt)), axis=axes
        )

    return te.compute((*g.shape[:-nd], *in_sizes), body, name=f"adaptive_avg_pool{nd}d_backward")


@rule("_adaptive_avg_pool2d_backward.default", "_adaptive_avg_pool3d_backward.default")
def adaptive_avg_pool_backward(imp, node):
    g = env(imp, node.args[0])
    x = env(imp, node.args[1])
    nd = 3 if node.target.__name__.startswith("_adaptive_avg_pool3d") else 2
    return emit_te(imp, _adaptive_avg_bwd_te, g, shape(x)[-nd:])


@rule("adaptive_max_pool2d_backward.default", "adaptive_max_pool3d_backward.default")
def adaptive_max_pool_backward(imp, node):
    """Each output gradient added into the input position its max came from."""
    grad, x, indices = (env(imp, a) for a in node.args[:3])
    nd = 3 if node.target.__name__.startswith("adaptive_max_pool3d") else 2
    xs, gs = shape(x), shape(grad)
    planes = math.prod(xs[:-nd])
    flat = [planes, math.prod(xs[-nd:])]
    grads = emit(imp, relax.op.reshape(grad, [planes, math.prod(gs[-nd:])]))
    where = emit(imp, relax.op.reshape(indices, [planes, math.prod(gs[-nd:])]))
    out = scatter_into(imp, zeros(imp, flat, dtype(grad)), 1, where, grads, "sum")
    return emit(imp, relax.op.reshape(out, xs))


# ---- padding ----------------------------------------------------------------------------------
@rule("replication_pad1d_backward.default", "replication_pad2d_backward.default",
      "replication_pad3d_backward.default")
def replication_pad_backward(imp, node):
    """Gradient of replication padding (negative padding crops), one padded dim at a time.

    Output position o of a dim padded by (before, after) reads input clamp(o - before, 0, n - 1):
    the positions that land inside pass their gradient straight back, those past either end sum
    into the first or last input position.
    """
    g, x = env(imp, node.args[0]), env(imp, node.args[1])
    padding = list(arg(node, 2, "padding"))
    sizes = shape(x)
    for i in range(len(padding) // 2):
        dim = len(sizes) - 1 - i  # padding pairs run from the last dim backwards
        before = padding[2 * i]
        n, m = sizes[dim], shape(g)[dim]

        def placed(lo, hi, at, summed):
            """g's positions [lo, hi) along dim (summed to one) as input positions from `at` on."""
            part = op.strided_slice(g, [dim], [lo], [hi])
            part = op.sum(part, axis=[dim], keepdims=True) if summed else part
            widths = [0] * (2 * len(sizes))
            widths[2 * dim:2 * dim + 2] = [at, n - at - (1 if summed else hi - lo)]
            return op.nn.pad(part, widths)

        lo, hi = max(before, 0), min(m, n + before)
        parts = [placed(lo, hi, lo - before, False)] if hi > lo else []
        if before > 0:
            parts.append(placed(0, min(before, m), 0, True))
        if m > n + before:
            parts.append(placed(max(n + before, 0), m, n - 1, True))
        grad = parts[0]
        for part in parts[1:]:
            grad = op.add(grad, part)
        g = emit(imp, grad)
    return g


# ---- normalization ----------------------------------------------------------------------------
@rule("native_layer_norm_backward.default")
def native_layer_norm_backward(imp, node):
    go = env(imp, node.args[0])
    x = env(imp, node.args[1])
    nshape = list(node.args[2])
    mean = env(imp, node.args[3])
    rstd = env(imp, node.args[4])
    w = env(imp, arg(node, 5, "weight"))
    b = env(imp, arg(node, 6, "bias"))
    mask = _mask(node, 7, "output_mask", 3)
    dts = [None if t is None else dtype(t) for t in (x, w, b)]
    # float16/bfloat16 in float32, each gradient rounded once (PyTorch's CPU kernel)
    acc = accumulation(dtype(x))
    go, x, mean, rstd, w = (None if t is None else cast(imp, t, acc) for t in (go, x, mean, rstd, w))
    nd, k = len(shape(x)), len(nshape)
    axes = list(range(nd - k, nd))
    batch_axes = list(range(0, nd - k))
    if 0 in shape(x):  # an empty batch: sums over it are zeros (kernels reducing over none don't schedule)
        grads = [zeros(imp, shape(t), dt) if on and t is not None else None
                 for on, t, dt in zip(mask, (x, w, b), dts)]
        return tuple_out(imp, node, grads)
    xhat = emit(imp, op.multiply(op.subtract(x, mean), rstd))
    gi = gw = gb = None
    if mask[0]:
        gx = emit(imp, op.multiply(go, w)) if w is not None else go
        m1 = op.mean(gx, axis=axes, keepdims=True)
        m2 = op.mean(op.multiply(gx, xhat), axis=axes, keepdims=True)
        gi = emit(imp, op.multiply(rstd, op.subtract(op.subtract(gx, m1), op.multiply(xhat, m2))))
    if mask[1] and w is not None:
        prod = op.multiply(go, xhat)
        gw = emit(imp, op.sum(prod, axis=batch_axes) if batch_axes else prod)
    if mask[2] and b is not None:
        gb = emit(imp, op.sum(go, axis=batch_axes)) if batch_axes else go
    grads = [None if g is None else to_dtype(imp, g, dt) for g, dt in zip((gi, gw, gb), dts)]
    return tuple_out(imp, node, grads)


@rule("_weight_norm_interface_backward.default")
def weight_norm_backward(imp, node):
    """weight_norm's fused backward (wav2vec2's convolutional position embedding), ATen's formula:
    with s the sum of grad_w * v over the dims but `dim`, grad_g = s / norm and
    grad_v = (g / norm) * (grad_w - v * s / norm^2); half types in float32, rounded once."""
    gw, v, g, norms = (env(imp, a) for a in node.args[:4])
    dim, nd = arg(node, 4, "dim"), len(shape(v))
    if dim not in (0, nd - 1):  # ATen's kernel takes no other (weight_norm computes the rest unfused)
        raise NotImplementedError(f"_weight_norm_interface_backward over dim {dim} of a {nd}-d weight")
    dts = (dtype(v), dtype(g))
    acc = accumulation(dtype(v))
    gw, v, g, norms = (cast(imp, t, acc) for t in (gw, v, g, norms))
    s = emit(imp, op.sum(op.multiply(gw, v), axis=[d for d in range(nd) if d != dim], keepdims=True))
    gg = op.divide(s, norms)
    gv = op.multiply(op.divide(g, norms), op.subtract(gw, op.multiply(v, op.divide(s, op.multiply(norms, norms)))))
    return tuple_out(imp, node, [to_dtype(imp, emit(imp, x), dt) for x, dt in zip((gv, gg), dts)])


@rule("native_batch_norm_backward.default")
def native_batch_norm_backward(imp, node):
    go = env(imp, node.args[0])
    x = env(imp, node.args[1])
    w = env(imp, arg(node, 2, "weight"))
    rm = env(imp, arg(node, 3, "running_mean"))
    rv = env(imp, arg(node, 4, "running_var"))
    save_mean = env(imp, arg(node, 5, "save_mean"))
    save_invstd = env(imp, arg(node, 6, "save_invstd"))
    train = arg(node, 7, "train")
    eps = arg(node, 8, "eps")
    mask = _mask(node, 9, "output_mask", 3)
    # float16/bfloat16 in float32, each gradient rounded once (PyTorch's CPU kernel); the saved
    # statistics may come in float32 beside a bfloat16 input
    dts = [dtype(x), dtype(w) if w is not None else None, dtype(w) if w is not None else None]
    dt = accumulation(dtype(x))
    go, x, w, rm, rv, save_mean, save_invstd = (None if t is None else cast(imp, t, dt)
                                                for t in (go, x, w, rm, rv, save_mean, save_invstd))
    nd = len(shape(x))
    axes = [0] + list(range(2, nd))

    def bc(v):
        return emit(imp, op.reshape(v, [-1] + [1] * (nd - 2)))

    if train:
        mean, invstd = save_mean, save_invstd
    else:
        mean = rm
        invstd = emit(imp, op.rsqrt(op.add(rv, scalar(eps, dt))))
    xhat = emit(imp, op.multiply(op.subtract(x, bc(mean)), bc(invstd)))
    gi = gw = gb = None
    wv = bc(w) if w is not None else None
    if mask[0]:
        scale = op.multiply(bc(invstd), wv) if wv is not None else bc(invstd)
        if train:
            m1 = op.mean(go, axis=axes, keepdims=True)
            m2 = op.mean(op.multiply(go, xhat), axis=axes, keepdims=True)
            gi = emit(imp, op.multiply(scale, op.subtract(op.subtract(go, m1), op.multiply(xhat, m2))))
        else:
            gi = emit(imp, op.multiply(go, scale))
    if mask[1]:
        gw = emit(imp, op.sum(op.multiply(go, xhat), axis=axes))
    if mask[2]:
        gb = emit(imp, op.sum(go, axis=axes))
    grads = [None if g is None else to_dtype(imp, g, out_meta(node, i)[1] if out_meta(node, i) else want)
             for i, (g, want) in enumerate(zip((gi, gw, gb), dts))]
    return tuple_out(imp, node, grads)


# ---- embedding --------------------------------------------------------------------------------
@rule("embedding_dense_backward.default")
def embedding_dense_backward(imp, node):
    g = env(imp, node.args[0])
    idx = env(imp, node.args[1])
    num_weights = arg(node, 2, "num_weights")
    padding_idx = arg(node, 3, "padding_idx")
    by_freq = arg(node, 4, "scale_grad_by_freq")
    D = shape(g)[-1]
    M = 1
    for s in shape(idx):
        M *= s
    dt = dtype(g)
    flat = emit(imp, op.reshape(cast(imp, idx, "int64"), [M]))
    rows = emit(imp, op.reshape(g, [M, D]))
    if padding_idx is not None and padding_idx >= 0:
        keep = op.expand_dims(op.not_equal(flat, relax.const(padding_idx, "int64")), -1)
        rows = emit(imp, op.where(keep, rows, op.zeros_like(rows)))
    flat = bounds.index(imp, flat, num_weights)
    if by_freq:
        # PyTorch scales each row by 1 / count converted to the gradient's dtype (counted in float32:
        # a bfloat16 count is exact only up to 256)
        acc = "float64" if dt == "float64" else "float32"
        ones = op.ones(relax.ShapeExpr([M]), acc)
        counts = emit(imp, op.scatter_elements(zeros(imp, [num_weights], acc), flat, ones, axis=0, reduction="add"))
        scale = to_dtype(imp, emit(imp, op.divide(scalar(1.0, acc), op.take(counts, flat, axis=0))), dt)
        rows = emit(imp, op.multiply(rows, op.expand_dims(scale, -1)))
    index = emit(imp, op.broadcast_to(op.expand_dims(flat, -1), relax.ShapeExpr([M, D])))
    return emit(imp, op.scatter_elements(zeros(imp, [num_weights, D], dt), index, rows, axis=0, reduction="add"))
