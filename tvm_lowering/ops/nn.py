"""Neural-network forward ops: losses, normalization, softmax, matrix products, convolution, pixel shuffle.

Their backward ops are in backward.py, pooling in pooling.py.
"""
import math

import numpy as np
from tvm import relax

from . import bounds
from .kit import accumulation, arg, cast, dtype, emit, env, flatten, nll_pick, out_meta, pair, scalar, shape, to_dtype, zeros
from .registry import rule


# TVM's rules for these return wrong values (an identity for training-mode
# dropout); None removes them. Training-mode dropout never reaches the table:
# ratex/core/random.py records it as ratex::dropout_keep (a mask from ratex::random_bits) and a multiply.
rule("native_dropout.default", "dropout.default")(None)


# TVM's rule is plain bilinear resizing (no antialias filter): wrong whenever the image
# shrinks. None removes it, so the op runs on CPU PyTorch.
rule("_upsample_bilinear2d_aa.default")(None)


# ---- losses -----------------------------------------------------------------------------------
def nll_loss(imp, x, target, weight, reduction, ignore_index, total_shape):
    """(loss, total_weight) of nll_loss on x (N, C) or (C,), the classes on its last dim.

    Unreduced (reduction 0), total_weight is zeros of `total_shape`, as PyTorch leaves it.
    float16/bfloat16 sum in float32, each result rounded once, as PyTorch's CPU kernel does: a
    bfloat16 running sum stops growing at 256 ones, or once a term is under half its step.
    """
    dt = dtype(x)
    acc = accumulation(dt)
    onehot, w_t = nll_pick(imp, (x, target, weight, ignore_index))
    picked = emit(imp, relax.op.sum(relax.op.multiply(x, onehot), axis=[-1]))  # one term: exact in dt
    w_t = cast(imp, w_t, acc)
    losses = emit(imp, relax.op.negative(relax.op.multiply(cast(imp, picked, acc), w_t)))
    if reduction == 0:
        return to_dtype(imp, losses, dt), zeros(imp, total_shape, dt)
    total = emit(imp, relax.op.sum(w_t))
    if reduction == 2:
        return to_dtype(imp, emit(imp, relax.op.sum(losses)), dt), to_dtype(imp, total, dt)
    return to_dtype(imp, emit(imp, relax.op.divide(relax.op.sum(losses), total)), dt), to_dtype(imp, total, dt)


@rule("nll_loss_forward.default")
def nll_loss_forward(imp, node):
    x = env(imp, node.args[0])
    if len(shape(x)) > 2:
        raise NotImplementedError("nll_loss_forward on more than 2 dims")
    out, total = nll_loss(imp, x, env(imp, node.args[1]), env(imp, arg(node, 2, "weight")), arg(node, 3, "reduction", 1),
                          arg(node, 4, "ignore_index", -100), out_meta(node, 1)[0])
    return emit(imp, relax.Tuple([out, total]))


@rule("nll_loss2d_forward.default")
def nll_loss2d_forward(imp, node):
    """nll_loss over (N, C, H, W) scores and (N, H, W) targets: the classes moved last, one row per pixel."""
    x, target = env(imp, node.args[0]), env(imp, node.args[1])
    xs = shape(x)
    if len(xs) != 4:
        raise NotImplementedError(f"nll_loss2d_forward of a {len(xs)}-dim input")
    rows = emit(imp, relax.op.reshape(emit(imp, relax.op.permute_dims(x, [0, 2, 3, 1])), [-1, xs[1]]))
    reduction = arg(node, 3, "reduction", 1)
    out, total = nll_loss(imp, rows, flatten(imp, target), env(imp, arg(node, 2, "weight")), reduction,
                          arg(node, 4, "ignore_index", -100), out_meta(node, 1)[0])
    if reduction == 0:
        out = emit(imp, relax.op.reshape(out, [xs[0], xs[2], xs[3]]))
    return emit(imp, relax.Tuple([out, total]))


