"""Neural-network forward ops where TVM's rule is missing or wrong.

Also home of the small helpers the other rule modules share (`arg`, `shape`,
`dtype`, `out_meta`, ...).
"""
import math

import numpy as np
from tvm import relax, te, tirx

from . import rule

# TVM's rules for these return wrong values (an identity for training-mode
# dropout); None removes them. Training-mode dropout never reaches the table:
# ratex/core/random.py records it as ratex::dropout_keep (a mask from ratex::random_bits) and a multiply.
rule("native_dropout.default", "dropout.default")(None)


# ---- helpers shared by the rule modules ------------------------------------------
def arg(node, i, name, default=None):
    """Return argument `i` (or keyword `name`) of an fx call node."""
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def env(imp, x):
    """Relax value of an fx node argument, None for None."""
    return None if x is None else imp.env[x]


def emit(imp, expr):
    return imp.block_builder.emit(expr)


def emit_te(imp, fn, *args, **kwargs):
    return imp.block_builder.emit_te(fn, *args, **kwargs)


def shape(expr):
    return [int(s) for s in expr.ty.shape.values]


def dtype(expr):
    return str(expr.ty.dtype)


def out_meta(node, i=None):
    """(shape, tvm dtype) that PyTorch recorded for output `i` (None: the single output)."""
    from ..dtypes import to_tvm

    val = node.meta["val"]
    if i is not None:
        val = val[i]
    if val is None:
        return None
    return [int(s) for s in val.shape], to_tvm(val.dtype)


def scalar(v, dt):
    return relax.const(v, dt)


def horner(x, coeffs):
    """coeffs[0] + coeffs[1] x + coeffs[2] x^2 + ... for a TIR expression `x`, in x's dtype."""
    dt = str(x.ty)
    acc = tirx.const(coeffs[-1], dt)
    for c in reversed(coeffs[:-1]):
        acc = acc * x + tirx.const(c, dt)
    return acc


def cast(imp, x, dt):
    return x if dtype(x) == dt else emit(imp, relax.op.astype(x, dt))


def zeros(imp, shp, dt):
    return emit(imp, relax.op.zeros(relax.ShapeExpr(list(shp)), dt))


def tuple_out(imp, node, outs):
    """Return a relax.Tuple of `outs`; None entries become cheap zero placeholders.

    A masked-off output (output_mask False) is None in node.meta['val'] and the
    importer does not check it; nothing reads it, so a 1-element zero tensor
    stands in (or zeros of the recorded shape where PyTorch recorded one).
    """
    fields = []
    for i, o in enumerate(outs):
        if o is None:
            m = out_meta(node, i)
            o = zeros(imp, m[0], m[1]) if m is not None else zeros(imp, [1], "float32")
        fields.append(o)
    return emit(imp, relax.Tuple(fields))


def norm_dims(dims, ndim):
    if isinstance(dims, int):
        dims = [dims]
    return [d % ndim if ndim else 0 for d in dims]


def pair(v, n=2):
    if isinstance(v, int):
        return [v] * n
    v = list(v)
    return v * n if len(v) == 1 else v


# ---- max_pool2d_with_indices ---------------------------------------------------------
def torch_argmax(dt):
    """(reducer, padding) for PyTorch's CPU max-pool window scan, over (int64 index, value) pairs.

    PyTorch scans each window in row-major order and replaces the current max only by
    a strictly greater value or a NaN: ties go to the smallest index, NaN beats
    everything and among NaNs the last one wins. That is a total order on (value,
    index), so the reducer gives the same answer in any reduction order. `padding`
    is the (index, value) pair a position outside the input reads as: (huge, -inf).
    """
    is_float = dt.startswith("float") or dt.startswith("bfloat")
    ninf = tirx.const(-np.inf, dt) if is_float else tirx.min_value(dt)
    big = tirx.const(np.iinfo(np.int64).max, "int64")

    def combine(a, b):
        i0, v0 = a
        i1, v1 = b
        if is_float:
            n0, n1 = tirx.isnan(v0), tirx.isnan(v1)
            take = tirx.any(
                tirx.all(n1, tirx.any(tirx.Not(n0), i1 > i0)),
                tirx.all(tirx.Not(n0), tirx.Not(n1), tirx.any(v1 > v0, tirx.all(v1 == v0, i1 < i0))),
            )
        else:
            take = tirx.any(v1 > v0, tirx.all(v1 == v0, i1 < i0))
        return tirx.Select(take, i1, i0), tirx.Select(take, v1, v0)

    def identity(t0, t1):
        return big, ninf

    return te.comm_reducer(combine, identity, name="torch_argmax"), (big, ninf)


