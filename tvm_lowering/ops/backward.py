"""Rules for the backward ops autograd emits on the lazy device: of activations, softmax, losses,
convolution, pooling, normalization and embedding."""
import math
import operator

import torch
from torch import fx
from tvm import relax, te, tirx

from .. import pool_grad
from . import bounds
from .kit import (arg, cast, dtype, emit, emit_te, env, nll_pick, out_meta, pair, pool_window, scalar, scatter_into,
                  shape, to_dtype, tuple_out, zeros)
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
    acc = "float32" if dtype(g) in ("float16", "bfloat16") else dtype(g)
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
def _conv_out_padding(in_size, out_size, k, s, p, d):
    return [i - ((o - 1) * st - 2 * pp + dd * (kk - 1) + 1) for i, o, kk, st, pp, dd in zip(in_size, out_size, k, s, p, d)]


@rule("convolution_backward.default")
def convolution_backward(imp, node):
    g = env(imp, node.args[0])
    x = env(imp, node.args[1])
    w = env(imp, node.args[2])
    stride, padding, dilation = arg(node, 4, "stride"), arg(node, 5, "padding"), arg(node, 6, "dilation")
    transposed = arg(node, 7, "transposed")
    groups = arg(node, 9, "groups")
    mask = _mask(node, 10, "output_mask", 3)
    if transposed:
        raise NotImplementedError("convolution_backward for transposed convolutions")
    nsp = len(shape(x)) - 2
    if nsp not in (1, 2):
        raise NotImplementedError(f"convolution_backward with {nsp} spatial dims")
    stride, padding, dilation = pair(stride, nsp), pair(padding, nsp), pair(dilation, nsp)
    if nsp == 1:  # lift to 2-D with a unit height
        g = emit(imp, op.expand_dims(g, 2))
        x = emit(imp, op.expand_dims(x, 2))
        w = emit(imp, op.expand_dims(w, 2))
        stride, padding, dilation = [1] + stride, [0] + padding, [1] + dilation
    N, C, H, W = shape(x)
    O, Cg, KH, KW = shape(w)
    _, _, Ho, Wo = shape(g)
    G = groups
    grad_in = grad_w = grad_b = None
    if mask[0]:
        # grad_input: transposed conv of grad with the same weight (OIHW read as IOHW).
        opad = _conv_out_padding((H, W), (Ho, Wo), (KH, KW), stride, padding, dilation)
        if all(0 <= op_ < max(s, d) for op_, s, d in zip(opad, stride, dilation)):
            grad_in = emit(
                imp,
                op.nn.conv2d_transpose(
                    g, w, strides=stride, padding=padding, output_padding=opad, dilation=dilation, groups=G
                ),
            )
        else:  # output padding beyond what conv2d_transpose takes: pad the result instead
            opad0 = [min(p, max(s, d) - 1) for p, s, d in zip(opad, stride, dilation)]
            gi = emit(
                imp,
                op.nn.conv2d_transpose(
                    g, w, strides=stride, padding=padding, output_padding=opad0, dilation=dilation, groups=G
                ),
            )
            extra = [a - b for a, b in zip(opad, opad0)]
            grad_in = emit(imp, op.nn.pad(gi, [0, 0, 0, 0, 0, extra[0], 0, extra[1]]))
    if mask[1]:
        # grad_weight[o, c, i, j] = sum_{n,ho,wo} g[n, o, ho, wo] * xpad[n, c, ho*s + i*d, wo*s + j*d]:
        # a conv of x (batch as channels) with g as kernel, stride/dilation swapped.
        xr = emit(imp, op.reshape(x, [N, G, Cg, H, W]))
        xr = emit(imp, op.permute_dims(xr, [2, 1, 0, 3, 4]))
        xr = emit(imp, op.reshape(xr, [Cg, G * N, H, W]))
        gr = emit(imp, op.permute_dims(g, [1, 0, 2, 3]))  # (O, N, Ho, Wo), O = G*Og
        gw = emit(
            imp,
            op.nn.conv2d(xr, gr, strides=dilation, padding=padding, dilation=stride, groups=G),
        )  # (Cg, O, KH', KW')
        gw = emit(imp, op.permute_dims(gw, [1, 0, 2, 3]))
        if shape(gw)[2:] != [KH, KW]:
            gw = emit(imp, op.strided_slice(gw, [2, 3], [0, 0], [KH, KW]))
        grad_w = gw
    if mask[2]:
        grad_b = emit(imp, op.sum(g, axis=[0, 2, 3]))
    if nsp == 1:
        grad_in = None if grad_in is None else emit(imp, op.squeeze(grad_in, [2]))
        grad_w = None if grad_w is None else emit(imp, op.squeeze(grad_w, [2]))
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