@rule("mse_loss.default")
def mse_loss(imp, node):
    x = env(imp, node.args[0])
    t = env(imp, node.args[1])
    reduction = arg(node, 2, "reduction", 1)
    dt = dtype(x)
    acc = accumulation(dt)  # rounded once, summed in float32 (nll_loss)
    d = emit(imp, relax.op.subtract(cast(imp, x, acc), cast(imp, t, acc)))
    sq = emit(imp, relax.op.multiply(d, d))
    if reduction == 0:
        return to_dtype(imp, sq, dt)
    if reduction == 2:
        return to_dtype(imp, emit(imp, relax.op.sum(sq)), dt)
    return to_dtype(imp, emit(imp, relax.op.mean(sq)), dt)


def _multilabel_terms(imp, x, target):
    """(z, live, is_target) of multilabel_margin_loss for x and target of shape (N, C):
    z[n, t, i] = 1 - x[n, target[n, t]] + x[n, i]; live marks the terms that count: t before the
    first negative target (a -1 ends the list), i not listed, z > 0 (a target listed twice counts
    twice, as in PyTorch's kernel); is_target[n, i] is 1 where i is listed."""
    n, c = shape(x)
    tgt = cast(imp, target, "int64")
    bounds.record(imp, tgt, c, 1, low=-1)  # PyTorch: "argument #2 'target' is out of range"
    negative = emit(imp, relax.op.less(tgt, relax.const(0, "int64")))
    ended = emit(imp, relax.op.cumsum(cast(imp, negative, "int32"), axis=1))
    listed = emit(imp, relax.op.equal(ended, relax.const(0, "int32")))
    safe = emit(imp, relax.op.minimum(relax.op.maximum(tgt, relax.const(0, "int64")), relax.const(c - 1, "int64")))
    classes = emit(imp, relax.op.arange(0, c, 1, "int64"))
    onehot = emit(imp, relax.op.logical_and(relax.op.equal(relax.op.expand_dims(safe, -1), classes),
                                            relax.op.expand_dims(listed, -1)))
    is_target = emit(imp, relax.op.astype(relax.op.max(cast(imp, onehot, "int32"), axis=[1]), dtype(x)))
    other = emit(imp, relax.op.equal(is_target, relax.const(0, dtype(is_target))))
    picked = emit(imp, relax.op.gather_elements(x, safe, axis=1))
    z = emit(imp, relax.op.add(relax.op.subtract(relax.const(1, dtype(x)), relax.op.expand_dims(picked, -1)),
                               relax.op.expand_dims(x, 1)))
    live = emit(imp, relax.op.logical_and(
        relax.op.logical_and(relax.op.expand_dims(listed, -1), relax.op.expand_dims(other, 1)),
        relax.op.greater(z, relax.const(0, dtype(x)))))
    return z, live, is_target


def _rows(imp, x):
    """x as (N, C) rows: a 1-D input is one row."""
    return x if len(shape(x)) == 2 else emit(imp, relax.op.reshape(x, [1, -1]))


@rule("multilabel_margin_loss_forward.default")
def multilabel_margin_loss_forward(imp, node):
    """(loss, is_target): per row the sum of 1 - x[target] + x[other] over listed targets and the
    classes not listed, where positive, / C; then the reduction (torch._decomp's is wrong)."""
    x, target = env(imp, node.args[0]), env(imp, node.args[1])
    reduction = arg(node, 2, "reduction", 1)
    if len(shape(x)) not in (1, 2) or 0 in shape(x):
        raise NotImplementedError("multilabel_margin_loss of an empty or 0-dim input")
    rows = _rows(imp, x)
    z, live, is_target = _multilabel_terms(imp, rows, _rows(imp, target))
    dt = dtype(x)
    per_row = emit(imp, relax.op.sum(relax.op.where(live, z, relax.const(0, dt)), axis=[1, 2]))
    per_row = emit(imp, relax.op.divide(per_row, relax.const(shape(rows)[1], dt)))
    loss = (emit(imp, relax.op.mean(per_row)) if reduction == 1 else emit(imp, relax.op.sum(per_row))
            if reduction == 2 else emit(imp, relax.op.reshape(per_row, out_meta(node, 0)[0])))
    is_target = emit(imp, relax.op.reshape(is_target, shape(x)))
    return emit(imp, relax.Tuple([loss, is_target]))


