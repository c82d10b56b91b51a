"""Reverse mode inside Relax: vector-Jacobian products of converted forwards.

`relax.transform.Gradient` differentiates a function with a scalar result
with respect to some of its parameters, using each op's `FPrimalGradient`
attribute. A forward with tensor outputs `outs` and incoming gradients `g`
is differentiated through the scalar `sum_i sum(outs[i] * g[i])`, whose
gradient is exactly the vector-Jacobian product autograd asks for.

TVM ships gradient rules for about 50 ops; the ones below fill the gaps
that common models (LeNet, transformer blocks) reach. Each rule has the
signature of TVM's own: `(orig_var, orig_call, output_grad, bb) -> [partials]`.
"""
import math

import numpy as np

import tvm
from tvm import relax
from tvm.relax.op import register_gradient
from tvm.relax.op import _op_gradient  # noqa: F401  (TVM's rules, registered on import)

from .inline import inline

op = relax.op


def _shape(e):
    return [int(s) for s in e.ty.shape]


def _dtype(e):
    return str(e.ty.dtype)


def _const(v, like):
    return relax.const(v, _dtype(like))


def _fit(bb, grad, like):
    """Sum a broadcast gradient back to the shape of `like`."""
    if _shape(bb.normalize(grad)) != _shape(like):
        return op.collapse_sum_to(grad, like.ty.shape)
    return grad


def _has_gradient(name):
    return tvm.ir.Op.get(name).get_attr("FPrimalGradient") is not None


def _register(name):
    """Register a rule unless TVM already has one for `name`."""

    def deco(fn):
        if not _has_gradient(name):
            register_gradient(name, fn)
        return fn

    return deco


# Ops whose output is piecewise constant in their inputs, or not a float at all: zero gradient
# everywhere it exists, as PyTorch defines it (floor, round, sign...). Relax's Gradient still asks
# for a rule when such an op's output feeds a differentiated value (a Llama's rotary positions:
# arange -> cos/sin -> multiplied into q and k).
_CONSTANT_GRADIENT = ("relax.arange", "relax.argmax", "relax.argmin", "relax.logical_and", "relax.logical_or",
                      "relax.logical_not", "relax.isnan", "relax.isinf", "relax.isfinite", "relax.floor",
                      "relax.ceil", "relax.round", "relax.sign", "relax.trunc", "relax.floor_divide",
                      "relax.one_hot", "relax.hamming_window")


def _zero_gradient(orig_var, orig_call, output_grad, bb):
    return [op.grad.no_grad(arg) for arg in orig_call.args]


for _name in _CONSTANT_GRADIENT:
    _register(_name)(_zero_gradient)


@_register("relax.flatten")
def _flatten_grad(orig_var, orig_call, output_grad, bb):
    return [op.reshape(output_grad, orig_call.args[0].ty.shape)]


@_register("relax.squeeze")
def _squeeze_grad(orig_var, orig_call, output_grad, bb):
    return [op.reshape(output_grad, orig_call.args[0].ty.shape)]


def _ints(expr):
    fields = expr.fields if hasattr(expr, "fields") else expr.values
    return [int(f.value) if hasattr(f, "value") else int(f) for f in fields]


@_register("relax.stack")
def _stack_grad(orig_var, orig_call, output_grad, bb):
    # The gradient of each stacked tensor is its slice of the output's: split along the new axis
    # (GPT-J's rotary embedding stacks the rotated halves).
    n = len(orig_call.args[0].ty.fields)
    axis = int(orig_call.attrs.axis) % len(_shape(orig_var))
    parts = bb.normalize(op.split(output_grad, n, axis))
    return [relax.Tuple([op.squeeze(relax.TupleGetItem(parts, i), [axis]) for i in range(n)])]


@_register("relax.tile")
def _tile_grad(orig_var, orig_call, output_grad, bb):
    # The sum of the gradients of every copy: the output read as (copies, size) per dim, summed
    # over the copies (DeBERTa repeats its relative positions per head).
    x = orig_call.args[0]
    shape, reps = _shape(x), [int(r) for r in orig_call.attrs.repeats]
    nd = max(len(shape), len(reps))
    full, reps = [1] * (nd - len(shape)) + shape, [1] * (nd - len(reps)) + reps
    g = op.reshape(output_grad, [v for r, n in zip(reps, full) for v in (r, n)])
    return [op.reshape(op.sum(g, axis=[2 * d for d in range(nd)]), shape)]


