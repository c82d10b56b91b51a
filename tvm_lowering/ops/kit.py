"""Helpers the rule modules share: reading fx nodes, emitting Relax, and the kernels several op families build on.

What one rule module alone uses stays in that module; what two need lives here, once.
"""
import math

import numpy as np
import torch
from tvm import relax, te, tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

from ..dtypes import to_tvm
from ..schedules import MATERIALIZE
from . import bounds


# ---- fx node arguments and Relax values -------------------------------------------------------
def arg(node, i, name, default=None):
    """Return argument `i` (or keyword `name`) of an fx call node."""
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def env(imp, x):
    """Relax value of an fx node argument, None for None."""
    return None if x is None else imp.env[x]


def emit(imp, expr):
    """Return the Relax variable bound to `expr` in the importer's current block."""
    return imp.block_builder.emit(expr)


def emit_te(imp, fn, *args, **kwargs):
    """Return the Relax variable bound to a call_tir of the TE compute `fn(*args)`. The kernel is
    named after `fn`, a lambda's `te_kernel`: a CUDA kernel named `<lambda>` is not valid C, and
    NVRTC fails the whole program."""
    if "primfunc_name_hint" not in kwargs and not fn.__name__.isidentifier():
        kwargs["primfunc_name_hint"] = "te_kernel"
    return imp.block_builder.emit_te(fn, *args, **kwargs)


def shape(expr):
    """Return a Relax tensor value's static shape as a list of ints."""
    return [int(s) for s in expr.ty.shape.values]


def dtype(expr):
    """Return a Relax tensor value's (or a TIR expression's) dtype as a string."""
    return str(expr.ty.dtype)


def accumulation(dt):
    """The dtype PyTorch's CPU kernels accumulate `dt` in: float32 for float16/bfloat16 (each
    result rounded once), else `dt`."""
    return "float32" if dt in ("float16", "bfloat16") else dt


def is_float(dt):
    """Return whether the dtype string `dt` is a floating-point one (bfloat16 included)."""
    return dt.startswith("float") or dt.startswith("bfloat")


def out_meta(node, i=None):
    """(shape, tvm dtype) that PyTorch recorded for output `i` (None: the single output)."""
    val = node.meta["val"]
    if i is not None:
        val = val[i]
    if val is None:
        return None
    return [int(s) for s in val.shape], to_tvm(val.dtype)


def isnan(v):
    """tirx.isnan of a TIR value of any float dtype (TVM's own takes no bfloat16: a bfloat16
    widens to float32 exactly, NaN staying NaN)."""
    return tirx.isnan(tirx.Cast("float32", v) if dtype(v) == "bfloat16" else v)


def guarded(cond, value, other):
    """`value` where `cond` holds, else `other`, for a `value` that reads memory at an index
    valid only where `cond` holds.

    tirx.Select evaluates both sides, and TVM's simplifier rewrites each side assuming the
    condition that selects it, so it drops a clamp that kept such a read in bounds. The read
    left out of bounds is undefined behaviour to LLVM, which may then assume the condition
    false (it did: a slice_scatter fused with a reshape returned garbage under -mcpu=znver5).
    if_then_else evaluates only the side taken, as TVM's own concatenate does."""
    return tirx.if_then_else(cond, value, other)


def scalar(v, dt):
    """Return the Relax constant `v` of dtype `dt`."""
    return relax.const(v, dt)


def cast(imp, x, dt):
    """Return `x` in dtype `dt` (a cast only where it is another)."""
    return x if dtype(x) == dt else emit(imp, relax.op.astype(x, dt))


def zeros(imp, shp, dt):
    """Return a tensor of zeros of shape `shp` and dtype `dt`."""
    return emit(imp, relax.op.zeros(relax.ShapeExpr(list(shp)), dt))


def filled(imp, node, value):
    """Return the node's output (shape and dtype as PyTorch recorded them) filled with `value`."""
    shp, dt = out_meta(node)
    return emit(imp, relax.op.broadcast_to(relax.const(value, dt), shp))


def flatten(imp, x):
    """Return `x` reshaped to one dim."""
    return emit(imp, relax.op.reshape(x, [-1]))


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
    """Return `dims` (an int or a list) as a list of non-negative dims of an `ndim`-dim tensor."""
    if isinstance(dims, int):
        dims = [dims]
    return [d % ndim if ndim else 0 for d in dims]