# ---- normalization ----------------------------------------------------------------------------
@rule("native_layer_norm.default")
def native_layer_norm(imp, node):
    """(out, mean, rstd): mean/rstd keep the normalized dims as size 1, as PyTorch does.

    A float16/bfloat16 input is normalized in float32 and the output rounded once, as
    PyTorch's CPU kernel does; its mean and rstd are float32 to PyTorch's shape inference but
    rounded to the input's dtype by its kernel (what autograd saves for the backward): so here.
    """
    x = env(imp, node.args[0])
    nshape = list(node.args[1])
    w = env(imp, arg(node, 2, "weight"))
    b = env(imp, arg(node, 3, "bias"))
    eps = arg(node, 4, "eps", 1e-5)
    dt = dtype(x)
    acc = accumulation(dt)
    x, w, b = (None if t is None else cast(imp, t, acc) for t in (x, w, b))
    axes = list(range(-len(nshape), 0))
    mean = emit(imp, relax.op.mean(x, axis=axes, keepdims=True))
    xc = emit(imp, relax.op.subtract(x, mean))
    var = emit(imp, relax.op.mean(relax.op.multiply(xc, xc), axis=axes, keepdims=True))
    rstd = emit(imp, relax.op.rsqrt(relax.op.add(var, scalar(eps, acc))))
    out = emit(imp, relax.op.multiply(xc, rstd))
    if w is not None:
        out = emit(imp, relax.op.multiply(out, w))
    if b is not None:
        out = emit(imp, relax.op.add(out, b))
    stats = [mean, rstd]
    if acc != dt:
        out = to_dtype(imp, out, dt)
        stats = [cast(imp, to_dtype(imp, t, dt), out_meta(node, i + 1)[1]) for i, t in enumerate(stats)]
    return emit(imp, relax.Tuple([out, *stats]))


def _bn_bcast(imp, v, nd):
    """Reshape a per-channel vector (C,) to broadcast against (N, C, *spatial)."""
    return emit(imp, relax.op.reshape(v, [-1] + [1] * (nd - 2)))