@_register("relax.gather_elements")
def _gather_elements_grad(orig_var, orig_call, output_grad, bb):
    # Each gathered element's gradient added back where it was read (DeBERTa's relative-position
    # scores), duplicates accumulating. TVM's scatter kernel walks each fiber along the axis
    # serially, but reads the indices' other dims as the data's: they must be the same sizes.
    x, indices = orig_call.args
    axis = int(orig_call.attrs.axis) % len(_shape(x))
    xs, ids = _shape(x), _shape(indices)
    if [n for d, n in enumerate(xs) if d != axis] != [n for d, n in enumerate(ids) if d != axis]:
        raise NotImplementedError(f"gradient of gather_elements of {xs} at indices {ids} along axis {axis}")
    zeros = op.zeros(x.ty.shape, _dtype(x))
    return [op.scatter_elements(zeros, indices, output_grad, axis, reduction="add"), op.grad.no_grad(indices)]


@_register("relax.nn.conv1d")
def _conv1d_grad(orig_var, orig_call, output_grad, bb):
    # Whisper's and ConvBERT's 1-d convolutions (a depthwise one among them).
    a = orig_call.attrs
    if (str(a.data_layout), str(a.kernel_layout), str(a.out_layout)) != ("NCW", "OIW", "NCW"):
        raise NotImplementedError(f"gradient of conv1d with layouts {a.data_layout}, {a.kernel_layout}")
    x, w = orig_call.args
    (stride,), (dilation,), (left, right) = ([int(v) for v in vs] for vs in (a.strides, a.dilation, a.padding))
    groups = int(a.groups)
    n, c, size = _shape(x)
    o, _, k = _shape(w)
    length = _shape(orig_var)[2]
    # The input's gradient: the transposed convolution of g, cropped to the input's length
    # (the crop at the end given as padding, and zeros past the last window's reach:
    # Relax's output padding must stay below the stride).
    full = (length - 1) * stride + dilation * (k - 1) + 1
    after = max(full - left - size, 0)
    dx = bb.normalize(op.nn.conv1d_transpose(output_grad, w, strides=stride, padding=(left, after),
                                             dilation=dilation, groups=groups))
    short = size - _shape(dx)[2]
    if short:
        dx = op.nn.pad(dx, [0, 0, 0, 0, 0, short])
    # The weight's gradient: a convolution of the input (channels as the batch, per group) with g
    # as the kernel, strides and dilation swapped, in 2-d over height-1 images, as TVM's conv2d rule.
    data = op.expand_dims(x, 2)
    if groups != 1:
        data = op.reshape(op.permute_dims(op.reshape(data, (n, groups, c // groups, 1, size)), [1, 0, 2, 3, 4]),
                          (groups * n, c // groups, 1, size))
    dw = bb.normalize(op.nn.conv2d(data, op.expand_dims(output_grad, 2), strides=(1, dilation),
                                   padding=(0, left, 0, right), dilation=(1, stride), groups=groups,
                                   data_layout="CNHW", kernel_layout="IOHW", out_layout="CNHW"))
    if _shape(dw)[3] > k:
        dw = op.strided_slice(dw, [3], [0], [k])
    return [dx, op.reshape(dw, [o, c // groups, k])]


@_register("relax.nn.pad")
def _pad_grad(orig_var, orig_call, output_grad, bb):
    # A constant pad's gradient is the output's gradient where the input sits (MobileBERT's and
    # ConvBERT's shifted copies of the sequence). Reflected or replicated borders would add up
    # several outputs' gradients in one input element: no rule for them.
    x = orig_call.args[0]
    widths = [int(w) for w in orig_call.attrs.pad_width]
    if str(orig_call.attrs.pad_mode) != "constant" or min(widths) < 0:
        raise NotImplementedError(f"gradient of a {orig_call.attrs.pad_mode} pad with widths {widths}")
    shape = _shape(x)
    axes = list(range(len(shape)))
    begins = [widths[2 * a] for a in axes]
    return [op.strided_slice(output_grad, axes, begins, [b + n for b, n in zip(begins, shape)])]


@_register("relax.strided_slice")
def _strided_slice_grad(orig_var, orig_call, output_grad, bb):
    """Put the gradient back where the slice came from: interleave zeros for steps, pad around."""
    x = orig_call.args[0]
    axes, begins = _ints(orig_call.args[1]), _ints(orig_call.args[2])
    strides = _ints(orig_call.args[4]) if len(orig_call.args) > 4 else [1] * len(axes)
    shape, out_shape = _shape(x), _shape(orig_var)
    g = output_grad
    for ax, b, step in zip(axes, begins, strides):
        ax %= len(shape)
        n, m = shape[ax], out_shape[ax]
        if step < 1:
            raise NotImplementedError("gradient of a slice with a negative step")
        b = min(max(b + n if b < 0 else b, 0), n)
        length = m
        if step > 1 and m > 0:
            g = op.expand_dims(g, ax + 1)
            pad = [0] * (2 * (len(shape) + 1))
            pad[2 * (ax + 1) + 1] = step - 1
            g = op.nn.pad(g, pad)
            cur = _shape(bb.normalize(g))
            g = op.reshape(g, cur[:ax] + [m * step] + cur[ax + 2 :])
            length = min(m * step, n - b)
            g = op.strided_slice(g, [ax], [0], [length])
        pad = [0] * (2 * len(shape))
        pad[2 * ax], pad[2 * ax + 1] = b, n - b - length
        g = op.nn.pad(g, pad)
    return [g, op.grad.no_grad(orig_call.args[1]), op.grad.no_grad(orig_call.args[2]),
            op.grad.no_grad(orig_call.args[3])] + ([op.grad.no_grad(orig_call.args[4])] if len(orig_call.args) > 4 else [])


@_register("relax.nn.gelu")
def _gelu_grad(orig_var, orig_call, output_grad, bb):
    # d/dx x*Phi(x) = Phi(x) + x*phi(x)
    x = orig_call.args[0]
    if _dtype(x) == "float32":
        # Phi(x) from the forward's own output, gelu(x) / x: erf is a scalar libm call an element
        # on CPU, which dominates the scripted GPT's GELU gradients; a division vectorizes. Near 0, where that is 0/0, Phi(x) = 1/2 + x phi(0) to float32's precision
        # (the next term, x^3 / (6 sqrt(2 pi)), is below 7e-11 there).
        near0 = op.less(op.abs(x), _const(1e-3, x))
        cdf = op.where(near0, op.add(_const(0.5, x), op.multiply(x, _const(1 / math.sqrt(2 * math.pi), x))),
                       op.divide(orig_var, x))
    else:
        cdf = op.multiply(_const(0.5, x), op.add(_const(1.0, x), op.erf(op.multiply(x, _const(1 / math.sqrt(2), x)))))
    pdf = op.multiply(_const(1 / math.sqrt(2 * math.pi), x), op.exp(op.multiply(_const(-0.5, x), op.multiply(x, x))))
    return [op.multiply(output_grad, op.add(cdf, op.multiply(x, pdf)))]


@_register("relax.nn.gelu_tanh")
def _gelu_tanh_grad(orig_var, orig_call, output_grad, bb):
    x = orig_call.args[0]
    k, c = math.sqrt(2 / math.pi), 0.044715
    x3 = op.multiply(op.multiply(x, x), x)
    t = op.tanh(op.multiply(_const(k, x), op.add(x, op.multiply(_const(c, x), x3))))
    dt = op.multiply(
        op.subtract(_const(1.0, x), op.multiply(t, t)),
        op.multiply(_const(k, x), op.add(_const(1.0, x), op.multiply(_const(3 * c, x), op.multiply(x, x)))),
    )
    d = op.add(op.multiply(_const(0.5, x), op.add(_const(1.0, x), t)), op.multiply(op.multiply(_const(0.5, x), x), dt))
    return [op.multiply(output_grad, d)]


@_register("relax.erf")
def _erf_grad(orig_var, orig_call, output_grad, bb):
    x = orig_call.args[0]
    d = op.multiply(_const(2 / math.sqrt(math.pi), x), op.exp(op.negative(op.multiply(x, x))))
    return [op.multiply(output_grad, d)]


@_register("relax.rsqrt")
def _rsqrt_grad(orig_var, orig_call, output_grad, bb):
    # d x^-1/2 = -1/2 x^-3/2 = -1/2 y^3
    y = orig_var
    return [op.multiply(output_grad, op.multiply(_const(-0.5, y), op.multiply(op.multiply(y, y), y)))]


@_register("relax.square")
def _square_grad(orig_var, orig_call, output_grad, bb):
    x = orig_call.args[0]
    return [op.multiply(output_grad, op.multiply(_const(2.0, x), x))]


@_register("relax.nn.layer_norm")
def _layer_norm_grad(orig_var, orig_call, output_grad, bb):
    x, gamma, beta = orig_call.args[:3]
    axes = [int(a) % len(_shape(x)) for a in orig_call.attrs.axes]
    eps = float(orig_call.attrs.epsilon)
    xc = bb.normalize(op.subtract(x, op.mean(x, axes, keepdims=True)))
    rstd = bb.normalize(op.rsqrt(op.add(op.mean(op.multiply(xc, xc), axes, keepdims=True), _const(eps, x))))
    xhat = bb.normalize(op.multiply(xc, rstd))
    g = bb.normalize(op.multiply(output_grad, gamma))
    # dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), means over the normalized axes
    dx = op.multiply(
        rstd,
        op.subtract(
            op.subtract(g, op.mean(g, axes, keepdims=True)),
            op.multiply(xhat, op.mean(op.multiply(g, xhat), axes, keepdims=True)),
        ),
    )
    lead = [i for i in range(len(_shape(x))) if i not in axes]
    dgamma = op.multiply(output_grad, xhat)
    dbeta = output_grad
    if lead:
        dgamma, dbeta = op.sum(dgamma, lead), op.sum(dbeta, lead)
    return [dx, _fit(bb, dgamma, gamma), _fit(bb, dbeta, beta)]


@_register("relax.nn.group_norm")
def _group_norm_grad(orig_var, orig_call, output_grad, bb):
    # Layer norm's gradient within each group (wav2vec2's feature encoder): the channel axis split
    # into (groups, channels per group), normalized over the latter and `axes`.
    x, gamma, beta = orig_call.args
    a = orig_call.attrs
    shape = _shape(x)
    nd, ca, groups = len(shape), int(a.channel_axis) % len(shape), int(a.num_groups)
    c = shape[ca]
    grouped = shape[:ca] + [groups, c // groups] + shape[ca + 1:]
    axes = [ca + 1] + [d + 1 if d > ca else d for d in (int(v) % nd for v in a.axes)]
    eps = float(a.epsilon)
    xg = bb.normalize(op.reshape(x, grouped))
    xc = bb.normalize(op.subtract(xg, op.mean(xg, axes, keepdims=True)))
    rstd = bb.normalize(op.rsqrt(op.add(op.mean(op.multiply(xc, xc), axes, keepdims=True), _const(eps, x))))
    xhat = bb.normalize(op.multiply(xc, rstd))
    go = bb.normalize(op.reshape(output_grad, grouped))
    per_channel = [1] * ca + [groups, c // groups] + [1] * (nd - ca - 1)
    g = bb.normalize(op.multiply(go, op.reshape(gamma, per_channel))) if a.scale else go
    dx = op.multiply(rstd, op.subtract(op.subtract(g, op.mean(g, axes, keepdims=True)),
                                       op.multiply(xhat, op.mean(op.multiply(g, xhat), axes, keepdims=True))))
    others = [d for d in range(nd) if d != ca]
    dgamma = op.sum(op.multiply(output_grad, op.reshape(xhat, shape)), others) if a.scale else op.zeros_like(gamma)
    dbeta = op.sum(output_grad, others) if a.center else op.zeros_like(beta)
    return [op.reshape(dx, shape), dgamma, dbeta]


def attention_probs(bb, q, k, v, attrs):
    """(qt, kt, vt, p) for attention(q, k, v) of relax.nn.attention's (batch, seq, head, dim)
    layout: q, k, v as (batch, head, seq, dim) and p = softmax(q k^T * scale [+ causal mask]).

    The forward's expansion (simplify.expand_attention) and the gradient below build p with
    this same function, so CSE keeps one copy of it per attention."""
    sq, sk = _shape(q)[1], _shape(k)[1]
    scale = attention_scale(q, attrs)
    qt, kt, vt = (bb.normalize(op.permute_dims(x, _BHSD)) for x in (q, k, v))
    scores = op.multiply(op.matmul(qt, _swap_last(kt)), _const(scale, q))
    causal = attrs.causal_mask
    if causal is not None:
        offset = 0 if str(causal) == "TopLeft" else sk - sq
        keep = np.tril(np.ones((sq, sk), dtype=bool), k=offset)
        scores = op.where(relax.const(keep), scores, _const(float("-inf"), q))
    return qt, kt, vt, bb.normalize(op.nn.softmax(scores, axis=-1))


def attention_scale(q, attrs) -> float:
    return float(attrs.scale) if attrs.scale is not None else 1.0 / math.sqrt(_shape(q)[3])


_BHSD = [0, 2, 1, 3]  # (batch, seq, head, dim) <-> (batch, head, seq, dim)


def _swap_last(x):
    return op.permute_dims(x, [0, 1, 3, 2])


def attention_expandable(call) -> bool:
    """Whether `call` (relax.nn.attention) is one `attention_probs` covers: no bias, no window."""
    return len(call.args) == 3 and call.attrs.window_size is None


@_register("relax.nn.attention")
def _attention_grad(orig_var, orig_call, output_grad, bb):
    if not attention_expandable(orig_call):
        raise NotImplementedError("gradient of attention with a bias or a window")
    q = orig_call.args[0]
    qt, kt, vt, p = attention_probs(bb, *orig_call.args, orig_call.attrs)
    do = bb.normalize(op.permute_dims(output_grad, _BHSD))
    scale = attention_scale(q, orig_call.attrs)
    dv = op.matmul(_swap_last(p), do)
    dp = bb.normalize(op.matmul(do, _swap_last(vt)))
    ds = bb.normalize(op.multiply(p, op.subtract(dp, op.sum(op.multiply(dp, p), axis=-1, keepdims=True))))
    dq = op.multiply(op.matmul(ds, kt), _const(scale, q))
    dk = op.multiply(op.matmul(_swap_last(ds), qt), _const(scale, q))
    return [op.permute_dims(g, _BHSD) for g in (dq, dk, dv)]


@register_gradient("relax.nn.relu", level=11)  # overrides TVM's where(x < 0, 0, g)
def _relu_grad(orig_var, orig_call, output_grad, bb):
    # PyTorch's threshold_backward(g, relu(x), 0): 0 where the output is <= 0, so at x = 0 too
    # (TVM passed g there), and g where x is NaN.
    x = orig_call.args[0]
    return [op.where(op.less_equal(x, _const(0, x)), _const(0, x), output_grad)]


@register_gradient("relax.matmul", level=11)  # overrides TVM's for a batched input times a matrix
def _matmul_grad(orig_var, orig_call, output_grad, bb):
    # x (..., K) @ w (K, N), a linear layer: TVM's rule makes w's gradient a batched
    # x^T @ g (..., K, N) and sums it over the batch dims afterwards (collapse_sum: a large,
    # unscheduled reduction besides the batched matmuls). As one 2-d product
    # of the flattened rows, x2^T @ g2, it is a single matmul with nothing to sum.
    a, b = orig_call.args
    acc = orig_call.attrs.out_dtype
    acc = _dtype(a) if acc is None or str(acc) in ("", "void") else str(acc)
    if acc != _dtype(a):
        # a half-precision product accumulated in float32: so are its gradients, then rounded
        wide = bb.normalize(op.matmul(op.astype(a, acc), op.astype(b, acc)))
        return [op.astype(g, _dtype(x)) for g, x in zip(_matmul_grad(orig_var, wide, output_grad, bb), (a, b))]
    if len(_shape(a)) <= 2 or len(_shape(b)) != 2:
        return _op_gradient.matmul_grad(orig_var, orig_call, output_grad, bb)
    k, n = _shape(b)
    a2 = op.reshape(a, [-1, k])
    g2 = op.reshape(output_grad, [-1, n])
    return [op.matmul(output_grad, op.permute_dims(b, [1, 0])), op.matmul(op.permute_dims(a2, [1, 0]), g2)]


@register_gradient("relax.where", level=11)  # overrides TVM's, which leaves a broadcast branch's gradient broadcast
def _where_grad(orig_var, orig_call, output_grad, bb):
    # T5's attention mask: where(mask (1, h, q, k), scores (b, h, q, k), -inf); each branch's
    # gradient is summed back over the dims it was broadcast along.
    cond, x, y = orig_call.args
    zero = _const(0, orig_var)
    return [op.grad.no_grad(cond), _fit(bb, op.where(cond, output_grad, zero), x),
            _fit(bb, op.where(cond, zero, output_grad), y)]


@register_gradient("relax.maximum", level=11)  # overrides TVM's, which gives a tie's gradient to x alone
def _maximum_grad(orig_var, orig_call, output_grad, bb):
    return _extremum_grad(orig_call, output_grad, bb, op.less)


@register_gradient("relax.minimum", level=11)
def _minimum_grad(orig_var, orig_call, output_grad, bb):
    return _extremum_grad(orig_call, output_grad, bb, op.greater)


def _extremum_grad(orig_call, output_grad, bb, loses):
    # PyTorch's maximum/minimum backward: where(x == y, g / 2, g), zeroed where the operand
    # loses (so g / 2 to each at a tie, and g to both where a NaN makes every comparison false).
    x, y = orig_call.args
    half = bb.normalize(op.multiply(output_grad, _const(0.5, output_grad)))
    zero = _const(0, output_grad)
    tie = bb.normalize(op.equal(x, y))
    gx = op.where(tie, half, op.where(loses(x, y), zero, output_grad))
    gy = op.where(tie, half, op.where(loses(y, x), zero, output_grad))
    return [_fit(bb, gx, x), _fit(bb, gy, y)]


@register_gradient("relax.take", level=11)  # overrides TVM's, whose kernel needs 1-d indices
def _take_grad(orig_var, orig_call, output_grad, bb):
    x, indices = orig_call.args[0], orig_call.args[1]
    axis = orig_call.attrs.axis
    rank = len(indices.ty.shape)
    if rank == 1:
        return _op_gradient.take_grad(orig_var, orig_call, output_grad, bb)
    if rank > 1 or axis is None:  # (Whisper's positions): the indices flattened, and the gradient's dims they made
        n = math.prod(_shape(indices))
        flat = op.reshape(indices, [n])
        if axis is None:
            g = op.reshape(output_grad, [n])
        else:
            axis = int(axis) % len(_shape(x))
            g = op.reshape(output_grad, _shape(x)[:axis] + [n] + _shape(x)[axis + 1:])
        return [op.grad.take_backward(g, x, flat, axis), op.grad.no_grad(indices)]
    axis = int(axis) % len(_shape(x))
    g = op.expand_dims(output_grad, axis)
    if isinstance(indices, tvm.ir.expr.Constant):  # x[..., i, ...] (select): pad the gradient around i
        n, i = _shape(x)[axis], int(indices.value.numpy())
        i %= n
        pad = [0] * (2 * len(_shape(x)))
        pad[2 * axis], pad[2 * axis + 1] = i, n - 1 - i
        return [op.nn.pad(g, pad), op.grad.no_grad(indices)]
    flat = op.reshape(indices, [1])
    return [op.grad.take_backward(g, x, flat, axis), op.grad.no_grad(indices)]


@register_gradient("relax.nn.avg_pool2d", level=11)  # overrides TVM's, wrong for a window past the padding
def _avg_pool2d_grad(orig_var, orig_call, output_grad, bb):
    # Each output spreads g / (its divisor) over its window, with PyTorch's divisors: a ceil_mode
    # window that runs past the padding counts only up to it (TVM's rule divided by the whole
    # window there, with count_include_pad). The spreading is a transposed convolution of each
    # plane with a window of ones, cropped to the input.
    a = orig_call.attrs
    x = orig_call.args[0]
    n, c, h, w = _shape(x)
    ho, wo = _shape(orig_var)[2:]
    (kh, kw), (sh, sw) = [int(v) for v in a.pool_size], [int(v) for v in a.strides]
    pt, pl, pb, pr = [int(v) for v in a.padding]
    if str(a.layout) != "NCHW" or [int(v) for v in a.dilation] != [1, 1] or (pt, pl) != (pb, pr):
        raise NotImplementedError("gradient of avg_pool2d other than NCHW, undilated, symmetric padding")
    rows = _window_sizes(ho, h, kh, sh, pt, a.count_include_pad)
    cols = _window_sizes(wo, w, kw, sw, pl, a.count_include_pad)
    divisor = relax.const(np.outer(rows, cols).astype(_dtype(x)))
    planes = op.reshape(op.divide(output_grad, divisor), [n * c, 1, ho, wo])
    ones = relax.const(np.ones((1, 1, kh, kw), _dtype(x)))
    full = bb.normalize(op.nn.conv2d_transpose(planes, ones, strides=(sh, sw)))  # the padded input's frame
    fh, fw = _shape(full)[2:]
    crop = op.strided_slice(full, [2, 3], [pt, pl], [min(pt + h, fh), min(pl + w, fw)])
    short_h, short_w = max(pt + h - fh, 0), max(pl + w - fw, 0)  # rows/columns no window reaches
    if short_h or short_w:
        crop = op.nn.pad(crop, [0, 0, 0, 0, 0, short_h, 0, short_w])
    return [op.reshape(crop, [n, c, h, w])]


def _window_sizes(outs, size, k, stride, pad, count_include_pad):
    """PyTorch's avg-pool divisor along one dim: each window clipped to the padded input, and to
    the input itself without count_include_pad."""
    sizes = []
    for o in range(outs):
        start = o * stride - pad
        end = min(start + k, size + pad)
        if not count_include_pad:
            start, end = max(start, 0), min(end, size)
        sizes.append(end - start)
    return np.array(sizes)


@_register("relax.nn.adaptive_avg_pool2d")
def _adaptive_avg_pool2d_grad(orig_var, orig_call, output_grad, bb):
    # Window o of a dim spans [floor(o * in / out), ceil((o + 1) * in / out)) (PyTorch's split);
    # each output spreads g / (its window's area) over it: per plane, S_h @ (g / area) @ S_w^T
    # with S[i, o] = 1 where window o covers position i.
    a = orig_call.attrs
    x = orig_call.args[0]
    if str(a.layout) != "NCHW" or str(a.out_layout) != "NCHW":
        raise NotImplementedError("gradient of adaptive_avg_pool2d other than NCHW")
    h, w = _shape(x)[2:]
    ho, wo = _shape(orig_var)[2:]
    spread_h, spread_w = _adaptive_spread(h, ho, _dtype(x)), _adaptive_spread(w, wo, _dtype(x))
    area = np.outer(spread_h.sum(0), spread_w.sum(0)).astype(_dtype(x))
    scaled = op.divide(output_grad, relax.const(area))
    return [op.matmul(op.matmul(relax.const(spread_h), scaled), relax.const(np.ascontiguousarray(spread_w.T)))]


@_register("relax.nn.adaptive_avg_pool1d")
def _adaptive_avg_pool1d_grad(orig_var, orig_call, output_grad, bb):
    # As the 2-d rule, along one dim: (g / window size) @ S^T (Swin's final pool over tokens).
    a = orig_call.attrs
    x = orig_call.args[0]
    if str(a.layout) != "NCW" or str(a.out_layout) != "NCW":
        raise NotImplementedError("gradient of adaptive_avg_pool1d other than NCW")
    spread = _adaptive_spread(_shape(x)[2], _shape(orig_var)[2], _dtype(x))
    scaled = op.divide(output_grad, relax.const(spread.sum(0)))
    return [op.matmul(scaled, relax.const(np.ascontiguousarray(spread.T)))]


def _adaptive_spread(size, outs, dtype):
    """(size, outs) matrix of ones where adaptive window o covers position i."""
    spread = np.zeros((size, outs), dtype)
    for o in range(outs):
        spread[o * size // outs: -(-(o + 1) * size // outs), o] = 1
    return spread


@_register("relax.bitwise_not")
def _bitwise_not_grad(orig_var, orig_call, output_grad, bb):
    # of an integer or bool tensor (~mask): nothing to differentiate
    return [op.grad.no_grad(orig_call.args[0])]


# Activations a scripted model reaches through TVM's rules, with PyTorch's backward formulas
# (at the bounds too: hardtanh's gradient is 0 where x is a bound).
@_register("relax.clip")
def _clip_grad(orig_var, orig_call, output_grad, bb):
    x, lo, hi = orig_call.args
    inside = op.logical_and(op.greater(x, _bound(lo, x)), op.less(x, _bound(hi, x)))
    return [op.where(inside, output_grad, _const(0, x)), op.grad.no_grad(lo), op.grad.no_grad(hi)]


def _bound(value, like):
    """A clip bound (a PrimValue, or the literal it holds) as a constant of `like`'s dtype."""
    while hasattr(value, "value"):
        value = value.value
    return _const(float(value), like)


@_register("relax.nn.leakyrelu")
def _leakyrelu_grad(orig_var, orig_call, output_grad, bb):
    x = orig_call.args[0]
    slope = float(orig_call.attrs.alpha)
    return [op.where(op.greater(x, _const(0, x)), output_grad, op.multiply(output_grad, _const(slope, x)))]


@_register("relax.nn.softplus")
def _softplus_grad(orig_var, orig_call, output_grad, bb):
    # g where beta * x > threshold (softplus is x there), else g * sigmoid(beta * x)
    x = orig_call.args[0]
    beta, threshold = float(orig_call.attrs.beta), float(orig_call.attrs.threshold)
    bx = op.multiply(x, _const(beta, x))
    return [op.where(op.greater(bx, _const(threshold, x)), output_grad, op.multiply(output_grad, op.sigmoid(bx)))]


@_register("relax.nn.prelu")
def _prelu_grad(orig_var, orig_call, output_grad, bb):
    x, w = orig_call.args
    axis = int(orig_call.attrs.axis) % len(_shape(x))
    shape = [1] * len(_shape(x))
    shape[axis] = _shape(w)[0]
    wb = op.reshape(w, shape)
    positive = op.greater(x, _const(0, x))
    gw = op.where(positive, _const(0, x), op.multiply(x, output_grad))
    gw = op.sum(gw, [d for d in range(len(shape)) if d != axis or _shape(w)[0] == 1])
    return [op.where(positive, output_grad, op.multiply(wb, output_grad)), op.reshape(gw, _shape(w))]


@_register("relax.nn.dropout")
def _dropout_grad(orig_var, orig_call, output_grad, bb):
    # TVM's dropout op draws no seed; a scripted dropout multiplies by a keep-mask input instead.
    raise NotImplementedError("gradient of relax.nn.dropout (its random mask cannot be replayed)")


@register_gradient("relax.nn.nll_loss", level=11)  # overrides TVM's, which reads weights[ignore_index]
def _nll_loss_grad(orig_var, orig_call, output_grad, bb):
    # TVM's kernel masks ignore_index only when it is >= 0, and reads the class weight at
    # every target: PyTorch's default ignore_index, -100 (Hugging Face pads labels with it),
    # read out of bounds and counted in the mean. Here an ignored target weighs 0 and is
    # read nowhere: -w[t] * g at the target's class, 0 elsewhere.
    pred, target = orig_call.args[0], orig_call.args[1]
    weights = orig_call.args[2] if len(orig_call.args) == 3 else None
    reduction, ignore = str(orig_call.attrs.reduction), int(orig_call.attrs.ignore_index)
    tdtype = _dtype(target)
    valid = bb.normalize(op.not_equal(target, relax.const(ignore, tdtype)))
    safe = bb.normalize(op.where(valid, target, relax.const(0, tdtype)))
    zero = _const(0.0, pred)
    if weights is None:
        w = op.where(valid, _const(1.0, pred), zero)
    else:
        w = op.where(valid, op.take(weights, safe, axis=0), zero)
    w = bb.normalize(w)
    tshape = _shape(target)
    if reduction == "mean":
        g = op.divide(op.broadcast_to(output_grad, tshape), op.sum(w))
    elif reduction == "sum":
        g = op.broadcast_to(output_grad, tshape)
    else:
        g = output_grad
    coef = op.negative(op.multiply(w, g))
    pshape = _shape(pred)
    classes = op.arange(pshape[1] if len(pshape) > 1 else pshape[0], dtype=tdtype)
    if len(pshape) > 1:  # (N, C, d...): the class axis is 1
        classes = op.reshape(classes, [1, pshape[1]] + [1] * (len(pshape) - 2))
        hot, coef = op.equal(op.expand_dims(safe, 1), classes), op.expand_dims(coef, 1)
    else:
        hot = op.equal(safe, classes)
    grads = [op.where(hot, coef, zero), op.grad.no_grad(target)]
    return grads + ([op.grad.no_grad(weights)] if weights is not None else [])


def _dependent_outputs(fwd: relax.Function, diff: list):
    """Positions of fwd's outputs computed from some parameter in `diff` (None: not known)."""
    live = {fwd.params[i] for i in diff}
    values = {}
    for block in fwd.body.blocks:
        for binding in block.bindings:
            values[binding.var] = binding.value
            if any(v in live for v in relax.analysis.free_vars(binding.value)):
                live.add(binding.var)
    result = fwd.body.body
    result = values.get(result, result) if isinstance(result, relax.Var) else result
    if not isinstance(result, relax.Tuple):
        return None
    return {i for i, f in enumerate(result.fields) if not isinstance(f, relax.Var) or f in live}


def vjp(fwd: relax.Function, diff: list, n_outs: int) -> relax.Function:
    """Return bwd(fwd's params..., grad_outs...) -> (scalar, (grads of params[diff]...)).

    Only fwd's first `n_outs` outputs get incoming gradients; the rest (new buffer
    values) are state, not results, and are dead code in bwd. So are outputs that no
    parameter in `diff` reaches (a gather from a buffer): their gradient is zero, and
    Gradient would refuse their ops if they lack gradient rules.
    """
    dependent = _dependent_outputs(fwd, diff)
    params = [relax.Var(p.name, p.ty) for p in fwd.params]
    out_tys = list(fwd.ret_ty.fields)[:n_outs]
    grads = [relax.Var(f"grad_out{i}", ty) for i, ty in enumerate(out_tys)]
    bb = relax.BlockBuilder()
    with bb.function("bwd", params + grads):
        with bb.dataflow():
            outs = inline(bb, fwd, params)
            # The outputs by their own variables where fwd's result is a tuple literal: then the
            # tuple, and what only it reads (new buffers, index checks), is unused here.
            bound = bb.lookup_binding(outs) if isinstance(outs, relax.Var) else outs
            if isinstance(bound, relax.Tuple):
                outs = bound
            total = None
            for i, (g, ty) in enumerate(zip(grads, out_tys)):
                if not str(ty.dtype).startswith(("float", "bfloat")) or (dependent is not None and i not in dependent):
                    continue
                o = outs.fields[i] if isinstance(outs, relax.Tuple) else bb.emit(relax.TupleGetItem(outs, i))
                s = bb.emit(op.sum(op.multiply(o, g)))
                if str(ty.dtype) != "float32":
                    s = bb.emit(op.astype(s, "float32"))
                total = s if total is None else bb.emit(op.add(total, s))
            if total is None:
                total = bb.emit(relax.const(0.0, "float32"))
            result = bb.emit_output(total)
        bb.emit_func_output(result)
    mod = bb.get()
    # What the loss does not read goes first: the forward's index checks (ops/bounds.py) are
    # reductions without gradient rules, and Gradient refuses any op it meets without one.
    mod["bwd"] = relax.analysis.remove_all_unused(mod["bwd"])
    mod = relax.transform.Gradient("bwd", require_grads=[params[i] for i in diff])(mod)
    return mod["bwd_adjoint"]