def _maxpool_te(x, kernel, stride, padding, dilation, out_hw):
    """Values and int64 flat indices (h*W+w) of a 2-D max pool over the last two dims (see torch_argmax)."""
    *lead, H, W = x.shape
    kh, kw = kernel
    sh, sw = stride
    ph, pw = padding
    dh, dw = dilation
    Ho, Wo = out_hw
    argmax, (big, ninf) = torch_argmax(str(x.dtype))
    ri = te.reduce_axis((0, kh), name="ki")
    rj = te.reduce_axis((0, kw), name="kj")

    def body(*idx):
        lead_idx, oh, ow = idx[:-2], idx[-2], idx[-1]
        h = oh * sh - ph + ri * dh
        w = ow * sw - pw + rj * dw
        valid = tirx.all(h >= 0, h < H, w >= 0, w < W)
        v = tirx.if_then_else(valid, x[(*lead_idx, h, w)], ninf)
        i = tirx.Select(valid, (h * W + w).astype("int64"), big)
        return argmax((i, v), axis=[ri, rj])

    inds, vals = te.compute((*lead, Ho, Wo), body, name="max_pool2d_with_indices")
    return vals, inds


def pool_window(node, first=1):
    """(kernel, stride, padding) of a 2-D pooling call whose kernel_size is argument `first`.

    stride defaults to the kernel, as in PyTorch.
    """
    kernel = pair(arg(node, first, "kernel_size"))
    stride = arg(node, first + 1, "stride", None)
    return kernel, pair(stride) if stride else kernel, pair(arg(node, first + 2, "padding", 0))


@rule("max_pool2d_with_indices.default")
def max_pool2d_with_indices(imp, node):
    x = env(imp, node.args[0])
    kernel, stride, padding = pool_window(node)
    dilation = pair(arg(node, 4, "dilation", 1))
    out_shape, _ = out_meta(node, 0)
    out = emit_te(imp, _maxpool_te, x, kernel, stride, padding, dilation, out_shape[-2:])
    vals = emit(imp, relax.TupleGetItem(out, 0))
    inds = emit(imp, relax.TupleGetItem(out, 1))
    return emit(imp, relax.Tuple([vals, inds]))


# ---- losses -------------------------------------------------------------------------
def nll_pick(imp, node_args, n_classes_axis=1):
    """Common part of nll_loss forward/backward: (one_hot mask, per-sample weight w_t)."""
    x, target, weight, ignore_index = node_args
    xs = shape(x)
    dt = dtype(x)
    C = xs[-1] if len(xs) == 1 else xs[1]
    tgt = cast(imp, target, "int64")
    valid = emit(imp, relax.op.not_equal(tgt, relax.const(ignore_index, "int64")))
    safe = emit(imp, relax.op.where(valid, tgt, relax.const(0, "int64")))
    if weight is not None:
        w_t = emit(imp, relax.op.take(weight, safe, axis=0))
    else:
        w_t = emit(imp, relax.op.ones_like(cast(imp, safe, dt)))
    w_t = emit(imp, relax.op.where(valid, w_t, relax.const(0, dt)))
    classes = emit(imp, relax.op.arange(0, C, 1, "int64"))
    onehot = emit(imp, relax.op.equal(relax.op.expand_dims(safe, -1), classes))
    onehot = cast(imp, onehot, dt)
    return onehot, w_t


def nll_loss(imp, x, target, weight, reduction, ignore_index, total_shape):
    """(loss, total_weight) of nll_loss on x (N, C) or (C,), the classes on its last dim.

    Unreduced (reduction 0), total_weight is zeros of `total_shape`, as PyTorch leaves it.
    """
    dt = dtype(x)
    onehot, w_t = nll_pick(imp, (x, target, weight, ignore_index))
    picked = emit(imp, relax.op.sum(relax.op.multiply(x, onehot), axis=[-1]))
    losses = emit(imp, relax.op.negative(relax.op.multiply(picked, w_t)))
    total = emit(imp, relax.op.sum(w_t))
    if reduction == 0:
        return losses, zeros(imp, total_shape, dt)
    if reduction == 2:
        return emit(imp, relax.op.sum(losses)), total
    return emit(imp, relax.op.divide(relax.op.sum(losses), total)), total


@rule("nll_loss_forward.default")
def nll_loss_forward(imp, node):
    x = env(imp, node.args[0])
    if len(shape(x)) > 2:
        raise NotImplementedError("nll_loss_forward on more than 2 dims")
    out, total = nll_loss(imp, x, env(imp, node.args[1]), env(imp, arg(node, 2, "weight")), arg(node, 3, "reduction", 1),
                          arg(node, 4, "ignore_index", -100), out_meta(node, 1)[0])
    return emit(imp, relax.Tuple([out, total]))