@rule(
    "native_batch_norm.default",
    "_native_batch_norm_legit_no_training.default",
    "_native_batch_norm_legit_functional.default",
    "_native_batch_norm_legit.no_stats",
)
def native_batch_norm(imp, node):
    """(out, save_mean, save_invstd), plus the new running stats for the functional form.

    native_batch_norm's in-place running-stat update is traced separately on the
    lazy path (ratex/core/ops.py); `_native_batch_norm_legit_functional` returns
    them (what a scripted BatchNorm writes back). Built from plain Relax ops, so
    relax.transform.Gradient can differentiate a scripted forward through it.
    """
    name = node.target.__name__
    x = env(imp, node.args[0])
    w = env(imp, arg(node, 1, "weight"))
    b = env(imp, arg(node, 2, "bias"))
    rm = rv = None
    momentum = 0.0
    if name.startswith("_native_batch_norm_legit_no_training"):
        rm, rv = env(imp, node.args[3]), env(imp, node.args[4])
        training, eps = False, arg(node, 6, "eps")
    elif name.startswith("_native_batch_norm_legit.no_stats"):
        training, eps = arg(node, 3, "training"), arg(node, 5, "eps")
    else:
        rm, rv = env(imp, arg(node, 3, "running_mean")), env(imp, arg(node, 4, "running_var"))
        training, momentum, eps = arg(node, 5, "training"), arg(node, 6, "momentum"), arg(node, 7, "eps")
    dt = dtype(x)
    # float16/bfloat16 in float32, rounded once, as PyTorch's CPU kernel; it returns the saved
    # statistics in the parameters' dtype, which its shape inference says is float32.
    param_dt = next((dtype(t) for t in (w, rm) if t is not None), dt)
    acc = accumulation(dt)
    x, w, b, rm, rv = (None if t is None else cast(imp, t, acc) for t in (x, w, b, rm, rv))
    nd = len(shape(x))
    axes = [0] + list(range(2, nd))
    if training:
        mean = emit(imp, relax.op.mean(x, axis=axes))
        xc = emit(imp, relax.op.subtract(x, _bn_bcast(imp, mean, nd)))
        var = emit(imp, relax.op.mean(relax.op.multiply(xc, xc), axis=axes))
        invstd = emit(imp, relax.op.rsqrt(relax.op.add(var, scalar(eps, acc))))
        save_mean, save_invstd = mean, invstd
        if acc != dt and param_dt == dt:
            # PyTorch's CPU kernel normalizes with the statistics it saves, rounded to half
            # precision (a mean of 40 in bfloat16 is off by up to 0.125)
            mean, invstd = (cast(imp, to_dtype(imp, t, dt), acc) for t in (mean, invstd))
            xc = emit(imp, relax.op.subtract(x, _bn_bcast(imp, mean, nd)))
    else:
        if rm is None or rv is None:
            raise NotImplementedError("eval-mode batch norm without running stats")
        xc = emit(imp, relax.op.subtract(x, _bn_bcast(imp, rm, nd)))
        invstd = emit(imp, relax.op.rsqrt(relax.op.add(rv, scalar(eps, acc))))
        # PyTorch CPU returns empty save_mean/save_invstd in eval mode.
        save_mean = zeros(imp, out_meta(node, 1)[0], acc)
        save_invstd = zeros(imp, out_meta(node, 2)[0], acc)
    out = emit(imp, relax.op.multiply(xc, _bn_bcast(imp, invstd, nd)))
    if w is not None:
        out = emit(imp, relax.op.multiply(out, _bn_bcast(imp, w, nd)))
    if b is not None:
        out = emit(imp, relax.op.add(out, _bn_bcast(imp, b, nd)))
    outs = [out, save_mean, save_invstd]
    if name.startswith("_native_batch_norm_legit_functional"):
        if training:
            # The running variance is unbiased, as PyTorch keeps it: var * n / (n - 1).
            n = math.prod(shape(x)) // shape(x)[1]
            unbiased = relax.op.multiply(var, scalar(n / max(n - 1, 1), acc))
            rm = emit(imp, _lerp(rm, save_mean, momentum, acc))
            rv = emit(imp, _lerp(rv, unbiased, momentum, acc))
        outs += [rm, rv]
    if acc != dt:
        outs = [to_dtype(imp, outs[0], dt)] + \
            [cast(imp, to_dtype(imp, t, param_dt) if i in (1, 2) else t, out_meta(node, i)[1]) if t is not None else t
             for i, t in enumerate(outs) if i]
        outs = [to_dtype(imp, t, out_meta(node, i)[1]) if i > 2 else t for i, t in enumerate(outs)]
    return emit(imp, relax.Tuple(outs))


def _lerp(old, new, momentum, dt):
    return relax.op.add(relax.op.multiply(old, scalar(1.0 - momentum, dt)), relax.op.multiply(new, scalar(momentum, dt)))


@rule("native_group_norm.default")
def native_group_norm(imp, node):
    """(out, mean, rstd), mean and rstd of shape (N, group); TVM's rule returns only out."""
    x = env(imp, node.args[0])
    w, b = env(imp, arg(node, 1, "weight")), env(imp, arg(node, 2, "bias"))
    n, c, hw, group, eps = (node.args[i] for i in range(3, 8))
    xs, dt = shape(x), dtype(x)
    grouped = emit(imp, relax.op.reshape(x, [n, group, -1]))
    mean = emit(imp, relax.op.mean(grouped, axis=[2], keepdims=True))
    centered = emit(imp, relax.op.subtract(grouped, mean))
    var = emit(imp, relax.op.mean(relax.op.multiply(centered, centered), axis=[2], keepdims=True))
    rstd = emit(imp, relax.op.rsqrt(relax.op.add(var, relax.const(eps, dt))))
    out = emit(imp, relax.op.reshape(relax.op.multiply(centered, rstd), [n, c, hw]))
    if w is not None:
        out = emit(imp, relax.op.multiply(out, relax.op.reshape(w, [c, 1])))
    if b is not None:
        out = emit(imp, relax.op.add(out, relax.op.reshape(b, [c, 1])))
    out = emit(imp, relax.op.reshape(out, xs))
    stats = [emit(imp, relax.op.reshape(s, [n, group])) for s in (mean, rstd)]
    return emit(imp, relax.Tuple([out, *stats]))