@rule("max_pool2d_with_indices_backward.default")
def max_pool2d_with_indices_backward(imp, node):
    g = env(imp, node.args[0])
    x = env(imp, node.args[1])
    idx = env(imp, arg(node, 7, "indices"))
    xs, gs = shape(x), shape(g)
    if _pool_indices_in_window(node):  # a gather, per input element: no zero fill, no scatter
        return emit_te(imp, _pool_grad_gather, g, idx, pair(arg(node, 2, "kernel_size")), xs,
                       primfunc_name_hint="max_pool2d_backward_gather")
    lead = xs[:-2]
    plane = xs[-2] * xs[-1]
    gflat = emit(imp, op.reshape(g, lead + [gs[-2] * gs[-1]]))
    iflat = emit(imp, op.reshape(idx, lead + [gs[-2] * gs[-1]]))
    base = zeros(imp, lead + [plane], dtype(g))
    out = emit(imp, op.scatter_elements(base, iflat, gflat, axis=len(lead), reduction="add"))
    return emit(imp, op.reshape(out, xs))


def _avg_pool_bwd_te(g, H, W, kernel, stride, padding, ceil_mode, count_include_pad, divisor):
    *lead, Ho, Wo = g.shape
    kh, kw = kernel
    sh, sw = stride
    ph, pw = padding
    dt = str(g.dtype)

    def div_of(oh, ow):
        if divisor:
            return tirx.const(divisor, "int32")
        h0, w0 = oh * sh - ph, ow * sw - pw
        h1, w1 = tirx.min(h0 + kh, H + ph), tirx.min(w0 + kw, W + pw)
        if count_include_pad:
            return (h1 - h0) * (w1 - w0)
        return (tirx.min(h1, H) - tirx.max(h0, 0)) * (tirx.min(w1, W) - tirx.max(w0, 0))

    scaled = te.compute(
        g.shape, lambda *i: g[i] / div_of(i[-2], i[-1]).astype(dt), name="avg_pool_scaled"
    )

    def body(*idx):
        lead_idx, h, w = idx[:-2], idx[-2], idx[-1]
        acc = tirx.const(0, dt)
        for i in range(kh):
            nh = h + ph - i
            oh = tirx.floordiv(nh, sh)
            vh = tirx.all(nh >= 0, tirx.floormod(nh, sh) == 0, oh < Ho)
            for j in range(kw):
                nw = w + pw - j
                ow = tirx.floordiv(nw, sw)
                ok = tirx.all(vh, nw >= 0, tirx.floormod(nw, sw) == 0, ow < Wo)
                acc = acc + tirx.if_then_else(ok, scaled[(*lead_idx, oh, ow)], tirx.const(0, dt))
        return acc

    return te.compute((*lead, H, W), body, name="avg_pool2d_backward")


@rule("avg_pool2d_backward.default")
def avg_pool2d_backward(imp, node):
    g = env(imp, node.args[0])
    x = env(imp, node.args[1])
    kernel, stride, padding = pool_window(node, first=2)
    ceil_mode = arg(node, 5, "ceil_mode")
    cip = arg(node, 6, "count_include_pad")
    divisor = arg(node, 7, "divisor_override")
    H, W = shape(x)[-2:]
    return emit_te(imp, _avg_pool_bwd_te, g, H, W, kernel, stride, padding, ceil_mode, cip, divisor)


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
    acc = "float32" if dtype(x) in ("float16", "bfloat16") else dtype(x)
    go, x, mean, rstd, w = (None if t is None else cast(imp, t, acc) for t in (go, x, mean, rstd, w))
    nd, k = len(shape(x)), len(nshape)
    axes = list(range(nd - k, nd))
    batch_axes = list(range(0, nd - k))
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
    dt = dtype(x)
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
    return tuple_out(imp, node, [gi, gw, gb])


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