def pair(v, n=2):
    """Return an int, or a list of one or `n` ints, as a list of `n` ints (a kernel size, a stride...)."""
    if isinstance(v, int):
        return [v] * n
    v = list(v)
    return v * n if len(v) == 1 else v


def pool_window(node, first=1, n=2):
    """(kernel, stride, padding) of an `n`-d pooling call whose kernel_size is argument `first`.

    stride defaults to the kernel, as in PyTorch.
    """
    kernel = pair(arg(node, first, "kernel_size"), n)
    stride = arg(node, first + 1, "stride", None)
    return kernel, pair(stride, n) if stride else kernel, pair(arg(node, first + 2, "padding", 0), n)


# ---- bfloat16 rounding ------------------------------------------------------------------------
# TVM computes bfloat16 in float32 and, inside a fused kernel, folds
# float32 -> bfloat16 -> float32 casts away, so `x.bfloat16().float()` would not round.
# Rounding explicitly (to nearest even, as PyTorch does) while still float32 makes the
# bfloat16 cast that follows exact, folded or not.
def round_bf16(v):
    """A float32 TIR value rounded to the nearest bfloat16 (ties to even), still float32; NaN stays NaN."""
    bits = tirx.reinterpret("uint32", v)
    odd = (bits >> tirx.const(16, "uint32")) & tirx.const(1, "uint32")
    up = (bits + tirx.const(0x7FFF, "uint32") + odd) & tirx.const(0xFFFF0000, "uint32")
    return tirx.Select(tirx.isnan(v), v, tirx.reinterpret("float32", up))


def _round_to_bf16_te(x):
    # Materialized: the rounding reads its input four times, so chains of roundings inlined
    # into each other would grow the kernel exponentially (and its compile time with it).
    return te.compute(x.shape, lambda *i: round_bf16(x(*i)), name="round_to_bfloat16", attrs={MATERIALIZE: 1})


def to_dtype(imp, x, dt):
    """`x` cast to `dt`; to bfloat16 rounded to nearest even, as PyTorch rounds.

    In a jit.script forward a plain cast: the rounding is a TIR kernel, which Relax's Gradient
    cannot differentiate."""
    if dt != "bfloat16" or dtype(x) == "bfloat16" or imp.differentiable:
        return cast(imp, x, dt)
    return emit(imp, relax.op.astype(emit_te(imp, _round_to_bf16_te, cast(imp, x, "float32")), "bfloat16"))


# ---- TIR expressions and elementwise kernels --------------------------------------------------
def horner(x, coeffs):
    """coeffs[0] + coeffs[1] x + coeffs[2] x^2 + ... for a TIR expression `x`, in x's dtype."""
    dt = str(x.ty)
    acc = tirx.const(coeffs[-1], dt)
    for c in reversed(coeffs[:-1]):
        acc = acc * x + tirx.const(c, dt)
    return acc


def pointwise(imp, node, fn, compute, nargs=1):
    """`fn` per element of the node's first `nargs` arguments, broadcast to the output shape and
    cast to `compute` first; the result is cast to the output dtype (to bfloat16 rounded as PyTorch rounds).

    `fn` may use a subexpression more than once, but must not bind it with a tirx.Let: TVM's
    bfloat16 legalization computes garbage from a Let whose value reads a bfloat16 tensor,
    as one does once a cast from bfloat16 is fused in. LLVM merges the repeated parts."""
    out_shape, out_dt = out_meta(node)
    xs = []
    for a in node.args[:nargs]:
        x = cast(imp, env(imp, a), compute) if isinstance(a, torch.fx.Node) else relax.const(a, compute)
        xs.append(x if shape(x) == out_shape else emit(imp, relax.op.broadcast_to(x, out_shape)))

    def at(*values):
        value = fn(*values)
        if out_dt == "bfloat16" and str(value.ty) == "float32":
            value = round_bf16(value)
        return value.astype(out_dt)

    def kernel(*ts):
        return te.compute(out_shape, lambda *i: at(*(t(*i) for t in ts)), name=node.target.__name__.split(".")[0])

    return imp.block_builder.emit_te(kernel, *xs)


def float_compute(node):
    """float64 for float64 results, float32 for the narrower float ones (and int inputs)."""
    return "float64" if out_meta(node)[1] == "float64" else "float32"