# ---- softmax ----------------------------------------------------------------------------------
@rule("_softmax.default", "_log_softmax.default")
def softmax(imp, node):
    """On a 0-dim tensor: a 1-element vector's softmax (TVM's rule assumes a dim to index)."""
    x = env(imp, node.args[0])
    if shape(x) or dtype(x) != out_meta(node)[1]:
        return imp.tvm_rules[node.target.__name__](node)
    fn = relax.op.nn.softmax if node.target.__name__.startswith("_softmax") else relax.op.nn.log_softmax
    out = emit(imp, fn(emit(imp, relax.op.reshape(x, [1])), axis=0))
    return emit(imp, relax.op.reshape(out, []))


# ---- matrix products (when not sent to the kernel library) ------------------------------------
# TVM's translator gives mm/bmm/addmm a float32 result whatever the inputs (a float64 product
# came back float32) and reads addmm's alpha and beta from keywords only. Half-precision
# products accumulate in float32 and round once, alpha * A @ B + beta * C included, as
# PyTorch's CPU kernels do.
def _matmul(imp, a, b, dt):
    """a @ b in `dt`; half precision: the float32 product, not yet rounded."""
    acc = accumulation(dt)
    return emit(imp, relax.op.matmul(a, b, out_dtype=acc))


@rule("mm.default", "bmm.default")
def matrix_product(imp, node):
    dt = out_meta(node)[1]
    return to_dtype(imp, _matmul(imp, env(imp, node.args[0]), env(imp, node.args[1]), dt), dt)


@rule("addmm.default")
def addmm(imp, node):
    dt = out_meta(node)[1]
    bias, a, b = (env(imp, x) for x in node.args[:3])
    beta, alpha = arg(node, 3, "beta", 1), arg(node, 4, "alpha", 1)
    out = _matmul(imp, a, b, dt)
    acc = dtype(out)
    if alpha != 1:
        out = emit(imp, relax.op.multiply(out, scalar(alpha, acc)))
    if beta != 0:  # else PyTorch ignores the bias, NaN included
        bias = cast(imp, bias, acc)
        if beta != 1:
            bias = emit(imp, relax.op.multiply(bias, scalar(beta, acc)))
        out = emit(imp, relax.op.add(bias, out))
    return to_dtype(imp, out, dt)


@rule("linear.default", script=True)
def linear(imp, node):
    """x @ w.T + b as a scripted model records it (TVM's rule makes every linear float32: a
    float64 one came back float32, a half-precision one failed to add its bias)."""
    x, w, b = env(imp, node.args[0]), env(imp, node.args[1]), env(imp, arg(node, 2, "bias"))
    dt = out_meta(node)[1]
    out = _matmul(imp, x, emit(imp, relax.op.permute_dims(w, [1, 0])), dt)
    if b is not None:
        out = emit(imp, relax.op.add(out, cast(imp, b, dtype(out))))
    return to_dtype(imp, out, dt)


@rule("addbmm.default")
def addbmm(imp, node):
    """beta * input + alpha * sum_b batch1[b] @ batch2[b], the batch sum done by one matmul:
    (n, B*m) @ (B*m, p). beta = 0 ignores input (NaN in it does not propagate), as PyTorch does."""
    inp, b1, b2 = (env(imp, a) for a in node.args[:3])
    beta, alpha = arg(node, 3, "beta", 1), arg(node, 4, "alpha", 1)
    shp, dt = out_meta(node)
    nb, n, m = shape(b1)
    p = shape(b2)[2]
    rows = emit(imp, relax.op.reshape(relax.op.permute_dims(b1, [1, 0, 2]), [n, nb * m]))
    cols = emit(imp, relax.op.reshape(b2, [nb * m, p]))
    out = _matmul(imp, rows, cols, dt)
    acc = dtype(out)
    if alpha != 1:
        out = emit(imp, relax.op.multiply(out, relax.const(alpha, acc)))
    if beta != 0:
        scaled = cast(imp, inp, acc)
        scaled = scaled if beta == 1 else emit(imp, relax.op.multiply(scaled, relax.const(beta, acc)))
        out = emit(imp, relax.op.add(out, relax.op.broadcast_to(scaled, shp)))
    return to_dtype(imp, out, dt)