@rule("mse_loss.default")
def mse_loss(imp, node):
    x = env(imp, node.args[0])
    t = env(imp, node.args[1])
    reduction = arg(node, 2, "reduction", 1)
    d = emit(imp, relax.op.subtract(x, t))
    sq = emit(imp, relax.op.multiply(d, d))
    if reduction == 0:
        return sq
    if reduction == 2:
        return emit(imp, relax.op.sum(sq))
    return emit(imp, relax.op.mean(sq))


# ---- reductions -------------------------------------------------------------------------
def extreme(imp, x, axes, keepdims, largest):
    """max (or min) over `axes`, -inf (+inf) where every element is -inf (+inf).

    TVM's max reduction starts from the lowest finite value, so a slice of only -inf
    (a fully masked attention row) came out as -3.4e38 instead of -inf.
    """
    reduce = relax.op.max if largest else relax.op.min
    out = emit(imp, reduce(x, axis=axes, keepdims=keepdims))
    dt = dtype(x)
    if not (dt.startswith("float") or dt.startswith("bfloat")):
        return out
    inf = relax.const(-np.inf if largest else np.inf, dt)
    hit = emit(imp, relax.op.astype(relax.op.equal(x, inf), "int8"))
    every = emit(imp, relax.op.equal(relax.op.min(hit, axis=axes, keepdims=keepdims), relax.const(1, "int8")))
    return emit(imp, relax.op.where(every, inf, out))


@rule("amax.default", "amin.default", "max.default", "min.default")
def amax(imp, node):
    """Bool tensors reduce as int32 (TVM has no max/min identity for bool): amax is any, amin is all."""
    x = env(imp, node.args[0])
    name = node.target.__name__
    dims = arg(node, 1, "dim", []) if name.startswith("am") else []
    keepdim = arg(node, 2, "keepdim", False) if name.startswith("am") else False
    nd = len(shape(x))
    axes = norm_dims(dims, nd) if dims not in ([], ()) else None
    if nd == 0:
        return x
    largest = name.startswith(("amax", "max"))
    if dtype(x) == "bool":
        reduce = relax.op.max if largest else relax.op.min
        return cast(imp, emit(imp, reduce(cast(imp, x, "int32"), axis=axes, keepdims=keepdim)), "bool")
    return extreme(imp, x, axes, keepdim, largest=largest)


# ---- normalization -----------------------------------------------------------------------
@rule("native_layer_norm.default")
def native_layer_norm(imp, node):
    """(out, mean, rstd): mean/rstd keep the normalized dims as size 1, as PyTorch does."""
    x = env(imp, node.args[0])
    nshape = list(node.args[1])
    w = env(imp, arg(node, 2, "weight"))
    b = env(imp, arg(node, 3, "bias"))
    eps = arg(node, 4, "eps", 1e-5)
    dt = dtype(x)
    axes = list(range(-len(nshape), 0))
    mean = emit(imp, relax.op.mean(x, axis=axes, keepdims=True))
    xc = emit(imp, relax.op.subtract(x, mean))
    var = emit(imp, relax.op.mean(relax.op.multiply(xc, xc), axis=axes, keepdims=True))
    rstd = emit(imp, relax.op.rsqrt(relax.op.add(var, scalar(eps, dt))))
    out = emit(imp, relax.op.multiply(xc, rstd))
    if w is not None:
        out = emit(imp, relax.op.multiply(out, w))
    if b is not None:
        out = emit(imp, relax.op.add(out, b))
    return emit(imp, relax.Tuple([out, mean, rstd]))


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
    nd = len(shape(x))
    axes = [0] + list(range(2, nd))
    if training:
        mean = emit(imp, relax.op.mean(x, axis=axes))
        xc = emit(imp, relax.op.subtract(x, _bn_bcast(imp, mean, nd)))
        var = emit(imp, relax.op.mean(relax.op.multiply(xc, xc), axis=axes))
        invstd = emit(imp, relax.op.rsqrt(relax.op.add(var, scalar(eps, dt))))
        save_mean, save_invstd = mean, invstd
    else:
        if rm is None or rv is None:
            raise NotImplementedError("eval-mode batch norm without running stats")
        xc = emit(imp, relax.op.subtract(x, _bn_bcast(imp, rm, nd)))
        invstd = emit(imp, relax.op.rsqrt(relax.op.add(rv, scalar(eps, dt))))
        # PyTorch CPU returns empty save_mean/save_invstd in eval mode.
        save_mean = zeros(imp, out_meta(node, 1)[0], dt)
        save_invstd = zeros(imp, out_meta(node, 2)[0], dt)
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
            unbiased = relax.op.multiply(var, scalar(n / max(n - 1, 1), dt))
            rm = emit(imp, _lerp(rm, mean, momentum, dt))
            rv = emit(imp, _lerp(rv, unbiased, momentum, dt))
        outs += [rm, rv]
    return emit(imp, relax.Tuple(outs))