# ---- losses -----------------------------------------------------------------------------------
def nll_pick(imp, node_args, n_classes_axis=1):
    """Common part of nll_loss forward/backward: (one_hot mask, per-sample weight w_t)."""
    x, target, weight, ignore_index = node_args
    xs = shape(x)
    dt = dtype(x)
    C = xs[-1] if len(xs) == 1 else xs[1]
    tgt = cast(imp, target, "int64")
    valid = emit(imp, relax.op.not_equal(tgt, relax.const(ignore_index, "int64")))
    safe = emit(imp, relax.op.where(valid, tgt, relax.const(0, "int64")))
    bounds.record(imp, safe, C, n_classes_axis if len(xs) > 1 else 0)  # PyTorch: "Target 70 is out of bounds"
    if weight is not None:
        w_t = emit(imp, relax.op.take(weight, safe, axis=0, mode="clip"))
    else:
        w_t = emit(imp, relax.op.ones_like(cast(imp, safe, dt)))
    w_t = emit(imp, relax.op.where(valid, w_t, relax.const(0, dt)))
    classes = emit(imp, relax.op.arange(0, C, 1, "int64"))
    onehot = emit(imp, relax.op.equal(relax.op.expand_dims(safe, -1), classes))
    onehot = cast(imp, onehot, dt)
    return onehot, w_t


# ---- scatter reductions and host loops --------------------------------------------------------
# The scatters (and reductions.py's scans) are TIR loops run on the host rather than TVM's
# `scatter_elements`, which has no mean, lets NaN lose a max/min, starts every reduction from
# the input (no `include_self=False`) and misplaces writes when the index is narrower than the
# input off the scattered dim. Host loops suit CPU builds only (`imp.host_kernels`); elsewhere
# update/add scatters that TVM gets right keep its GPU kernel and the rest fall back to PyTorch.
def emit_host_kernel(imp, name, fn, *args):
    """emit_te of a kernel written as host loops (te.extern): only where the module is built for the CPU.

    Elsewhere the node falls back to PyTorch (a CUDA build would run these loops on the host).
    """
    if not imp.host_kernels:
        raise NotImplementedError(f"{name} has only a CPU kernel")
    return emit_te(imp, fn, *args)


def _unravel(flat, sizes):
    """Coordinates of a row-major flat position over `sizes`."""
    coords = []
    for size in reversed(sizes):
        coords.append(tirx.floormod(flat, size))
        flat = tirx.floordiv(flat, size)
    return coords[::-1]


def _reducer(reduce, dt):
    """(combine(current, value), identity) of a scatter reduction; max/min let NaN win, as PyTorch does."""
    if reduce == "sum":
        return (lambda a, b: a + b), tirx.const(0, dt)
    if reduce == "prod":
        return (lambda a, b: a * b), tirx.const(1, dt)
    if reduce == "update":
        return (lambda a, b: b), tirx.const(0, dt)
    largest = reduce == "amax"
    if is_float(dt):
        identity = tirx.const(-np.inf if largest else np.inf, dt)
        return (lambda a, b: tirx.Select(tirx.any(isnan(b), b > a if largest else b < a), b, a)), identity
    if largest:
        return tirx.max, tirx.min_value(dt)
    return tirx.min, tirx.max_value(dt)


def _scatter_te(x, index, src, axis, reduce, include_self):
    """out = x; then out[.., index[p], ..] = reduce(out[.., index[p], ..], src[p]) for every position p of index.

    `index[p]` replaces p's coordinate on `axis`. Without include_self every written
    element first starts from the reduction's identity. Negative indices count from
    the end; indices still out of range write nothing (PyTorch raises on them).
    One parallel task per index position off `axis` walks that axis serially, so no
    element is written by two tasks and the order is PyTorch's.
    """
    xs = [int(s) for s in x.shape]
    ishape = [int(s) for s in index.shape]
    dt = str(x.dtype)
    combine, identity = _reducer(reduce, dt)
    size = xs[axis]
    cols = [d for d in range(len(xs)) if d != axis]

    def gen(ins, outs):
        data, idx, values = (T.buffer_proxy(b) for b in ins)
        out = T.buffer_proxy(outs[0])
        with IRBuilder() as ib:
            with T.seq_scope():
                with T.parallel(0, math.prod(xs)) as i:
                    at = tuple(_unravel(i, xs))
                    out[at] = data[at]
                with T.parallel(0, math.prod(ishape[d] for d in cols)) as col:
                    coords = dict(zip(cols, _unravel(col, [ishape[d] for d in cols])))
                    for write in ([] if include_self else [lambda cur, v: identity]) + [combine]:
                        with T.serial(0, ishape[axis]) as k:
                            at = tuple(k if d == axis else coords[d] for d in range(len(xs)))
                            t = idx[at].astype("int64")
                            t = tirx.Select(t < 0, t + size, t)
                            with T.If(tirx.all(t >= 0, t < size)):
                                with T.Then():
                                    dst = tuple(t if d == axis else coords[d] for d in range(len(xs)))
                                    out[dst] = write(out[dst], values[at])
            return ib.get()

    return te.extern([x.shape], [x, index, src], gen, dtype=dt, name=f"scatter_{reduce}")