# ---- convolution ------------------------------------------------------------------------------
# Relax's convolutions by spatial rank: (convolution, transposed convolution).
CONV = {
    1: (relax.op.nn.conv1d, relax.op.nn.conv1d_transpose),
    2: (relax.op.nn.conv2d, relax.op.nn.conv2d_transpose),
    3: (relax.op.nn.conv3d, relax.op.nn.conv3d_transpose),
}


def conv_window(node, first, x):
    """(stride, padding, dilation) of a convolution call whose stride is argument `first`, one
    int per spatial dim of its input `x`."""
    nsp = len(shape(x)) - 2
    if nsp not in CONV:
        raise NotImplementedError(f"a convolution with {nsp} spatial dims")
    return [pair(arg(node, first + i, name), nsp) for i, name in enumerate(("stride", "padding", "dilation"))]


def transposed_conv(imp, g, w, stride, padding, dilation, groups, out_size):
    """The transposed convolution of `g` with `w` (read as IOHW) whose spatial size is `out_size`.

    PyTorch's output padding extends the output at the end, into what the padding would crop
    and past it; Relax takes output padding only below the stride. Beyond that, the crop at
    the end is given as padding of its own and zeros are padded on where the output reaches
    past every window. Where output padding below the stride suffices, the call keeps
    symmetric padding: the only form library dispatch sends to PyTorch's kernel.
    """
    in_size, k = shape(g)[2:], shape(w)[2:]
    full = [(i - 1) * s + d * (kk - 1) + 1 for i, kk, s, d in zip(in_size, k, stride, dilation)]
    opad = [o - (f - 2 * p) for o, f, p in zip(out_size, full, padding)]
    conv = CONV[len(stride)][1]
    if all(0 <= p < s for p, s in zip(opad, stride)):
        return emit(imp, conv(g, w, strides=stride, padding=padding, output_padding=opad, dilation=dilation,
                              groups=groups))
    after = [max(f - p - o, 0) for f, p, o in zip(full, padding, out_size)]
    out = emit(imp, conv(g, w, strides=stride, padding=[*padding, *after], dilation=dilation, groups=groups))
    short = [o - s for o, s in zip(out_size, shape(out)[2:])]
    if any(short):
        out = emit(imp, relax.op.nn.pad(out, [0, 0, 0, 0] + [n for s in short for n in (0, s)]))
    return out


@rule("convolution.default")
def convolution(imp, node):
    """A transposed convolution of any spatial rank in the input's dtype (TVM's rule has none in 3-d
    and makes every one float32); plain convolutions are TVM's."""
    if not arg(node, 6, "transposed"):
        return imp.tvm_rules["convolution.default"](node)
    x, w, b = env(imp, node.args[0]), env(imp, node.args[1]), env(imp, arg(node, 2, "bias"))
    stride, padding, dilation = conv_window(node, 3, x)
    out_shape, _ = out_meta(node)
    out = transposed_conv(imp, x, w, stride, padding, dilation, arg(node, 8, "groups"), out_shape[2:])
    if b is not None:
        out = emit(imp, relax.op.add(out, relax.op.reshape(b, [-1] + [1] * len(stride))))
    return out


@rule("_trilinear.default")
def trilinear(imp, node):
    """The sum over `sumdim` of i1 * i2 * i3, each first unsqueezed at its `expand` dims (nn.Bilinear,
    and the gradients autograd makes of it, which are _trilinear again): one broadcast product and
    one sum, which fuse into one kernel (nothing of the product's size is stored)."""
    ins = [env(imp, a) for a in node.args[:3]]
    total = len(shape(ins[0])) + len(arg(node, 3, "expand1"))
    expands = [{d % total for d in arg(node, 3 + i, f"expand{i + 1}")} for i in range(3)]
    sumdim = sorted({d % total for d in arg(node, 6, "sumdim")})
    shp, dt = out_meta(node)
    acc = accumulation(dt)
    prod = None
    for x, expand in zip(ins, expands):
        sizes = iter(shape(x))
        x = emit(imp, relax.op.reshape(cast(imp, x, acc), [1 if d in expand else next(sizes) for d in range(total)]))
        prod = x if prod is None else emit(imp, relax.op.multiply(prod, x))
    out = emit(imp, relax.op.sum(prod, axis=sumdim)) if sumdim else prod
    return to_dtype(imp, emit(imp, relax.op.reshape(out, shp)), dt)