def _lerp(old, new, momentum, dt):
    return relax.op.add(relax.op.multiply(old, scalar(1.0 - momentum, dt)), relax.op.multiply(new, scalar(momentum, dt)))


# ---- avg_pool2d / avg_pool3d --------------------------------------------------------------
def _avg_pool_te(x, kernel, stride, padding, out_sizes, count_include_pad, divisor):
    """Average pool over the last len(kernel) dims, as PyTorch's CPU kernel counts the window.

    A window is clipped to the padded input (input + padding on each side);
    without count_include_pad it is further clipped to the input itself.
    """
    n = len(kernel)
    sizes = x.shape[-n:]
    dt = str(x.dtype)

    def body(*idx):
        lead_idx, out_idx = idx[:-n], idx[-n:]
        starts = [o * s - p for o, s, p in zip(out_idx, stride, padding)]
        acc = tirx.const(0, dt)
        for offs in np.ndindex(*kernel):
            pos = [s + o for s, o in zip(starts, offs)]
            ok = tirx.all(*[tirx.all(q >= 0, q < size) for q, size in zip(pos, sizes)])
            acc = acc + tirx.if_then_else(ok, x[(*lead_idx, *pos)], tirx.const(0, dt))
        if divisor:
            div = tirx.const(divisor, "int32")
        else:
            ends = [tirx.min(s + k, size + p) for s, k, size, p in zip(starts, kernel, sizes, padding)]
            if not count_include_pad:
                starts = [tirx.max(s, 0) for s in starts]
                ends = [tirx.min(e, size) for e, size in zip(ends, sizes)]
            div = ends[0] - starts[0]
            for s, e in zip(starts[1:], ends[1:]):
                div = div * (e - s)
        return acc / div.astype(dt)

    return te.compute((*x.shape[:-n], *out_sizes), body, name=f"avg_pool{n}d")


@rule("avg_pool2d.default", "avg_pool3d.default")
def avg_pool(imp, node):
    """TVM's rules ignore divisor_override (and get 3-D windows wrong); this follows PyTorch's CPU kernel."""
    x = env(imp, node.args[0])
    n = 3 if node.target.__name__.startswith("avg_pool3d") else 2
    kernel = pair(arg(node, 1, "kernel_size"), n)
    stride = arg(node, 2, "stride", None)
    stride = pair(stride, n) if stride else kernel
    padding = pair(arg(node, 3, "padding", 0), n)
    cip = arg(node, 5, "count_include_pad", True)
    divisor = arg(node, 6, "divisor_override", None)
    out_shape, _ = out_meta(node)
    return emit_te(imp, _avg_pool_te, x, kernel, stride, padding, out_shape[-n:], cip, divisor)


# ---- matrix products (when not sent to the kernel library) ------------------------------
# TVM's translator gives mm/bmm/addmm a float32 result whatever the inputs (a float64 product
# came back float32) and reads addmm's alpha and beta from keywords only. Half-precision
# products accumulate in float32, as PyTorch's CPU kernels do.
def _matmul(imp, a, b, dt):
    acc = "float32" if dt in ("float16", "bfloat16") else dt
    out = emit(imp, relax.op.matmul(a, b, out_dtype=acc))
    return out if acc == dt else emit(imp, relax.op.astype(out, dt))


@rule("mm.default", "bmm.default")
def matrix_product(imp, node):
    return _matmul(imp, env(imp, node.args[0]), env(imp, node.args[1]), out_meta(node)[1])


@rule("addmm.default")
def addmm(imp, node):
    dt = out_meta(node)[1]
    bias, a, b = (env(imp, x) for x in node.args[:3])
    beta, alpha = arg(node, 3, "beta", 1), arg(node, 4, "alpha", 1)
    out = _matmul(imp, a, b, dt)
    if alpha != 1:
        out = emit(imp, relax.op.multiply(out, scalar(alpha, dt)))
    if beta == 0:  # PyTorch ignores the bias then, NaN included
        return out
    if beta != 1:
        bias = emit(imp, relax.op.multiply(bias, scalar(beta, dt)))
    return emit(imp, relax.op.add(bias, out))