def scatter_into(imp, x, axis, index, src, reduce, include_self=True):
    """x (not 0-dim) scattered into by src at index along axis, reduced by `reduce`
    ("update", "sum", "prod", "mean", "amax", "amin"); index may be narrower than x and src
    wider than index on any dim.

    mean is the sum divided by how many values met at each element (x counting as one
    with include_self); integer means round down, as PyTorch's do.
    """
    xs, ishape = shape(x), shape(index)
    if 0 in ishape:
        return x
    if dtype(x) == "bool" and reduce != "update":
        raise NotImplementedError(f"scatter reduction '{reduce}' of a bool tensor")
    src = cast(imp, src, dtype(x))
    off_axis = [n for d, n in enumerate(xs) if d != axis]
    spans_x = off_axis == [n for d, n in enumerate(ishape) if d != axis]
    if not imp.host_kernels and (reduce == "update" or reduce == "sum" and include_self) and spans_x:
        # TVM's scatter_elements has a GPU kernel, and is right where index spans x off the axis
        # (its sum always starts from x: include_self=False goes the host loops' way, so falls back).
        if shape(src) != ishape:
            src = emit(imp, relax.op.strided_slice(src, list(range(len(ishape))), [0] * len(ishape), ishape))
        reduction = "add" if reduce == "sum" else "update"
        return emit(imp, relax.op.scatter_elements(x, cast(imp, index, "int64"), src, axis=axis, reduction=reduction))
    if reduce != "mean":
        return emit_host_kernel(imp, f"scatter '{reduce}'", _scatter_te, x, index, src, axis, reduce, include_self)
    total = emit_host_kernel(imp, "scatter 'mean'", _scatter_te, x, index, src, axis, "sum", include_self)
    ones = emit(imp, relax.op.ones(relax.ShapeExpr(xs), dtype(x)))
    ones_src = emit(imp, relax.op.ones_like(src))
    count = emit_host_kernel(imp, "scatter 'mean'", _scatter_te, ones, index, ones_src, axis, "sum", include_self)
    count = emit(imp, relax.op.maximum(count, relax.const(1, dtype(x))))  # nothing met x here: x / 1
    divide = relax.op.divide if is_float(dtype(x)) else relax.op.floor_divide
    return emit(imp, divide(total, count))


# ---- NaN, as PyTorch propagates it ------------------------------------------------------------
def nan_mask(imp, x):
    """Bool tensor: where the float tensor x is NaN (a half-precision x is widened first, exactly:
    TVM's isnan takes no bfloat16)."""
    return emit(imp, relax.op.isnan(cast(imp, x, "float32") if dtype(x) in ("bfloat16", "float16") else x))


def keep_nan(imp, out, *xs):
    """`out`, NaN wherever one of the tensors `xs` (broadcast to out's shape) is NaN.

    PyTorch's max, min and clamp let a NaN operand through; TVM's maximum, minimum and clip are
    comparisons that drop it (maximum(NaN, 3) is 3), and integer operands are never NaN. The NaN
    is a constant, so in a jit.script forward no gradient flows through it (PyTorch's is 0 there)."""
    if not is_float(dtype(out)):
        return out
    for x in xs:
        if is_float(dtype(x)):
            out = emit(imp, relax.op.where(nan_mask(imp, x), relax.const(math.nan, dtype(out)), out))
    return out