# ---- attention --------------------------------------------------------------------------------
@rule("scaled_dot_product_attention.default")
def scaled_dot_product_attention(imp, node):
    """The composite op a scripted model records (the lazy device sees its parts).

    Without a mask, 4-D and unbroadcast: relax.nn.attention, which simplify.expand_attention and
    autodiff's gradient take apart. Otherwise softmax(q k^T * scale + mask) v in Relax ops, a
    boolean mask as -inf where False. A row with no key left gives 0, as PyTorch's does (a
    softmax over -inf alone is NaN). TVM's rule takes no boolean mask and ignores `scale`.
    """
    q, k, v = (env(imp, a) for a in node.args[:3])
    mask = env(imp, arg(node, 3, "attn_mask"))
    if arg(node, 4, "dropout_p", 0.0) or node.kwargs.get("enable_gqa", False):
        raise NotImplementedError("scaled_dot_product_attention with dropout or grouped-query heads")
    causal = arg(node, 5, "is_causal", False)
    dt = dtype(q)
    scale = node.kwargs.get("scale")
    scale = 1.0 / math.sqrt(shape(q)[-1]) if scale is None else float(scale)
    op = relax.op
    if mask is None and len(shape(q)) == 4 and shape(q)[:2] == shape(k)[:2] == shape(v)[:2]:
        bshd = [0, 2, 1, 3]
        out = emit(imp, op.nn.attention(*(op.permute_dims(t, bshd) for t in (q, k, v)), scale=scale,
                                         causal_mask="TopLeft" if causal else None))
        return emit(imp, op.permute_dims(out, bshd))
    nd = len(shape(k))
    kt = op.permute_dims(k, list(range(nd - 2)) + [nd - 1, nd - 2])
    scores = emit(imp, op.multiply(op.matmul(q, kt), scalar(scale, dt)))
    ninf = scalar(-math.inf, dt)
    if causal:
        sq, sk = shape(q)[-2], shape(k)[-2]
        keep = relax.const(np.tril(np.ones((sq, sk), dtype=bool)))
        scores = emit(imp, op.where(keep, scores, ninf))
    if mask is not None and dtype(mask) == "bool":
        scores = emit(imp, op.where(mask, scores, ninf))
    elif mask is not None:
        scores = emit(imp, op.add(scores, cast(imp, mask, dt)))
    # Rows with no key left (TVM's max starts from the lowest finite float, not -inf: count keys instead).
    alive = op.astype(op.not_equal(scores, ninf), dt)
    empty = emit(imp, op.equal(op.max(alive, axis=-1, keepdims=True), scalar(0.0, dt)))
    probs = op.nn.softmax(op.where(empty, scalar(0.0, dt), scores), axis=-1)
    probs = emit(imp, op.where(empty, scalar(0.0, dt), probs))
    return emit(imp, op.matmul(probs, v))


# ---- pixel shuffle ----------------------------------------------------------------------------
@rule("pixel_shuffle.default")
def pixel_shuffle(imp, node):
    """(*, C*r*r, H, W) -> (*, C, H*r, W*r): split the channels, interleave, merge (TVM's op has no
    kernel)."""
    x = env(imp, node.args[0])
    r = arg(node, 1, "upscale_factor")
    *lead, c, h, w = shape(x)
    n = len(lead)
    split = emit(imp, relax.op.reshape(x, [*lead, c // (r * r), r, r, h, w]))
    perm = list(range(n)) + [n + i for i in (0, 3, 1, 4, 2)]
    moved = emit(imp, relax.op.permute_dims(split, perm))
    return emit(imp, relax.op.reshape(moved, out_meta(node)[0]))
